// Corrupt and hostile weight files: every one must give a clear error, never
// a crash (this suite also runs under ASan+UBSan). The crafted GGUF cases
// follow the llama.cpp GGUF advisories: header vs file size, counts,
// string/array lengths, unknown types, overflowing shapes, tensors outside
// the file, misaligned or overlapping data, duplicate names and keys.
#include <gtest/gtest.h>

#include "../temp_path.hpp"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "models/gguf.hpp"
#include "models/safetensors.hpp"

using namespace troupe;
using namespace troupe::models;
namespace fs = std::filesystem;

namespace {

// A raw GGUF byte builder that can write anything, including lies.
struct raw {
  std::vector<std::uint8_t> b;
  template <class T>
  raw& v(T x) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(&x);
    b.insert(b.end(), p, p + sizeof x);
    return *this;
  }
  raw& s(const std::string& x) {
    v<std::uint64_t>(x.size());
    b.insert(b.end(), x.begin(), x.end());
    return *this;
  }
  raw& pad(std::size_t align = 32) {
    while (b.size() % align) b.push_back(0);
    return *this;
  }
  raw& zeros(std::size_t n) {
    b.insert(b.end(), n, 0);
    return *this;
  }
};

// Header: magic, version, counts.
raw header(std::uint64_t nt, std::uint64_t nkv, std::uint32_t version = 3) {
  raw r;
  r.v<std::uint32_t>(0x46554747)
      .v<std::uint32_t>(version)
      .v<std::uint64_t>(nt)
      .v<std::uint64_t>(nkv);
  return r;
}

// One tensor info: name, dims (innermost first), ggml type, offset.
raw& tinfo(raw& r, const std::string& name, std::vector<std::int64_t> ne, std::uint32_t type,
           std::uint64_t off) {
  r.s(name).v<std::uint32_t>(static_cast<std::uint32_t>(ne.size()));
  for (auto e : ne) r.v<std::int64_t>(e);
  return r.v<std::uint32_t>(type).v<std::uint64_t>(off);
}

std::map<std::string, std::vector<std::uint8_t>> crafted_gguf() {
  std::map<std::string, std::vector<std::uint8_t>> c;
  c["empty"] = {};
  c["bad_magic"] = raw()
                       .v<std::uint32_t>(0x12345678)
                       .v<std::uint32_t>(3)
                       .v<std::uint64_t>(0)
                       .v<std::uint64_t>(0)
                       .b;
  c["version_1"] = header(0, 0, 1).b;
  c["version_99"] = header(0, 0, 99).b;
  c["huge_tensor_count"] = header(1ull << 62, 0).b;
  c["huge_kv_count"] = header(0, 1ull << 62).b;
  c["kv_count_past_end"] = header(0, 5).b;
  {
    auto r = header(0, 1);
    r.v<std::uint64_t>(1ull << 60);
    c["huge_key_length"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.v<std::uint64_t>(100).zeros(10);
    c["key_past_end"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("k").v<std::uint32_t>(77);
    c["unknown_value_type"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("k").v<std::uint32_t>(7).v<std::uint8_t>(9);
    c["bool_not_0_or_1"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("k").v<std::uint32_t>(8).v<std::uint64_t>(1ull << 40);
    c["huge_string_value"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("k").v<std::uint32_t>(9).v<std::uint32_t>(4).v<std::uint64_t>(1ull << 61);
    c["huge_array"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("k").v<std::uint32_t>(9).v<std::uint32_t>(8).v<std::uint64_t>(1000000);
    c["string_array_past_end"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("k").v<std::uint32_t>(9).v<std::uint32_t>(9).v<std::uint64_t>(1);
    c["nested_array"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("k").v<std::uint32_t>(9).v<std::uint32_t>(55).v<std::uint64_t>(1);
    c["array_unknown_type"] = r.b;
  }
  {
    auto r = header(0, 2);
    r.s("k").v<std::uint32_t>(4).v<std::uint32_t>(1).s("k").v<std::uint32_t>(4).v<std::uint32_t>(2);
    c["duplicate_key"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("general.alignment").v<std::uint32_t>(4).v<std::uint32_t>(24);
    c["alignment_not_pow2"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("general.alignment").v<std::uint32_t>(4).v<std::uint32_t>(0);
    c["alignment_zero"] = r.b;
  }
  {
    auto r = header(0, 1);
    r.s("").v<std::uint32_t>(4).v<std::uint32_t>(0);
    c["empty_key"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {32}, 0, 0);
    r.pad();
    c["tensor_data_missing"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {8}, 0, 1ull << 62);
    r.pad().zeros(32);
    c["offset_far_outside"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {8}, 0, ~0ull - 8);
    r.pad().zeros(32);
    c["offset_wraps"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {8}, 0, 4);
    r.pad().zeros(64);
    c["misaligned_offset"] = r.b;
  }
  {
    auto r = header(2, 0);
    tinfo(r, "a", {16}, 0, 0);
    tinfo(r, "b", {16}, 0, 32);
    r.pad().zeros(96);
    c["overlapping_tensors"] = r.b;
  }
  {
    auto r = header(2, 0);
    tinfo(r, "a", {8}, 0, 0);
    tinfo(r, "a", {8}, 0, 32);
    r.pad().zeros(64);
    c["duplicate_tensor"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {8}, 12, 0);
    r.pad().zeros(64);
    c["unsupported_ggml_type_q4_k"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {8}, 1234, 0);
    r.pad().zeros(64);
    c["unknown_ggml_type"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {33}, 8, 0);
    r.pad().zeros(64);
    c["q8_0_not_whole_blocks"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {0}, 0, 0);
    r.pad().zeros(32);
    c["zero_extent"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {-4}, 0, 0);
    r.pad().zeros(32);
    c["negative_extent"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {1, 1, 1, 1, 1}, 0, 0);
    r.pad().zeros(32);
    c["five_dims"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {1ll << 40, 1ll << 40}, 0, 0);
    r.pad().zeros(32);
    c["numel_overflow"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "t", {1ll << 36, 1ll << 26}, 0, 0);
    r.pad().zeros(32);
    c["bytes_overflow"] = r.b;
  }
  {
    auto r = header(1, 0);
    tinfo(r, "", {8}, 0, 0);
    r.pad().zeros(32);
    c["empty_tensor_name"] = r.b;
  }
  return c;
}

std::vector<std::uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

std::string write_temp(const std::string& name, const std::vector<std::uint8_t>& bytes) {
  const std::string path = troupe::test::temp_path(name);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  return path;
}

std::string fixture(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/models/" + name;
}

// A successful parse must only expose tensors that lie inside the file.
void check_parse_is_safe(const std::string& path) {
  auto f = gguf_file::open(path);
  if (!f) {
    EXPECT_FALSE(f.error().message.empty());
    return;
  }
  for (const auto& t : f->tensors()) {
    auto v = f->view(t);
    ASSERT_TRUE(v);
    volatile std::uint8_t sink = 0;
    const auto* p = static_cast<const std::uint8_t*>(v->data());
    for (std::uint64_t i = 0; i < t.bytes; i += 61) sink = sink + p[i];
    if (t.bytes) sink = sink + p[t.bytes - 1];
  }
}

}  // namespace

TEST(GgufValidation, CraftedFilesAreRejectedWithAMessage) {
  for (const auto& [name, bytes] : crafted_gguf()) {
    const auto path = write_temp(name + ".gguf", bytes);
    auto f = gguf_file::open(path);
    EXPECT_FALSE(f) << name << " was accepted";
    if (!f) {
      EXPECT_NE(f.error().message.find(path), std::string::npos)
          << name << ": " << f.error().message;
    }
    std::remove(path.c_str());
  }
}

TEST(GgufValidation, CommittedCorpusIsRejected) {
  // tests/fixtures/models/corrupt holds the crafted cases as files (written
  // by TROUPE_WRITE_CORPUS=dir running this test) so other tools and fuzzers
  // can start from them.
  const fs::path dir = fixture("corrupt");
  if (const char* out = std::getenv("TROUPE_WRITE_CORPUS")) {
    fs::create_directories(out);
    for (const auto& [name, bytes] : crafted_gguf()) {
      std::ofstream o(fs::path(out) / (name + ".gguf"), std::ios::binary);
      o.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    }
  }
  ASSERT_TRUE(fs::exists(dir));
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".gguf") continue;
    ++n;
    EXPECT_FALSE(gguf_file::open(e.path().string())) << e.path();
  }
  EXPECT_GE(n, 30);
}

TEST(GgufValidation, TruncatedFilesAreRejectedOrStayInBounds) {
  const auto good = read_all(fixture("tiny.gguf"));
  ASSERT_GT(good.size(), 100u);
  ASSERT_TRUE(gguf_file::open(fixture("tiny.gguf")));
  for (std::size_t n = 0; n < good.size(); ++n) {
    // The last tensor's alignment padding is not data: cutting only padding is fine.
    std::vector<std::uint8_t> cut(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(n));
    const auto path = write_temp("cut.gguf", cut);
    auto f = gguf_file::open(path);
    if (f) {
      for (const auto& t : f->tensors()) EXPECT_LE(t.offset + t.bytes, n) << "prefix " << n;
    }
  }
}

TEST(GgufValidation, RandomCorruptionNeverCrashes) {
  const auto good = read_all(fixture("tiny.gguf"));
  std::mt19937_64 rng(99);
  for (int iter = 0; iter < 3000; ++iter) {
    auto bad = good;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = rng() % bad.size();
      switch (rng() % 3) {
        case 0:
          bad[at] = static_cast<std::uint8_t>(rng());
          break;
        case 1:
          bad[at] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
          break;
        default: {  // an 8-byte field overwritten with an extreme value
          const std::uint64_t vals[] = {0, 1, ~0ull, 1ull << 63, 1ull << 32, 0x7fffffff};
          const std::uint64_t v = vals[rng() % 6];
          for (int k = 0; k < 8 && at + static_cast<std::size_t>(k) < bad.size(); ++k)
            bad[at + static_cast<std::size_t>(k)] = static_cast<std::uint8_t>(v >> (8 * k));
        }
      }
    }
    check_parse_is_safe(write_temp("fuzz.gguf", bad));
  }
}

TEST(SafetensorsValidation, CraftedHeadersAreRejected) {
  auto file = [](const std::string& header, std::size_t data_bytes, std::uint64_t claimed = ~0ull) {
    const std::uint64_t n = claimed == ~0ull ? header.size() : claimed;
    std::string s(8, '\0');
    std::memcpy(s.data(), &n, 8);
    s += header;
    s.append(data_bytes, '\0');
    return std::vector<std::uint8_t>(s.begin(), s.end());
  };
  const std::map<std::string, std::vector<std::uint8_t>> cases = {
      {"short", {1, 2, 3}},
      {"header_past_end", file("{}", 0, 1000)},
      {"huge_header", file("{}", 0, 1ull << 62)},
      {"not_json", file("{\"a\": ", 16)},
      {"not_object", file("[1,2]", 16)},
      {"missing_dtype", file(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8)},
      {"unknown_dtype", file(R"({"a":{"dtype":"F8","shape":[2],"data_offsets":[0,2]}})", 8)},
      {"negative_shape", file(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8)},
      {"float_shape", file(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8)},
      {"size_mismatch", file(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 16)},
      {"outside_data", file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 8)},
      {"reversed_offsets", file(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8)},
      {"overlap",
       file(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
           16)},
      {"shape_overflow",
       file(R"({"a":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,8]}})",
            8)},
      {"rank5", file(R"({"a":{"dtype":"F32","shape":[1,1,1,1,2],"data_offsets":[0,8]}})", 8)},
      {"bad_metadata", file(R"({"__metadata__":{"a":1}})", 0)},
      {"offsets_not_pair", file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8)},
  };
  for (const auto& [name, bytes] : cases) {
    const auto path = write_temp(name + ".safetensors", bytes);
    auto m = safetensors_model::open(path);
    EXPECT_FALSE(m) << name << " was accepted";
    if (!m) {
      EXPECT_NE(m.error().message.find(path), std::string::npos) << m.error().message;
    }
  }
}

TEST(SafetensorsValidation, BadIndexesAreRejected) {
  const std::string dir = troupe::test::temp_path("st_index");
  fs::create_directories(dir);
  fs::copy_file(fixture("tiny.safetensors"), dir + "/one.safetensors",
                fs::copy_options::overwrite_existing);
  auto index = [&](const std::string& text) {
    std::ofstream(dir + "/model.safetensors.index.json") << text;
    return safetensors_model::open(dir);
  };
  EXPECT_TRUE(index(R"({"weight_map":{"a":"one.safetensors","b":"one.safetensors"}})"));
  EXPECT_FALSE(index(R"({"weight_map":{"a":"missing.safetensors"}})"));
  EXPECT_FALSE(index(R"({"weight_map":{"a":"../one.safetensors"}})"));
  EXPECT_FALSE(index(R"({"weight_map":{"a":"/etc/passwd"}})"));
  EXPECT_FALSE(index(
      R"({"weight_map":{"zz":"one.safetensors","a":"one.safetensors","b":"one.safetensors"}})"));
  EXPECT_FALSE(index(R"({"weight_map":{"a":"one.safetensors"}})"));  // b stored but not listed
  EXPECT_FALSE(index(R"({"weight_map":[1,2]})"));
  EXPECT_FALSE(index(R"(not json)"));
  EXPECT_FALSE(safetensors_model::open(::testing::TempDir() + "/no_such_dir_xyz"));
}

TEST(SafetensorsValidation, RandomCorruptionNeverCrashes) {
  const auto good = read_all(fixture("tiny.safetensors"));
  std::mt19937_64 rng(5);
  for (int iter = 0; iter < 2000; ++iter) {
    auto bad = good;
    for (int e = 0; e < 1 + static_cast<int>(rng() % 3); ++e)
      bad[rng() % bad.size()] = static_cast<std::uint8_t>(rng());
    const auto path = write_temp("fuzz.safetensors", bad);
    auto m = safetensors_model::open(path);
    if (m) {
      for (const auto& t : m->tensors()) EXPECT_LE(t.offset + t.bytes, bad.size());
    }
  }
}
