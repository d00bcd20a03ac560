// Ops against PyTorch references (tests/fixtures/kernels/ops.bin, written by
// `/usr/bin/python3 tools/make_fixtures.py torch`). References are computed
// in float64 from the float32 inputs (RoPE: float32 inv_freq and angles as
// transformers, exact cos/sin), so the tolerances below bound our float32
// error. Every case runs on the scalar path and on AVX2 where available.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/ops.hpp"
#include "tests/kernels/fixture_reader.hpp"

using namespace troupe::kernels;
using troupe::test::fixture_array;
using troupe::test::fixture_path;
using troupe::test::load_fixture;

namespace {

const std::map<std::string, fixture_array>& fixture() {
  static const auto fx = load_fixture(fixture_path("ops.bin"));
  return fx;
}

const fixture_array& arr(const std::string& name) {
  return fixture().at(name);
}

shape_t to_shape(const std::vector<std::int64_t>& dims) {
  shape_t s;
  s.ndim = static_cast<int>(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) s.dims[i] = dims[i];
  return s;
}

tensor view(std::vector<float>& v, const std::vector<std::int64_t>& dims) {
  auto t = tensor::view(v.data(), dtype::f32, to_shape(dims));
  EXPECT_TRUE(t) << t.error().message;
  return *t;
}

// |got - want| <= atol + rtol * |want| for every element; returns the worst
// error for the failure message.
void expect_close(const std::vector<float>& got, const std::vector<float>& want, double atol,
                  double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << what << " [" << i << "]";
      continue;
    }
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    const double excess = err - (atol + rtol * std::fabs(static_cast<double>(want[i])));
    if (excess > worst) worst = excess, worst_i = i;
  }
  EXPECT_EQ(worst, 0.0) << what << ": element " << worst_i << " got " << got[worst_i] << " want "
                        << want[worst_i] << " (atol " << atol << ", rtol " << rtol << ")";
}

class OpsFixture : public ::testing::TestWithParam<cpu::isa> {
 protected:
  void SetUp() override {
    ctx_ = cpu::context::create(2);
    if (GetParam() > ctx_->hardware_level()) GTEST_SKIP() << "ISA not available";
    ctx_->set_level(GetParam());
  }
  std::unique_ptr<cpu::context> ctx_;
};

TEST_P(OpsFixture, RopeMatchesTransformersAndMeta) {
  for (const char* name : {"neox", "adjacent", "partial", "adjacent_partial", "llama3"}) {
    const std::string p = std::string("rope.") + name;
    SCOPED_TRACE(p);
    std::vector<float> x = arr(p + ".x").as<float>();
    const auto dims = arr(p + ".x").dims;
    const std::vector<std::int64_t> pos = arr(p + ".pos").as<std::int64_t>();
    const std::vector<float> prm = arr(p + ".params").as<float>();
    rope_params params;
    params.layout = prm[0] == 0.0f ? rope_layout::neox : rope_layout::adjacent;
    params.theta = prm[1];
    params.rotary_dims = static_cast<int>(prm[2]);
    if (prm[3] != 0.0f)
      params.llama3 =
          rope_llama3_scaling{prm[4], prm[5], prm[6], static_cast<std::int64_t>(prm[7])};

    // inv_freq: within 1 ulp of torch's float32 pow (bit-exact where both
    // round correctly; torch's vectorised pow is not always).
    const std::vector<float> want_inv = arr(p + ".inv_freq").as<float>();
    std::vector<float> inv(want_inv.size());
    ASSERT_TRUE(rope_inv_freq(params, static_cast<int>(dims[2]), inv));
    for (std::size_t i = 0; i < inv.size(); ++i) {
      std::int32_t a, b;
      std::memcpy(&a, &inv[i], 4);
      std::memcpy(&b, &want_inv[i], 4);
      EXPECT_LE(std::abs(a - b), 1) << "inv_freq[" << i << "] " << inv[i] << " vs " << want_inv[i];
    }

    std::vector<float> out(x.size());
    tensor tx = view(x, dims), tout = view(out, dims);
    ASSERT_TRUE(rope(*ctx_, tx, std::span<const std::int64_t>(pos), params, tout));
    // float32 cos/sin (< 1 ulp) and three rounded float32 operations per
    // output, |x| < ~5: a few ulp (measured: 1 ulp).
    expect_close(out, arr(p + ".out").as<float>(), 2e-6, 1e-6, p);

    // In place with i32 positions gives the same bits.
    std::vector<std::int32_t> pos32(pos.begin(), pos.end());
    ASSERT_TRUE(rope(*ctx_, tx, std::span<const std::int32_t>(pos32), params, tx));
    EXPECT_EQ(std::memcmp(x.data(), out.data(), x.size() * 4), 0);
  }
}

TEST_P(OpsFixture, ActivationsMatchTorch) {
  std::vector<float> x = arr("act.x").as<float>();
  const auto dims = arr("act.x").dims;
  std::vector<float> out(x.size());
  tensor tx = view(x, dims), tout = view(out, dims);
  ASSERT_TRUE(silu(*ctx_, tx, tout));
  expect_close(out, arr("act.silu").as<float>(), 1e-7, 1e-6, "silu");
  ASSERT_TRUE(gelu(*ctx_, tx, gelu_kind::tanh, tout));
  expect_close(out, arr("act.gelu_tanh").as<float>(), 1e-7, 1e-6, "gelu tanh");
  ASSERT_TRUE(gelu(*ctx_, tx, gelu_kind::erf, tout));
  expect_close(out, arr("act.gelu_erf").as<float>(), 1e-7, 2e-6, "gelu erf");
  ASSERT_TRUE(gelu(*ctx_, tx, gelu_kind::quick, tout));
  expect_close(out, arr("act.gelu_quick").as<float>(), 1e-7, 1e-6, "gelu quick");

  std::vector<float> g = arr("swiglu.gate").as<float>(), u = arr("swiglu.up").as<float>();
  const auto sd = arr("swiglu.gate").dims;
  std::vector<float> y(g.size());
  ASSERT_TRUE(swiglu(*ctx_, view(g, sd), view(u, sd), view(y, sd)));
  expect_close(y, arr("swiglu.out").as<float>(), 1e-7, 1e-6, "swiglu");
}

TEST_P(OpsFixture, SoftmaxMatchesTorch) {
  std::vector<float> x = arr("softmax.x").as<float>();
  const auto dims = arr("softmax.x").dims;
  std::vector<float> out(x.size());
  ASSERT_TRUE(softmax(*ctx_, view(x, dims), view(out, dims)));
  expect_close(out, arr("softmax.out").as<float>(), 1e-8, 2e-6, "softmax");
  ASSERT_TRUE(softmax(*ctx_, view(x, dims), view(out, dims), 0.125f));
  expect_close(out, arr("softmax.out_scale_0.125").as<float>(), 1e-8, 2e-6, "softmax scale 0.125");
}

TEST_P(OpsFixture, NormsMatchTorch) {
  std::vector<float> x = arr("norm.x").as<float>(), w = arr("norm.weight").as<float>(),
                     b = arr("norm.bias").as<float>(), x3 = arr("norm.x_plus_3").as<float>();
  const auto dims = arr("norm.x").dims;
  const std::vector<std::int64_t> wd{dims[1]};
  std::vector<float> out(x.size());
  ASSERT_TRUE(rms_norm(*ctx_, view(x, dims), view(w, wd), 1e-6f, view(out, dims)));
  expect_close(out, arr("norm.rms_1e-6").as<float>(), 1e-6, 2e-6, "rms_norm");
  ASSERT_TRUE(layer_norm(*ctx_, view(x3, dims), view(w, wd), view(b, wd), 1e-5f, view(out, dims)));
  expect_close(out, arr("norm.layer_1e-5").as<float>(), 1e-6, 2e-6, "layer_norm");
}

TEST_P(OpsFixture, PatchEmbeddingMatchesConv2d) {
  std::vector<float> in = arr("conv.input").as<float>(), w = arr("conv.weight").as<float>(),
                     b = arr("conv.bias").as<float>();
  auto pe =
      patch_embedding::create(view(w, arr("conv.weight").dims), view(b, arr("conv.bias").dims));
  ASSERT_TRUE(pe) << pe.error().message;
  const auto od = arr("conv.out").dims;
  std::vector<float> out(static_cast<std::size_t>(od[0] * od[1] * od[2]));
  auto r = (*pe)->run(*ctx_, view(in, arr("conv.input").dims), view(out, od));
  ASSERT_TRUE(r) << r.error().message;
  // 147 products of |x| ~ 1 and |w| ~ 0.1 in float32.
  expect_close(out, arr("conv.out").as<float>(), 2e-5, 1e-5, "patch embedding");
}

INSTANTIATE_TEST_SUITE_P(Isa, OpsFixture, ::testing::Values(cpu::isa::scalar, cpu::isa::avx2),
                         [](const auto& info) { return std::string(cpu::to_string(info.param)); });

}  // namespace
