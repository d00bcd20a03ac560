// Patch embedding (conv2d, stride = kernel, no padding, bias) through oneDNN 2.x.
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

#include "kernels/ops.hpp"

namespace troupe::kernels {

namespace {

// One batch-1 primitive and the weights in the layout it asked for.
struct conv_entry {
  dnnl::convolution_forward prim;
  dnnl::memory weights;
  dnnl::memory::desc src_md;
  dnnl::memory::desc dst_md;
};

}  // namespace

struct patch_embedding::state {
  std::int64_t hidden = 0, channels = 0, patch = 0;
  std::vector<float> weight;  // oihw
  std::vector<float> bias;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::memory bias_mem;
  std::mutex mtx;
  std::map<std::pair<std::int64_t, std::int64_t>, std::unique_ptr<conv_entry>> cache;  // (H, W)

  result<conv_entry*> entry_for(std::int64_t h, std::int64_t w) {
    std::lock_guard<std::mutex> guard(mtx);
    auto it = cache.find({h, w});
    if (it != cache.end()) return it->second.get();
    using tag = dnnl::memory::format_tag;
    using dt = dnnl::memory::data_type;
    const dnnl::memory::dims src_dims{1, channels, h, w};
    const dnnl::memory::dims wei_dims{hidden, channels, patch, patch};
    const dnnl::memory::dims dst_dims{1, hidden, h / patch, w / patch};
    try {
      auto e = std::make_unique<conv_entry>();
      e->src_md = dnnl::memory::desc(src_dims, dt::f32, tag::nchw);
      // nhwc for batch 1 is exactly [patches, hidden].
      e->dst_md = dnnl::memory::desc(dst_dims, dt::f32, tag::nhwc);
      const dnnl::memory::desc wei_any(wei_dims, dt::f32, tag::any);
      const dnnl::memory::desc bias_md({hidden}, dt::f32, tag::x);
      dnnl::convolution_forward::desc d(dnnl::prop_kind::forward_inference,
                                        dnnl::algorithm::convolution_direct, e->src_md, wei_any,
                                        bias_md, e->dst_md, {patch, patch}, {0, 0}, {0, 0});
      dnnl::convolution_forward::primitive_desc pd(d, engine);
      e->prim = dnnl::convolution_forward(pd);
      dnnl::memory user_w({wei_dims, dt::f32, tag::oihw}, engine, weight.data());
      if (pd.weights_desc() != user_w.get_desc()) {
        e->weights = dnnl::memory(pd.weights_desc(), engine);
        dnnl::stream s(engine);
        dnnl::reorder(user_w, e->weights).execute(s, user_w, e->weights);
        s.wait();
      } else {
        e->weights = user_w;
      }
      if (!bias_mem) bias_mem = dnnl::memory(bias_md, engine, bias.data());
      conv_entry* raw = e.get();
      cache.emplace(std::make_pair(h, w), std::move(e));
      return raw;
    } catch (const dnnl::error& err) {
      return make_error(errc::internal,
                        std::string("oneDNN patch embedding setup failed: ") + err.what());
    }
  }
};

patch_embedding::patch_embedding(std::unique_ptr<state> s) : state_(std::move(s)) {}
patch_embedding::~patch_embedding() = default;

std::int64_t patch_embedding::hidden() const {
  return state_->hidden;
}
std::int64_t patch_embedding::channels() const {
  return state_->channels;
}
std::int64_t patch_embedding::patch() const {
  return state_->patch;
}

result<std::unique_ptr<patch_embedding>> patch_embedding::create(const tensor& weight,
                                                                 const tensor& bias) {
  if (auto r = expect_tensor(weight, dtype::f32, 4, "patch embedding weight"); !r)
    return std::unexpected(r.error());
  if (weight.dim(2) != weight.dim(3) || weight.dim(2) <= 0 || weight.dim(0) <= 0 ||
      weight.dim(1) <= 0)
    return make_error(errc::shape_mismatch,
                      "patch embedding weight must be [hidden, channels, patch, patch], got " +
                          weight.shape().to_string());
  if (auto r = expect_tensor(bias, dtype::f32, 1, "patch embedding bias"); !r)
    return std::unexpected(r.error());
  if (bias.dim(0) != weight.dim(0))
    return make_error(errc::shape_mismatch, "patch embedding bias must be [" +
                                                std::to_string(weight.dim(0)) + "], got " +
                                                bias.shape().to_string());
  auto s = std::make_unique<state>();
  s->hidden = weight.dim(0);
  s->channels = weight.dim(1);
  s->patch = weight.dim(2);
  s->weight.assign(weight.data_as<float>(), weight.data_as<float>() + weight.numel());
  s->bias.assign(bias.data_as<float>(), bias.data_as<float>() + bias.numel());
  return std::unique_ptr<patch_embedding>(new patch_embedding(std::move(s)));
}

result<void> patch_embedding::run(cpu::context& ctx, const tensor& input, const tensor& out) {
  state& st = *state_;
  if (auto r = expect_tensor(input, dtype::f32, 4, "patch embedding input"); !r) return r;
  const std::int64_t batch = input.dim(0), h = input.dim(2), w = input.dim(3);
  if (input.dim(1) != st.channels)
    return make_error(errc::shape_mismatch, "patch embedding input must have " +
                                                std::to_string(st.channels) + " channels, got " +
                                                input.shape().to_string());
  if (h <= 0 || w <= 0 || h % st.patch != 0 || w % st.patch != 0)
    return make_error(errc::shape_mismatch,
                      "patch embedding input H and W must be positive multiples of the patch " +
                          std::to_string(st.patch) + ", got " + input.shape().to_string());
  const std::int64_t patches = (h / st.patch) * (w / st.patch);
  if (auto r = expect_tensor(out, dtype::f32, 3, "patch embedding output"); !r) return r;
  if (out.dim(0) != batch || out.dim(1) != patches || out.dim(2) != st.hidden)
    return make_error(errc::shape_mismatch,
                      "patch embedding output must be [" + std::to_string(batch) + ", " +
                          std::to_string(patches) + ", " + std::to_string(st.hidden) + "], got " +
                          out.shape().to_string());
  if (batch == 0) return {};
  auto entry = st.entry_for(h, w);
  if (!entry) return std::unexpected(entry.error());
  conv_entry& e = **entry;
  ctx.prepare_onednn_thread();
  try {
    dnnl::stream s(st.engine);
    dnnl::memory src(e.src_md, st.engine, DNNL_MEMORY_NONE);
    dnnl::memory dst(e.dst_md, st.engine, DNNL_MEMORY_NONE);
    const std::int64_t in_stride = st.channels * h * w, out_stride = patches * st.hidden;
    for (std::int64_t b = 0; b < batch; ++b) {
      src.set_data_handle(input.data_as<float>() + b * in_stride);
      dst.set_data_handle(out.data_as<float>() + b * out_stride);
      e.prim.execute(s, {{DNNL_ARG_SRC, src},
                         {DNNL_ARG_WEIGHTS, e.weights},
                         {DNNL_ARG_BIAS, st.bias_mem},
                         {DNNL_ARG_DST, dst}});
    }
    s.wait();
  } catch (const dnnl::error& err) {
    return make_error(errc::internal, std::string("oneDNN patch embedding failed: ") + err.what());
  }
  return {};
}

}  // namespace troupe::kernels
