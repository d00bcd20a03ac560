// Quantization tools: fake quantization against the gguf fixtures, error
// reports against hand-computed values and the known SNR of each format.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/quant_tools.hpp"
#include "tests/kernels/fixture_reader.hpp"

using namespace troupe::kernels;

namespace {

tensor view(std::vector<float>& v, shape_t s) {
  return *tensor::view(v.data(), dtype::f32, s);
}

TEST(QuantTools, ErrorReportMatchesHandComputedValues) {
  std::vector<float> ref = {1, 2, 3, 4}, got = {1, 2, 3, 5};
  auto r = quant_error_report(view(ref, {2, 2}), view(got, {2, 2}));
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_DOUBLE_EQ(r->max_abs_err, 1.0);
  EXPECT_DOUBLE_EQ(r->rms_err, 0.5);                  // sqrt(1 / 4)
  EXPECT_NEAR(r->snr_db, 14.771212547196624, 1e-12);  // 10 log10(30 / 1)
  EXPECT_EQ(r->count, 4);
  auto same = quant_error_report(view(ref, {4}), view(ref, {4}));
  ASSERT_TRUE(same);
  EXPECT_EQ(same->max_abs_err, 0.0);
  EXPECT_TRUE(std::isinf(same->snr_db) && same->snr_db > 0);
}

TEST(QuantTools, FakeQuantizeMatchesGgufDequantizedValues) {
  const auto fx = troupe::test::load_fixture(troupe::test::fixture_path("quant.bin"));
  std::vector<float> x = fx.at("x").as<float>();
  const auto& d = fx.at("x").dims;
  auto pool = memory_pool::create();
  for (auto [fmt, name] : {std::pair{weight_format::q8_0, "q8_0"}, {weight_format::q4_0, "q4_0"}}) {
    auto fq = fake_quantize(*pool, view(x, {d[0], d[1]}), fmt);
    ASSERT_TRUE(fq) << fq.error().message;
    const std::vector<float> want = fx.at(std::string(name) + ".deq").as<float>();
    ASSERT_EQ(fq->numel(), static_cast<std::int64_t>(want.size()));
    EXPECT_EQ(std::memcmp(fq->data(), want.data(), want.size() * 4), 0) << name;
  }
}

TEST(QuantTools, SnrOfEachFormatOnGaussianWeights) {
  // Expected SNR for N(0,1) weights, from the formats' step sizes: f16 (11-bit
  // significand) ~ 70+ dB, bf16 (8-bit) ~ 50 dB, per-row int8 with absmax
  // ~ 4.5 sigma ~ 40 dB, Q8_0 (per-32 absmax) ~ 45 dB, 4-bit per 32 ~ 20 dB.
  struct want_t {
    weight_format f;
    double lo, hi;
  };
  const want_t wants[] = {{weight_format::f16, 65, 90},       {weight_format::bf16, 45, 60},
                          {weight_format::int8_sym, 35, 48},  {weight_format::int8_asym, 35, 48},
                          {weight_format::q8_0, 40, 52},      {weight_format::int4_sym, 15, 25},
                          {weight_format::int4_asym, 15, 25}, {weight_format::q4_0, 15, 25}};
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> src(64 * 256);
  for (auto& v : src) v = nd(rng);
  auto pool = memory_pool::create();
  const tensor ts = view(src, {64, 256});
  for (const auto& w : wants) {
    auto q = quantize(*pool, ts, w.f, 32);
    ASSERT_TRUE(q);
    auto rep = weight_error_report(*q, ts);
    ASSERT_TRUE(rep) << rep.error().message;
    std::printf("%-10s max %.5f rms %.6f snr %.2f dB\n", std::string(to_string(w.f)).c_str(),
                rep->max_abs_err, rep->rms_err, rep->snr_db);
    EXPECT_GT(rep->snr_db, w.lo) << to_string(w.f);
    EXPECT_LT(rep->snr_db, w.hi) << to_string(w.f);
    // The row-by-row report agrees with the report on the full fake-quantized copy.
    auto fq = fake_quantize(*pool, ts, w.f, 32);
    ASSERT_TRUE(fq);
    auto full = quant_error_report(ts, *fq);
    ASSERT_TRUE(full);
    EXPECT_EQ(full->max_abs_err, rep->max_abs_err);
    EXPECT_EQ(full->rms_err, rep->rms_err);
    EXPECT_EQ(full->snr_db, rep->snr_db);
  }
  auto f32 = quantize(*pool, ts, weight_format::f32);
  ASSERT_TRUE(f32);
  auto exact = weight_error_report(*f32, ts);
  ASSERT_TRUE(exact);
  EXPECT_EQ(exact->max_abs_err, 0.0);
}

TEST(QuantTools, Q8_0ErrorStaysWithinHalfAStep) {
  std::mt19937 rng(8);
  std::uniform_real_distribution<float> ud(-3, 3);
  std::vector<float> src(4 * 96);
  for (auto& v : src) v = ud(rng);
  auto pool = memory_pool::create();
  auto fq = fake_quantize(*pool, view(src, {4, 96}), weight_format::q8_0);
  ASSERT_TRUE(fq);
  for (std::size_t b = 0; b < src.size() / 32; ++b) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(src[b * 32 + j]));
    // step d = amax/127 (f16-rounded: relative error <= 2^-11 on up to 127 steps)
    const double bound = amax / 127.0 * (0.5 + 127.0 / 2048.0) + 1e-7;
    for (int j = 0; j < 32; ++j)
      ASSERT_LE(std::fabs(fq->data_as<float>()[b * 32 + j] - src[b * 32 + j]), bound)
          << b << " " << j;
  }
}

}  // namespace
