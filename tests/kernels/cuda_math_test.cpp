// The CUDA backend's index and dequantization math (kernels/cuda/
// weight_math.hpp, shared by host and device) run on the CPU against the
// storage contract: every stored weight reads back bit for bit as
// kernels::dequantize_row gives it, in every format, so the GPU kernels'
// layouts are checked on a machine without a GPU.
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cuda/weight_math.hpp"
#include "kernels/half.hpp"
#include "kernels/quant.hpp"

using namespace troupe::kernels;
namespace kc = troupe::kernels::cuda;

namespace {

kc::weight_view view_of(const weight_matrix& w) {
  kc::weight_view v;
  v.format = static_cast<kc::wfmt>(w.format);
  v.rows = w.rows;
  v.cols = w.cols;
  v.group = w.group;
  v.data = static_cast<const std::uint8_t*>(w.data.data());
  v.scales = w.scales.empty_view() ? nullptr : w.scales.data_as<float>();
  v.zeros = w.zeros.empty_view() ? nullptr : w.zeros.data_as<std::uint8_t>();
  return v;
}

TEST(CudaMath, EveryStoredWeightReadsBackAsTheStorageContractSays) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 0.7f);
  auto pool = memory_pool::create();
  constexpr std::int64_t rows = 9, cols = 256;
  std::vector<float> src(rows * cols);
  for (auto& x : src) x = dist(rng);
  src[3] = 0.0f;
  auto t = tensor::view(src.data(), dtype::f32, {rows, cols});
  ASSERT_TRUE(t.has_value());
  const std::vector<std::pair<weight_format, int>> formats = {
      {weight_format::f32, 32},       {weight_format::f16, 32},       {weight_format::bf16, 32},
      {weight_format::int8_sym, 32},  {weight_format::int8_asym, 32}, {weight_format::int4_sym, 32},
      {weight_format::int4_sym, 128}, {weight_format::int4_asym, 64}, {weight_format::q8_0, 32},
      {weight_format::q4_0, 32}};
  for (auto [f, g] : formats) {
    SCOPED_TRACE(std::string(to_string(f)) + " group " + std::to_string(g));
    auto w = quantize(*pool, *t, f, g);
    ASSERT_TRUE(w.has_value()) << w.error().message;
    const auto v = view_of(*w);
    // The row stride the kernels use is the stored one.
    EXPECT_EQ(kc::row_bytes(v.format, cols),
              static_cast<std::int64_t>(w->data.row(1) - w->data.row(0)));
    std::vector<float> row(cols);
    int differ = 0;
    for (std::int64_t n = 0; n < rows; ++n) {
      ASSERT_TRUE(dequantize_row(*w, n, row).has_value());
      for (std::int64_t k = 0; k < cols; ++k) {
        const float got = kc::weight_at(v, n, k);
        differ += std::bit_cast<std::uint32_t>(got) !=
                  std::bit_cast<std::uint32_t>(row[static_cast<std::size_t>(k)]);
      }
    }
    EXPECT_EQ(differ, 0);
  }
}

TEST(CudaMath, HalfAndBfloatDecodingIsExactForEveryBitPattern) {
  int differ = 0;
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    differ += std::bit_cast<std::uint32_t>(kc::half_to_float(h)) !=
              std::bit_cast<std::uint32_t>(to_f32(f16{h}));
    differ += std::bit_cast<std::uint32_t>(kc::bf16_to_float(h)) !=
              std::bit_cast<std::uint32_t>(to_f32(bf16{h}));
  }
  EXPECT_EQ(differ, 0);
}

TEST(CudaMath, TheFormatsAreInTheOrderOfWeightFormat) {
  EXPECT_EQ(static_cast<int>(kc::wfmt::q4_0), static_cast<int>(weight_format::q4_0));
  EXPECT_EQ(static_cast<int>(kc::wfmt::int4_asym), static_cast<int>(weight_format::int4_asym));
  EXPECT_EQ(static_cast<int>(kc::wfmt::bf16), static_cast<int>(weight_format::bf16));
}

TEST(CudaMath, KeyVisibilityFollowsTheAttentionContract) {
  // Causal: keys up to the row's own position.
  EXPECT_TRUE(kc::key_visible(true, 0, 0, 5, 5));
  EXPECT_FALSE(kc::key_visible(true, 0, 0, 5, 6));
  // Bidirectional: every key.
  EXPECT_TRUE(kc::key_visible(false, 0, 0, 5, 60));
  // A window of 4 with 2 sinks at position 20: keys 0, 1 and 17..20.
  std::vector<int> seen;
  for (int j = 0; j <= 25; ++j)
    if (kc::key_visible(true, 4, 2, 20, j)) seen.push_back(j);
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 17, 18, 19, 20}));
}

}  // namespace
