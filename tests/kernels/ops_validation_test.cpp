// Bad arguments to the ops and quantization tools return errors (never crash,
// never write out of bounds). Runs under ASan + UBSan in CI.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/ops.hpp"
#include "kernels/quant_tools.hpp"

using namespace troupe::kernels;

namespace {

struct buf {
  std::vector<float> v;
  tensor t;
  explicit buf(shape_t s, float fill = 1.0f) : v(static_cast<std::size_t>(s.numel()), fill) {
    t = *tensor::view(v.data(), dtype::f32, s);
  }
};

template <class R>
void expect_error(const R& r, errc code, const char* what) {
  ASSERT_FALSE(r.has_value()) << what << ": expected an error";
  EXPECT_EQ(r.error().code, code) << what << ": " << r.error().message;
  EXPECT_FALSE(r.error().message.empty()) << what;
}

class OpsValidation : public ::testing::Test {
 protected:
  std::unique_ptr<cpu::context> ctx_ = cpu::context::create(2);
};

TEST_F(OpsValidation, ElementwiseOpsRejectBadShapesAndDtypes) {
  buf x({3, 8}), y({3, 8}), w({8}), b({8}), wrong({3, 9}), wrong_w({7}), flat({24});
  std::vector<std::uint16_t> h(24);
  const tensor half = *tensor::view(h.data(), dtype::f16, {3, 8});
  const tensor none;

  expect_error(rms_norm(*ctx_, half, w.t, 1e-6f, y.t), errc::unsupported_dtype, "rms_norm f16");
  expect_error(rms_norm(*ctx_, x.t, wrong_w.t, 1e-6f, y.t), errc::shape_mismatch,
               "rms_norm weight");
  expect_error(rms_norm(*ctx_, x.t, w.t, 1e-6f, wrong.t), errc::shape_mismatch, "rms_norm out");
  expect_error(rms_norm(*ctx_, x.t, w.t, 1e-6f, flat.t), errc::shape_mismatch,
               "rms_norm out reshaped");
  expect_error(rms_norm(*ctx_, x.t, w.t, -1.0f, y.t), errc::invalid_argument, "rms_norm eps<0");
  expect_error(rms_norm(*ctx_, x.t, w.t, NAN, y.t), errc::invalid_argument, "rms_norm eps NaN");
  expect_error(rms_norm(*ctx_, none, w.t, 1e-6f, y.t), errc::shape_mismatch, "rms_norm no input");
  expect_error(layer_norm(*ctx_, x.t, w.t, wrong_w.t, 1e-5f, y.t), errc::shape_mismatch,
               "layer_norm bias");
  expect_error(layer_norm(*ctx_, x.t, half, b.t, 1e-5f, y.t), errc::unsupported_dtype,
               "layer_norm f16 weight");
  expect_error(silu(*ctx_, x.t, wrong.t), errc::shape_mismatch, "silu out");
  expect_error(silu(*ctx_, half, y.t), errc::unsupported_dtype, "silu f16");
  expect_error(gelu(*ctx_, x.t, static_cast<gelu_kind>(7), y.t), errc::invalid_argument,
               "gelu kind");
  expect_error(gelu(*ctx_, x.t, gelu_kind::erf, wrong.t), errc::shape_mismatch, "gelu out");
  expect_error(swiglu(*ctx_, x.t, wrong.t, y.t), errc::shape_mismatch, "swiglu up");
  expect_error(swiglu(*ctx_, x.t, y.t, wrong.t), errc::shape_mismatch, "swiglu out");
  expect_error(softmax(*ctx_, x.t, wrong.t), errc::shape_mismatch, "softmax out");
  expect_error(softmax(*ctx_, x.t, y.t, 0.0f), errc::invalid_argument, "softmax scale 0");
  expect_error(softmax(*ctx_, x.t, y.t, INFINITY), errc::invalid_argument, "softmax scale inf");
  expect_error(add(*ctx_, x.t, wrong.t, y.t), errc::shape_mismatch, "add rhs");
  expect_error(add(*ctx_, x.t, y.t, half), errc::unsupported_dtype, "add out f16");
  // None of the failed calls wrote anything.
  for (float v : y.v) ASSERT_EQ(v, 1.0f);
  for (float v : wrong.v) ASSERT_EQ(v, 1.0f);
}

TEST_F(OpsValidation, EmptyBatchesAreFine) {
  buf x({0, 8}), y({0, 8}), w({8}), b({8});
  EXPECT_TRUE(rms_norm(*ctx_, x.t, w.t, 1e-6f, y.t));
  EXPECT_TRUE(layer_norm(*ctx_, x.t, w.t, b.t, 1e-5f, y.t));
  EXPECT_TRUE(softmax(*ctx_, x.t, y.t));
  EXPECT_TRUE(silu(*ctx_, x.t, y.t));
  EXPECT_TRUE(add(*ctx_, x.t, x.t, y.t));
  buf r({0, 2, 16}), ro({0, 2, 16});
  EXPECT_TRUE(rope(*ctx_, r.t, std::span<const std::int64_t>(), rope_params{}, ro.t));
}

TEST_F(OpsValidation, EmbeddingRejectsBadIdsAndShapes) {
  auto pool = memory_pool::create();
  buf table({10, 32}, 0.5f);
  auto w = quantize(*pool, table.t, weight_format::q4_0);
  ASSERT_TRUE(w);
  std::vector<std::int32_t> ids = {1, 2, 10};
  const tensor tids = *tensor::view(ids.data(), dtype::i32, {3});
  buf out({3, 32}, -7.0f);
  expect_error(embedding(*ctx_, *w, tids, out.t), errc::invalid_argument, "id == vocab");
  ids[2] = -1;
  expect_error(embedding(*ctx_, *w, tids, out.t), errc::invalid_argument, "negative id");
  for (float v : out.v) ASSERT_EQ(v, -7.0f);  // nothing written
  ids[2] = 3;
  buf wrong({3, 31});
  expect_error(embedding(*ctx_, *w, tids, wrong.t), errc::shape_mismatch, "out cols");
  buf wrong_rows({2, 32});
  expect_error(embedding(*ctx_, *w, tids, wrong_rows.t), errc::shape_mismatch, "out rows");
  buf fids({3});
  expect_error(embedding(*ctx_, *w, fids.t, out.t), errc::unsupported_dtype, "f32 ids");
  weight_matrix broken = *w;
  broken.cols = 64;  // parts no longer agree
  expect_error(embedding(*ctx_, broken, tids, out.t), errc::shape_mismatch, "inconsistent table");
  expect_error(embedding(*ctx_, weight_matrix{}, tids, out.t), errc::invalid_argument,
               "empty table");
  EXPECT_TRUE(embedding(*ctx_, *w, tids, out.t));
}

TEST_F(OpsValidation, RopeRejectsBadParamsAndPositions) {
  buf x({2, 3, 16}), y({2, 3, 16});
  const std::vector<std::int64_t> pos = {0, 5};
  const std::span<const std::int64_t> sp(pos);
  auto bad = [&](rope_params p, const char* what) {
    expect_error(rope(*ctx_, x.t, sp, p, y.t), errc::invalid_argument, what);
  };
  rope_params p;
  p.rotary_dims = 7;
  bad(p, "odd rotary dims");
  p.rotary_dims = 18;
  bad(p, "rotary dims > head_dim");
  p.rotary_dims = -2;
  bad(p, "negative rotary dims");
  p = {};
  p.theta = 0.0f;
  bad(p, "theta 0");
  p.theta = NAN;
  bad(p, "theta NaN");
  p = {};
  p.layout = static_cast<rope_layout>(9);
  bad(p, "layout");
  p = {};
  p.llama3 = rope_llama3_scaling{0.0f, 1.0f, 4.0f, 8192};
  bad(p, "llama3 factor 0");
  p.llama3 = rope_llama3_scaling{8.0f, 4.0f, 4.0f, 8192};
  bad(p, "llama3 low == high");
  p.llama3 = rope_llama3_scaling{8.0f, 1.0f, 4.0f, 0};
  bad(p, "llama3 original 0");

  const std::vector<std::int64_t> neg = {0, -1};
  expect_error(rope(*ctx_, x.t, std::span<const std::int64_t>(neg), rope_params{}, y.t),
               errc::invalid_argument, "negative position");
  const std::vector<std::int64_t> three = {0, 1, 2};
  expect_error(rope(*ctx_, x.t, std::span<const std::int64_t>(three), rope_params{}, y.t),
               errc::shape_mismatch, "position count");
  buf flat({2, 48}), wrong({2, 3, 17});
  expect_error(rope(*ctx_, flat.t, sp, rope_params{}, flat.t), errc::shape_mismatch, "2-D input");
  expect_error(rope(*ctx_, x.t, sp, rope_params{}, wrong.t), errc::shape_mismatch, "out shape");
  buf odd({2, 1, 17}), odd_out({2, 1, 17});
  expect_error(rope(*ctx_, odd.t, sp, rope_params{}, odd_out.t), errc::invalid_argument,
               "odd head_dim");
  buf huge({1, 1, 2048}), huge_out({1, 1, 2048});
  expect_error(
      rope(*ctx_, huge.t, std::span<const std::int64_t>(pos.data(), 1), rope_params{}, huge_out.t),
      errc::invalid_argument, "head_dim too large");
  buf fpos({2});
  expect_error(rope(*ctx_, x.t, fpos.t, rope_params{}, y.t), errc::unsupported_dtype,
               "f32 positions tensor");
  for (float v : y.v) ASSERT_EQ(v, 1.0f);  // nothing written

  std::vector<float> inv(3);
  expect_error(rope_inv_freq(rope_params{}, 16, inv), errc::shape_mismatch, "inv_freq span size");
  expect_error(rope_inv_freq(rope_params{}, 0, inv), errc::invalid_argument, "inv_freq head_dim 0");
}

TEST_F(OpsValidation, PatchEmbeddingRejectsBadShapes) {
  buf w({4, 3, 2, 2}), b({4}), nonsquare({4, 3, 2, 3}), short_bias({3}), w3({4, 3, 4});
  expect_error(patch_embedding::create(nonsquare.t, b.t), errc::shape_mismatch,
               "non-square kernel");
  expect_error(patch_embedding::create(w.t, short_bias.t), errc::shape_mismatch, "bias length");
  expect_error(patch_embedding::create(w3.t, b.t), errc::shape_mismatch, "3-D weight");
  auto pe = patch_embedding::create(w.t, b.t);
  ASSERT_TRUE(pe) << pe.error().message;
  buf in({1, 3, 4, 6}), out({1, 6, 4});
  buf wrong_ch({1, 2, 4, 6}), odd_h({1, 3, 5, 6}), in3({3, 4, 6}), wrong_out({1, 5, 4});
  expect_error((*pe)->run(*ctx_, wrong_ch.t, out.t), errc::shape_mismatch, "channels");
  expect_error((*pe)->run(*ctx_, odd_h.t, out.t), errc::shape_mismatch,
               "H not a multiple of patch");
  expect_error((*pe)->run(*ctx_, in3.t, out.t), errc::shape_mismatch, "3-D input");
  expect_error((*pe)->run(*ctx_, in.t, wrong_out.t), errc::shape_mismatch, "out shape");
  EXPECT_TRUE((*pe)->run(*ctx_, in.t, out.t));
  // All-ones input and weights: every output is 3*2*2 + 1 = 13.
  for (float v : out.v) EXPECT_EQ(v, 13.0f);
}

TEST_F(OpsValidation, QuantToolsRejectBadInputs) {
  auto pool = memory_pool::create();
  buf a({2, 32}), b({2, 31}), c({2, 32});
  expect_error(quant_error_report(a.t, b.t), errc::shape_mismatch, "report shapes");
  c.v[3] = NAN;
  expect_error(quant_error_report(a.t, c.t), errc::invalid_argument, "report NaN");
  std::vector<std::int32_t> ints(64);
  const tensor ti = *tensor::view(ints.data(), dtype::i32, {2, 32});
  expect_error(quant_error_report(ti, a.t), errc::unsupported_dtype, "report i32");
  expect_error(fake_quantize(*pool, b.t, weight_format::q8_0), errc::shape_mismatch,
               "q8_0 cols % 32");
  expect_error(fake_quantize(*pool, a.t, weight_format::int4_sym, 48), errc::invalid_argument,
               "int4 group 48");
  auto w = quantize(*pool, a.t, weight_format::int8_sym);
  ASSERT_TRUE(w);
  buf other({3, 32});
  expect_error(weight_error_report(*w, other.t), errc::shape_mismatch,
               "weight report source shape");
}

}  // namespace
