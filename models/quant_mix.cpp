#include "models/quant_mix.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <string>

namespace troupe::models {

using kernels::weight_format;

namespace {

struct mix_name {
  gguf_mix mix;
  std::string_view name;
  weight_format base;
};

constexpr std::array<mix_name, 11> mixes{{
    {gguf_mix::q2_k, "q2_k", weight_format::q2_k},
    {gguf_mix::q3_k_s, "q3_k_s", weight_format::q3_k},
    {gguf_mix::q3_k_m, "q3_k_m", weight_format::q3_k},
    {gguf_mix::q3_k_l, "q3_k_l", weight_format::q3_k},
    {gguf_mix::q4_k_s, "q4_k_s", weight_format::q4_k},
    {gguf_mix::q4_k_m, "q4_k_m", weight_format::q4_k},
    {gguf_mix::q5_k_s, "q5_k_s", weight_format::q5_k},
    {gguf_mix::q5_k_m, "q5_k_m", weight_format::q5_k},
    {gguf_mix::q6_k, "q6_k", weight_format::q6_k},
    {gguf_mix::iq4_nl, "iq4_nl", weight_format::iq4_nl},
    {gguf_mix::iq4_xs, "iq4_xs", weight_format::iq4_xs},
}};

// The kinds of matrix llama.cpp's rules tell apart.
enum class role_kind {
  token_embd,
  output,
  attn_q,
  attn_k,
  attn_v,
  attn_output,
  ffn_gate,
  ffn_up,
  ffn_down,
  other
};

// "layers.N.leaf" -> (N, leaf); other names -> (-1, name).
std::pair<std::int64_t, std::string> split_layer(const std::string& role) {
  if (role.rfind("layers.", 0) != 0) return {-1, role};
  const auto dot = role.find('.', 7);
  if (dot == std::string::npos) return {-1, role};
  std::int64_t n = 0;
  for (std::size_t i = 7; i < dot; ++i) {
    if (!std::isdigit(static_cast<unsigned char>(role[i]))) return {-1, role};
    n = n * 10 + (role[i] - '0');
  }
  return {n, role.substr(dot + 1)};
}

role_kind kind_of(const std::string& leaf, std::int64_t layer) {
  if (layer < 0) {
    if (leaf == "embed_tokens") return role_kind::token_embd;
    if (leaf == "lm_head") return role_kind::output;
    return role_kind::other;
  }
  if (leaf == "q_proj") return role_kind::attn_q;
  if (leaf == "k_proj") return role_kind::attn_k;
  if (leaf == "v_proj" || leaf == "qkv_proj") return role_kind::attn_v;
  if (leaf == "o_proj") return role_kind::attn_output;
  if (leaf == "gate_proj") return role_kind::ffn_gate;
  if (leaf == "up_proj" || leaf == "gate_up_proj") return role_kind::ffn_up;
  if (leaf == "down_proj") return role_kind::ffn_down;
  return role_kind::other;
}

std::int64_t block_of(weight_format f) {
  const auto dt = kernels::block_dtype(f);
  return dt ? kernels::block_elems(*dt) : 1;
}

// llama.cpp's layers that get more bits in the _M mixes: the first and last
// eighth, and every third one between.
bool more_bits(std::int64_t i, std::int64_t n) {
  return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

}  // namespace

std::optional<gguf_mix> gguf_mix_from_string(std::string_view name) {
  std::string lower(name);
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  for (const auto& m : mixes)
    if (m.name == lower) return m.mix;
  return std::nullopt;
}

std::string_view to_string(gguf_mix m) {
  return mixes[static_cast<std::size_t>(m)].name;
}

weight_format base_format(gguf_mix m) {
  return mixes[static_cast<std::size_t>(m)].base;
}

weight_format shape_fallback(weight_format f, std::int64_t cols) {
  if (cols % block_of(f) == 0) return f;
  weight_format to = f;
  switch (f) {
    case weight_format::q2_k:
    case weight_format::q3_k:
      to = weight_format::q4_0;
      break;
    case weight_format::q4_k:
      to = weight_format::q5_0;
      break;
    case weight_format::q5_k:
      to = weight_format::q5_1;
      break;
    case weight_format::q6_k:
      to = weight_format::q8_0;
      break;
    case weight_format::iq4_xs:
      to = weight_format::iq4_nl;
      break;
    default:
      return f;  // no fallback: quantizing says why the shape does not fit
  }
  return cols % block_of(to) == 0 ? to : weight_format::f16;
}

weight_format mix_format(gguf_mix mix, const std::string& role, std::int64_t cols,
                         const mix_model& model) {
  using enum gguf_mix;
  const weight_format base = base_format(mix);
  const auto [layer, leaf] = split_layer(role);
  const role_kind kind = kind_of(leaf, layer);
  const std::int64_t n = model.num_layers;
  const bool gqa4 = model.num_kv_heads > 0 && model.num_heads / model.num_kv_heads >= 4;
  weight_format f = base;
  if (kind == role_kind::output || (model.tied_output && kind == role_kind::token_embd)) {
    // The output matrix (and a token embedding that doubles as it): Q6_K,
    // or Q8_0 where the base format's blocks do not divide its rows.
    f = cols % block_of(base) != 0 ? weight_format::q8_0 : weight_format::q6_k;
  } else if (kind == role_kind::attn_v) {
    if (mix == q2_k)
      f = gqa4 ? weight_format::q4_k : weight_format::q3_k;
    else if (mix == q3_k_m)
      f = layer < 2 ? weight_format::q5_k : weight_format::q4_k;
    else if (mix == q3_k_l)
      f = weight_format::q5_k;
    else if ((mix == iq4_nl || mix == iq4_xs) && gqa4)
      f = weight_format::q5_k;
    else if ((mix == q4_k_m || mix == q5_k_m) && more_bits(layer, n))
      f = weight_format::q6_k;
    else if (mix == q4_k_s && layer < 4)
      f = weight_format::q5_k;
    // LLaMA 70B's value projection is 8x smaller than its query's: more bits.
    if (model.llama_70b && (f == weight_format::q3_k || f == weight_format::q4_k))
      f = weight_format::q5_k;
  } else if (kind == role_kind::ffn_down) {
    if (mix == q2_k)
      f = weight_format::q3_k;
    else if (mix == q3_k_m)
      f = layer < n / 16 ? weight_format::q5_k : weight_format::q4_k;
    else if (mix == q3_k_l)
      f = weight_format::q5_k;
    else if (mix == q4_k_m)
      f = more_bits(layer, n) ? weight_format::q6_k : base;
    else if (layer < n / 8 && (mix == iq4_nl || mix == iq4_xs))
      f = weight_format::q5_k;
    else if (mix == q5_k_m && more_bits(layer, n))
      f = weight_format::q6_k;
    else if (mix == q4_k_s && layer < n / 8)
      f = weight_format::q5_k;
  } else if (kind == role_kind::attn_output) {
    if (mix == q2_k)
      f = weight_format::q3_k;
    else if (mix == q3_k_m)
      f = weight_format::q4_k;
    else if (mix == q3_k_l)
      f = weight_format::q5_k;
  }
  return shape_fallback(f, cols);
}

}  // namespace troupe::models
