#include "models/llava_config.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

namespace troupe::models {

using json = nlohmann::json;

namespace {

std::string field_error(const std::string& source, const std::string& field,
                        const std::string& what) {
  return source + ": " + field + " " + what;
}

// An optional integer field; null or absent keeps `out`.
result<void> get_int(const json& j, const char* key, std::int64_t& out, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_number_integer())
    return make_error(errc::corrupt_data, field_error(src, key, "must be an integer"));
  out = it->get<std::int64_t>();
  return {};
}

result<void> get_float(const json& j, const char* key, double& out, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_number())
    return make_error(errc::corrupt_data, field_error(src, key, "must be a number"));
  out = it->get<double>();
  if (!std::isfinite(out))
    return make_error(errc::corrupt_data, field_error(src, key, "must be finite"));
  return {};
}

result<void> get_string(const json& j, const char* key, std::string& out, const std::string& src) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_string())
    return make_error(errc::corrupt_data, field_error(src, key, "must be a string"));
  out = it->get<std::string>();
  return {};
}

result<void> range(const std::string& src, const char* name, std::int64_t v, std::int64_t lo,
                   std::int64_t hi) {
  if (v < lo || v > hi)
    return make_error(errc::corrupt_data,
                      field_error(src, name,
                                  "= " + std::to_string(v) + " is outside [" + std::to_string(lo) +
                                      ", " + std::to_string(hi) + "]"));
  return {};
}

result<clip_vision_config> parse_vision(const json& j, const std::string& src) {
  clip_vision_config c;
  std::string model_type;
  if (auto r = get_string(j, "model_type", model_type, src); !r) return std::unexpected(r.error());
  if (!model_type.empty() && model_type != "clip_vision_model" &&
      model_type != "siglip_vision_model")
    return make_error(
        errc::unsupported_op,
        field_error(
            src, "model_type",
            "'" + model_type + "' is not supported (clip_vision_model, siglip_vision_model)"));
  std::string act = "quick_gelu";
  if (model_type == "siglip_vision_model") {  // SiglipVisionConfig's defaults
    c.siglip = true;
    c.patch_size = 16;
    c.layer_norm_eps = 1e-6;
    act = "gelu_pytorch_tanh";
  }
  for (auto [key, out] :
       {std::pair{"hidden_size", &c.hidden_size},
        std::pair{"intermediate_size", &c.intermediate_size},
        std::pair{"num_hidden_layers", &c.num_layers},
        std::pair{"num_attention_heads", &c.num_heads}, std::pair{"image_size", &c.image_size},
        std::pair{"patch_size", &c.patch_size}, std::pair{"num_channels", &c.num_channels}})
    if (auto r = get_int(j, key, *out, src); !r) return std::unexpected(r.error());
  if (auto r = get_float(j, "layer_norm_eps", c.layer_norm_eps, src); !r)
    return std::unexpected(r.error());
  if (auto r = get_string(j, "hidden_act", act, src); !r) return std::unexpected(r.error());
  auto kind = gelu_from_hf_name(act, src + ": hidden_act");
  if (!kind) return std::unexpected(kind.error());
  c.activation = *kind;
  if (c.num_heads > 0 && c.hidden_size % c.num_heads != 0)
    return make_error(errc::corrupt_data, field_error(src, "num_attention_heads",
                                                      "= " + std::to_string(c.num_heads) +
                                                          " does not divide hidden_size " +
                                                          std::to_string(c.hidden_size)));
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;
  if (auto r = c.validate(src); !r) return std::unexpected(r.error());
  return c;
}

// LlamaConfig's defaults for fields older transformers left out of a nested
// text_config (it saved only the differences from the class defaults).
json with_llama_defaults(const json& t) {
  json out = t;
  const std::pair<const char*, json> defaults[] = {
      {"vocab_size", 32000},     {"hidden_size", 4096},         {"intermediate_size", 11008},
      {"num_hidden_layers", 32}, {"num_attention_heads", 32},   {"max_position_embeddings", 2048},
      {"rms_norm_eps", 1e-6},    {"rope_theta", 10000.0},       {"bos_token_id", 1},
      {"eos_token_id", 2},       {"tie_word_embeddings", false}};
  for (const auto& [k, v] : defaults)
    if (!out.contains(k)) out[k] = v;
  out["architectures"] = json::array({"LlamaForCausalLM"});
  return out;
}

}  // namespace

result<kernels::gelu_kind> gelu_from_hf_name(std::string_view name, const std::string& field) {
  if (name == "gelu" || name == "gelu_python") return kernels::gelu_kind::erf;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast" ||
      name == "gelu_accurate")
    return kernels::gelu_kind::tanh;
  if (name == "quick_gelu") return kernels::gelu_kind::quick;
  return make_error(errc::unsupported_op,
                    field + " '" + std::string(name) +
                        "' is not supported (gelu, gelu_python, gelu_new, gelu_pytorch_tanh, "
                        "gelu_fast, gelu_accurate, quick_gelu)");
}

result<void> clip_vision_config::validate(const std::string& src) const {
  for (auto r : {range(src, "hidden_size", hidden_size, 1, 1 << 16),
                 range(src, "intermediate_size", intermediate_size, 1, 1 << 18),
                 range(src, "num_hidden_layers", num_layers, 1, 1024),
                 range(src, "num_attention_heads", num_heads, 1, 1024),
                 range(src, "head_dim", head_dim, 1, 1 << 14),
                 range(src, "image_size", image_size, 1, 1 << 14),
                 range(src, "patch_size", patch_size, 1, 1 << 14),
                 range(src, "num_channels", num_channels, 1, 64)})
    if (!r) return r;
  if (hidden_size != num_heads * head_dim)
    return make_error(errc::corrupt_data,
                      field_error(src, "num_attention_heads", "must divide hidden_size"));
  // A SigLIP convolution drops the pixels past the last whole patch (384 /
  // 14 gives 27 patches a side); CLIP configs divide evenly.
  if (!siglip && image_size % patch_size != 0)
    return make_error(errc::corrupt_data,
                      field_error(src, "patch_size",
                                  "= " + std::to_string(patch_size) +
                                      " does not divide image_size " + std::to_string(image_size)));
  if (positions() > (1 << 20))
    return make_error(errc::corrupt_data, field_error(src, "image_size / patch_size",
                                                      "gives " + std::to_string(num_patches()) +
                                                          " patches, more than 2^20 - 1"));
  if (!(layer_norm_eps > 0 && layer_norm_eps < 1))
    return make_error(errc::corrupt_data, field_error(src, "layer_norm_eps", "must be in (0, 1)"));
  return {};
}

std::int64_t llava_config::vision_layers_used() const {
  return vision_feature_layer >= 0 ? vision_feature_layer
                                   : vision.num_layers + 1 + vision_feature_layer;
}

std::int64_t llava_config::tokens_per_image() const {
  return vision.positions() - (select == vision_select::full ? 0 : 1);
}

std::int64_t llava_config::patch_grid() const {
  return vision.image_size / std::max<std::int64_t>(vision.patch_size, 1);
}

std::int64_t llava_config::tokens_per_frame() const {
  if (!video || video->pool_stride < 1) return 0;
  const std::int64_t side = patch_grid() / video->pool_stride;
  return side * side + (video->frame_newline ? 1 : 0);
}

std::int64_t audio_tower_config::tokens_for_samples(std::int64_t samples) const {
  const std::int64_t window = window_samples(), hop = features.hop_length;
  if (samples <= 0 || window <= 0 || hop <= 0) return 0;
  auto tokens = [&](std::int64_t n) {
    const std::int64_t frames = n / hop;
    return frames > 0 ? projector.tokens_for((frames + 1) / 2) : 0;
  };
  return (samples / window) * tokens(window) + tokens(samples % window);
}

result<void> llava_config::validate(const std::string& src) const {
  if (auto r = vision.validate(src + " vision_config"); !r) return r;
  if (auto r = text.validate(src + " text_config"); !r) return r;
  if (vision_feature_layer < -(vision.num_layers + 1) || vision_feature_layer > vision.num_layers)
    return make_error(
        errc::corrupt_data,
        field_error(src, "vision_feature_layer",
                    "= " + std::to_string(vision_feature_layer) + " is outside [" +
                        std::to_string(-(vision.num_layers + 1)) + ", " +
                        std::to_string(vision.num_layers) + "] (the vision tower has " +
                        std::to_string(vision.num_layers) + " layers)"));
  if (image_token_index < 0 || image_token_index >= text.vocab_size)
    return make_error(errc::corrupt_data, field_error(src, "image_token_index",
                                                      "= " + std::to_string(image_token_index) +
                                                          " is outside the text vocabulary [0, " +
                                                          std::to_string(text.vocab_size) + ")"));
  if (audio) {
    if (auto r = audio->encoder.validate(src + " audio_config"); !r) return r;
    if (auto r = audio->projector.validate(src); !r) return r;
    if (auto r = models::validate(audio->features); !r) return r;
    // Its positions always take audio rows, never an embedding: it may be
    // a tokenizer's added token past the decoder's rows (it is then never
    // sampled either).
    if (audio->token_index < 0 || audio->token_index > std::numeric_limits<std::int32_t>::max() ||
        audio->token_index == image_token_index)
      return make_error(errc::corrupt_data,
                        field_error(src, "audio_token_index",
                                    "= " + std::to_string(audio->token_index) +
                                        " must be a token id other than image_token_index"));
  }
  if (video) {
    const std::string ids = std::to_string(video->token_index);
    if (video->token_index < 0 || video->token_index > std::numeric_limits<std::int32_t>::max() ||
        video->token_index == image_token_index ||
        (audio && video->token_index == audio->token_index))
      return make_error(errc::corrupt_data,
                        field_error(src, "video_token_index",
                                    "= " + ids +
                                        " must be a token id other than image_token_index and "
                                        "audio_token_index"));
    if (select == vision_select::full)
      return make_error(errc::unsupported_op,
                        field_error(src, "video_token_index",
                                    "video needs the patch grid without CLS "
                                    "(vision_feature_select_strategy \"default\")"));
    if (video->pool_stride < 1 || video->pool_stride > patch_grid())
      return make_error(errc::corrupt_data,
                        field_error(src, "spatial_pool_stride",
                                    "= " + std::to_string(video->pool_stride) + " is outside [1, " +
                                        std::to_string(patch_grid()) +
                                        "] (the side of the vision tower's patch grid)"));
  }
  return {};
}

bool is_llava_config(std::string_view text) {
  json root = json::parse(text.begin(), text.end(), nullptr, false);
  if (root.is_discarded() || !root.is_object()) return false;
  if (auto m = root.find("model_type"); m != root.end() && m->is_string() && *m == "llava")
    return true;
  if (auto a = root.find("architectures"); a != root.end() && a->is_array())
    for (const auto& e : *a)
      if (e.is_string() && e == "LlavaForConditionalGeneration") return true;
  return false;
}

result<llava_config> parse_llava_config(std::string_view text, const std::string& src) {
  json root = json::parse(text.begin(), text.end(), nullptr, false);
  if (root.is_discarded() || !root.is_object())
    return make_error(errc::corrupt_data, src + ": not a JSON object");
  if (!is_llava_config(text))
    return make_error(errc::unsupported_op,
                      src +
                          ": not a LLaVA config (architectures LlavaForConditionalGeneration "
                          "or model_type llava)");
  llava_config c;
  auto v = root.find("vision_config");
  if (v == root.end() || !v->is_object())
    return make_error(errc::corrupt_data, src + ": vision_config is missing or not an object");
  auto t = root.find("text_config");
  if (t == root.end() || !t->is_object())
    return make_error(errc::corrupt_data, src + ": text_config is missing or not an object");
  auto vision = parse_vision(*v, src + " vision_config");
  if (!vision) return std::unexpected(vision.error());
  c.vision = *vision;
  std::string text_type;
  if (auto r = get_string(*t, "model_type", text_type, src + " text_config"); !r)
    return std::unexpected(r.error());
  // LLaMA text configs of older transformers saved only the differences
  // from LlamaConfig's defaults; Qwen2 and Mistral ones are read as written.
  json text_json = *t;
  if (text_type.empty() || text_type == "llama") {
    text_json = with_llama_defaults(*t);
  } else if (text_type == "qwen2" || text_type == "mistral") {
    text_json["architectures"] =
        json::array({text_type == "qwen2" ? "Qwen2ForCausalLM" : "MistralForCausalLM"});
  } else {
    return make_error(errc::unsupported_op, src + " text_config: model_type '" + text_type +
                                                "' is not supported (llama, mistral, qwen2)");
  }
  auto llama = parse_llama_config(text_json.dump(), src + " text_config");
  if (!llama) return std::unexpected(llama.error());
  c.text = *llama;
  c.text.architecture = "LlavaForConditionalGeneration";

  if (auto r = get_int(root, "image_token_index", c.image_token_index, src); !r)
    return std::unexpected(r.error());
  if (auto it = root.find("vision_feature_layer"); it != root.end() && it->is_array())
    return make_error(errc::unsupported_op,
                      field_error(src, "vision_feature_layer",
                                  "as a list (several layers concatenated) is not supported"));
  if (auto r = get_int(root, "vision_feature_layer", c.vision_feature_layer, src); !r)
    return std::unexpected(r.error());
  std::string strategy = "default";
  if (auto r = get_string(root, "vision_feature_select_strategy", strategy, src); !r)
    return std::unexpected(r.error());
  if (strategy == "default") {
    c.select = vision_select::drop_cls;
  } else if (strategy == "full") {
    c.select = vision_select::full;
  } else {
    return make_error(errc::corrupt_data,
                      field_error(src, "vision_feature_select_strategy",
                                  "'" + strategy + "' is not one of default, full"));
  }
  std::string act = "gelu";
  if (auto r = get_string(root, "projector_hidden_act", act, src); !r)
    return std::unexpected(r.error());
  auto kind = gelu_from_hf_name(act, src + ": projector_hidden_act");
  if (!kind) return std::unexpected(kind.error());
  c.projector_activation = *kind;
  if (auto it = root.find("multimodal_projector_bias"); it != root.end() && !it->is_null()) {
    if (!it->is_boolean())
      return make_error(errc::corrupt_data,
                        field_error(src, "multimodal_projector_bias", "must be a boolean"));
    c.projector_bias = it->get<bool>();
  }
  if (auto a = root.find("audio_config"); a != root.end() && !a->is_null()) {
    auto enc = parse_whisper_encoder_config(text, src);
    if (!enc) return std::unexpected(enc.error());
    audio_tower_config at;
    at.encoder = *enc;
    at.projector.out = c.text.hidden_size;
    at.projector.hidden = c.text.hidden_size;
    if (auto it = root.find("audio_token_index"); it == root.end() || !it->is_number_integer())
      return make_error(
          errc::corrupt_data,
          field_error(src, "audio_token_index", "must be an integer when audio_config is present"));
    for (auto [key, out] : {std::pair{"audio_token_index", &at.token_index},
                            std::pair{"audio_stack_factor", &at.projector.stack},
                            std::pair{"audio_projector_hidden", &at.projector.hidden}})
      if (auto r = get_int(root, key, *out, src); !r) return std::unexpected(r.error());
    std::string audio_act = "gelu";
    if (auto r = get_string(root, "audio_projector_hidden_act", audio_act, src); !r)
      return std::unexpected(r.error());
    auto ak = gelu_from_hf_name(audio_act, src + ": audio_projector_hidden_act");
    if (!ak) return std::unexpected(ak.error());
    at.projector.activation = *ak;
    if (auto it = root.find("audio_projector_bias"); it != root.end() && !it->is_null()) {
      if (!it->is_boolean())
        return make_error(errc::corrupt_data,
                          field_error(src, "audio_projector_bias", "must be a boolean"));
      at.projector.bias = it->get<bool>();
    }
    at.features.n_mels =
        static_cast<int>(std::clamp<std::int64_t>(at.encoder.num_mel_bins, 0, 512));
    at.features.n_samples = 0;
    c.audio = at;
  }
  if (auto it = root.find("video_token_index"); it != root.end() && !it->is_null()) {
    video_config vc;
    if (!it->is_number_integer())
      return make_error(errc::corrupt_data,
                        field_error(src, "video_token_index", "must be an integer"));
    if (auto r = get_int(root, "video_token_index", vc.token_index, src); !r)
      return std::unexpected(r.error());
    if (auto r = get_int(root, "spatial_pool_stride", vc.pool_stride, src); !r)
      return std::unexpected(r.error());
    std::string mode = "average";
    if (auto r = get_string(root, "spatial_pool_mode", mode, src); !r)
      return std::unexpected(r.error());
    if (mode == "average") {
      vc.pool = video_pool::average;
    } else if (mode == "max") {
      vc.pool = video_pool::max;
    } else {
      return make_error(
          errc::unsupported_op,
          field_error(src, "spatial_pool_mode", "'" + mode + "' is not supported (average, max)"));
    }
    if (auto n = root.find("video_frame_newline"); n != root.end() && !n->is_null()) {
      if (!n->is_boolean())
        return make_error(errc::corrupt_data,
                          field_error(src, "video_frame_newline", "must be a boolean"));
      vc.frame_newline = n->get<bool>();
    }
    c.video = vc;
  } else {
    for (const char* key : {"spatial_pool_stride", "spatial_pool_mode", "video_frame_newline"})
      if (root.contains(key))
        return make_error(errc::corrupt_data,
                          field_error(src, key, "is set but video_token_index is not"));
  }
  if (auto r = c.validate(src); !r) return std::unexpected(r.error());
  return c;
}

result<llava_config> load_llava_config(const std::string& path) {
  auto text = read_text_file(path);
  if (!text) return std::unexpected(text.error());
  return parse_llava_config(*text, path);
}

}  // namespace troupe::models
