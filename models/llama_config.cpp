#include "models/llama_config.hpp"

#include <sys/stat.h>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

namespace troupe::models {

using json = nlohmann::json;

namespace {

std::string field_error(const std::string& source, const std::string& field,
                        const std::string& what) {
  return source + ": " + field + " " + what;
}

// Reads an optional integer field; wrong types are errors.
result<bool> get_int(const json& j, const char* key, std::int64_t& out, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return false;
  if (!it->is_number_integer())
    return make_error(errc::corrupt_data, field_error(src, key, "must be an integer"));
  out = it->get<std::int64_t>();
  return true;
}

result<bool> get_float(const json& j, const char* key, double& out, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return false;
  if (!it->is_number())
    return make_error(errc::corrupt_data, field_error(src, key, "must be a number"));
  out = it->get<double>();
  if (!std::isfinite(out))
    return make_error(errc::corrupt_data, field_error(src, key, "must be finite"));
  return true;
}

result<std::vector<std::int64_t>> get_ids(const json& j, const char* key, const std::string& src) {
  std::vector<std::int64_t> out;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return out;
  if (it->is_number_integer()) {
    out.push_back(it->get<std::int64_t>());
  } else if (it->is_array()) {
    for (const auto& e : *it) {
      if (!e.is_number_integer())
        return make_error(errc::corrupt_data, field_error(src, key, "must hold integers"));
      out.push_back(e.get<std::int64_t>());
    }
  } else {
    return make_error(errc::corrupt_data,
                      field_error(src, key, "must be an integer or a list of integers"));
  }
  return out;
}

// What a Hugging Face `architectures` entry (or a LLaVA text config's
// model_type) is, among the families troupe runs.
struct known_arch {
  const char* name;
  decoder_family family;
};
constexpr known_arch hf_archs[] = {
    {"LlamaForCausalLM", decoder_family::llama},   {"MistralForCausalLM", decoder_family::mistral},
    {"Qwen2ForCausalLM", decoder_family::qwen2},   {"Phi3ForCausalLM", decoder_family::phi3},
    {"Gemma2ForCausalLM", decoder_family::gemma2}, {"Gemma3ForCausalLM", decoder_family::gemma3}};
constexpr known_arch llava_text_types[] = {{"llama", decoder_family::llama},
                                           {"mistral", decoder_family::mistral},
                                           {"qwen2", decoder_family::qwen2}};

bool is_gemma(decoder_family f) {
  return f == decoder_family::gemma2 || f == decoder_family::gemma3;
}

}  // namespace

const char* to_string(decoder_family f) {
  switch (f) {
    case decoder_family::llama:
      return "llama";
    case decoder_family::mistral:
      return "mistral";
    case decoder_family::qwen2:
      return "qwen2";
    case decoder_family::phi3:
      return "phi3";
    case decoder_family::gemma2:
      return "gemma2";
    case decoder_family::gemma3:
      return "gemma3";
  }
  return "?";
}

result<std::string> read_text_file(const std::string& path, std::size_t max_bytes) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return make_error(errc::not_found, path + ": no such file");
  if (!S_ISREG(st.st_mode)) return make_error(errc::io_error, path + ": not a regular file");
  if (static_cast<std::size_t>(st.st_size) > max_bytes)
    return make_error(errc::corrupt_data,
                      path + ": " + std::to_string(st.st_size) + " bytes is too large");
  std::ifstream in(path, std::ios::binary);
  if (!in) return make_error(errc::io_error, path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

result<void> llama_config::validate(const std::string& src) const {
  auto range = [&](const char* name, std::int64_t v, std::int64_t lo,
                   std::int64_t hi) -> result<void> {
    if (v < lo || v > hi)
      return make_error(errc::corrupt_data,
                        field_error(src, name,
                                    "= " + std::to_string(v) + " is outside [" +
                                        std::to_string(lo) + ", " + std::to_string(hi) + "]"));
    return {};
  };
  for (auto r :
       {range("vocab_size", vocab_size, 1, 1 << 22), range("hidden_size", hidden_size, 1, 1 << 16),
        range("intermediate_size", intermediate_size, 1, 1 << 18),
        range("num_hidden_layers", num_layers, 1, 1024),
        range("num_attention_heads", num_heads, 1, 1024),
        range("num_key_value_heads", num_kv_heads, 1, 1024), range("head_dim", head_dim, 2, 1024),
        range("max_position_embeddings", max_position_embeddings, 1, 1 << 24)})
    if (!r) return r;
  if (num_heads % num_kv_heads != 0)
    return make_error(errc::corrupt_data,
                      field_error(src, "num_key_value_heads", "must divide num_attention_heads"));
  if (head_dim % 2 != 0)
    return make_error(errc::corrupt_data, field_error(src, "head_dim", "must be even for RoPE"));
  if (!(rms_norm_eps > 0 && rms_norm_eps < 1))
    return make_error(errc::corrupt_data, field_error(src, "rms_norm_eps", "must be in (0, 1)"));
  if (!(rope_theta > 1))
    return make_error(errc::corrupt_data, field_error(src, "rope_theta", "must be > 1"));
  if (scaling.type != rope_scaling::kind::none && scaling.type != rope_scaling::kind::longrope &&
      !(scaling.factor >= 1 && scaling.factor <= 1024))
    return make_error(errc::corrupt_data,
                      field_error(src, "rope_scaling.factor", "must be in [1, 1024]"));
  if ((scaling.type == rope_scaling::kind::yarn || scaling.type == rope_scaling::kind::longrope) &&
      (scaling.original_max_position_embeddings < 2 ||
       scaling.original_max_position_embeddings > (1 << 24)))
    return make_error(errc::corrupt_data,
                      field_error(src, "original_max_position_embeddings",
                                  "must be in [2, 2^24] for yarn and longrope"));
  if (scaling.type == rope_scaling::kind::llama3) {
    if (!(scaling.high_freq_factor > scaling.low_freq_factor && scaling.low_freq_factor > 0))
      return make_error(
          errc::corrupt_data,
          field_error(src, "rope_scaling", "needs high_freq_factor > low_freq_factor > 0"));
    if (scaling.original_max_position_embeddings < 1)
      return make_error(
          errc::corrupt_data,
          field_error(src, "rope_scaling.original_max_position_embeddings", "must be positive"));
  }
  if (!(embed_scale > 0 && embed_scale < 1e6))
    return make_error(errc::corrupt_data, field_error(src, "embed_scale", "must be in (0, 1e6)"));
  if (sliding_window < 0 || sliding_window > (1 << 24) || sliding_pattern < 0 ||
      sliding_pattern > 1024)
    return make_error(
        errc::corrupt_data,
        field_error(src, "sliding_window",
                    "window must be in [0, 2^24] and the layer pattern in [0, 1024]"));
  if (sliding_window > 0 && rope_local_theta != 0 && !(rope_local_theta > 1))
    return make_error(errc::corrupt_data, field_error(src, "rope_local_base_freq", "must be > 1"));
  if (!(attn_scale >= 0 && attn_scale < 1e3))
    return make_error(errc::corrupt_data, field_error(src, "query_pre_attn_scalar",
                                                      "gives an attention scale outside [0, 1e3)"));
  for (auto [name, v] : {std::pair{"attn_logit_softcapping", attn_softcap},
                         std::pair{"final_logit_softcapping", final_softcap}})
    if (!(v >= 0 && v < 1e6))
      return make_error(errc::corrupt_data, field_error(src, name, "must be in [0, 1e6)"));
  if (!(norm_offset >= 0 && norm_offset <= 1))
    return make_error(errc::corrupt_data, field_error(src, "norm_offset", "must be in [0, 1]"));
  if (!sliding_layers.empty() && static_cast<std::int64_t>(sliding_layers.size()) != num_layers)
    return make_error(errc::corrupt_data,
                      field_error(src, "layer_types",
                                  "has " + std::to_string(sliding_layers.size()) + " entries for " +
                                      std::to_string(num_layers) + " layers"));
  for (auto id : bos_token_ids)
    if (id < 0 || id >= vocab_size)
      return make_error(errc::corrupt_data,
                        field_error(src, "bos_token_id", "outside the vocabulary"));
  for (auto id : eos_token_ids)
    if (id < 0 || id >= vocab_size)
      return make_error(errc::corrupt_data,
                        field_error(src, "eos_token_id", "outside the vocabulary"));
  return {};
}

namespace {

// An optional number that may be null (null and absent give `fallback`).
result<double> number_or(const json& j, const char* key, double fallback, const std::string& src) {
  double v = fallback;
  if (auto r = get_float(j, key, v, src); !r) return std::unexpected(r.error());
  return v;
}

// The window, which layers use it, and the switches of each family.
result<void> apply_family(const json& j, const std::string& src, llama_config& c) {
  std::int64_t window = 0;
  if (auto r = get_int(j, "sliding_window", window, src); !r) return std::unexpected(r.error());
  if (auto lt = j.find("layer_types"); lt != j.end() && !lt->is_null()) {
    if (!lt->is_array())
      return make_error(errc::corrupt_data, field_error(src, "layer_types", "must be a list"));
    for (const auto& e : *lt) {
      const std::string t = e.is_string() ? e.get<std::string>() : std::string();
      if (t != "sliding_attention" && t != "full_attention")
        return make_error(errc::unsupported_op,
                          field_error(src, "layer_types",
                                      "holds '" + (e.is_string() ? t : e.dump()) +
                                          "' (sliding_attention, full_attention)"));
      c.sliding_layers.push_back(t == "sliding_attention" ? 1 : 0);
    }
  }
  const bool any_sliding =
      std::find(c.sliding_layers.begin(), c.sliding_layers.end(), 1) != c.sliding_layers.end();
  switch (c.family) {
    case decoder_family::llama:
      break;
    case decoder_family::mistral:
    case decoder_family::phi3:
      // One window on every layer (transformers applies it when set).
      c.sliding_window = window;
      c.sliding_pattern = 0;
      c.fused_qkv = c.family == decoder_family::phi3;
      break;
    case decoder_family::qwen2: {
      c.qkv_bias = true;
      // transformers 4.x: use_sliding_window puts the window on the layers
      // from max_window_layers on; 5.x writes that out as layer_types.
      bool use = false;
      if (auto u = j.find("use_sliding_window"); u != j.end() && u->is_boolean())
        use = u->get<bool>();
      if (c.sliding_layers.empty() && use) {
        std::int64_t from = c.num_layers;
        if (auto r = get_int(j, "max_window_layers", from, src); !r)
          return std::unexpected(r.error());
        for (std::int64_t l = 0; l < c.num_layers; ++l)
          c.sliding_layers.push_back(l >= from ? 1 : 0);
      }
      const bool slides =
          std::find(c.sliding_layers.begin(), c.sliding_layers.end(), 1) != c.sliding_layers.end();
      c.sliding_window = slides ? window : 0;  // Qwen2 writes a window it does not use
      if (!slides) c.sliding_layers.clear();
      break;
    }
    case decoder_family::gemma2:
    case decoder_family::gemma3: {
      const bool g3 = c.family == decoder_family::gemma3;
      c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
      c.sandwich_norms = true;
      c.gelu_ffn = true;
      c.qk_norm = g3;
      c.norm_offset = 1.0;  // Gemma's RMSNorm multiplies by (1 + w)
      c.sliding_window = window;
      c.sliding_pattern = g3 ? 6 : 2;
      if (g3) {
        if (auto r = get_int(j, "sliding_window_pattern", c.sliding_pattern, src); !r)
          return std::unexpected(r.error());
        if (c.rope_local_theta == 0) {
          auto local = number_or(j, "rope_local_base_freq", 10000.0, src);
          if (!local) return std::unexpected(local.error());
          c.rope_local_theta = *local;
        }
      }
      auto scalar = number_or(j, "query_pre_attn_scalar", static_cast<double>(c.head_dim), src);
      auto attn_cap = number_or(j, "attn_logit_softcapping", 0.0, src);
      auto final_cap = number_or(j, "final_logit_softcapping", 0.0, src);
      for (auto* r : {&scalar, &attn_cap, &final_cap})
        if (!*r) return std::unexpected(r->error());
      if (!(*scalar > 0))
        return make_error(errc::corrupt_data,
                          field_error(src, "query_pre_attn_scalar", "must be positive"));
      c.attn_scale = 1.0 / std::sqrt(*scalar);
      c.attn_softcap = *attn_cap;
      c.final_softcap = *final_cap;
      if (!j.contains("tie_word_embeddings")) c.tie_word_embeddings = true;
      break;
    }
  }
  if ((any_sliding || (c.sliding_layers.empty() && c.sliding_pattern > 0)) && is_gemma(c.family) &&
      c.sliding_window <= 0)
    return make_error(errc::corrupt_data,
                      field_error(src, "sliding_window", "is missing for windowed layers"));
  if (any_sliding && c.sliding_window <= 0)
    return make_error(errc::corrupt_data,
                      field_error(src, "sliding_window", "is missing for windowed layers"));
  return {};
}

}  // namespace

result<llama_config> parse_llama_config(std::string_view text, const std::string& src) {
  json root = json::parse(text.begin(), text.end(), nullptr, false);
  if (root.is_discarded() || !root.is_object())
    return make_error(errc::corrupt_data, src + ": not a JSON object");
  llama_config c;
  if (auto a = root.find("architectures"); a != root.end()) {
    if (!a->is_array() || a->empty() || !(*a)[0].is_string())
      return make_error(errc::corrupt_data,
                        field_error(src, "architectures", "must be a list of names"));
    c.architecture = (*a)[0].get<std::string>();
  }
  const json* j = &root;
  auto supported = [&] {
    std::string names;
    for (const auto& a : hf_archs) names += std::string(names.empty() ? "" : ", ") + a.name;
    return names + ", LlavaForConditionalGeneration";
  };
  if (c.architecture == "LlavaForConditionalGeneration") {
    auto t = root.find("text_config");
    if (t == root.end() || !t->is_object())
      return make_error(errc::corrupt_data, src + ": LLaVA config without text_config");
    j = &*t;
    if (auto mt = j->find("model_type"); mt != j->end() && mt->is_string()) {
      const auto type = mt->get<std::string>();
      bool found = false;
      for (const auto& a : llava_text_types)
        if (type == a.name) {
          c.family = a.family;
          found = true;
        }
      if (!found)
        return make_error(errc::unsupported_op,
                          field_error(src, "text_config.model_type",
                                      "'" + type + "' is not supported (llama, mistral, qwen2)"));
    }
  } else {
    bool found = false;
    for (const auto& a : hf_archs)
      if (c.architecture == a.name) {
        c.family = a.family;
        found = true;
      }
    if (!found)
      return make_error(errc::unsupported_op, src + ": architecture " + c.architecture +
                                                  " is not supported (" + supported() + ")");
  }
  const bool gemma = is_gemma(c.family);
  // The activation: SiLU (SwiGLU) for the LLaMA-like families, tanh-GELU
  // (GeGLU) for Gemma; transformers names the key hidden_act or, for Gemma,
  // hidden_activation.
  for (const char* key : {"hidden_act", "hidden_activation"}) {
    auto act = j->find(key);
    if (act == j->end() || act->is_null()) continue;
    const char* want = gemma ? "gelu_pytorch_tanh" : "silu";
    if (!act->is_string() || act->get<std::string>() != want)
      return make_error(errc::unsupported_op, field_error(src, key,
                                                          std::string("must be \"") + want +
                                                              "\" for " + to_string(c.family)));
  }
  for (const char* b : {"attention_bias", "mlp_bias"})
    if (auto it = j->find(b); it != j->end() && it->is_boolean() && it->get<bool>())
      return make_error(errc::unsupported_op, field_error(src, b, "= true is not supported"));
  if (auto it = j->find("partial_rotary_factor");
      it != j->end() && !it->is_null() && (!it->is_number() || it->get<double>() != 1.0))
    return make_error(errc::unsupported_op,
                      field_error(src, "partial_rotary_factor", "other than 1 is not supported"));
  // Absent optional fields stay -1 and get their defaults below; an explicit
  // 0 is a value (and fails validation).
  c.num_kv_heads = -1;
  c.head_dim = -1;
  struct need {
    const char* key;
    std::int64_t* out;
    bool required;
  };
  for (auto n :
       {need{"vocab_size", &c.vocab_size, true}, need{"hidden_size", &c.hidden_size, true},
        need{"intermediate_size", &c.intermediate_size, true},
        need{"num_hidden_layers", &c.num_layers, true},
        need{"num_attention_heads", &c.num_heads, true},
        need{"num_key_value_heads", &c.num_kv_heads, false}, need{"head_dim", &c.head_dim, false},
        need{"max_position_embeddings", &c.max_position_embeddings, false}}) {
    auto got = get_int(*j, n.key, *n.out, src);
    if (!got) return std::unexpected(got.error());
    if (!*got && n.required)
      return make_error(errc::corrupt_data, field_error(src, n.key, "is missing"));
  }
  if (c.num_kv_heads == -1) c.num_kv_heads = c.num_heads;
  if (c.head_dim == -1 && c.num_heads > 0) {
    if (c.hidden_size % c.num_heads != 0)
      return make_error(errc::corrupt_data,
                        field_error(src, "num_attention_heads",
                                    "must divide hidden_size when head_dim is absent"));
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (auto r = get_float(*j, "rms_norm_eps", c.rms_norm_eps, src); !r)
    return std::unexpected(r.error());
  if (auto r = get_float(*j, "rope_theta", c.rope_theta, src); !r)
    return std::unexpected(r.error());
  if (auto t = j->find("tie_word_embeddings"); t != j->end()) {
    if (!t->is_boolean())
      return make_error(errc::corrupt_data,
                        field_error(src, "tie_word_embeddings", "must be a boolean"));
    c.tie_word_embeddings = t->get<bool>();
  }
  // RoPE: transformers 4.x writes rope_theta and rope_scaling; 5.x writes
  // rope_parameters (rope_theta, rope_type and the factors in one object).
  // Both are read; a type troupe does not implement is refused by name.
  std::function<result<void>(const json&, const std::string&)> rope_object;
  rope_object = [&](const json& rs, const std::string& key) -> result<void> {
    // transformers 5 writes Gemma 3's as one object per layer type: the
    // global layers' is the model's, the windowed layers' gives their base.
    if (rs.is_object() && (rs.contains("full_attention") || rs.contains("sliding_attention"))) {
      if (!is_gemma(c.family))
        return make_error(
            errc::unsupported_op,
            field_error(src, key, "per-layer-type RoPE parameters are only read for Gemma"));
      for (const auto& [k, v] : rs.items())
        if (k != "full_attention" && k != "sliding_attention")
          return make_error(errc::unsupported_op,
                            field_error(src, key + "." + k, "is not a layer type troupe knows"));
      if (auto full = rs.find("full_attention"); full != rs.end())
        if (auto r = rope_object(*full, key + ".full_attention"); !r) return r;
      if (auto slide = rs.find("sliding_attention"); slide != rs.end()) {
        const double theta = c.rope_theta;
        const rope_scaling scaling = c.scaling;
        c.scaling = {};
        if (auto r = rope_object(*slide, key + ".sliding_attention"); !r) return r;
        if (c.scaling.type != rope_scaling::kind::none)
          return make_error(errc::unsupported_op,
                            field_error(src, key + ".sliding_attention",
                                        "scaling on the windowed layers is not supported"));
        c.rope_local_theta = c.rope_theta;
        c.rope_theta = theta;
        c.scaling = scaling;
      }
      return {};
    }
    if (!rs.is_object())
      return make_error(errc::corrupt_data, field_error(src, key, "must be an object"));
    if (auto p = rs.find("partial_rotary_factor");
        p != rs.end() && !p->is_null() && (!p->is_number() || p->get<double>() != 1.0))
      return make_error(errc::unsupported_op, field_error(src, key + ".partial_rotary_factor",
                                                          "other than 1 is not supported"));
    std::string type = key == "rope_scaling" ? "" : "default";
    for (const char* k : {"rope_type", "type"})
      if (auto t = rs.find(k); t != rs.end()) {
        if (!t->is_string())
          return make_error(errc::corrupt_data,
                            field_error(src, key + "." + k, "must be a string"));
        type = t->get<std::string>();
      }
    if (type == "llama3")
      c.scaling.type = rope_scaling::kind::llama3;
    else if (type == "linear")
      c.scaling.type = rope_scaling::kind::linear;
    else if (type == "yarn")
      c.scaling.type = rope_scaling::kind::yarn;
    else if (type == "longrope")
      c.scaling.type = rope_scaling::kind::longrope;
    else if (type != "default")
      return make_error(
          errc::unsupported_op,
          field_error(src, key + ".rope_type",
                      "'" + type + "' is not supported (default, llama3, linear, yarn, longrope)"));
    if (type == "longrope") {
      for (auto [k, out] : {std::pair{"short_factor", &c.scaling.short_factor},
                            std::pair{"long_factor", &c.scaling.long_factor}}) {
        auto it = rs.find(k);
        if (it == rs.end() || !it->is_array() ||
            it->size() != static_cast<std::size_t>(c.head_dim / 2))
          return make_error(errc::corrupt_data,
                            field_error(src, key + "." + k,
                                        "must be a list of head_dim / 2 = " +
                                            std::to_string(c.head_dim / 2) + " numbers"));
        for (const auto& v : *it) {
          if (!v.is_number() || !(v.get<double>() > 0) || !std::isfinite(v.get<double>()))
            return make_error(errc::corrupt_data,
                              field_error(src, key + "." + k, "must hold positive numbers"));
          out->push_back(static_cast<float>(v.get<double>()));
        }
      }
      // The pretraining context: in the object (5.x) or beside it (4.x).
      std::int64_t orig = 0;
      if (auto r = get_int(rs, "original_max_position_embeddings", orig, src); !r)
        return std::unexpected(r.error());
      if (orig == 0)
        if (auto r = get_int(*j, "original_max_position_embeddings", orig, src); !r)
          return std::unexpected(r.error());
      if (orig < 2)
        return make_error(errc::corrupt_data,
                          field_error(src, key + ".original_max_position_embeddings",
                                      "is missing (longrope needs it)"));
      double factor = 0, attention = 0;
      if (auto r = get_float(rs, "factor", factor, src); !r) return std::unexpected(r.error());
      if (auto r = get_float(rs, "attention_factor", attention, src); !r)
        return std::unexpected(r.error());
      if (factor == 0)
        factor = static_cast<double>(c.max_position_embeddings) / static_cast<double>(orig);
      if (attention == 0)
        attention = factor <= 1
                        ? 1.0
                        : std::sqrt(1 + std::log(factor) / std::log(static_cast<double>(orig)));
      if (!(attention > 0 && attention < 100))
        return make_error(errc::corrupt_data,
                          field_error(src, key + ".attention_factor", "must be in (0, 100)"));
      c.scaling.attention_factor = attention;
      c.scaling.original_max_position_embeddings = orig;
      c.max_position_embeddings = std::min(c.max_position_embeddings, orig);  // see rope_scaling
      return {};  // no "factor" check: longrope's is only the ratio of the two lengths
    }
    if (type == "yarn") {
      for (auto [k, out] :
           {std::pair{"attention_factor", &c.scaling.attention_factor},
            std::pair{"beta_fast", &c.scaling.beta_fast},
            std::pair{"beta_slow", &c.scaling.beta_slow}, std::pair{"mscale", &c.scaling.mscale},
            std::pair{"mscale_all_dim", &c.scaling.mscale_all_dim}})
        if (auto r = get_float(rs, k, *out, src + " " + key); !r) return std::unexpected(r.error());
      if (auto t = rs.find("truncate"); t != rs.end() && !t->is_null()) {
        if (!t->is_boolean())
          return make_error(errc::corrupt_data,
                            field_error(src, key + ".truncate", "must be a boolean"));
        c.scaling.truncate = t->get<bool>();
      }
      // transformers' default for the pretraining length is the model's.
      if (!rs.contains("original_max_position_embeddings"))
        c.scaling.original_max_position_embeddings = c.max_position_embeddings;
      if (!(c.scaling.attention_factor >= 0 && c.scaling.attention_factor < 100) ||
          !(c.scaling.beta_fast > 0) || !(c.scaling.beta_slow > 0))
        return make_error(
            errc::corrupt_data,
            field_error(src, key, "yarn needs attention_factor in [0, 100) and positive betas"));
    }
    if (auto r = get_float(rs, "rope_theta", c.rope_theta, src + " " + key); !r)
      return std::unexpected(r.error());
    for (auto [k, out] : {std::pair{"factor", &c.scaling.factor},
                          std::pair{"low_freq_factor", &c.scaling.low_freq_factor},
                          std::pair{"high_freq_factor", &c.scaling.high_freq_factor}})
      if (auto r = get_float(rs, k, *out, src + " " + key); !r) return std::unexpected(r.error());
    if (auto r = get_int(rs, "original_max_position_embeddings",
                         c.scaling.original_max_position_embeddings, src);
        !r)
      return std::unexpected(r.error());
    return {};
  };
  const auto params = j->find("rope_parameters");
  const auto scaling = j->find("rope_scaling");
  const bool has_params = params != j->end() && !params->is_null();
  const bool has_scaling = scaling != j->end() && !scaling->is_null();
  if (has_params && has_scaling && *params != *scaling)
    return make_error(errc::corrupt_data,
                      src + ": rope_parameters and rope_scaling are both set and differ");
  if (has_params) {
    const double old_theta = c.rope_theta;
    const bool old_theta_given = j->contains("rope_theta");
    if (auto r = rope_object(*params, "rope_parameters"); !r) return std::unexpected(r.error());
    const bool per_type = params->is_object() && (params->contains("full_attention") ||
                                                  params->contains("sliding_attention"));
    if (!per_type && !params->contains("rope_theta") && !old_theta_given)
      return make_error(errc::corrupt_data, field_error(src, "rope_parameters.rope_theta",
                                                        "is missing (and no rope_theta)"));
    if (old_theta_given && params->contains("rope_theta") && old_theta != c.rope_theta)
      return make_error(errc::corrupt_data,
                        src + ": rope_theta and rope_parameters.rope_theta differ");
  } else if (has_scaling) {
    if (auto r = rope_object(*scaling, "rope_scaling"); !r) return std::unexpected(r.error());
  }
  if (auto r = apply_family(*j, src, c); !r) return std::unexpected(r.error());
  auto bos = get_ids(*j, "bos_token_id", src);
  auto eos = get_ids(*j, "eos_token_id", src);
  if (!bos) return std::unexpected(bos.error());
  if (!eos) return std::unexpected(eos.error());
  c.bos_token_ids = *bos;
  c.eos_token_ids = *eos;
  if (auto r = c.validate(src); !r) return std::unexpected(r.error());
  return c;
}

result<llama_config> load_llama_config(const std::string& path) {
  auto text = read_text_file(path);
  if (!text) return std::unexpected(text.error());
  return parse_llama_config(*text, path);
}

result<llama_config> llama_config_from_gguf(const gguf_file& f) {
  const std::string src = f.path();
  const auto* arch = f.find("general.architecture");
  if (!arch || !arch->as_string())
    return make_error(errc::corrupt_data, src + ": general.architecture missing");
  const std::string a = *arch->as_string();
  static constexpr std::pair<const char*, const char*> gguf_archs[] = {
      {"llama", "LlamaForCausalLM"},
      {"qwen2", "Qwen2ForCausalLM"},
      {"phi3", "Phi3ForCausalLM"},
      {"gemma2", "Gemma2ForCausalLM"},
      {"gemma3", "Gemma3ForCausalLM"}};
  llama_config c;
  c.architecture.clear();
  for (auto [name, hf] : gguf_archs)
    if (a == name) c.architecture = hf;
  if (c.architecture.empty())
    return make_error(errc::unsupported_op,
                      src + ": GGUF architecture '" + a +
                          "' is not supported (llama, qwen2, phi3, gemma2, gemma3)");
  const bool gemma = a == "gemma3" || a == "gemma2";
  // llama.cpp's converter permutes LLaMA's q/k rows to adjacent pairs; it
  // leaves the others as they are (NEOX halves).
  c.layout = a == "llama" ? rope_layout::adjacent_pairs : rope_layout::halves;
  const std::string pre = a + ".";
  auto get = [&](const std::string& key, std::int64_t& out, bool required) -> result<void> {
    const auto* v = f.find(pre + key);
    if (!v) {
      if (required) return make_error(errc::corrupt_data, src + ": " + pre + key + " missing");
      return {};
    }
    auto i = v->as_int();
    if (!i) return make_error(errc::corrupt_data, src + ": " + pre + key + " must be an integer");
    out = *i;
    return {};
  };
  std::int64_t key_length = 0, value_length = 0;
  for (auto r :
       {get("embedding_length", c.hidden_size, true),
        get("feed_forward_length", c.intermediate_size, true),
        get("block_count", c.num_layers, true), get("attention.head_count", c.num_heads, true),
        get("attention.head_count_kv", c.num_kv_heads, false),
        get("context_length", c.max_position_embeddings, false),
        get("rope.dimension_count", c.head_dim, false), get("vocab_size", c.vocab_size, false),
        get("attention.key_length", key_length, gemma),
        get("attention.value_length", value_length, false),
        get("attention.sliding_window", c.sliding_window, false)})
    if (!r) return std::unexpected(r.error());
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  if (key_length > 0) {
    if (value_length > 0 && value_length != key_length)
      return make_error(errc::unsupported_op, src + ": attention.key_length " +
                                                  std::to_string(key_length) + " != value_length " +
                                                  std::to_string(value_length));
    if (c.head_dim > 0 && c.head_dim != key_length)
      return make_error(errc::unsupported_op,
                        src + ": partial RoPE (rope.dimension_count " + std::to_string(c.head_dim) +
                            " of head size " + std::to_string(key_length) + ") is not supported");
    c.head_dim = key_length;
  }
  if (c.head_dim == 0 && c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  if (key_length == 0 && c.num_heads > 0 && c.head_dim != c.hidden_size / c.num_heads)
    return make_error(errc::unsupported_op, src + ": partial RoPE (rope.dimension_count " +
                                                std::to_string(c.head_dim) + " of head size " +
                                                std::to_string(c.hidden_size / c.num_heads) +
                                                ") is not supported");
  if (c.vocab_size == 0) {
    if (const auto* toks = f.find("tokenizer.ggml.tokens"); toks && toks->as_array())
      c.vocab_size = static_cast<std::int64_t>(toks->as_array()->size());
  }
  if (const auto* v = f.find(pre + "attention.layer_norm_rms_epsilon"); v && v->as_float())
    c.rms_norm_eps = *v->as_float();
  if (const auto* v = f.find(pre + "rope.freq_base"); v && v->as_float())
    c.rope_theta = *v->as_float();
  if (const auto* v = f.find(pre + "rope.scaling.type"); v && v->as_string()) {
    const std::string& type = *v->as_string();
    if (type == "linear" || type == "yarn") {
      c.scaling.type = type == "linear" ? rope_scaling::kind::linear : rope_scaling::kind::yarn;
      if (const auto* fct = f.find(pre + "rope.scaling.factor"); fct && fct->as_float())
        c.scaling.factor = *fct->as_float();
      if (type == "yarn") {
        // llama.cpp: the pretraining length, and an optional attention factor
        // that multiplies YaRN's own (1 + 0.1 ln factor).
        std::int64_t orig = c.max_position_embeddings;
        if (auto r = get("rope.scaling.original_context_length", orig, false); !r)
          return std::unexpected(r.error());
        c.scaling.original_max_position_embeddings = orig;
        if (const auto* af = f.find(pre + "rope.scaling.attn_factor"); af && af->as_float())
          c.scaling.attention_factor =
              *af->as_float() *
              (c.scaling.factor > 1 ? 0.1 * std::log(c.scaling.factor) + 1.0 : 1.0);
        for (const char* k : {"rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                              "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_log_multiplier"})
          if (f.find(pre + k))
            return make_error(errc::unsupported_op,
                              src + ": " + pre + k + " is not read (YaRN with its defaults only)");
      }
    } else if (type != "none") {
      return make_error(errc::unsupported_op, src + ": rope scaling '" + type +
                                                  "' is not supported (none, linear, yarn)");
    }
  }
  for (auto [key, out] : {std::pair{"attn_logit_softcapping", &c.attn_softcap},
                          std::pair{"final_logit_softcapping", &c.final_softcap}})
    if (const auto* v = f.find(pre + key)) {
      if (a != "gemma2")  // llama.cpp reads them for Gemma 2 only
        return make_error(errc::unsupported_op,
                          src + ": " + pre + key + " (logit soft-capping) is not read for " + a);
      if (!v->as_float())
        return make_error(errc::corrupt_data, src + ": " + pre + key + " must be a number");
      *out = *v->as_float();
    }
  if (a == "qwen2") {
    c.family = decoder_family::qwen2;
    c.qkv_bias = true;
    c.sliding_window = 0;  // llama.cpp runs Qwen2 without a window
  } else if (a == "phi3") {
    // llama.cpp's phi3 keeps q, k, v in attn_qkv and gate, up in ffn_up.
    // A window in the file is applied, as transformers applies it (llama.cpp
    // currently disables Phi-3's window). longrope files carry per-frequency
    // factors troupe does not apply: refused.
    c.family = decoder_family::phi3;
    c.fused_qkv = true;
    if (f.find_tensor("rope_factors_long.weight") || f.find_tensor("rope_factors_short.weight")) {
      // longrope, as llama.cpp's converter writes it: the factor tensors
      // (the short ones are read at load), the attention factor and the
      // original context.
      if (!f.find_tensor("rope_factors_short.weight"))
        return make_error(errc::corrupt_data,
                          src + ": rope_factors_long without rope_factors_short");
      c.scaling.type = rope_scaling::kind::longrope;
      std::int64_t orig = 0;
      if (auto r = get("rope.scaling.original_context_length", orig, true); !r)
        return std::unexpected(r.error());
      if (orig < 2)
        return make_error(errc::corrupt_data, src + ": rope.scaling.original_context_length < 2");
      c.scaling.original_max_position_embeddings = orig;
      c.scaling.attention_factor = 1.0;
      if (const auto* af = f.find(pre + "rope.scaling.attn_factor"); af && af->as_float())
        c.scaling.attention_factor = *af->as_float();
      if (!(c.scaling.attention_factor > 0 && c.scaling.attention_factor < 100))
        return make_error(errc::corrupt_data, src + ": rope.scaling.attn_factor out of range");
      c.max_position_embeddings = std::min(c.max_position_embeddings, orig);
    }
  } else if (!gemma) {
    c.sliding_window = 0;  // llama.cpp's llama has no window
  }
  if (gemma) {
    // What llama.cpp hard-codes for Gemma: a window on every other layer
    // (Gemma 2) or on 5 of 6 (Gemma 3, whose windowed layers have a RoPE base
    // of 10k), embeddings scaled by sqrt(hidden), and an attention scale of
    // 1/sqrt(head_dim) except for the 27B models (46 layers for Gemma 2, 62
    // for Gemma 3), which use 1/sqrt(hidden / heads). The converter has
    // already added Gemma's +1 to the norm weights.
    const bool g3 = a == "gemma3";
    if (!g3 && c.sliding_window == 0) c.sliding_window = 4096;  // llama.cpp's Gemma 2 default
    c.family = g3 ? decoder_family::gemma3 : decoder_family::gemma2;
    c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
    c.qk_norm = g3;
    c.sandwich_norms = true;
    c.gelu_ffn = true;
    c.sliding_pattern = g3 ? 6 : 2;
    if (g3) c.rope_local_theta = 10000.0;
    if (c.num_layers == (g3 ? 62 : 46) && c.num_heads > 0)
      c.attn_scale = 1.0 / std::sqrt(static_cast<double>(c.hidden_size / c.num_heads));
  }
  if (const auto* v = f.find("tokenizer.ggml.bos_token_id"); v && v->as_int())
    c.bos_token_ids = {*v->as_int()};
  if (const auto* v = f.find("tokenizer.ggml.eos_token_id"); v && v->as_int())
    c.eos_token_ids = {*v->as_int()};
  // The end of a turn, where the file names it (llama.cpp stops there too),
  // and the turn ends of the chat formats the file carries no id for.
  auto add_stop = [&](std::int64_t id) {
    if (std::find(c.eos_token_ids.begin(), c.eos_token_ids.end(), id) == c.eos_token_ids.end())
      c.eos_token_ids.push_back(id);
  };
  if (const auto* v = f.find("tokenizer.ggml.eot_token_id"); v && v->as_int())
    add_stop(*v->as_int());
  const char* turn_end = gemma ? "<end_of_turn>" : a == "phi3" ? "<|end|>" : nullptr;
  if (turn_end)
    if (const auto* toks = f.find("tokenizer.ggml.tokens"); toks && toks->as_array()) {
      const auto& s = toks->as_array()->strings;
      for (std::size_t i = 0; i < s.size(); ++i)
        if (s[i] == turn_end) add_stop(static_cast<std::int64_t>(i));
    }
  c.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;
  if (auto r = c.validate(src); !r) return std::unexpected(r.error());
  return c;
}

yarn_rope compute_yarn(const rope_scaling& s, double theta, std::int64_t head_dim) {
  // transformers' _compute_yarn_parameters, the float32 steps in float32.
  auto get_mscale = [](double scale, double m) {
    return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
  };
  yarn_rope y;
  const double factor = s.factor;
  if (s.attention_factor > 0)
    y.attention_factor = s.attention_factor;
  else if (s.mscale != 0 && s.mscale_all_dim != 0)
    y.attention_factor = get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim);
  else
    y.attention_factor = get_mscale(factor, 1.0);
  const double dim = static_cast<double>(head_dim);
  const double pi = std::acos(-1.0);
  auto correction_dim = [&](double rotations) {
    return dim *
           std::log(static_cast<double>(s.original_max_position_embeddings) /
                    (rotations * 2 * pi)) /
           (2 * std::log(theta));
  };
  double low = correction_dim(s.beta_fast), high = correction_dim(s.beta_slow);
  if (s.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, dim - 1);
  if (low == high) high += 0.001;
  const std::int64_t half = head_dim / 2;
  y.divisors.resize(static_cast<std::size_t>(half));
  for (std::int64_t i = 0; i < half; ++i) {
    const float pos_freq = std::pow(static_cast<float>(theta),
                                    static_cast<float>(2 * i) / static_cast<float>(head_dim));
    const float extrap = 1.0f / pos_freq;
    const float interp = 1.0f / (static_cast<float>(factor) * pos_freq);
    const float ramp = std::clamp(
        (static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low), 0.0f,
        1.0f);
    const float e = 1.0f - ramp;  // the extrapolated share
    const float inv = interp * (1.0f - e) + extrap * e;
    y.divisors[static_cast<std::size_t>(i)] =
        static_cast<float>(static_cast<double>(extrap) / static_cast<double>(inv));
  }
  return y;
}

result<generation_defaults> parse_generation_config(std::string_view text, const std::string& src) {
  json j = json::parse(text.begin(), text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return make_error(errc::corrupt_data, src + ": not a JSON object");
  generation_defaults g;
  for (auto [k, out] :
       {std::pair{"temperature", &g.temperature}, std::pair{"top_p", &g.top_p},
        std::pair{"min_p", &g.min_p}, std::pair{"repetition_penalty", &g.repetition_penalty}}) {
    double v = 0;
    auto r = get_float(j, k, v, src);
    if (!r) return std::unexpected(r.error());
    if (*r) *out = v;
  }
  for (auto [k, out] :
       {std::pair{"top_k", &g.top_k}, std::pair{"max_new_tokens", &g.max_new_tokens}}) {
    std::int64_t v = 0;
    auto r = get_int(j, k, v, src);
    if (!r) return std::unexpected(r.error());
    if (*r) *out = v;
  }
  if (auto it = j.find("do_sample"); it != j.end() && it->is_boolean())
    g.do_sample = it->get<bool>();
  auto eos = get_ids(j, "eos_token_id", src);
  if (!eos) return std::unexpected(eos.error());
  g.eos_token_ids = *eos;
  if (g.temperature && *g.temperature < 0)
    return make_error(errc::corrupt_data, field_error(src, "temperature", "must be >= 0"));
  if (g.top_p && (*g.top_p <= 0 || *g.top_p > 1))
    return make_error(errc::corrupt_data, field_error(src, "top_p", "must be in (0, 1]"));
  if (g.top_k && *g.top_k < 0)
    return make_error(errc::corrupt_data, field_error(src, "top_k", "must be >= 0"));
  return g;
}

result<generation_defaults> load_generation_config(const std::string& path) {
  auto text = read_text_file(path);
  if (!text) {
    if (text.error().code == errc::not_found) return generation_defaults{};
    return std::unexpected(text.error());
  }
  return parse_generation_config(*text, path);
}

}  // namespace troupe::models
