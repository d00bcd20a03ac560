// The compute seam: the models run every op through a kernels::device. A
// device that forwards to the CPU backend and counts what it is asked to do
// stands where a GPU backend will: the models give it the same bits as the
// CPU device, ask it for every op the LLaVA path needs, and fail cleanly
// when it refuses one. A weight prepared by another backend is refused.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/device.hpp"
#include "models/llava.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

std::string dir(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/llava/" + name;
}

// Forwards to a CPU device; counts each call; refuses `refuse` if set.
class counting_device final : public k::device {
 public:
  counting_device() : inner_(k::cpu::cpu_device::with_threads(2)) {
    info_ = inner_->info();
    info_.name = "counting";
  }

  std::map<k::op_kind, int> calls;
  int prepared = 0;
  std::optional<k::op_kind> refuse;

  const k::device_info& info() const override { return info_; }
  bool supports(k::op_kind op, k::dtype t) const override {
    return op != refuse && inner_->supports(op, t);
  }
  bool supports(k::op_kind op, k::weight_format f) const override {
    return op != refuse && inner_->supports(op, f);
  }
  k::memory_pool& memory() override { return inner_->memory(); }
  bool host_visible() const override { return true; }
  k::result<k::matrix> prepare(const k::weight_matrix& w) override {
    ++prepared;
    return inner_->prepare(w);
  }
  k::result<k::patch_conv> prepare_patch_conv(const k::tensor& w, const k::tensor& b) override {
    ++prepared;
    return inner_->prepare_patch_conv(w, b);
  }
  k::result<void> matmul(const k::tensor& x, const k::matrix& w, k::tensor& y) override {
    if (auto r = count(k::op_kind::matmul); !r) return r;
    return inner_->matmul(x, w, y);
  }
  k::result<void> embedding(const k::weight_matrix& t, const k::tensor& ids,
                            const k::tensor& out) override {
    if (auto r = count(k::op_kind::embedding); !r) return r;
    return inner_->embedding(t, ids, out);
  }
  k::result<void> rms_norm(const k::tensor& x, const k::tensor& w, float eps,
                           const k::tensor& out) override {
    if (auto r = count(k::op_kind::rms_norm); !r) return r;
    return inner_->rms_norm(x, w, eps, out);
  }
  k::result<void> layer_norm(const k::tensor& x, const k::tensor& w, const k::tensor& b, float eps,
                             const k::tensor& out) override {
    if (auto r = count(k::op_kind::layer_norm); !r) return r;
    return inner_->layer_norm(x, w, b, eps, out);
  }
  k::result<void> rope(const k::tensor& x, std::span<const std::int32_t> pos,
                       const k::rope_params& p, const k::tensor& out) override {
    if (auto r = count(k::op_kind::rope); !r) return r;
    return inner_->rope(x, pos, p, out);
  }
  k::result<void> silu(const k::tensor& x, const k::tensor& out) override {
    if (auto r = count(k::op_kind::activation); !r) return r;
    return inner_->silu(x, out);
  }
  k::result<void> gelu(const k::tensor& x, k::gelu_kind g, const k::tensor& out) override {
    if (auto r = count(k::op_kind::activation); !r) return r;
    return inner_->gelu(x, g, out);
  }
  k::result<void> swiglu(const k::tensor& g, const k::tensor& u, const k::tensor& out) override {
    if (auto r = count(k::op_kind::activation); !r) return r;
    return inner_->swiglu(g, u, out);
  }
  k::result<void> softmax(const k::tensor& x, const k::tensor& out, float scale) override {
    if (auto r = count(k::op_kind::softmax); !r) return r;
    return inner_->softmax(x, out, scale);
  }
  k::result<void> add(const k::tensor& a, const k::tensor& b, const k::tensor& out) override {
    if (auto r = count(k::op_kind::add); !r) return r;
    return inner_->add(a, b, out);
  }
  k::result<void> attention(const k::tensor& q, const k::tensor& kk, const k::tensor& v,
                            const k::tensor& out, const k::attention_options& o,
                            std::int64_t q_start) override {
    if (auto r = count(k::op_kind::attention); !r) return r;
    return inner_->attention(q, kk, v, out, o, q_start);
  }
  k::result<void> attention_paged(const k::paged_kv_cache& c,
                                  std::span<const k::attention_sequence> s,
                                  const k::attention_options& o) override {
    if (auto r = count(k::op_kind::attention); !r) return r;
    return inner_->attention_paged(c, s, o);
  }
  k::result<void> append_kv(k::paged_kv_cache& c, std::span<const std::int32_t> table,
                            std::int64_t start, const k::tensor& key,
                            const k::tensor& value) override {
    return inner_->append_kv(c, table, start, key, value);
  }
  k::result<void> run_patch_conv(const k::patch_conv& c, const k::tensor& in,
                                 const k::tensor& out) override {
    if (auto r = count(k::op_kind::conv2d_patch); !r) return r;
    return inner_->run_patch_conv(c, in, out);
  }
  void host_parallel_for(std::int64_t n, std::int64_t grain,
                         const std::function<void(std::int64_t, std::int64_t, int)>& fn) override {
    inner_->host_parallel_for(n, grain, fn);
  }

 private:
  k::result<void> count(k::op_kind op) {
    ++calls[op];
    if (op == refuse)
      return k::make_error(k::errc::unsupported_op,
                           "counting device: " + std::string(k::to_string(op)) + " refused");
    return {};
  }
  std::unique_ptr<k::cpu::cpu_device> inner_;
  k::device_info info_;
};

std::vector<float> values(const k::tensor& t) {
  const auto* p = t.data_as<float>();
  return std::vector<float>(p, p + t.shape().numel());
}

k::tensor pixels(k::device& dev, const llava_model& m, int n) {
  const auto S = m.image_size(), C = m.channels();
  auto t = k::tensor::empty(dev.memory(), k::dtype::f32, {n, C, S, S});
  EXPECT_TRUE(t);
  auto* p = t->data_as<float>();
  for (std::int64_t i = 0; i < t->shape().numel(); ++i)
    p[i] = static_cast<float>((i * 37) % 101) / 50.0f - 1.0f;
  return *t;
}

// What the encoder and the decoder produce on `dev`: projected image rows
// and the logits of a prompt that holds them.
struct outputs {
  std::vector<float> image_rows, logits;
};

outputs run_llava(k::device& dev, const clip_options& copts = {}) {
  auto m = llava_model::load(dir("odd"), dev);
  EXPECT_TRUE(m) << m.error().message;
  if (!m) return {};
  const auto px = pixels(dev, **m, 2);
  auto rows = (*m)->encode_images(dev, px, copts);
  EXPECT_TRUE(rows) << rows.error().message;
  if (!rows) return {};
  const auto& lm = (*m)->language_model();
  auto cache = lm.make_cache(dev.memory(), kv_options{.block_size = 16, .capacity_tokens = 64});
  EXPECT_TRUE(cache);
  const std::vector<std::int32_t> toks{1, 40, 7, 12, 99};
  step_input in{cache->add_sequence(), toks, true};
  auto l = lm.forward(dev, *cache, std::vector<step_input>{in});
  EXPECT_TRUE(l) << l.error().message;
  return {values(*rows), l ? values(*l) : std::vector<float>{}};
}

TEST(DeviceSeam, ModelsRunEveryOpThroughTheDeviceAndGetTheCpuBits) {
  auto cpu = k::cpu::cpu_device::with_threads(2);
  const auto want = run_llava(*cpu);
  ASSERT_FALSE(want.logits.empty());
  counting_device dev;
  const auto got = run_llava(dev);
  EXPECT_EQ(got.image_rows, want.image_rows);
  EXPECT_EQ(got.logits, want.logits);
  EXPECT_GT(dev.prepared, 0);
  // Every op of the LLaVA path was asked of the device (the decoder: the
  // embedding, RMSNorm, RoPE, paged attention, SwiGLU, residual adds, the
  // matmuls; the tower: LayerNorm, attention, GELU; the projector: GELU).
  for (auto op :
       {k::op_kind::matmul, k::op_kind::embedding, k::op_kind::rms_norm, k::op_kind::layer_norm,
        k::op_kind::rope, k::op_kind::activation, k::op_kind::add, k::op_kind::attention})
    EXPECT_GT(dev.calls[op], 0) << k::to_string(op);
  // The oneDNN patch convolution runs through the device when chosen.
  EXPECT_EQ(dev.calls[k::op_kind::conv2d_patch], 0);
  clip_options onednn;
  onednn.onednn_patch_embedding = true;
  (void)run_llava(dev, onednn);
  EXPECT_GT(dev.calls[k::op_kind::conv2d_patch], 0);
}

TEST(DeviceSeam, AnOpTheDeviceRefusesFailsTheCallWithItsReason) {
  for (auto op : {k::op_kind::attention, k::op_kind::rms_norm, k::op_kind::matmul}) {
    counting_device dev;
    auto m = llava_model::load(dir("odd"), dev);
    ASSERT_TRUE(m) << m.error().message;
    dev.refuse = op;
    const auto& lm = (*m)->language_model();
    auto cache = lm.make_cache(dev.memory(), kv_options{.block_size = 16, .capacity_tokens = 64});
    ASSERT_TRUE(cache);
    const std::vector<std::int32_t> toks{1, 40, 7};
    step_input in{cache->add_sequence(), toks, true};
    auto l = lm.forward(dev, *cache, std::vector<step_input>{in});
    ASSERT_FALSE(l) << k::to_string(op);
    EXPECT_EQ(l.error().code, k::errc::unsupported_op);
    EXPECT_NE(l.error().message.find(std::string(k::to_string(op)) + " refused"), std::string::npos)
        << l.error().message;
    EXPECT_FALSE(dev.supports(op, k::dtype::f32));
  }
}

TEST(DeviceSeam, AWeightPreparedByAnotherBackendIsRefused) {
  auto cpu = k::cpu::cpu_device::with_threads(1);
  auto x = k::tensor::zeros(cpu->memory(), k::dtype::f32, {1, 4});
  auto y = k::tensor::empty(cpu->memory(), k::dtype::f32, {1, 4});
  ASSERT_TRUE(x && y);
  const k::matrix foreign(k::device_kind::cuda, std::make_shared<int>(0), 4, 4,
                          k::weight_format::f32, 64);
  auto r = cpu->matmul(*x, foreign, *y);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, k::errc::device_unavailable);
  EXPECT_NE(r.error().message.find("cuda"), std::string::npos) << r.error().message;
  auto empty = cpu->matmul(*x, k::matrix(), *y);
  ASSERT_FALSE(empty);
  EXPECT_EQ(empty.error().code, k::errc::invalid_argument);
  const k::patch_conv conv(k::device_kind::npu, std::make_shared<int>(0), 4, 3, 2);
  auto px = k::tensor::zeros(cpu->memory(), k::dtype::f32, {1, 3, 2, 2});
  ASSERT_TRUE(px);
  auto c = cpu->run_patch_conv(conv, *px, *y);
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().code, k::errc::device_unavailable);
}

// A matrix prepared on one CPU device runs on another (host memory is
// shared): a model loaded on a 2-thread device gives the same bits run on a
// 1-thread one.
TEST(DeviceSeam, CpuDevicesShareTheirPreparedWeights) {
  auto two = k::cpu::cpu_device::with_threads(2);
  auto one = k::cpu::cpu_device::with_threads(1);
  auto w = k::tensor::empty(two->memory(), k::dtype::f32, {8, 32});
  auto x = k::tensor::empty(two->memory(), k::dtype::f32, {3, 32});
  auto y1 = k::tensor::empty(two->memory(), k::dtype::f32, {3, 8});
  auto y2 = k::tensor::empty(two->memory(), k::dtype::f32, {3, 8});
  ASSERT_TRUE(w && x && y1 && y2);
  for (std::int64_t i = 0; i < 8 * 32; ++i) w->data_as<float>()[i] = float(i % 13) / 7.0f - 0.9f;
  for (std::int64_t i = 0; i < 3 * 32; ++i) x->data_as<float>()[i] = float(i % 5) / 3.0f - 0.5f;
  k::weight_matrix wm;
  wm.rows = 8;
  wm.cols = 32;
  wm.data = *w;
  auto m = two->prepare(wm);
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ(m->rows(), 8);
  EXPECT_EQ(m->cols(), 32);
  EXPECT_GT(m->bytes(), 0u);
  ASSERT_TRUE(two->matmul(*x, *m, *y1));
  ASSERT_TRUE(one->matmul(*x, *m, *y2));
  EXPECT_EQ(values(*y1), values(*y2));
  EXPECT_NE(values(*y1), std::vector<float>(24, 0.0f));
}

TEST(DeviceSeam, CpuDeviceSaysWhatItRuns) {
  auto cpu = k::cpu::cpu_device::with_threads(1);
  EXPECT_TRUE(cpu->host_visible());
  EXPECT_TRUE(cpu->supports(k::op_kind::matmul, k::dtype::q4_0));
  EXPECT_TRUE(cpu->supports(k::op_kind::attention, k::dtype::f16));
  EXPECT_FALSE(cpu->supports(k::op_kind::matmul, k::dtype::i32));
  EXPECT_FALSE(cpu->supports(k::op_kind::rms_norm, k::dtype::f16));
  EXPECT_EQ(cpu->info().kind, k::device_kind::cpu);
  EXPECT_EQ(cpu->info().cores, 1);
  k::cpu::cpu_device_options bad;
  bad.cores = {0, 0};
  auto twice = k::cpu::cpu_device::create(bad);
  ASSERT_FALSE(twice);
  EXPECT_NE(twice.error().message.find("listed twice"), std::string::npos);
}

}  // namespace
