#pragma once
// Reader for the binary fixtures that tools/make_fixtures.py writes.
//
// File layout (little endian): magic "TRPF", u32 version (1), u32 count, then
// `count` records: u32 name length, name bytes, u32 dtype (0 = f32, 1 = u8,
// 2 = i32, 3 = i64), u32 ndim, i64 dims[ndim], raw data (dense, row-major).
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe::test {

struct fixture_array {
  std::uint32_t dtype = 0;
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> bytes;

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : dims) n *= d;
    return n;
  }
  template <class T>
  std::vector<T> as() const {
    std::vector<T> out(bytes.size() / sizeof(T));
    std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
    return out;
  }
};

/// Loads every array of a fixture file; throws std::runtime_error (tests
/// only) when the file is missing or malformed.
inline std::map<std::string, fixture_array> load_fixture(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open fixture " + path);
  auto read = [&](void* p, std::size_t n) {
    if (!in.read(static_cast<char*>(p), static_cast<std::streamsize>(n)))
      throw std::runtime_error("truncated fixture " + path);
  };
  char magic[4];
  read(magic, 4);
  if (std::memcmp(magic, "TRPF", 4) != 0) throw std::runtime_error("bad fixture magic in " + path);
  std::uint32_t version = 0, count = 0;
  read(&version, 4);
  read(&count, 4);
  if (version != 1 || count > 10000) throw std::runtime_error("bad fixture header in " + path);
  std::map<std::string, fixture_array> out;
  static constexpr std::size_t elem[] = {4, 1, 4, 8};
  for (std::uint32_t i = 0; i < count; ++i) {
    std::uint32_t len = 0;
    read(&len, 4);
    if (len > 4096) throw std::runtime_error("bad name length in " + path);
    std::string name(len, '\0');
    read(name.data(), len);
    fixture_array a;
    std::uint32_t ndim = 0;
    read(&a.dtype, 4);
    read(&ndim, 4);
    if (a.dtype > 3 || ndim > 8) throw std::runtime_error("bad array header in " + path);
    a.dims.resize(ndim);
    for (auto& d : a.dims) read(&d, 8);
    const auto n = static_cast<std::size_t>(a.numel());
    if (n > (std::size_t{1} << 30)) throw std::runtime_error("array too large in " + path);
    a.bytes.resize(n * elem[a.dtype]);
    read(a.bytes.data(), a.bytes.size());
    out.emplace(std::move(name), std::move(a));
  }
  return out;
}

inline std::string fixture_path(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/kernels/" + name;
}

}  // namespace troupe::test
