// Corrupt and hostile weight files: every one must give a clear error, never
// a crash (this suite also runs under ASan+UBSan). The crafted GGUF cases
// follow the llama.cpp GGUF advisories: header vs file size, counts,
// string/array lengths, unknown types, overflowing shapes, tensors outside
// the file, misaligned or overlapping data, duplicate names and keys.
#include <gtest/gtest.h>

#include "../temp_path.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

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

// Where the GGUF-encoded string `s` (u64 length, then its bytes) ends in
// `b`: the offset of the field that follows it. b.size() when absent.
std::size_t after_gguf_string(const std::vector<std::uint8_t>& b, const std::string& s) {
  raw enc;
  enc.s(s);
  const auto it = std::search(b.begin(), b.end(), enc.b.begin(), enc.b.end());
  return it == b.end() ? b.size() : static_cast<std::size_t>(it - b.begin()) + enc.b.size();
}

template <class T>
void put(std::vector<std::uint8_t>& b, std::size_t at, T v) {
  ASSERT_LE(at + sizeof v, b.size());
  std::memcpy(b.data() + at, &v, sizeof v);
}

// Offsets of one tensor's fields in a GGUF file's tensor table.
struct tensor_fields {
  std::size_t n_dims = 0, first_extent = 0, type = 0, offset = 0, end = 0;
};
tensor_fields locate(const std::vector<std::uint8_t>& b, const gguf_tensor_info& t) {
  tensor_fields f;
  f.n_dims = after_gguf_string(b, t.name);
  f.first_extent = f.n_dims + 4;
  f.type = f.first_extent + 8 * t.ne.size();
  f.offset = f.type + 4;
  f.end = f.offset + 8;
  return f;
}

// The tensor table as text, to compare two parses.
std::string table(const gguf_file& f) {
  std::string out;
  for (const auto& t : f.tensors()) {
    out += t.name + " type " + std::to_string(t.ggml_type) + " ne";
    for (auto e : t.ne) out += " " + std::to_string(e);
    out += " at " + std::to_string(t.offset) + " bytes " + std::to_string(t.bytes) + "\n";
  }
  return out;
}

// What an accepted GGUF file must satisfy whatever its bytes: each tensor's
// byte size follows from its extents and type, and it lies inside the data
// section (`data_bytes` long), aligned and apart from the others; its view
// covers exactly those bytes.
void expect_consistent(const gguf_file& f, std::uint64_t data_bytes) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
  for (const auto& t : f.tensors()) {
    std::int64_t numel = 1;
    for (auto e : t.ne) {
      EXPECT_GT(e, 0) << t.name;
      numel *= e;
    }
    const std::int64_t per_block = kernels::block_elems(t.type);
    EXPECT_EQ(t.ne[0] % per_block, 0) << t.name;
    EXPECT_EQ(t.bytes, static_cast<std::uint64_t>(numel / per_block) * kernels::block_bytes(t.type))
        << t.name;
    EXPECT_EQ(t.offset % f.alignment(), 0u) << t.name;
    ASSERT_LE(t.offset + t.bytes, data_bytes) << t.name;  // before touching the bytes
    auto v = f.view(t);
    ASSERT_TRUE(v) << t.name << ": " << v.error().message;
    EXPECT_EQ(v->numel(), numel) << t.name;
    EXPECT_EQ(v->nbytes(), t.bytes) << t.name;
    volatile std::uint8_t sink = 0;
    const auto* p = static_cast<const std::uint8_t*>(v->data());
    for (std::uint64_t i = 0; i < t.bytes; i += 61) sink = sink + p[i];
    if (t.bytes) sink = sink + p[t.bytes - 1];
    spans.emplace_back(t.offset, t.offset + t.bytes);
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    EXPECT_GE(spans[i].first, spans[i - 1].second) << "tensors overlap";
}

// Opens `bytes` as a file: it must be rejected with a message that names
// the file and contains every one of `needles`.
template <class Open>
void expect_rejected(Open open, const std::string& what, const std::vector<std::uint8_t>& bytes,
                     const std::vector<std::string>& needles) {
  const auto path = write_temp("targeted", bytes);
  auto r = open(path);
  ASSERT_FALSE(r) << what << " was accepted";
  const std::string& m = r.error().message;
  EXPECT_EQ(m.rfind(path, 0), 0u) << what << ": " << m;
  for (const auto& n : needles) EXPECT_NE(m.find(n), std::string::npos) << what << ": " << m;
  std::remove(path.c_str());
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

// Targeted corruptions of a real file: each is rejected, and the message
// names the field and what is wrong with it.
TEST(GgufValidation, CorruptedFieldsOfARealFileAreNamed) {
  const auto good = read_all(fixture("tiny.gguf"));
  auto f = gguf_file::open(fixture("tiny.gguf"));
  ASSERT_TRUE(f) << f.error().message;
  ASSERT_TRUE(f->find_tensor("t.f32") && f->find_tensor("t.f16") && f->find_tensor("t.q8_0"));
  const auto open = [](const std::string& p) { return gguf_file::open(p); };
  const tensor_fields f32 = locate(good, *f->find_tensor("t.f32"));
  const tensor_fields f16 = locate(good, *f->find_tensor("t.f16"));
  const tensor_fields q8 = locate(good, *f->find_tensor("t.q8_0"));
  ASSERT_LT(q8.end, good.size());

  auto b = good;
  b[3] = 'X';
  expect_rejected(open, "bad magic", b, {"not a GGUF file (bad magic)"});

  // Cut one element into the test.ints array (key, u32 type, u32 element
  // type, u64 count, then elements).
  const std::size_t ints = after_gguf_string(good, "test.ints");
  ASSERT_LT(ints, good.size());
  b.assign(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(ints + 4 + 4 + 8 + 4));
  expect_rejected(open, "cut in an array", b, {"'test.ints'", "runs past the end of the file"});

  b.assign(good.begin(), good.end() - 40);
  expect_rejected(open, "cut in the data", b, {"'t.q4_0'", "lies outside the file's data section"});

  b = good;
  const std::size_t str = after_gguf_string(good, "test.string");
  ASSERT_LT(str, good.size());
  put<std::uint64_t>(b, str + 4, 5000);  // the value's length, after its u32 type
  expect_rejected(open, "string length past the end", b,
                  {"test.string", "string runs past the end of the file"});

  b = good;
  put<std::uint64_t>(b, str + 4, std::uint64_t{1} << 40);
  expect_rejected(open, "huge string length", b, {"test.string", "exceeds the limit"});

  b = good;
  put<std::uint32_t>(b, f16.type, 77);
  expect_rejected(open, "unknown ggml type", b, {"tensor 't.f16' has ggml type 77"});

  b = good;
  put<std::uint64_t>(b, q8.offset, 4096);
  expect_rejected(open, "offset out of range", b,
                  {"tensor 't.q8_0'", "at 4096", "lies outside the file's data section"});

  b = good;
  put<std::uint64_t>(b, q8.offset, 100);
  expect_rejected(open, "misaligned offset", b, {"tensor 't.q8_0' offset 100 is not aligned"});

  b = good;
  put<std::int64_t>(b, f32.first_extent, 0);
  expect_rejected(open, "zero extent", b, {"tensor 't.f32' has extent 0"});

  b = good;
  put<std::uint32_t>(b, f32.n_dims, 7);
  expect_rejected(open, "seven dimensions", b, {"tensor 't.f32' has 7 dimensions"});
}

// Random corruption of a real file: a changed magic is always rejected;
// changes only in the data section are always accepted with the same tensor
// table; any other change is rejected with a message naming the file, or
// accepted with a table that is still consistent (sizes from shapes, inside
// the data section, aligned, apart). An accepted header keeps its length, so
// the data section starts where the original's does.
TEST(GgufValidation, RandomCorruptionNeverCrashes) {
  const auto good = read_all(fixture("tiny.gguf"));
  auto original = gguf_file::open(fixture("tiny.gguf"));
  ASSERT_TRUE(original) << original.error().message;
  ASSERT_FALSE(original->tensors().empty());
  const std::uint64_t header_end = locate(good, original->tensors().back()).end;
  const std::uint64_t data_start =
      (header_end + original->alignment() - 1) / original->alignment() * original->alignment();
  ASSERT_LT(data_start, good.size());
  int bad_magic = 0, data_only = 0, rejected = 0, accepted = 0;
  std::mt19937_64 rng(99);
  for (int iter = 0; iter < 3000; ++iter) {
    auto bad = good;
    std::size_t first = bad.size();  // the lowest byte an edit wrote
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const std::size_t at = rng() % bad.size();
      first = std::min(first, at);
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
    const auto path = write_temp("fuzz.gguf", bad);
    auto f = gguf_file::open(path);
    SCOPED_TRACE("iteration " + std::to_string(iter) + ", first change at byte " +
                 std::to_string(first));
    if (!std::equal(good.begin(), good.begin() + 4, bad.begin())) {
      ++bad_magic;
      ASSERT_FALSE(f) << "a file without the GGUF magic was accepted";
      EXPECT_NE(f.error().message.find("bad magic"), std::string::npos) << f.error().message;
    } else if (first >= data_start) {
      ++data_only;
      ASSERT_TRUE(f) << "a change in tensor data only was rejected: " << f.error().message;
      EXPECT_EQ(table(*f), table(*original));
      EXPECT_EQ(f->metadata().size(), original->metadata().size());
      expect_consistent(*f, bad.size() - data_start);
    } else if (!f) {
      ++rejected;
      EXPECT_EQ(f.error().message.rfind(path + ": ", 0), 0u) << f.error().message;
      EXPECT_GT(f.error().message.size(), path.size() + 8) << f.error().message;
    } else {
      ++accepted;
      expect_consistent(*f, bad.size() - data_start);
    }
  }
  std::printf("GGUF corruption: %d bad magic, %d data only, %d header rejected, %d accepted\n",
              bad_magic, data_only, rejected, accepted);
  // Every class was exercised, so every branch above asserted something.
  EXPECT_GT(bad_magic, 0);
  EXPECT_GT(data_only, 0);
  EXPECT_GT(rejected, 0);
  EXPECT_GT(accepted, 0);
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

// Targeted corruptions of a real file: each is rejected, and the message
// names the tensor or field and what is wrong with it.
TEST(SafetensorsValidation, CorruptedFieldsOfARealFileAreNamed) {
  const auto good = read_all(fixture("tiny.safetensors"));
  ASSERT_GT(good.size(), 8u);
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, good.data(), 8);
  ASSERT_LE(8 + header_len, good.size());
  const std::string header(good.begin() + 8,
                           good.begin() + 8 + static_cast<std::ptrdiff_t>(header_len));
  const auto open = [](const std::string& p) { return safetensors_model::open(p); };
  // The header with `from` replaced by `to` (same length, so offsets hold).
  const auto edited = [&](const std::string& from, const std::string& to) {
    std::string h = header;
    const auto at = h.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    EXPECT_EQ(from.size(), to.size());
    if (at != std::string::npos) h.replace(at, from.size(), to);
    std::string file(good.begin(), good.begin() + 8);
    file += h;
    file.append(good.begin() + 8 + static_cast<std::ptrdiff_t>(header_len), good.end());
    return std::vector<std::uint8_t>(file.begin(), file.end());
  };

  auto b = good;
  put<std::uint64_t>(b, 0, 10000);
  expect_rejected(open, "header length past the end", b,
                  {"header length 10000 runs past the end of the file"});

  b.assign(good.begin(), good.begin() + 5);
  expect_rejected(open, "cut in the length", b, {"shorter than the 8-byte header length"});

  b.assign(good.begin(), good.begin() + 8 + static_cast<std::ptrdiff_t>(header_len) / 2);
  expect_rejected(open, "cut in the header", b, {"runs past the end of the file"});

  b.assign(good.begin(), good.begin() + 8 + static_cast<std::ptrdiff_t>(header_len) + 50);
  expect_rejected(open, "cut in the data", b,
                  {"tensor 'a'", "bytes [0, 96) outside the data section of 50 bytes"});

  expect_rejected(open, "unknown dtype", edited(R"("dtype":"F16")", R"("dtype":"I16")"),
                  {"tensor 'b'", "dtype I16 is not supported"});
  expect_rejected(open, "offset out of range", edited("[96,102]", "[96,902]"),
                  {"tensor 'b'", "bytes [96, 902) outside the data section"});
  expect_rejected(open, "reversed offsets", edited("[96,102]", "[99,96 ]"),
                  {"tensor 'b'", "bytes [99, 96) outside the data section"});
  expect_rejected(open, "shape against bytes", edited("[4,6]", "[4,7]"),
                  {"tensor 'a'", "96 bytes for", "(expected 112)"});
  expect_rejected(open, "broken JSON", edited(R"("format":"pt")", R"("format" "pt")"),
                  {"malformed JSON"});
}

// Random corruption of a real file (random bytes, digits and JSON
// punctuation): a changed header length is always rejected; changes only in
// the data are always accepted with the same tensors; any other change is
// rejected with a message naming the file, or accepted with tensors whose
// byte ranges, as the mutated header states them, hold exactly their shape
// and dtype, inside the file and apart from each other.
TEST(SafetensorsValidation, RandomCorruptionNeverCrashes) {
  const auto good = read_all(fixture("tiny.safetensors"));
  auto original = safetensors_model::open(fixture("tiny.safetensors"));
  ASSERT_TRUE(original) << original.error().message;
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, good.data(), 8);
  const std::uint64_t data_start = 8 + header_len;
  ASSERT_LT(data_start, good.size());
  const auto tensors_of = [](const safetensors_model& m) {
    std::string out;
    for (const auto& t : m.tensors())
      out += t.name + " " + std::string(kernels::to_string(t.type)) + " " + t.shape.to_string() +
             " at " + std::to_string(t.offset) + " bytes " + std::to_string(t.bytes) + "\n";
    return out;
  };
  const std::map<std::string, std::size_t> element_bytes = {{"F32", 4}, {"F16", 2}, {"BF16", 2}};
  int length_changed = 0, data_only = 0, rejected = 0, accepted = 0;
  std::mt19937_64 rng(5);
  for (int iter = 0; iter < 2000; ++iter) {
    auto bad = good;
    std::size_t first = bad.size();
    for (int e = 0; e < 1 + static_cast<int>(rng() % 3); ++e) {
      const std::size_t at = rng() % bad.size();
      first = std::min(first, at);
      switch (rng() % 3) {
        case 0:
          bad[at] = static_cast<std::uint8_t>(rng());
          break;
        case 1:
          bad[at] = static_cast<std::uint8_t>('0' + rng() % 10);
          break;
        default:
          bad[at] = static_cast<std::uint8_t>("{}[]\",: "[rng() % 8]);
      }
    }
    const auto path = write_temp("fuzz.safetensors", bad);
    auto m = safetensors_model::open(path);
    SCOPED_TRACE("iteration " + std::to_string(iter) + ", first change at byte " +
                 std::to_string(first));
    if (!std::equal(good.begin(), good.begin() + 8, bad.begin())) {
      // Shorter cuts the JSON, longer takes data bytes into it.
      ++length_changed;
      ASSERT_FALSE(m) << "a changed header length was accepted";
      EXPECT_NE(m.error().message.find("header"), std::string::npos) << m.error().message;
    } else if (first >= data_start) {
      ++data_only;
      ASSERT_TRUE(m) << "a change in tensor data only was rejected: " << m.error().message;
      EXPECT_EQ(tensors_of(*m), tensors_of(*original));
    } else if (!m) {
      ++rejected;
      EXPECT_EQ(m.error().message.rfind(path, 0), 0u) << m.error().message;
    } else {
      ++accepted;
      // The header as the test reads it, independently of the parser.
      const auto header = nlohmann::json::parse(
          bad.begin() + 8, bad.begin() + static_cast<std::ptrdiff_t>(data_start), nullptr,
          /*allow_exceptions=*/false);
      ASSERT_TRUE(header.is_object()) << "accepted with a header that is not a JSON object";
      EXPECT_EQ(m->tensors().size(), header.size() - header.count("__metadata__"));
      std::vector<std::pair<std::uint64_t, std::uint64_t>> spans;
      for (const auto& t : m->tensors()) {
        ASSERT_TRUE(header.contains(t.name)) << t.name;
        const auto& desc = header[t.name];
        const auto& offsets = desc.at("data_offsets");
        ASSERT_TRUE(offsets.is_array() && offsets.size() == 2) << desc.dump();
        const auto begin = offsets[0].get<std::uint64_t>(), end = offsets[1].get<std::uint64_t>();
        const auto dt = element_bytes.find(desc.at("dtype").get<std::string>());
        ASSERT_NE(dt, element_bytes.end()) << desc.dump();
        std::uint64_t numel = 1;
        for (const auto& e : desc.at("shape")) numel *= e.get<std::uint64_t>();
        EXPECT_EQ(end - begin, numel * dt->second) << t.name << " " << desc.dump();
        EXPECT_EQ(t.offset, data_start + begin) << t.name;
        EXPECT_EQ(t.bytes, end - begin) << t.name;
        EXPECT_EQ(static_cast<std::uint64_t>(t.shape.numel()), numel) << t.name;
        ASSERT_LE(t.offset + t.bytes, bad.size()) << t.name;  // before making a view
        auto v = m->view(t);
        ASSERT_TRUE(v) << t.name;
        EXPECT_EQ(v->nbytes(), t.bytes) << t.name;
        if (t.bytes) spans.emplace_back(t.offset, t.offset + t.bytes);
      }
      std::sort(spans.begin(), spans.end());
      for (std::size_t i = 1; i < spans.size(); ++i)
        EXPECT_GE(spans[i].first, spans[i - 1].second) << "tensors overlap";
    }
  }
  std::printf(
      "safetensors corruption: %d length changed, %d data only, %d header rejected, %d "
      "accepted\n",
      length_changed, data_only, rejected, accepted);
  EXPECT_GT(length_changed, 0);
  EXPECT_GT(data_only, 0);
  EXPECT_GT(rejected, 0);
  EXPECT_GT(accepted, 0);
}
