#include "models/llama.hpp"

#include <cmath>
#include <cstring>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <map>

namespace troupe::models {

using kernels::dtype;
using kernels::tensor;

namespace {

template <class T>
result<T> check(result<T> r, const std::string& what) {
  if (!r) return make_error(r.error().code, what + ": " + r.error().message);
  return r;
}

// `range` with `last` resolved, or why it does not fit `cfg`.
result<layer_range> resolve_range(const llama_config& cfg, const layer_range& range) {
  const std::int64_t n = cfg.num_layers;
  if (n < 1 || n > (1 << 20))
    return make_error(errc::invalid_argument, "bad layer count " + std::to_string(n));
  layer_range r = range;
  if (r.last == -1) r.last = static_cast<int>(n);
  const std::string what = "layer range [" + std::to_string(range.first) + ", " +
                           std::to_string(range.last) + ") of a " + std::to_string(n) +
                           "-layer model: ";
  if (r.first < 0) return make_error(errc::invalid_argument, what + "first must be >= 0");
  if (r.last < 0)
    return make_error(errc::invalid_argument, what + "last must be >= 1 or -1 (all layers)");
  if (r.last > n)
    return make_error(errc::invalid_argument, what + "last is beyond the model's layers");
  if (r.first >= r.last)
    return make_error(errc::invalid_argument, what + "holds no layer (first must be < last)");
  if (r.embed && r.first != 0)
    return make_error(errc::invalid_argument,
                      what + "only a stage starting at layer 0 can hold the embedding");
  if (r.head && r.last != n)
    return make_error(errc::invalid_argument,
                      what + "only a stage ending at the last layer can hold the head");
  return r;
}

}  // namespace

result<std::unique_ptr<llama_model>> llama_model::load(const std::string& path,
                                                       kernels::device& dev, const quant_plan& plan,
                                                       const layer_range& range,
                                                       const tensor_split& split) {
  auto src = weight_source::open(path);
  if (!src) return std::unexpected(src.error());
  result<llama_config> cfg = make_error(errc::internal, "");
  if ((*src)->is_gguf()) {
    cfg = llama_config_from_gguf(*(*src)->gguf());
  } else {
    std::string dir = path;
    if (auto slash = dir.rfind('/');
        dir.size() > 5 && (dir.ends_with(".json") || dir.ends_with(".safetensors")))
      dir = slash == std::string::npos ? "." : dir.substr(0, slash);
    cfg = load_llama_config(dir + "/config.json");
  }
  if (!cfg) return std::unexpected(cfg.error());
  return build(**src, *cfg, dev, plan, range, split);
}

mix_model mix_model_of(const llama_config& cfg, const weight_source& src) {
  return mix_model{.num_layers = cfg.num_layers,
                   .num_heads = cfg.num_heads,
                   .num_kv_heads = cfg.num_kv_heads,
                   .tied_output = cfg.tie_word_embeddings || !src.has("lm_head"),
                   .llama_70b = cfg.family == decoder_family::llama && cfg.num_layers == 80 &&
                                cfg.num_heads != cfg.num_kv_heads};
}

std::string mix_role(const llama_config& cfg, const std::string& name) {
  if (!cfg.fused_qkv || name.rfind("layers.", 0) != 0) return name;
  const auto dot = name.find('.', 7);
  if (dot == std::string::npos) return name;
  const std::string leaf = name.substr(dot + 1);
  if (leaf == "q_proj" || leaf == "k_proj" || leaf == "v_proj")
    return name.substr(0, dot + 1) + "qkv_proj";
  if (leaf == "gate_proj" || leaf == "up_proj") return name.substr(0, dot + 1) + "gate_up_proj";
  return name;
}

std::vector<held_matrix> decoder_formats(const llama_config& cfg, const weight_source& src,
                                         const quant_plan& plan) {
  const mix_model facts = mix_model_of(cfg, src);
  const std::int64_t H = cfg.hidden_size, D = cfg.head_dim, F = cfg.intermediate_size;
  const std::int64_t q = cfg.num_heads * D, kv = cfg.num_kv_heads * D;
  std::vector<held_matrix> out;
  auto add = [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
    // A fused family's matrices are rows of the fused tensor: its storage.
    const std::string role = mix_role(cfg, name);
    auto t = src.get(role);
    if (!t || t->ndim() != 2) return;
    out.push_back({name, plan.choose(name, t->type(), cols, &facts, role), rows, cols});
  };
  add("embed_tokens", cfg.vocab_size, H);
  if (src.has("lm_head")) add("lm_head", cfg.vocab_size, H);
  for (std::int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    add(p + "q_proj", q, H);
    add(p + "k_proj", kv, H);
    add(p + "v_proj", kv, H);
    add(p + "o_proj", H, q);
    add(p + "gate_proj", F, H);
    add(p + "up_proj", F, H);
    add(p + "down_proj", H, F);
  }
  return out;
}

result<std::unique_ptr<llama_model>> llama_model::build(
    const weight_source& src, const llama_config& cfg, kernels::device& dev, const quant_plan& plan,
    const layer_range& range, const tensor_split& split) {
  auto resolved = resolve_range(cfg, range);
  if (!resolved)
    return make_error(resolved.error().code, src.path() + ": " + resolved.error().message);
  if (split.size < 1 || split.rank < 0 || split.rank >= split.size)
    return make_error(errc::invalid_argument, "tensor split: rank " + std::to_string(split.rank) +
                                                  " of " + std::to_string(split.size));
  if (split.size > 1) {
    if (cfg.num_heads % split.size || cfg.num_kv_heads % split.size ||
        cfg.intermediate_size % split.size)
      return make_error(errc::invalid_argument,
                        "tensor split in " + std::to_string(split.size) + ": heads (" +
                            std::to_string(cfg.num_heads) + "), KV heads (" +
                            std::to_string(cfg.num_kv_heads) + ") and FFN width (" +
                            std::to_string(cfg.intermediate_size) + ") must divide evenly");
    if (!split.all_reduce)
      return make_error(errc::invalid_argument, "tensor split without an all-reduce");
  }
  std::unique_ptr<llama_model> m(new llama_model());
  m->cfg_ = cfg;
  m->range_ = *resolved;
  m->split_ = split;
  m->attn_scale_ = cfg.attn_scale;
  m->nh_ = cfg.num_heads / split.size;
  m->nkv_ = cfg.num_kv_heads / split.size;
  m->ffn_ = cfg.intermediate_size / split.size;
  // Weights are converted in host memory: the device's own pool where the
  // device is the host (a CPU device counts them against its limit), else
  // a host pool of the model's, and `prepare` (or `to_device`) gives the
  // device its copy.
  if (!dev.host_visible()) m->host_pool_ = kernels::memory_pool::create();
  auto& pool = dev.host_visible() ? dev.memory() : *m->host_pool_;
  const std::int64_t H = cfg.hidden_size, D = cfg.head_dim;
  auto expect_shape = [&](const std::string& name, const tensor& t, std::int64_t rows,
                          std::int64_t cols) -> result<void> {
    if (t.ndim() != 2 || t.dim(0) != rows || t.dim(1) != cols)
      return make_error(errc::corrupt_data, src.path() + ": tensor '" + src.file_name(name) +
                                                "' has shape " + t.shape().to_string() +
                                                ", the config implies [" + std::to_string(rows) +
                                                ", " + std::to_string(cols) + "]");
    return {};
  };
  // A canonical tensor: a view of the file's, or for families that keep
  // q, k, v (and gate, up) in one matrix, the rows of it that are this one.
  const std::int64_t NH = cfg.num_heads, NKV = cfg.num_kv_heads, F = cfg.intermediate_size;
  auto fetch = [&](const std::string& name) -> result<tensor> {
    if (!cfg.fused_qkv || name.rfind("layers.", 0) != 0) return src.get(name);
    const auto dot = name.find('.', 7);
    const std::string prefix = name.substr(0, dot + 1), leaf = name.substr(dot + 1);
    struct part {
      const char* leaf;
      const char* fused;
      std::int64_t r0, n, total;
    };
    for (auto [l, fused, r0, n, total] :
         {part{"q_proj", "qkv_proj", 0, NH * D, (NH + 2 * NKV) * D},
          part{"k_proj", "qkv_proj", NH * D, NKV * D, (NH + 2 * NKV) * D},
          part{"v_proj", "qkv_proj", (NH + NKV) * D, NKV * D, (NH + 2 * NKV) * D},
          part{"gate_proj", "gate_up_proj", 0, F, 2 * F},
          part{"up_proj", "gate_up_proj", F, F, 2 * F}}) {
      if (leaf != l) continue;
      auto t = src.get(prefix + fused);
      if (!t) return t;
      if (t->ndim() != 2 || t->dim(0) != total || t->dim(1) != H)
        return make_error(errc::corrupt_data,
                          src.path() + ": tensor '" + src.file_name(prefix + fused) +
                              "' has shape " + t->shape().to_string() + ", the config implies [" +
                              std::to_string(total) + ", " + std::to_string(H) + "]");
      return t->slice_rows(r0, n);
    }
    return src.get(name);
  };
  const mix_model mix_facts = mix_model_of(cfg, src);
  const bool tied_head = mix_facts.tied_output;  // the config says so, or no lm_head
  auto format_for = [&](const std::string& name, const tensor& t,
                        std::int64_t full_cols) -> kernels::weight_format {
    return plan.choose(name, t.type(), full_cols, &mix_facts, mix_role(cfg, name));
  };
  auto matrix = [&](const std::string& name, std::int64_t rows,
                    std::int64_t cols) -> result<kernels::weight_matrix> {
    auto t = fetch(name);
    if (!t) return std::unexpected(t.error());
    if (auto r = expect_shape(name, *t, rows, cols); !r) return std::unexpected(r.error());
    return check(convert_weight(pool, *t, format_for(name, *t, cols), plan.int4_group),
                 src.file_name(name));
  };
  auto packed = [&](const std::string& name, std::int64_t rows,
                    std::int64_t cols) -> result<kernels::matrix> {
    auto w = matrix(name, rows, cols);
    if (!w) return std::unexpected(w.error());
    return check(dev.prepare(*w), src.file_name(name));
  };
  // This rank's slice of a [rows, cols] matrix: rows [r0, r0 + nr) and
  // columns [c0, c0 + nc) (columns in whole quantization blocks).
  auto sliced = [&](const std::string& name, std::int64_t rows, std::int64_t cols, std::int64_t r0,
                    std::int64_t nr, std::int64_t c0, std::int64_t nc) -> result<kernels::matrix> {
    if (split.size == 1) return packed(name, rows, cols);
    auto t = fetch(name);
    if (!t) return std::unexpected(t.error());
    if (auto r = expect_shape(name, *t, rows, cols); !r) return std::unexpected(r.error());
    if (!t->is_contiguous())
      return make_error(errc::unsupported_op, src.file_name(name) + ": not contiguous");
    const auto full = kernels::row_bytes(t->type(), cols);
    const auto skip = kernels::row_bytes(t->type(), c0);
    const auto width = kernels::row_bytes(t->type(), nc);
    if (!full || !skip || !width)
      return make_error(errc::invalid_argument,
                        src.file_name(name) + ": a tensor-parallel slice of " + std::to_string(nc) +
                            " columns is not whole " + std::string(kernels::to_string(t->type())) +
                            " blocks");
    auto part = tensor::empty(pool, t->type(), {nr, nc});
    if (!part) return std::unexpected(part.error());
    const auto* from = static_cast<const std::uint8_t*>(t->data());
    auto* to = static_cast<std::uint8_t*>(part->data());
    for (std::int64_t r = 0; r < nr; ++r)
      std::memcpy(to + static_cast<std::size_t>(r) * *width,
                  from + static_cast<std::size_t>(r0 + r) * *full + *skip, *width);
    auto w = check(convert_weight(pool, *part, format_for(name, *t, cols), plan.int4_group),
                   src.file_name(name));
    if (!w) return std::unexpected(w.error());
    return check(dev.prepare(*w), src.file_name(name));
  };
  const auto scratch = kernels::memory_pool::create();  // host copies on their way to `dev`
  // A 1-D tensor as f32 in the device's memory: rows [r0, r0 + count) of
  // it (count -1: all), plus `offset` (HF Gemma's norms multiply by 1 + w).
  auto vec = [&](const std::string& name, std::int64_t n, double offset = 0, std::int64_t r0 = 0,
                 std::int64_t count = -1) -> result<tensor> {
    auto t = src.get(name);
    if (!t) return std::unexpected(t.error());
    if (t->ndim() != 1 || t->dim(0) != n)
      return make_error(errc::corrupt_data, src.path() + ": tensor '" + src.file_name(name) +
                                                "' has shape " + t->shape().to_string() +
                                                ", expected [" + std::to_string(n) + "]");
    if (offset == 0 && r0 == 0 && count == -1) return to_f32(dev, *t);
    auto host = to_f32(*scratch, *t);
    if (!host) return host;
    auto part = host->slice_rows(r0, count == -1 ? n : count);
    if (!part) return part;
    std::vector<float> values(part->data_as<float>(), part->data_as<float>() + part->numel());
    for (auto& v : values) v = static_cast<float>(v + offset);
    auto out = tensor::empty(dev.memory(), dtype::f32, {static_cast<std::int64_t>(values.size())});
    if (!out) return out;
    if (auto r = dev.write(*out, std::as_bytes(std::span<const float>(values))); !r)
      return std::unexpected(r.error());
    return out;
  };

  if (m->range_.embed) {
    auto embed = matrix("embed_tokens", cfg.vocab_size, H);
    if (!embed) return std::unexpected(embed.error());
    m->embed_ = std::move(*embed);
  }
  for (std::int64_t l = m->range_.first; l < m->range_.last; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    layer L;
    struct mat {
      const char* name;
      kernels::matrix* out;
      std::int64_t rows, cols, r0, nr, c0, nc;  // full shape, this rank's slice
    };
    const std::int64_t k = split.rank, NHl = m->nh_, NKVl = m->nkv_, Fl = m->ffn_;
    for (auto [name, out, rows, cols, r0, nr, c0, nc] :
         {mat{"q_proj", &L.q, NH * D, H, k * NHl * D, NHl * D, 0, H},
          mat{"k_proj", &L.k, NKV * D, H, k * NKVl * D, NKVl * D, 0, H},
          mat{"v_proj", &L.v, NKV * D, H, k * NKVl * D, NKVl * D, 0, H},
          mat{"o_proj", &L.o, H, NH * D, 0, H, k * NHl * D, NHl * D},
          mat{"gate_proj", &L.gate, F, H, k * Fl, Fl, 0, H},
          mat{"up_proj", &L.up, F, H, k * Fl, Fl, 0, H},
          mat{"down_proj", &L.down, H, F, 0, H, k * Fl, Fl}}) {
      auto w = sliced(p + name, rows, cols, r0, nr, c0, nc);
      if (!w) return std::unexpected(w.error());
      *out = std::move(*w);
    }
    struct norm {
      const char* name;
      kernels::tensor* out;
      std::int64_t n;
      bool held;  // what the family has
    };
    // The FFN input norm: LLaMA's "post-attention" norm, Gemma's
    // "pre-feedforward" one (its "post-attention" norm is on the attention
    // output).
    const char* ffn_in = cfg.sandwich_norms ? "pre_ffn_norm" : "post_norm";
    for (auto [name, out, n, held] :
         {norm{"input_norm", &L.input_norm, H, true}, norm{ffn_in, &L.post_norm, H, true},
          norm{"q_norm", &L.q_norm, D, cfg.qk_norm}, norm{"k_norm", &L.k_norm, D, cfg.qk_norm},
          norm{"attn_out_norm", &L.attn_out_norm, H, cfg.sandwich_norms},
          norm{"ffn_out_norm", &L.ffn_out_norm, H, cfg.sandwich_norms}}) {
      if (!held) continue;
      auto t = vec(p + name, n, cfg.norm_offset);
      if (!t) return std::unexpected(t.error());
      *out = std::move(*t);
    }
    if (cfg.qkv_bias) {  // this rank's rows of each
      struct bias {
        const char* name;
        kernels::tensor* out;
        std::int64_t n, r0, count;
      };
      for (auto [name, out, n, r0, count] :
           {bias{"q_proj.bias", &L.q_bias, NH * D, k * NHl * D, NHl * D},
            bias{"k_proj.bias", &L.k_bias, NKV * D, k * NKVl * D, NKVl * D},
            bias{"v_proj.bias", &L.v_bias, NKV * D, k * NKVl * D, NKVl * D}}) {
        auto t = vec(p + name, n, 0, r0, count);
        if (!t) return std::unexpected(t.error());
        *out = std::move(*t);
      }
    }
    m->layers_.push_back(std::move(L));
  }
  if (m->range_.head) {
    auto norm = vec("norm", H, cfg.norm_offset);
    if (!norm) return std::unexpected(norm.error());
    m->norm_ = std::move(*norm);
    auto head = packed(tied_head ? "embed_tokens" : "lm_head", cfg.vocab_size, H);
    if (!head) return std::unexpected(head.error());
    m->lm_head_ = std::move(*head);
  }

  m->rope_.layout = cfg.layout == rope_layout::halves ? kernels::rope_layout::neox
                                                      : kernels::rope_layout::adjacent;
  m->rope_.theta = static_cast<float>(cfg.rope_theta);
  if (cfg.scaling.type == rope_scaling::kind::llama3) {
    kernels::rope_llama3_scaling s;
    s.factor = static_cast<float>(cfg.scaling.factor);
    s.low_freq_factor = static_cast<float>(cfg.scaling.low_freq_factor);
    s.high_freq_factor = static_cast<float>(cfg.scaling.high_freq_factor);
    s.original_max_position_embeddings = cfg.scaling.original_max_position_embeddings;
    m->rope_.llama3 = s;
  }
  // A file's per-frequency divisors (head_dim / 2 of them, finite, > 0).
  auto file_factors = [&](const std::string& name) -> result<std::vector<float>> {
    auto t = src.get(name);
    if (!t) return std::unexpected(t.error());
    auto ff = to_f32(pool, *t);
    if (!ff) return std::unexpected(ff.error());
    if (ff->numel() != D / 2)
      return make_error(errc::corrupt_data,
                        src.path() + ": " + src.file_name(name) + " has " +
                            std::to_string(ff->numel()) +
                            " values, expected head_dim/2 = " + std::to_string(D / 2));
    std::vector<float> v(ff->data_as<float>(), ff->data_as<float>() + ff->numel());
    for (float x : v)
      if (!(x > 0) || !std::isfinite(x))
        return make_error(errc::corrupt_data,
                          src.path() + ": " + src.file_name(name) + " must be finite and > 0");
    return v;
  };
  if (cfg.scaling.type != rope_scaling::kind::llama3 && src.has("rope_freqs")) {
    // GGUF files carry LLaMA-3 scaling as per-frequency divisors.
    auto f = file_factors("rope_freqs");
    if (!f) return std::unexpected(f.error());
    m->rope_.freq_factors = std::move(*f);
  }
  // YaRN and longrope multiply cos and sin by an attention factor: the
  // scores by its square.
  double attention_factor = 1.0;
  if (cfg.scaling.type == rope_scaling::kind::yarn) {
    if (!m->rope_.freq_factors.empty())
      return make_error(errc::unsupported_op,
                        src.path() + ": YaRN RoPE scaling with per-frequency factors");
    auto y = compute_yarn(cfg.scaling, cfg.rope_theta, D);
    m->rope_.freq_factors = std::move(y.divisors);
    attention_factor = y.attention_factor;
  }
  if (cfg.scaling.type == rope_scaling::kind::longrope) {
    // The short factors (positions past the original context are refused):
    // the config's, or a GGUF's tensor.
    std::vector<float> factors = cfg.scaling.short_factor;
    if (factors.empty()) {
      auto f = file_factors("rope_factors_short");
      if (!f) return std::unexpected(f.error());
      factors = std::move(*f);
    }
    if (static_cast<std::int64_t>(factors.size()) != D / 2)
      return make_error(errc::corrupt_data,
                        src.path() + ": longrope short factors: " + std::to_string(factors.size()) +
                            " values, expected head_dim/2 = " + std::to_string(D / 2));
    m->rope_.freq_factors = std::move(factors);
    attention_factor = cfg.scaling.attention_factor;
  }
  if (attention_factor != 1.0) {
    const double base =
        cfg.attn_scale > 0 ? cfg.attn_scale : 1.0 / std::sqrt(static_cast<double>(D));
    m->attn_scale_ = base * attention_factor * attention_factor;
  }
  if (cfg.scaling.type == rope_scaling::kind::linear) {
    // Positions divided by the factor: every frequency divided by it.
    if (!m->rope_.freq_factors.empty())
      return make_error(errc::unsupported_op,
                        src.path() + ": linear RoPE scaling with per-frequency factors");
    m->rope_.freq_factors.assign(static_cast<std::size_t>(D / 2),
                                 static_cast<float>(cfg.scaling.factor));
  }
  m->rope_local_ = m->rope_;
  if (cfg.rope_local_theta > 0) {
    m->rope_local_.theta = static_cast<float>(cfg.rope_local_theta);
    m->rope_local_.llama3.reset();
    m->rope_local_.freq_factors.clear();
  }
  spdlog::debug("loaded {}: {}", src.path(), m->describe());
  return m;
}

result<kv_cache> llama_model::make_cache(kernels::memory_pool& pool, const kv_options& opts) const {
  return kv_cache::create(pool, static_cast<int>(layers_.size()), static_cast<int>(nkv_),
                          static_cast<int>(cfg_.head_dim), opts);
}

result<kv_cache> llama_model::make_cache(kernels::device& dev, const kv_options& opts) const {
  return kv_cache::create(dev, static_cast<int>(layers_.size()), static_cast<int>(nkv_),
                          static_cast<int>(cfg_.head_dim), opts);
}

bool llama_model::is_full() const {
  return range_.first == 0 && range_.last == cfg_.num_layers && range_.embed && range_.head;
}

std::size_t llama_model::bytes_per_token() const {
  std::size_t b = range_.head ? lm_head_.bytes() : 0;
  for (const auto& L : layers_)
    for (const auto* w : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) b += w->bytes();
  if (range_.embed)
    b += embed_.storage_bytes() / static_cast<std::size_t>(std::max<std::int64_t>(1, embed_.rows));
  return b;
}

std::string llama_model::describe() const {
  std::map<std::string, int> counts;
  for (const auto& L : layers_)
    for (const auto* w : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down})
      counts[std::string(kernels::to_string(w->format()))]++;
  std::string s = "layers=" + std::to_string(layers_.size());
  if (!is_full())
    s += " [" + std::to_string(range_.first) + ", " + std::to_string(range_.last) + ") of " +
         std::to_string(cfg_.num_layers);
  if (split_.size > 1)
    s += " tensor slice " + std::to_string(split_.rank) + "/" + std::to_string(split_.size);
  s += " matrices:";
  for (const auto& [f, n] : counts) s += " " + f + "x" + std::to_string(n);
  if (range_.embed) s += " embed=" + std::string(kernels::to_string(embed_.format));
  if (range_.head) s += " lm_head=" + std::string(kernels::to_string(lm_head_.format()));
  return s;
}

// Checks what every stage checks alone (no cache): a token count per input
// and token ids in the vocabulary; with `embeddings`, also the inputs' own
// embeddings. Returns the step's token count.
result<std::int64_t> llama_model::check_inputs(std::span<const step_input> inputs,
                                               bool embeddings) const {
  const std::int64_t H = cfg_.hidden_size, V = cfg_.vocab_size;
  if (inputs.empty())
    return make_error(errc::invalid_argument, "a step needs at least one sequence");
  std::int64_t T = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& in = inputs[i];
    for (std::size_t j = 0; j < i; ++j)
      if (inputs[j].seq == in.seq)
        return make_error(errc::invalid_argument, "sequence appears twice in one step");
    if (in.tokens.empty()) return make_error(errc::invalid_argument, "a step input has no tokens");
    for (auto t : in.tokens)
      if (t < 0 || t >= V)
        return make_error(errc::invalid_argument,
                          "token id " + std::to_string(t) + " outside the vocabulary");
    if (embeddings) {
      if (in.embed_token >= V || in.embed_token < -1 ||
          (in.embed_token == -1 && !in.embeddings.empty()))
        return make_error(errc::invalid_argument,
                          "step input embeddings need an embed_token in the vocabulary");
      if (in.embed_token >= 0) {
        const auto n = static_cast<std::size_t>(
            std::count(in.tokens.begin(), in.tokens.end(), in.embed_token));
        if (n * static_cast<std::size_t>(H) != in.embeddings.size())
          return make_error(errc::invalid_argument,
                            "a step input has " + std::to_string(n) + " embedding token(s) (id " +
                                std::to_string(in.embed_token) + ") but " +
                                std::to_string(in.embeddings.size()) +
                                " embedding floats (hidden " + std::to_string(H) + " each)");
      }
    }
    T += static_cast<std::int64_t>(in.tokens.size());
  }
  return T;
}

namespace {

result<void> check_hidden(const tensor& x, std::int64_t T, std::int64_t H, const char* what) {
  if (x.empty_view() || x.type() != dtype::f32 || x.ndim() != 2 || x.dim(0) != T || x.dim(1) != H ||
      !x.is_contiguous())
    return make_error(errc::shape_mismatch,
                      std::string(what) + ": hidden states must be contiguous f32 [" +
                          std::to_string(T) + ", " + std::to_string(H) + "] for this step, got " +
                          std::string(kernels::to_string(x.type())) + " " + x.shape().to_string());
  return {};
}

result<void> commit_step(kv_cache& cache, std::span<const step_input> inputs,
                         std::span<const std::int64_t> start) {
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (auto r = cache.commit(inputs[i].seq,
                              start[i] + static_cast<std::int64_t>(inputs[i].tokens.size()));
        !r)
      return std::unexpected(r.error());
  return {};
}

}  // namespace

#define TRY(expr)                                                  \
  do {                                                             \
    if (auto r_ = (expr); !r_) return std::unexpected(r_.error()); \
  } while (0)

result<tensor> llama_model::embed(kernels::device& dev, std::span<const step_input> inputs) const {
  if (!range_.embed)
    return make_error(errc::invalid_argument,
                      "embed: this stage does not hold the embedding table");
  auto T = check_inputs(inputs, true);
  if (!T) return std::unexpected(T.error());
  const std::int64_t H = cfg_.hidden_size;
  auto& pool = dev.memory();
  auto ids = tensor::empty(pool, dtype::i32, {*T});
  auto x = tensor::empty(pool, dtype::f32, {*T, H});
  if (!ids) return std::unexpected(ids.error());
  if (!x) return std::unexpected(x.error());
  // Host data reaches the device's memory through write (a GPU's memory is
  // not addressable from here).
  std::vector<std::int32_t> host_ids;
  host_ids.reserve(static_cast<std::size_t>(*T));
  for (const auto& in : inputs) host_ids.insert(host_ids.end(), in.tokens.begin(), in.tokens.end());
  TRY(dev.write(*ids, std::as_bytes(std::span<const std::int32_t>(host_ids))));
  TRY(dev.embedding(embed_, *ids, *x));
  if (cfg_.embed_scale != 1.0) TRY(dev.scale(*x, static_cast<float>(cfg_.embed_scale), *x));
  std::int64_t at = 0;
  for (const auto& in : inputs) {  // input embeddings replace table rows
    if (in.embed_token >= 0) {
      const float* e = in.embeddings.data();
      for (std::size_t j = 0; j < in.tokens.size(); ++j)
        if (in.tokens[j] == in.embed_token) {
          auto row = x->slice_rows(at + static_cast<std::int64_t>(j), 1);
          if (!row) return std::unexpected(row.error());
          TRY(dev.write(*row,
                        std::as_bytes(std::span<const float>(e, static_cast<std::size_t>(H)))));
          e += H;
        }
    }
    at += static_cast<std::int64_t>(in.tokens.size());
  }
  return x;
}

result<llama_model::step_plan> llama_model::layers_step(
    kernels::device& dev, kv_cache& cache, std::span<const step_input> inputs, tensor& x,
    const kernels::attention_options& attn_in) const {
  if (cache.layers() != static_cast<int>(layers_.size()))
    return make_error(errc::invalid_argument, "the KV cache has " + std::to_string(cache.layers()) +
                                                  " layer(s), this model holds " +
                                                  std::to_string(layers_.size()));
  auto total = check_inputs(inputs, false);
  if (!total) return std::unexpected(total.error());
  const std::int64_t T = *total;
  // This rank's heads and FFN width (all of them without a tensor split).
  const std::int64_t H = cfg_.hidden_size, D = cfg_.head_dim, NH = nh_, NKV = nkv_;
  const std::int64_t F = ffn_;
  if (auto r = check_hidden(x, T, H, "run_layers"); !r) return std::unexpected(r.error());
  // A cache that frees blocks behind a window only works with that window.
  kernels::attention_options attn = attn_in;
  if (attn.scale == 0.0f && attn_scale_ > 0) attn.scale = static_cast<float>(attn_scale_);
  if (attn.softcap == 0.0f && cfg_.attn_softcap > 0)
    attn.softcap = static_cast<float>(cfg_.attn_softcap);
  if (cache.options().window > 0) {
    attn.window = cache.options().window;
    attn.sinks = cache.options().sinks;
  }
  // Token layout of the step and validation before anything changes.
  step_plan plan;
  plan.offset.resize(inputs.size());
  plan.start.resize(inputs.size());
  std::int64_t at = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& in = inputs[i];
    if (!cache.contains(in.seq))
      return make_error(errc::invalid_argument, "unknown sequence " + std::to_string(in.seq));
    plan.offset[i] = at;
    plan.start[i] = cache.length(in.seq);
    if (plan.start[i] + static_cast<std::int64_t>(in.tokens.size()) >
        cfg_.max_position_embeddings * 64)
      return make_error(errc::invalid_argument, "sequence too long");
    if (cfg_.scaling.type == rope_scaling::kind::longrope &&
        plan.start[i] + static_cast<std::int64_t>(in.tokens.size()) >
            cfg_.scaling.original_max_position_embeddings)
      return make_error(
          errc::invalid_argument,
          "a longrope model runs up to its original context of " +
              std::to_string(cfg_.scaling.original_max_position_embeddings) +
              " tokens (past it transformers re-rotates every position with the long factors, "
              "which keys already cached cannot follow)");
    at += static_cast<std::int64_t>(in.tokens.size());
  }
  const auto& offset = plan.offset;
  const auto& start = plan.start;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (auto r = cache.reserve(inputs[i].seq,
                               start[i] + static_cast<std::int64_t>(inputs[i].tokens.size()));
        !r)
      return std::unexpected(r.error());

  auto& pool = dev.memory();
  auto alloc = [&](std::int64_t rows, std::int64_t cols) {
    return tensor::empty(pool, dtype::f32, {rows, cols});
  };
  auto h = alloc(T, H), q = alloc(T, NH * D), k = alloc(T, NKV * D), v = alloc(T, NKV * D);
  auto att = alloc(T, NH * D), proj = alloc(T, H), g = alloc(T, F), u = alloc(T, F);
  for (auto* t : {&h, &q, &k, &v, &att, &proj, &g, &u})
    if (!*t) return std::unexpected(t->error());
  std::vector<std::int32_t> positions(static_cast<std::size_t>(T));
  for (std::size_t i = 0; i < inputs.size(); ++i)
    for (std::size_t j = 0; j < inputs[i].tokens.size(); ++j)
      positions[static_cast<std::size_t>(offset[i]) + j] =
          static_cast<std::int32_t>(start[i] + static_cast<std::int64_t>(j));
  const auto eps = static_cast<float>(cfg_.rms_norm_eps);
  auto q3 = q->reshape({T, NH, D});
  auto k3 = k->reshape({T, NKV, D});
  auto v3 = v->reshape({T, NKV, D});
  auto att3 = att->reshape({T, NH, D});
  auto qh = q->reshape({T * NH, D});  // one row per head (qk_norm)
  auto kh = k->reshape({T * NKV, D});
  if (!q3 || !k3 || !v3 || !att3 || !qh || !kh) return make_error(errc::internal, "reshape failed");
  std::vector<kernels::attention_sequence> seqs(inputs.size());
  for (std::size_t l = 0; l < layers_.size(); ++l) {
    const auto& L = layers_[l];
    auto& kv = cache.layer(static_cast<int>(l));
    const bool sliding = cfg_.is_sliding(range_.first + static_cast<std::int64_t>(l));
    const kernels::rope_params& rope = sliding ? rope_local_ : rope_;
    TRY(dev.rms_norm(x, L.input_norm, eps, *h));
    TRY(dev.matmul(*h, L.q, *q));
    TRY(dev.matmul(*h, L.k, *k));
    TRY(dev.matmul(*h, L.v, *v));
    if (cfg_.qkv_bias) {
      TRY(dev.add(*q, L.q_bias, *q));
      TRY(dev.add(*k, L.k_bias, *k));
      TRY(dev.add(*v, L.v_bias, *v));
    }
    if (cfg_.qk_norm) {  // each head of q and k over head_dim
      TRY(dev.rms_norm(*qh, L.q_norm, eps, *qh));
      TRY(dev.rms_norm(*kh, L.k_norm, eps, *kh));
    }
    TRY(dev.rope(*q3, std::span<const std::int32_t>(positions), rope, *q3));
    TRY(dev.rope(*k3, std::span<const std::int32_t>(positions), rope, *k3));
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const auto n = static_cast<std::int64_t>(inputs[i].tokens.size());
      auto ks = k3->slice_rows(offset[i], n);
      auto vs = v3->slice_rows(offset[i], n);
      auto qs = q3->slice_rows(offset[i], n);
      auto os = att3->slice_rows(offset[i], n);
      if (!ks || !vs || !qs || !os) return make_error(errc::internal, "slice failed");
      TRY(dev.append_kv(kv, cache.block_table(inputs[i].seq), start[i], *ks, *vs));
      seqs[i].q = *qs;
      seqs[i].out = *os;
      seqs[i].q_start = start[i];
      seqs[i].kv_len = start[i] + n;
      seqs[i].block_table = cache.block_table(inputs[i].seq);
    }
    kernels::attention_options layer_attn = attn;
    if (sliding && (layer_attn.window == 0 || layer_attn.window > cfg_.sliding_window)) {
      layer_attn.window = static_cast<int>(cfg_.sliding_window);
      layer_attn.sinks = 0;
    }
    TRY(dev.attention_paged(kv, seqs, layer_attn));
    TRY(dev.matmul(*att, L.o, *proj));
    if (split_.size > 1) TRY(split_.all_reduce(*proj));  // the heads' partial sums
    if (cfg_.sandwich_norms) TRY(dev.rms_norm(*proj, L.attn_out_norm, eps, *proj));
    TRY(dev.add(x, *proj, x));
    TRY(dev.rms_norm(x, L.post_norm, eps, *h));
    TRY(dev.matmul(*h, L.gate, *g));
    TRY(dev.matmul(*h, L.up, *u));
    if (cfg_.gelu_ffn)
      TRY(dev.geglu(*g, *u, *g));
    else
      TRY(dev.swiglu(*g, *u, *g));
    TRY(dev.matmul(*g, L.down, *proj));
    if (split_.size > 1) TRY(split_.all_reduce(*proj));  // the FFN slices' partial sums
    if (cfg_.sandwich_norms) TRY(dev.rms_norm(*proj, L.ffn_out_norm, eps, *proj));
    TRY(dev.add(x, *proj, x));
  }
  return plan;
}

result<void> llama_model::run_layers(kernels::device& dev, kv_cache& cache,
                                     std::span<const step_input> inputs, tensor& x,
                                     const kernels::attention_options& attn) const {
  auto plan = layers_step(dev, cache, inputs, x, attn);
  if (!plan) return std::unexpected(plan.error());
  return commit_step(cache, inputs, plan->start);
}

result<tensor> llama_model::head(kernels::device& dev, std::span<const step_input> inputs,
                                 const tensor& x) const {
  if (!range_.head)
    return make_error(errc::invalid_argument,
                      "head: this stage does not hold the final norm and LM head");
  auto T = check_inputs(inputs, false);
  if (!T) return std::unexpected(T.error());
  const std::int64_t H = cfg_.hidden_size, V = cfg_.vocab_size;
  if (auto r = check_hidden(x, *T, H, "head"); !r) return std::unexpected(r.error());
  std::int64_t n_logits = 0;
  for (const auto& in : inputs)
    n_logits += in.all_logits ? static_cast<std::int64_t>(in.tokens.size()) : 1;
  // Final norm and LM head on the rows that need logits.
  auto& pool = dev.memory();
  auto sel = tensor::empty(pool, dtype::f32, {n_logits, H});
  auto logits = tensor::empty(pool, dtype::f32, {n_logits, V});
  if (!sel) return std::unexpected(sel.error());
  if (!logits) return std::unexpected(logits.error());
  std::int64_t row = 0, offset = 0;
  for (const auto& in : inputs) {
    const auto n = static_cast<std::int64_t>(in.tokens.size());
    for (std::int64_t j = in.all_logits ? 0 : n - 1; j < n; ++j, ++row) {
      auto from = x.slice_rows(offset + j, 1);
      auto to = sel->slice_rows(row, 1);
      if (!from || !to) return make_error(errc::internal, "slice failed");
      TRY(dev.copy(*from, *to));
    }
    offset += n;
  }
  const auto eps = static_cast<float>(cfg_.rms_norm_eps);
  TRY(dev.rms_norm(*sel, norm_, eps, *sel));
  TRY(dev.matmul(*sel, lm_head_, *logits));
  if (cfg_.final_softcap > 0)
    TRY(dev.softcap(*logits, static_cast<float>(cfg_.final_softcap), *logits));
  return logits;
}

#undef TRY

result<tensor> llama_model::forward(kernels::device& dev, kv_cache& cache,
                                    std::span<const step_input> inputs,
                                    const kernels::attention_options& attn) const {
  if (!is_full())
    return make_error(errc::invalid_argument,
                      "forward needs the whole decoder; this model holds a stage (" + describe() +
                          "): use embed, run_layers and head");
  auto x = embed(dev, inputs);
  if (!x) return std::unexpected(x.error());
  // The cache is committed only once the logits exist, so that an error
  // anywhere leaves every sequence's length as it was.
  auto plan = layers_step(dev, cache, inputs, *x, attn);
  if (!plan) return std::unexpected(plan.error());
  auto logits = head(dev, inputs, *x);
  if (!logits) return std::unexpected(logits.error());
  if (auto r = commit_step(cache, inputs, plan->start); !r) return std::unexpected(r.error());
  return logits;
}

}  // namespace troupe::models
