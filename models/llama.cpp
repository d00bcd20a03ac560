#include "models/llama.hpp"

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

}  // namespace

result<std::unique_ptr<llama_model>> llama_model::load(const std::string& path, kernels::cpu::context& ctx,
                                                       const quant_plan& plan) {
  auto src = weight_source::open(path);
  if (!src) return std::unexpected(src.error());
  result<llama_config> cfg = make_error(errc::internal, "");
  if ((*src)->is_gguf()) {
    cfg = llama_config_from_gguf(*(*src)->gguf());
  } else {
    std::string dir = path;
    if (auto slash = dir.rfind('/'); dir.size() > 5 && (dir.ends_with(".json") || dir.ends_with(".safetensors")))
      dir = slash == std::string::npos ? "." : dir.substr(0, slash);
    cfg = load_llama_config(dir + "/config.json");
  }
  if (!cfg) return std::unexpected(cfg.error());
  return build(**src, *cfg, ctx, plan);
}

result<std::unique_ptr<llama_model>> llama_model::build(const weight_source& src, const llama_config& cfg,
                                                        kernels::cpu::context& ctx, const quant_plan& plan) {
  std::unique_ptr<llama_model> m(new llama_model());
  m->cfg_ = cfg;
  auto& pool = ctx.memory();
  const std::int64_t H = cfg.hidden_size, D = cfg.head_dim;
  auto expect_shape = [&](const std::string& name, const tensor& t, std::int64_t rows, std::int64_t cols) -> result<void> {
    if (t.ndim() != 2 || t.dim(0) != rows || t.dim(1) != cols)
      return make_error(errc::corrupt_data, src.path() + ": tensor '" + src.file_name(name) + "' has shape " +
                                                t.shape().to_string() + ", the config implies [" + std::to_string(rows) +
                                                ", " + std::to_string(cols) + "]");
    return {};
  };
  auto matrix = [&](const std::string& name, std::int64_t rows, std::int64_t cols) -> result<kernels::weight_matrix> {
    auto t = src.get(name);
    if (!t) return std::unexpected(t.error());
    if (auto r = expect_shape(name, *t, rows, cols); !r) return std::unexpected(r.error());
    return check(convert_weight(pool, *t, plan.choose(name, t->type()), plan.int4_group), src.file_name(name));
  };
  auto packed = [&](const std::string& name, std::int64_t rows, std::int64_t cols) -> result<kernels::packed_matrix> {
    auto w = matrix(name, rows, cols);
    if (!w) return std::unexpected(w.error());
    return check(kernels::packed_matrix::pack(ctx, *w), src.file_name(name));
  };
  auto vec = [&](const std::string& name, std::int64_t n) -> result<tensor> {
    auto t = src.get(name);
    if (!t) return std::unexpected(t.error());
    if (t->ndim() != 1 || t->dim(0) != n)
      return make_error(errc::corrupt_data, src.path() + ": tensor '" + src.file_name(name) + "' has shape " +
                                                t->shape().to_string() + ", expected [" + std::to_string(n) + "]");
    return to_f32(pool, *t);
  };

  auto embed = matrix("embed_tokens", cfg.vocab_size, H);
  if (!embed) return std::unexpected(embed.error());
  m->embed_ = std::move(*embed);
  for (std::int64_t l = 0; l < cfg.num_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    layer L;
    struct mat { const char* name; kernels::packed_matrix* out; std::int64_t rows, cols; };
    for (auto [name, out, rows, cols] : {mat{"q_proj", &L.q, cfg.num_heads * D, H}, mat{"k_proj", &L.k, cfg.num_kv_heads * D, H},
                                         mat{"v_proj", &L.v, cfg.num_kv_heads * D, H}, mat{"o_proj", &L.o, H, cfg.num_heads * D},
                                         mat{"gate_proj", &L.gate, cfg.intermediate_size, H},
                                         mat{"up_proj", &L.up, cfg.intermediate_size, H},
                                         mat{"down_proj", &L.down, H, cfg.intermediate_size}}) {
      auto w = packed(p + name, rows, cols);
      if (!w) return std::unexpected(w.error());
      *out = std::move(*w);
    }
    auto in = vec(p + "input_norm", H);
    auto post = vec(p + "post_norm", H);
    if (!in) return std::unexpected(in.error());
    if (!post) return std::unexpected(post.error());
    L.input_norm = std::move(*in);
    L.post_norm = std::move(*post);
    m->layers_.push_back(std::move(L));
  }
  auto norm = vec("norm", H);
  if (!norm) return std::unexpected(norm.error());
  m->norm_ = std::move(*norm);
  const bool tied = cfg.tie_word_embeddings || !src.has("lm_head");
  auto head = packed(tied ? "embed_tokens" : "lm_head", cfg.vocab_size, H);
  if (!head) return std::unexpected(head.error());
  m->lm_head_ = std::move(*head);

  m->rope_.layout = cfg.layout == rope_layout::halves ? kernels::rope_layout::neox : kernels::rope_layout::adjacent;
  m->rope_.theta = static_cast<float>(cfg.rope_theta);
  if (cfg.scaling.type == rope_scaling::kind::llama3) {
    kernels::rope_llama3_scaling s;
    s.factor = static_cast<float>(cfg.scaling.factor);
    s.low_freq_factor = static_cast<float>(cfg.scaling.low_freq_factor);
    s.high_freq_factor = static_cast<float>(cfg.scaling.high_freq_factor);
    s.original_max_position_embeddings = cfg.scaling.original_max_position_embeddings;
    m->rope_.llama3 = s;
  } else if (src.has("rope_freqs")) {
    // GGUF files carry LLaMA-3 scaling as per-frequency divisors.
    auto f = src.get("rope_freqs");
    if (!f) return std::unexpected(f.error());
    auto ff = to_f32(pool, *f);
    if (!ff) return std::unexpected(ff.error());
    if (ff->numel() != D / 2)
      return make_error(errc::corrupt_data, src.path() + ": rope_freqs.weight has " + std::to_string(ff->numel()) +
                                                " values, expected head_dim/2 = " + std::to_string(D / 2));
    m->rope_.freq_factors.assign(ff->data_as<float>(), ff->data_as<float>() + ff->numel());
  }
  if (cfg.scaling.type == rope_scaling::kind::linear) {
    return make_error(errc::unsupported_op, src.path() + ": linear rope scaling is not implemented yet");
  }
  spdlog::debug("loaded {}: {}", src.path(), m->describe());
  return m;
}

result<kv_cache> llama_model::make_cache(kernels::memory_pool& pool, const kv_options& opts) const {
  return kv_cache::create(pool, static_cast<int>(cfg_.num_layers), static_cast<int>(cfg_.num_kv_heads),
                          static_cast<int>(cfg_.head_dim), opts);
}

std::size_t llama_model::bytes_per_token() const {
  std::size_t b = lm_head_.bytes();
  for (const auto& L : layers_)
    for (const auto* w : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) b += w->bytes();
  b += embed_.storage_bytes() / static_cast<std::size_t>(std::max<std::int64_t>(1, embed_.rows));
  return b;
}

std::string llama_model::describe() const {
  std::map<std::string, int> counts;
  for (const auto& L : layers_)
    for (const auto* w : {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down}) counts[std::string(kernels::to_string(w->format()))]++;
  std::string s = "layers=" + std::to_string(layers_.size()) + " matrices:";
  for (const auto& [f, n] : counts) s += " " + f + "x" + std::to_string(n);
  s += " embed=" + std::string(kernels::to_string(embed_.format)) + " lm_head=" + std::string(kernels::to_string(lm_head_.format()));
  return s;
}

result<tensor> llama_model::forward(kernels::cpu::context& ctx, kv_cache& cache, std::span<const step_input> inputs,
                                    const kernels::attention_options& attn_in) const {
  // A cache that frees blocks behind a window only works with that window.
  kernels::attention_options attn = attn_in;
  if (cache.options().window > 0) {
    attn.window = cache.options().window;
    attn.sinks = cache.options().sinks;
  }
  auto& pool = ctx.memory();
  const std::int64_t H = cfg_.hidden_size, D = cfg_.head_dim, NH = cfg_.num_heads, NKV = cfg_.num_kv_heads;
  const std::int64_t F = cfg_.intermediate_size, V = cfg_.vocab_size;
  if (inputs.empty()) return make_error(errc::invalid_argument, "forward needs at least one sequence");
  // Token layout of the step and validation before anything changes.
  std::int64_t T = 0, n_logits = 0;
  std::vector<std::int64_t> offset(inputs.size()), start(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto& in = inputs[i];
    if (!cache.contains(in.seq)) return make_error(errc::invalid_argument, "unknown sequence " + std::to_string(in.seq));
    for (std::size_t j = 0; j < i; ++j)
      if (inputs[j].seq == in.seq) return make_error(errc::invalid_argument, "sequence appears twice in one step");
    if (in.tokens.empty()) return make_error(errc::invalid_argument, "a step input has no tokens");
    for (auto t : in.tokens)
      if (t < 0 || t >= V) return make_error(errc::invalid_argument, "token id " + std::to_string(t) + " outside the vocabulary");
    if (in.embed_token >= V || in.embed_token < -1 || (in.embed_token == -1 && !in.embeddings.empty()))
      return make_error(errc::invalid_argument, "step input embeddings need an embed_token in the vocabulary");
    if (in.embed_token >= 0) {
      const auto n = static_cast<std::size_t>(std::count(in.tokens.begin(), in.tokens.end(), in.embed_token));
      if (n * static_cast<std::size_t>(H) != in.embeddings.size())
        return make_error(errc::invalid_argument, "a step input has " + std::to_string(n) + " embedding token(s) (id " +
                                                      std::to_string(in.embed_token) + ") but " +
                                                      std::to_string(in.embeddings.size()) + " embedding floats (hidden " +
                                                      std::to_string(H) + " each)");
    }
    offset[i] = T;
    start[i] = cache.length(in.seq);
    if (start[i] + static_cast<std::int64_t>(in.tokens.size()) > cfg_.max_position_embeddings * 64)
      return make_error(errc::invalid_argument, "sequence too long");
    T += static_cast<std::int64_t>(in.tokens.size());
    n_logits += in.all_logits ? static_cast<std::int64_t>(in.tokens.size()) : 1;
  }
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (auto r = cache.reserve(inputs[i].seq, start[i] + static_cast<std::int64_t>(inputs[i].tokens.size())); !r)
      return std::unexpected(r.error());

  auto alloc = [&](std::int64_t rows, std::int64_t cols) { return tensor::empty(pool, dtype::f32, {rows, cols}); };
  auto ids = tensor::empty(pool, dtype::i32, {T});
  auto x = alloc(T, H), h = alloc(T, H), q = alloc(T, NH * D), k = alloc(T, NKV * D), v = alloc(T, NKV * D);
  auto att = alloc(T, NH * D), proj = alloc(T, H), g = alloc(T, F), u = alloc(T, F);
  for (auto* t : {&ids, &x, &h, &q, &k, &v, &att, &proj, &g, &u})
    if (!*t) return std::unexpected(t->error());
  std::vector<std::int32_t> positions(static_cast<std::size_t>(T));
  for (std::size_t i = 0; i < inputs.size(); ++i)
    for (std::size_t j = 0; j < inputs[i].tokens.size(); ++j) {
      ids->data_as<std::int32_t>()[offset[i] + static_cast<std::int64_t>(j)] = inputs[i].tokens[j];
      positions[static_cast<std::size_t>(offset[i]) + j] = static_cast<std::int32_t>(start[i] + static_cast<std::int64_t>(j));
    }
#define TRY(expr)                                              \
  do {                                                         \
    if (auto r_ = (expr); !r_) return std::unexpected(r_.error()); \
  } while (0)
  TRY(kernels::embedding(ctx, embed_, *ids, *x));
  for (std::size_t i = 0; i < inputs.size(); ++i) {  // input embeddings replace table rows
    if (inputs[i].embed_token < 0) continue;
    const float* e = inputs[i].embeddings.data();
    for (std::size_t j = 0; j < inputs[i].tokens.size(); ++j)
      if (inputs[i].tokens[j] == inputs[i].embed_token) {
        std::copy_n(e, H, x->row_as<float>(offset[i] + static_cast<std::int64_t>(j)));
        e += H;
      }
  }
  const auto eps = static_cast<float>(cfg_.rms_norm_eps);
  auto q3 = q->reshape({T, NH, D});
  auto k3 = k->reshape({T, NKV, D});
  auto v3 = v->reshape({T, NKV, D});
  auto att3 = att->reshape({T, NH, D});
  if (!q3 || !k3 || !v3 || !att3) return make_error(errc::internal, "reshape failed");
  std::vector<kernels::attention_sequence> seqs(inputs.size());
  for (std::int64_t l = 0; l < cfg_.num_layers; ++l) {
    const auto& L = layers_[static_cast<std::size_t>(l)];
    auto& kv = cache.layer(static_cast<int>(l));
    TRY(kernels::rms_norm(ctx, *x, L.input_norm, eps, *h));
    TRY(kernels::matmul(ctx, *h, L.q, *q));
    TRY(kernels::matmul(ctx, *h, L.k, *k));
    TRY(kernels::matmul(ctx, *h, L.v, *v));
    TRY(kernels::rope(ctx, *q3, std::span<const std::int32_t>(positions), rope_, *q3));
    TRY(kernels::rope(ctx, *k3, std::span<const std::int32_t>(positions), rope_, *k3));
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const auto n = static_cast<std::int64_t>(inputs[i].tokens.size());
      auto ks = k3->slice_rows(offset[i], n);
      auto vs = v3->slice_rows(offset[i], n);
      auto qs = q3->slice_rows(offset[i], n);
      auto os = att3->slice_rows(offset[i], n);
      if (!ks || !vs || !qs || !os) return make_error(errc::internal, "slice failed");
      TRY(kernels::append_kv(kv, cache.block_table(inputs[i].seq), start[i], *ks, *vs));
      seqs[i].q = *qs;
      seqs[i].out = *os;
      seqs[i].q_start = start[i];
      seqs[i].kv_len = start[i] + n;
      seqs[i].block_table = cache.block_table(inputs[i].seq);
    }
    TRY(kernels::attention_paged(ctx, kv, seqs, attn));
    TRY(kernels::matmul(ctx, *att, L.o, *proj));
    TRY(kernels::add(ctx, *x, *proj, *x));
    TRY(kernels::rms_norm(ctx, *x, L.post_norm, eps, *h));
    TRY(kernels::matmul(ctx, *h, L.gate, *g));
    TRY(kernels::matmul(ctx, *h, L.up, *u));
    TRY(kernels::swiglu(ctx, *g, *u, *g));
    TRY(kernels::matmul(ctx, *g, L.down, *proj));
    TRY(kernels::add(ctx, *x, *proj, *x));
  }
  // Final norm and LM head on the rows that need logits.
  auto sel = alloc(n_logits, H);
  auto logits = alloc(n_logits, V);
  if (!sel) return std::unexpected(sel.error());
  if (!logits) return std::unexpected(logits.error());
  std::int64_t row = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const auto n = static_cast<std::int64_t>(inputs[i].tokens.size());
    const std::int64_t first = inputs[i].all_logits ? 0 : n - 1;
    for (std::int64_t j = first; j < n; ++j, ++row)
      std::copy_n(x->row_as<float>(offset[i] + j), H, sel->row_as<float>(row));
  }
  TRY(kernels::rms_norm(ctx, *sel, norm_, eps, *sel));
  TRY(kernels::matmul(ctx, *sel, lm_head_, *logits));
#undef TRY
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (auto r = cache.commit(inputs[i].seq, start[i] + static_cast<std::int64_t>(inputs[i].tokens.size())); !r)
      return std::unexpected(r.error());
  return logits;
}

}  // namespace troupe::models
