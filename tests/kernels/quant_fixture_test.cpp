// Q8_0 / Q4_0 against the `gguf` Python package (tools/make_fixtures.py gguf):
// identical block bytes and identical dequantized floats, bit for bit.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/quant.hpp"
#include "tests/kernels/fixture_reader.hpp"

using namespace troupe::kernels;
using troupe::test::fixture_array;
using troupe::test::fixture_path;
using troupe::test::load_fixture;

namespace {

std::uint32_t bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

class QuantFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    fx_ = load_fixture(fixture_path("quant.bin"));
    const fixture_array& x = fx_.at("x");
    ASSERT_EQ(x.dtype, 0u);
    ASSERT_EQ(x.dims.size(), 2u);
    rows_ = x.dims[0];
    cols_ = x.dims[1];
    ASSERT_EQ(cols_ % qk, 0);
    x_ = x.as<float>();
  }

  template <class Block, class Quantize, class Dequantize>
  void check(const char* name, Quantize quantize, Dequantize dequantize) {
    const fixture_array& raw = fx_.at(std::string(name) + ".bytes");
    const fixture_array& deq = fx_.at(std::string(name) + ".deq");
    const std::int64_t row_bytes = cols_ / qk * static_cast<std::int64_t>(sizeof(Block));
    ASSERT_EQ(raw.dims, (std::vector<std::int64_t>{rows_, row_bytes}));
    ASSERT_EQ(deq.dims, (std::vector<std::int64_t>{rows_, cols_}));
    const std::vector<float> want = deq.as<float>();
    std::vector<Block> blocks(static_cast<std::size_t>(cols_ / qk));
    std::vector<float> back(static_cast<std::size_t>(cols_));
    for (std::int64_t r = 0; r < rows_; ++r) {
      quantize(x_.data() + r * cols_, blocks.data(), cols_);
      const std::uint8_t* ref = raw.bytes.data() + r * row_bytes;
      const auto* got = reinterpret_cast<const std::uint8_t*>(blocks.data());
      for (std::int64_t b = 0; b < row_bytes; ++b)
        ASSERT_EQ(got[b], ref[b]) << name << " row " << r << " byte " << b << " (block "
                                  << b / static_cast<std::int64_t>(sizeof(Block)) << ")";
      // Dequantize the gguf bytes (not ours) so this half checks the
      // dequantizer on its own.
      std::vector<Block> theirs(blocks.size());
      std::memcpy(theirs.data(), ref, static_cast<std::size_t>(row_bytes));
      dequantize(theirs.data(), back.data(), cols_);
      for (std::int64_t c = 0; c < cols_; ++c)
        ASSERT_EQ(bits(back[static_cast<std::size_t>(c)]),
                  bits(want[static_cast<std::size_t>(r * cols_ + c)]))
            << name << " row " << r << " col " << c << ": " << back[static_cast<std::size_t>(c)]
            << " vs " << want[static_cast<std::size_t>(r * cols_ + c)];
    }
  }

  std::map<std::string, fixture_array> fx_;
  std::int64_t rows_ = 0, cols_ = 0;
  std::vector<float> x_;
};

TEST_F(QuantFixture, Q8_0MatchesGgufBitExact) {
  check<block_q8_0>("q8_0", quantize_row_q8_0, dequantize_row_q8_0);
}

TEST_F(QuantFixture, Q4_0MatchesGgufBitExact) {
  check<block_q4_0>("q4_0", quantize_row_q4_0, dequantize_row_q4_0);
}

// The whole-matrix path (quantize + dequantize of a weight_matrix) agrees
// with the row functions, so loaders that use it are ggml-exact too.
TEST_F(QuantFixture, WeightMatrixPathMatchesGguf) {
  auto pool = memory_pool::create();
  auto src = tensor::view(x_.data(), dtype::f32, {rows_, cols_});
  ASSERT_TRUE(src);
  for (auto [fmt, name] : {std::pair{weight_format::q8_0, "q8_0"}, {weight_format::q4_0, "q4_0"}}) {
    auto w = quantize(*pool, *src, fmt);
    ASSERT_TRUE(w) << w.error().message;
    const fixture_array& raw = fx_.at(std::string(name) + ".bytes");
    ASSERT_EQ(w->data.nbytes(), raw.bytes.size());
    EXPECT_EQ(std::memcmp(w->data.data(), raw.bytes.data(), raw.bytes.size()), 0) << name;
    auto d = dequantize(*pool, *w);
    ASSERT_TRUE(d) << d.error().message;
    const std::vector<float> want = fx_.at(std::string(name) + ".deq").as<float>();
    EXPECT_EQ(std::memcmp(d->data(), want.data(), want.size() * 4), 0) << name;
  }
}

}  // namespace
