#include "models/clip.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>

namespace troupe::models {

using kernels::dtype;
using kernels::tensor;

namespace {

#define TRY(expr)                                                  \
  do {                                                             \
    if (auto r_ = (expr); !r_) return std::unexpected(r_.error()); \
  } while (0)

template <class T>
result<T> named(result<T> r, const std::string& what) {
  if (!r) return make_error(r.error().code, what + ": " + r.error().message);
  return r;
}

kernels::memory_pool& host_pool() {
  return host_staging_pool();
}

kernels::memory_pool& staging_for(kernels::device& dev) {
  return dev.memory().host_accessible() ? dev.memory() : host_pool();
}

}  // namespace

kernels::memory_pool& host_staging_pool() {
  static const auto pool = kernels::memory_pool::create();
  return *pool;
}

result<void> linear_layer::run(kernels::device& dev, const tensor& x, tensor& y) const {
  TRY(dev.matmul(x, weight, y));
  if (!bias.empty_view()) TRY(dev.add(y, bias, y));  // the bias, added to every row
  return {};
}

result<tensor> load_f32(kernels::memory_pool& pool, const weight_source& src,
                        const std::string& name, const kernels::shape_t& shape) {
  auto t = src.get(name);
  if (!t) return std::unexpected(t.error());
  if (!(t->shape() == shape))
    return make_error(errc::corrupt_data, src.path() + ": tensor '" + src.file_name(name) +
                                              "' has shape " + t->shape().to_string() +
                                              ", the config implies " + shape.to_string());
  return named(to_f32(pool, *t), src.file_name(name));
}

result<tensor> load_f32(kernels::device& dev, const weight_source& src, const std::string& name,
                        const kernels::shape_t& shape) {
  auto f = load_f32(staging_for(dev), src, name, shape);
  if (!f) return f;
  return named(kernels::to_device(dev, *f), src.file_name(name));
}

result<linear_layer> load_linear(kernels::device& dev, const weight_source& src,
                                 const quant_plan& plan, const std::string& name, std::int64_t rows,
                                 std::int64_t cols, bool bias) {
  auto t = src.get(name);
  if (!t) return std::unexpected(t.error());
  if (t->ndim() != 2 || t->dim(0) != rows || t->dim(1) != cols)
    return make_error(errc::corrupt_data, src.path() + ": tensor '" + src.file_name(name) +
                                              "' has shape " + t->shape().to_string() +
                                              ", the config implies [" + std::to_string(rows) +
                                              ", " + std::to_string(cols) + "]");
  auto w = named(convert_weight(staging_for(dev), *t, plan.choose(name, t->type(), t->dim(1)),
                                plan.int4_group),
                 src.file_name(name));
  if (!w) return std::unexpected(w.error());
  linear_layer l;
  auto packed = named(dev.prepare(*w), src.file_name(name));
  if (!packed) return std::unexpected(packed.error());
  l.weight = std::move(*packed);
  if (bias) {
    auto b = load_f32(dev, src, name + ".bias", {rows});
    if (!b) return std::unexpected(b.error());
    l.bias = std::move(*b);
  }
  return l;
}

result<encoder_layer> encoder_layer::load(kernels::device& dev, const weight_source& src,
                                          const quant_plan& plan, const std::string& p,
                                          std::int64_t D, std::int64_t F, bool k_bias) {
  encoder_layer L;
  struct mat {
    const char* name;
    linear_layer* out;
    std::int64_t rows, cols;
    bool bias;
  };
  for (auto& [name, out, rows, cols, bias] :
       {mat{"q_proj", &L.q, D, D, true}, mat{"k_proj", &L.k, D, D, k_bias},
        mat{"v_proj", &L.v, D, D, true}, mat{"o_proj", &L.o, D, D, true},
        mat{"fc1", &L.fc1, F, D, true}, mat{"fc2", &L.fc2, D, F, true}}) {
    auto w = load_linear(dev, src, plan, p + name, rows, cols, bias);
    if (!w) return std::unexpected(w.error());
    *out = std::move(*w);
  }
  struct vec {
    const char* name;
    tensor* out;
  };
  for (auto& [name, out] : {vec{"norm1", &L.norm1_w}, vec{"norm1.bias", &L.norm1_b},
                            vec{"norm2", &L.norm2_w}, vec{"norm2.bias", &L.norm2_b}}) {
    auto t = load_f32(dev, src, p + name, {D});
    if (!t) return std::unexpected(t.error());
    *out = std::move(*t);
  }
  return L;
}

result<void> encoder_layer::run(kernels::device& dev, tensor& x, encoder_scratch& s, float eps,
                                kernels::gelu_kind activation, const attend_fn& attend) const {
  TRY(dev.layer_norm(x, norm1_w, norm1_b, eps, s.h));
  TRY(q.run(dev, s.h, s.q));
  TRY(k.run(dev, s.h, s.k));
  TRY(v.run(dev, s.h, s.v));
  TRY(attend(s.q, s.k, s.v, s.att));
  TRY(o.run(dev, s.att, s.proj));
  TRY(dev.add(x, s.proj, x));
  TRY(dev.layer_norm(x, norm2_w, norm2_b, eps, s.h));
  TRY(fc1.run(dev, s.h, s.f));
  TRY(dev.gelu(s.f, activation, s.f));
  TRY(fc2.run(dev, s.f, s.proj));
  TRY(dev.add(x, s.proj, x));
  return {};
}

void encoder_layer::count_formats(std::map<std::string, int>& counts) const {
  for (const auto* w : {&q, &k, &v, &o, &fc1, &fc2})
    counts[std::string(kernels::to_string(w->weight.format()))]++;
}

result<std::unique_ptr<clip_vision_tower>> clip_vision_tower::build(const weight_source& src,
                                                                    const clip_vision_config& cfg,
                                                                    std::int64_t layers,
                                                                    kernels::device& dev,
                                                                    const quant_plan& plan) {
  if (auto r = cfg.validate(src.path() + " vision_config"); !r) return std::unexpected(r.error());
  if (layers < 0 || layers > cfg.num_layers)
    return make_error(errc::invalid_argument, "vision tower: " + std::to_string(layers) +
                                                  " layers requested, it has " +
                                                  std::to_string(cfg.num_layers));
  std::unique_ptr<clip_vision_tower> m(new clip_vision_tower());
  m->cfg_ = cfg;
  const std::int64_t D = cfg.hidden_size, F = cfg.intermediate_size, P = cfg.patch_size;
  // Host memory: prepare and prepare_patch_conv take their weights from the host.
  auto patch = load_f32(host_pool(), src, "vision.patch_embedding", {D, cfg.num_channels, P, P});
  if (!patch) return std::unexpected(patch.error());
  auto conv_bias = cfg.siglip ? load_f32(host_pool(), src, "vision.patch_embedding.bias", {D})
                              : tensor::zeros(host_pool(), dtype::f32, {D});
  if (!conv_bias) return std::unexpected(conv_bias.error());
  auto conv =
      named(dev.prepare_patch_conv(*patch, *conv_bias), src.file_name("vision.patch_embedding"));
  if (!conv) return std::unexpected(conv.error());
  m->patch_ = std::move(*conv);
  {  // the same weights as a matrix over patches flattened (channel, row, column)
    kernels::weight_matrix w;
    w.rows = D;
    w.cols = cfg.num_channels * P * P;
    auto flat = patch->reshape({w.rows, w.cols});
    if (!flat) return std::unexpected(flat.error());
    w.data = std::move(*flat);
    auto packed = named(dev.prepare(w), src.file_name("vision.patch_embedding"));
    if (!packed) return std::unexpected(packed.error());
    m->patch_matrix_ = std::move(*packed);
  }
  struct vec {
    const char* name;
    tensor* out;
    kernels::shape_t shape;
  };
  for (auto& [name, out, shape] :
       {vec{"vision.class_embedding", &m->class_embedding_, {D}},
        vec{"vision.position_embedding", &m->position_embedding_, {cfg.positions(), D}},
        vec{"vision.pre_norm", &m->pre_norm_w_, {D}},
        vec{"vision.pre_norm.bias", &m->pre_norm_b_, {D}},
        vec{"vision.patch_embedding.bias", &m->patch_bias_, {D}}}) {
    const bool clip_only = out != &m->position_embedding_ && out != &m->patch_bias_;
    if (cfg.siglip ? clip_only : out == &m->patch_bias_) continue;
    auto t = load_f32(dev, src, name, shape);
    if (!t) return std::unexpected(t.error());
    *out = std::move(*t);
  }
  for (std::int64_t l = 0; l < layers; ++l) {
    auto L =
        encoder_layer::load(dev, src, plan, "vision.layers." + std::to_string(l) + ".", D, F, true);
    if (!L) return std::unexpected(L.error());
    m->layers_.push_back(std::move(*L));
  }
  return m;
}

std::string describe_layers(const std::string& what, const std::vector<encoder_layer>& layers) {
  std::map<std::string, int> counts;
  for (const auto& L : layers) L.count_formats(counts);
  std::string s = what + " layers=" + std::to_string(layers.size()) + " matrices:";
  for (const auto& [f, n] : counts) s += " " + f + "x" + std::to_string(n);
  return s;
}

std::string clip_vision_tower::describe() const {
  return describe_layers("vision", layers_);
}

result<void> clip_vision_tower::attend(kernels::device& dev, const tensor& q, const tensor& k,
                                       const tensor& v, tensor& out, std::int64_t images,
                                       const clip_options& opts,
                                       kernels::paged_kv_cache* cache) const {
  const std::int64_t T = positions(), H = cfg_.num_heads, hd = cfg_.head_dim;
  // Image n's rows of t as [T, heads, head_dim].
  auto heads = [&](const tensor& t, std::int64_t n) -> result<tensor> {
    auto rows = t.slice_rows(n * T, T);
    if (!rows) return make_error(errc::internal, "vision attention slice failed");
    auto r = rows->reshape({T, H, hd});
    if (!r) return make_error(errc::internal, "vision attention reshape failed");
    return r;
  };
  if (cache == nullptr) {
    for (std::int64_t n = 0; n < images; ++n) {
      auto q3 = heads(q, n), k3 = heads(k, n), v3 = heads(v, n), o3 = heads(out, n);
      if (!q3 || !k3 || !v3 || !o3)
        return std::unexpected(!q3 ? q3.error() : !k3 ? k3.error() : !v3 ? v3.error() : o3.error());
      TRY(dev.attention(*q3, *k3, *v3, *o3, opts.attention));
    }
    return {};
  }
  // Sparse: each image's keys go to its own blocks of a paged cache.
  const std::int64_t per_image = (T + cache->config.block_size - 1) / cache->config.block_size;
  std::vector<std::vector<std::int32_t>> tables(static_cast<std::size_t>(images));
  std::vector<kernels::attention_sequence> seqs(static_cast<std::size_t>(images));
  for (std::int64_t n = 0; n < images; ++n) {
    auto& table = tables[static_cast<std::size_t>(n)];
    for (std::int64_t b = 0; b < per_image; ++b)
      table.push_back(static_cast<std::int32_t>(n * per_image + b));
    auto q3 = heads(q, n), k3 = heads(k, n), v3 = heads(v, n), o3 = heads(out, n);
    if (!q3 || !k3 || !v3 || !o3)
      return std::unexpected(!q3 ? q3.error() : !k3 ? k3.error() : !v3 ? v3.error() : o3.error());
    TRY(dev.append_kv(*cache, table, 0, *k3, *v3));
    auto& s = seqs[static_cast<std::size_t>(n)];
    s.q = *q3;
    s.out = *o3;
    s.q_start = 0;
    s.kv_len = T;
    s.block_table = table;
  }
  return dev.attention_paged(*cache, seqs, opts.attention);
}

result<tensor> clip_vision_tower::forward(kernels::device& dev, const tensor& pixels,
                                          const clip_options& opts) const {
  const std::int64_t S = cfg_.image_size, C = cfg_.num_channels;
  if (pixels.type() != dtype::f32 || pixels.ndim() != 4 || !pixels.is_contiguous() ||
      pixels.dim(0) < 1 || pixels.dim(1) != C || pixels.dim(2) != S || pixels.dim(3) != S)
    return make_error(errc::shape_mismatch,
                      "pixel_values must be a contiguous f32 tensor [N >= 1, " + std::to_string(C) +
                          ", " + std::to_string(S) + ", " + std::to_string(S) + "], got " +
                          std::string(kernels::to_string(pixels.type())) + " " +
                          pixels.shape().to_string());
  // The pixels as host memory (they may come in the device's).
  auto host_pixels = kernels::to_host(pixels, host_pool());
  if (!host_pixels) return std::unexpected(host_pixels.error());
  {
    const float* p = host_pixels->data_as<float>();
    for (std::int64_t i = 0, n = pixels.numel(); i < n; ++i)
      if (!std::isfinite(p[i]))
        return make_error(errc::invalid_argument,
                          "pixel_values holds a non-finite value at element " + std::to_string(i));
  }
  if (opts.attention.top_k >= 0 && (opts.kv_block_size < 1 || opts.kv_block_size > 4096))
    return make_error(errc::invalid_argument, "clip_options.kv_block_size must be in [1, 4096]");
  auto& pool = dev.memory();
  const std::int64_t N = pixels.dim(0), T = positions(), D = cfg_.hidden_size;
  const std::int64_t F = cfg_.intermediate_size, P = cfg_.num_patches();
  if (N > (std::int64_t{1} << 31) / T)
    return make_error(errc::invalid_argument, "too many images in one batch");
  const std::int64_t rows = N * T;
  auto alloc = [&](std::int64_t r, std::int64_t c) {
    return tensor::empty(pool, dtype::f32, {r, c});
  };
  auto patches = tensor::empty(pool, dtype::f32, {N, P, D});
  auto x = alloc(rows, D), h = alloc(rows, D), q = alloc(rows, D), k = alloc(rows, D);
  auto v = alloc(rows, D), att = alloc(rows, D), proj = alloc(rows, D), f = alloc(rows, F);
  for (auto* t : {&patches, &x, &h, &q, &k, &v, &att, &proj, &f})
    if (!*t) return std::unexpected(t->error());
  if (opts.onednn_patch_embedding && S % cfg_.patch_size == 0) {
    auto on_device = kernels::to_device(dev, pixels);
    if (!on_device) return std::unexpected(on_device.error());
    TRY(dev.run_patch_conv(patch_, *on_device, *patches));
  } else {
    // Gather each patch as a row (channel, row, column order) in host
    // memory, then one matmul on the device.
    const std::int64_t ps = cfg_.patch_size, side = cfg_.patches_per_side(), K = C * ps * ps;
    auto rows_in = tensor::empty(host_pool(), dtype::f32, {N * P, K});
    if (!rows_in) return std::unexpected(rows_in.error());
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t py = 0; py < side; ++py)
        for (std::int64_t px = 0; px < side; ++px) {
          float* dst = rows_in->row_as<float>(n * P + py * side + px);
          for (std::int64_t c = 0; c < C; ++c)
            for (std::int64_t y = 0; y < ps; ++y) {
              const float* src =
                  host_pixels->data_as<float>() + ((n * C + c) * S + py * ps + y) * S + px * ps;
              std::copy_n(src, ps, dst + (c * ps + y) * ps);
            }
        }
    auto flat = patches->reshape({N * P, D});
    if (!flat) return std::unexpected(flat.error());
    auto rows_dev = kernels::to_device(dev, *rows_in);
    if (!rows_dev) return std::unexpected(rows_dev.error());
    TRY(dev.matmul(*rows_dev, patch_matrix_, *flat));
    if (cfg_.siglip) TRY(dev.add(*flat, patch_bias_, *flat));
  }
  // embeddings = cat(class, patches) + position_embedding, through the
  // device: per image, the class row and the patch rows, then the positions.
  if (cfg_.siglip) {  // no class token: the patches plus positions, then no pre-LayerNorm
    auto flat = patches->reshape({N * P, D});
    if (!flat) return make_error(errc::internal, "vision embeddings reshape failed");
    TRY(dev.copy(*flat, *x));
    for (std::int64_t n = 0; n < N; ++n) {
      auto image = x->slice_rows(n * T, T);
      if (!image) return make_error(errc::internal, "vision embeddings slice failed");
      TRY(dev.add(*image, position_embedding_, *image));
    }
  } else {
    auto cls = class_embedding_.reshape({1, D});
    auto flat = patches->reshape({N * P, D});
    if (!cls || !flat) return make_error(errc::internal, "vision embeddings reshape failed");
    for (std::int64_t n = 0; n < N; ++n) {
      auto first = x->slice_rows(n * T, 1);
      auto rest = x->slice_rows(n * T + 1, P);
      auto from = flat->slice_rows(n * P, P);
      auto image = x->slice_rows(n * T, T);
      if (!first || !rest || !from || !image)
        return make_error(errc::internal, "vision embeddings slice failed");
      TRY(dev.copy(*cls, *first));
      TRY(dev.copy(*from, *rest));
      TRY(dev.add(*image, position_embedding_, *image));
    }
  }
  const auto eps = static_cast<float>(cfg_.layer_norm_eps);
  if (!cfg_.siglip) TRY(dev.layer_norm(*x, pre_norm_w_, pre_norm_b_, eps, *x));

  std::optional<kernels::paged_kv_cache> cache;
  if (opts.attention.top_k >= 0) {
    kernels::kv_cache_config kc;
    kc.block_size = opts.kv_block_size;
    kc.n_kv_heads = static_cast<int>(cfg_.num_heads);
    kc.head_dim = static_cast<int>(cfg_.head_dim);
    kc.type = dtype::f32;
    kc.n_blocks = N * ((T + kc.block_size - 1) / kc.block_size);
    kc.summaries = true;
    auto made = kernels::create_paged_kv_cache(dev, kc);
    if (!made) return std::unexpected(made.error());
    cache = std::move(*made);
  }
  encoder_scratch s{*h, *q, *k, *v, *att, *proj, *f};
  const auto attend_images = [&](const tensor& aq, const tensor& ak, const tensor& av,
                                 tensor& out) {
    return attend(dev, aq, ak, av, out, N, opts, cache ? &*cache : nullptr);
  };
  for (const auto& L : layers_) TRY(L.run(dev, *x, s, eps, cfg_.activation, attend_images));
  return x->reshape({N, T, D});
}

#undef TRY

}  // namespace troupe::models
