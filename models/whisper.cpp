#include "models/whisper.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

#include "models/llava_config.hpp"
#include "models/mapped_file.hpp"

namespace troupe::models {

using json = nlohmann::json;
using kernels::dtype;
using kernels::tensor;

namespace {

#define TRY(expr)                                                  \
  do {                                                             \
    if (auto r_ = (expr); !r_) return std::unexpected(r_.error()); \
  } while (0)

result<void> range(const std::string& src, const char* name, std::int64_t v, std::int64_t lo,
                   std::int64_t hi) {
  if (v < lo || v > hi)
    return make_error(errc::corrupt_data, src + ": " + name + " = " + std::to_string(v) +
                                              " is outside [" + std::to_string(lo) + ", " +
                                              std::to_string(hi) + "]");
  return {};
}

// A convolution weight [out, in, 3] as a matrix [out, in * 3] (channel,
// tap) order, the order the gathered rows use.
result<kernels::matrix> conv_matrix(kernels::device& dev, const weight_source& src,
                                    const std::string& name, std::int64_t out, std::int64_t in) {
  auto w = load_f32(host_staging_pool(), src, name, {out, in, 3});
  if (!w) return std::unexpected(w.error());
  kernels::weight_matrix m;
  m.rows = out;
  m.cols = in * 3;
  auto flat = w->reshape({out, in * 3});
  if (!flat) return std::unexpected(flat.error());
  m.data = std::move(*flat);
  auto packed = dev.prepare(m);
  if (!packed)
    return make_error(packed.error().code, src.file_name(name) + ": " + packed.error().message);
  return packed;
}

}  // namespace

result<void> whisper_encoder_config::validate(const std::string& src) const {
  for (auto r : {range(src, "d_model", d_model, 1, 1 << 14),
                 range(src, "encoder_layers", encoder_layers, 1, 256),
                 range(src, "encoder_attention_heads", encoder_attention_heads, 1, 256),
                 range(src, "encoder_ffn_dim", encoder_ffn_dim, 1, 1 << 16),
                 range(src, "num_mel_bins", num_mel_bins, 1, 512),
                 range(src, "max_source_positions", max_source_positions, 1, 1 << 16)})
    if (!r) return r;
  if (d_model % encoder_attention_heads != 0)
    return make_error(errc::corrupt_data,
                      src +
                          ": encoder_attention_heads = " + std::to_string(encoder_attention_heads) +
                          " does not divide d_model " + std::to_string(d_model));
  if (!(layer_norm_eps > 0) || layer_norm_eps > 1)
    return make_error(errc::corrupt_data, src + ": the LayerNorm epsilon must be in (0, 1]");
  return {};
}

result<whisper_encoder_config> parse_whisper_encoder_config(std::string_view text,
                                                            const std::string& source) {
  auto root = json::parse(text, nullptr, false);
  if (root.is_discarded() || !root.is_object())
    return make_error(errc::corrupt_data, source + ": not a JSON object");
  const json* j = &root;
  std::string where = source;
  if (root.contains("audio_config")) {
    if (!root["audio_config"].is_object())
      return make_error(errc::corrupt_data, source + ": audio_config must be an object");
    j = &root["audio_config"];
    where = source + " audio_config";
  }
  whisper_encoder_config c;
  if (auto it = j->find("model_type"); it != j->end() && !it->is_null()) {
    if (!it->is_string() || (*it != "whisper" && *it != "whisper_encoder"))
      return make_error(errc::unsupported_op,
                        where + ": model_type " + it->dump() + " is not supported (whisper)");
  }
  for (auto [key, out] :
       {std::pair{"d_model", &c.d_model}, std::pair{"encoder_layers", &c.encoder_layers},
        std::pair{"encoder_attention_heads", &c.encoder_attention_heads},
        std::pair{"encoder_ffn_dim", &c.encoder_ffn_dim},
        std::pair{"num_mel_bins", &c.num_mel_bins},
        std::pair{"max_source_positions", &c.max_source_positions}}) {
    auto it = j->find(key);
    if (it == j->end() || it->is_null()) continue;
    if (!it->is_number_integer())
      return make_error(errc::corrupt_data, where + ": " + key + " must be an integer");
    *out = it->get<std::int64_t>();
  }
  if (auto it = j->find("activation_function"); it != j->end() && !it->is_null()) {
    if (!it->is_string())
      return make_error(errc::corrupt_data, where + ": activation_function must be a string");
    auto kind = gelu_from_hf_name(it->get<std::string>(), where + ": activation_function");
    if (!kind) return std::unexpected(kind.error());
    c.activation = *kind;
  }
  // WhisperEncoder never applies embed_scale, but a checkpoint that sets
  // it may come from code that does: refused rather than guessed.
  if (auto it = j->find("scale_embedding"); it != j->end() && *it == json(true))
    return make_error(errc::unsupported_op, where + ": scale_embedding = true is not supported");
  if (auto r = c.validate(where); !r) return std::unexpected(r.error());
  return c;
}

result<whisper_encoder_config> load_whisper_encoder_config(const std::string& path) {
  auto bytes = read_file_bytes(path, 4 << 20);
  if (!bytes) return std::unexpected(bytes.error());
  return parse_whisper_encoder_config(
      std::string_view(reinterpret_cast<const char*>(bytes->data()), bytes->size()), path);
}

result<std::unique_ptr<whisper_encoder>> whisper_encoder::build(const weight_source& src,
                                                                const whisper_encoder_config& cfg,
                                                                kernels::device& dev,
                                                                const quant_plan& plan) {
  if (auto r = cfg.validate(src.path() + " audio encoder"); !r) return std::unexpected(r.error());
  std::unique_ptr<whisper_encoder> m(new whisper_encoder());
  m->cfg_ = cfg;
  const std::int64_t D = cfg.d_model, F = cfg.encoder_ffn_dim, M = cfg.num_mel_bins;
  auto c1 = conv_matrix(dev, src, "audio.conv1", D, M);
  if (!c1) return std::unexpected(c1.error());
  m->conv1_ = std::move(*c1);
  auto c2 = conv_matrix(dev, src, "audio.conv2", D, D);
  if (!c2) return std::unexpected(c2.error());
  m->conv2_ = std::move(*c2);
  struct vec {
    const char* name;
    tensor* out;
    kernels::shape_t shape;
  };
  for (auto& [name, out, shape] :
       {vec{"audio.conv1.bias", &m->conv1_b_, {D}}, vec{"audio.conv2.bias", &m->conv2_b_, {D}},
        vec{"audio.positions", &m->positions_, {cfg.max_source_positions, D}},
        vec{"audio.norm", &m->norm_w_, {D}}, vec{"audio.norm.bias", &m->norm_b_, {D}}}) {
    auto t = load_f32(dev, src, name, shape);
    if (!t) return std::unexpected(t.error());
    *out = std::move(*t);
  }
  for (std::int64_t l = 0; l < cfg.encoder_layers; ++l) {
    // Whisper's k projection has no bias.
    auto L =
        encoder_layer::load(dev, src, plan, "audio.layers." + std::to_string(l) + ".", D, F, false);
    if (!L) return std::unexpected(L.error());
    m->layers_.push_back(std::move(*L));
  }
  return m;
}

std::string whisper_encoder::describe() const {
  return describe_layers("audio", layers_);
}

result<tensor> whisper_encoder::forward(kernels::device& dev, const tensor& features) const {
  const std::int64_t M = cfg_.num_mel_bins, D = cfg_.d_model, F = cfg_.encoder_ffn_dim;
  if (features.type() != dtype::f32 || features.ndim() != 3 || !features.is_contiguous() ||
      features.dim(0) < 1 || features.dim(1) != M || features.dim(2) < 1 ||
      features.dim(2) > cfg_.max_frames())
    return make_error(errc::shape_mismatch,
                      "audio features must be a contiguous f32 tensor [N >= 1, " +
                          std::to_string(M) + ", 1.." + std::to_string(cfg_.max_frames()) +
                          "], got " + std::string(kernels::to_string(features.type())) + " " +
                          features.shape().to_string());
  const std::int64_t N = features.dim(0), T = features.dim(2), T2 = rows_for(T);
  if (N > (std::int64_t{1} << 24) / T)
    return make_error(errc::invalid_argument, "too many audio clips in one batch");
  auto host = kernels::to_host(features, host_staging_pool());
  if (!host) return std::unexpected(host.error());
  const float* in = host->data_as<float>();
  for (std::int64_t i = 0, n = features.numel(); i < n; ++i)
    if (!std::isfinite(in[i]))
      return make_error(errc::invalid_argument,
                        "audio features hold a non-finite value at element " + std::to_string(i));
  auto& pool = dev.memory();
  auto alloc = [&](std::int64_t r, std::int64_t c) {
    return tensor::empty(pool, dtype::f32, {r, c});
  };
  // conv1: each frame's 3 taps of every mel bin as a row, one matmul.
  auto rows1 = tensor::empty(host_staging_pool(), dtype::f32, {N * T, M * 3});
  if (!rows1) return std::unexpected(rows1.error());
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t t = 0; t < T; ++t) {
      float* dst = rows1->row_as<float>(n * T + t);
      for (std::int64_t c = 0; c < M; ++c) {
        const float* f = in + (n * M + c) * T;
        for (std::int64_t k = 0; k < 3; ++k) {
          const std::int64_t s = t + k - 1;
          dst[c * 3 + k] = s >= 0 && s < T ? f[s] : 0.0f;
        }
      }
    }
  auto h1 = alloc(N * T, D);
  if (!h1) return std::unexpected(h1.error());
  {
    auto r = kernels::to_device(dev, *rows1);
    if (!r) return std::unexpected(r.error());
    TRY(dev.matmul(*r, conv1_, *h1));
    TRY(dev.add(*h1, conv1_b_, *h1));
    TRY(dev.gelu(*h1, cfg_.activation, *h1));
  }
  // conv2 (stride 2) over conv1's output, gathered the same way.
  auto h1_host = kernels::to_host(*h1, host_staging_pool());
  if (!h1_host) return std::unexpected(h1_host.error());
  auto rows2 = tensor::empty(host_staging_pool(), dtype::f32, {N * T2, D * 3});
  if (!rows2) return std::unexpected(rows2.error());
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t t = 0; t < T2; ++t) {
      float* dst = rows2->row_as<float>(n * T2 + t);
      for (std::int64_t k = 0; k < 3; ++k) {
        const std::int64_t s = 2 * t + k - 1;
        const float* src = s >= 0 && s < T ? h1_host->row_as<float>(n * T + s) : nullptr;
        for (std::int64_t c = 0; c < D; ++c) dst[c * 3 + k] = src ? src[c] : 0.0f;
      }
    }
  const std::int64_t rows = N * T2;
  auto x = alloc(rows, D), h = alloc(rows, D), q = alloc(rows, D), k = alloc(rows, D);
  auto v = alloc(rows, D), att = alloc(rows, D), proj = alloc(rows, D), f = alloc(rows, F);
  for (auto* t : {&x, &h, &q, &k, &v, &att, &proj, &f})
    if (!*t) return std::unexpected(t->error());
  {
    auto r = kernels::to_device(dev, *rows2);
    if (!r) return std::unexpected(r.error());
    TRY(dev.matmul(*r, conv2_, *x));
    TRY(dev.add(*x, conv2_b_, *x));
    TRY(dev.gelu(*x, cfg_.activation, *x));
  }
  auto pos = positions_.slice_rows(0, T2);
  if (!pos) return make_error(errc::internal, "audio positions slice failed");
  for (std::int64_t n = 0; n < N; ++n) {
    auto clip = x->slice_rows(n * T2, T2);
    if (!clip) return make_error(errc::internal, "audio embeddings slice failed");
    TRY(dev.add(*clip, *pos, *clip));
  }
  const auto eps = static_cast<float>(cfg_.layer_norm_eps);
  const std::int64_t H = cfg_.encoder_attention_heads, hd = cfg_.head_dim();
  auto heads = [&](const tensor& t, std::int64_t n) -> result<tensor> {
    auto r = t.slice_rows(n * T2, T2);
    if (!r) return make_error(errc::internal, "audio attention slice failed");
    return r->reshape({T2, H, hd});
  };
  const kernels::attention_options full{.causal = false};
  const auto attend_clips = [&](const tensor& aq, const tensor& ak, const tensor& av,
                                tensor& out) -> result<void> {
    for (std::int64_t n = 0; n < N; ++n) {  // each clip attends to itself
      auto q3 = heads(aq, n), k3 = heads(ak, n), v3 = heads(av, n), o3 = heads(out, n);
      if (!q3 || !k3 || !v3 || !o3) return make_error(errc::internal, "audio attention views");
      TRY(dev.attention(*q3, *k3, *v3, *o3, full));
    }
    return {};
  };
  encoder_scratch s{*h, *q, *k, *v, *att, *proj, *f};
  for (const auto& L : layers_) TRY(L.run(dev, *x, s, eps, cfg_.activation, attend_clips));
  TRY(dev.layer_norm(*x, norm_w_, norm_b_, eps, *x));
  return x->reshape({N, T2, D});
}

result<void> audio_projector_config::validate(const std::string& src) const {
  for (auto r : {range(src, "audio_stack_factor", stack, 1, 64),
                 range(src, "audio_projector_hidden", hidden, 1, 1 << 16),
                 range(src, "hidden_size", out, 1, 1 << 16)})
    if (!r) return r;
  return {};
}

result<std::unique_ptr<audio_projector>> audio_projector::build(const weight_source& src,
                                                                const audio_projector_config& c,
                                                                std::int64_t in,
                                                                kernels::device& dev,
                                                                const quant_plan& plan) {
  audio_projector_config cfg = c;
  if (cfg.hidden == 0) cfg.hidden = cfg.out;
  if (auto r = cfg.validate(src.path() + " audio projector"); !r) return std::unexpected(r.error());
  std::unique_ptr<audio_projector> p(new audio_projector());
  p->cfg_ = cfg;
  p->in_ = in;
  auto l1 =
      load_linear(dev, src, plan, "audio_projector.linear_1", cfg.hidden, in * cfg.stack, cfg.bias);
  if (!l1) return std::unexpected(l1.error());
  auto l2 = load_linear(dev, src, plan, "audio_projector.linear_2", cfg.out, cfg.hidden, cfg.bias);
  if (!l2) return std::unexpected(l2.error());
  p->l1_ = std::move(*l1);
  p->l2_ = std::move(*l2);
  return p;
}

result<tensor> audio_projector::forward(kernels::device& dev, const tensor& rows) const {
  if (rows.type() != dtype::f32 || rows.ndim() != 3 || !rows.is_contiguous() ||
      rows.dim(2) != in_ || rows.dim(1) < 1)
    return make_error(errc::shape_mismatch, "audio projector input must be f32 [N, R >= 1, " +
                                                std::to_string(in_) + "], got " +
                                                rows.shape().to_string());
  const std::int64_t N = rows.dim(0), R = rows.dim(1), S = cfg_.stack, A = cfg_.tokens_for(R);
  // Stacked rows: A groups of S rows side by side, the last padded with zeros.
  auto host = kernels::to_host(rows, host_staging_pool());
  if (!host) return std::unexpected(host.error());
  auto stacked = tensor::zeros(host_staging_pool(), dtype::f32, {N * A, S * in_});
  if (!stacked) return std::unexpected(stacked.error());
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t r = 0; r < R; ++r)
      std::copy_n(host->data_as<float>() + (n * R + r) * in_, in_,
                  stacked->row_as<float>(n * A + r / S) + (r % S) * in_);
  auto& pool = dev.memory();
  auto mid = tensor::empty(pool, dtype::f32, {N * A, cfg_.hidden});
  auto out = tensor::empty(pool, dtype::f32, {N * A, cfg_.out});
  if (!mid || !out) return std::unexpected(!mid ? mid.error() : out.error());
  auto d = kernels::to_device(dev, *stacked);
  if (!d) return std::unexpected(d.error());
  TRY(l1_.run(dev, *d, *mid));
  TRY(dev.gelu(*mid, cfg_.activation, *mid));
  TRY(l2_.run(dev, *mid, *out));
  return out->reshape({N, A, cfg_.out});
}

#undef TRY

}  // namespace troupe::models
