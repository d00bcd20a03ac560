#include "models/weights.hpp"

#include <fnmatch.h>
#include <sys/stat.h>

#include <cstring>
#include <regex>
#include <span>
#include <string_view>

namespace troupe::models {

using kernels::dtype;
using kernels::weight_format;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// canonical -> GGUF name
std::string gguf_name(const std::string& c) {
  static const std::pair<const char*, const char*> top[] = {
      {"embed_tokens", "token_embd.weight"},
      {"norm", "output_norm.weight"},
      {"lm_head", "output.weight"},
      {"rope_freqs", "rope_freqs.weight"},
      {"rope_factors_short", "rope_factors_short.weight"}};
  for (auto [a, b] : top)
    if (c == a) return b;
  static const std::pair<const char*, const char*> per_layer[] = {
      {"q_proj", "attn_q.weight"},
      {"k_proj", "attn_k.weight"},
      {"v_proj", "attn_v.weight"},
      {"o_proj", "attn_output.weight"},
      {"gate_proj", "ffn_gate.weight"},
      {"up_proj", "ffn_up.weight"},
      {"down_proj", "ffn_down.weight"},
      {"input_norm", "attn_norm.weight"},
      {"post_norm", "ffn_norm.weight"},
      {"q_norm", "attn_q_norm.weight"},
      {"k_norm", "attn_k_norm.weight"},
      {"attn_out_norm", "post_attention_norm.weight"},
      {"ffn_out_norm", "post_ffw_norm.weight"},
      {"pre_ffn_norm", "ffn_norm.weight"},
      {"qkv_proj", "attn_qkv.weight"},
      {"gate_up_proj", "ffn_up.weight"}};
  if (c.rfind("layers.", 0) == 0) {
    const auto dot = c.find('.', 7);
    if (dot != std::string::npos) {
      const std::string idx = c.substr(7, dot - 7);
      std::string leaf = c.substr(dot + 1);
      const bool bias = ends_with(leaf, ".bias");
      if (bias) leaf.resize(leaf.size() - 5);
      for (auto [a, b] : per_layer)
        if (leaf == a) {
          std::string name = "blk." + idx + "." + b;
          if (bias) name.replace(name.size() - 7, 7, ".bias");
          return name;
        }
    }
  }
  return c;
}

// canonical -> HF name (without the LLaVA prefix)
std::string hf_name(const std::string& c) {
  if (c == "embed_tokens") return "model.embed_tokens.weight";
  if (c == "norm") return "model.norm.weight";
  if (c == "lm_head") return "lm_head.weight";
  if (c.rfind("layers.", 0) == 0) {
    const auto dot = c.find('.', 7);
    if (dot != std::string::npos) {
      const std::string idx = c.substr(7, dot - 7);
      std::string leaf = c.substr(dot + 1), suffix = ".weight";
      if (ends_with(leaf, ".bias")) {
        leaf.resize(leaf.size() - 5);
        suffix = ".bias";
      }
      const std::string base = "model.layers." + idx + ".";
      for (const char* a : {"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_norm", "k_norm"})
        if (leaf == a) return base + "self_attn." + leaf + suffix;
      for (const char* m : {"gate_proj", "up_proj", "down_proj", "gate_up_proj"})
        if (leaf == m) return base + "mlp." + leaf + suffix;
      // LLaMA's second norm is "post_attention_layernorm"; Gemma's norm of
      // that name is on the attention output, and its FFN input norm is
      // "pre_feedforward_layernorm".
      static const std::pair<const char*, const char*> norms[] = {
          {"input_norm", "input_layernorm"},
          {"post_norm", "post_attention_layernorm"},
          {"attn_out_norm", "post_attention_layernorm"},
          {"pre_ffn_norm", "pre_feedforward_layernorm"},
          {"ffn_out_norm", "post_feedforward_layernorm"}};
      for (auto [a, b] : norms)
        if (leaf == a) return base + b + suffix;
    }
  }
  return c;
}

using name_pair = std::pair<const char*, const char*>;

// A component's canonical name -> its HF name after the component prefix:
// `top` maps whole names, `per_layer` the leaves of "<layers>N.<leaf>",
// which become "<hf_layers>N.<its HF leaf>"; a ".bias" suffix names the
// bias, else the weight. Unknown names stay as they are.
std::string component_name(const std::string& c, std::span<const name_pair> top,
                           std::string_view layers, std::string_view hf_layers,
                           std::span<const name_pair> per_layer) {
  std::string base = c, suffix = ".weight";
  if (ends_with(base, ".bias")) {
    base.resize(base.size() - 5);
    suffix = ".bias";
  }
  for (auto [a, b] : top)
    if (base == a) return b + suffix;
  if (base.rfind(layers, 0) == 0) {
    const auto dot = base.find('.', layers.size());
    if (dot != std::string::npos) {
      const std::string idx = base.substr(layers.size(), dot - layers.size());
      const std::string leaf = base.substr(dot + 1);
      for (auto [a, b] : per_layer)
        if (leaf == a) return std::string(hf_layers) + idx + "." + b + suffix;
    }
  }
  return c;
}

// "vision.*" / "projector.*" canonical -> HF name after the component prefix.
std::string hf_component_name(const std::string& c) {
  if (c == "vision.class_embedding") return "embeddings.class_embedding";
  static const name_pair top[] = {{"vision.patch_embedding", "embeddings.patch_embedding"},
                                  {"vision.position_embedding", "embeddings.position_embedding"},
                                  {"vision.pre_norm", "pre_layrnorm"},
                                  {"vision.post_norm", "post_layernorm"},
                                  {"projector.linear_1", "linear_1"},
                                  {"projector.linear_2", "linear_2"}};
  static const name_pair per_layer[] = {{"q_proj", "self_attn.q_proj"},
                                        {"k_proj", "self_attn.k_proj"},
                                        {"v_proj", "self_attn.v_proj"},
                                        {"o_proj", "self_attn.out_proj"},
                                        {"norm1", "layer_norm1"},
                                        {"norm2", "layer_norm2"},
                                        {"fc1", "mlp.fc1"},
                                        {"fc2", "mlp.fc2"}};
  return component_name(c, top, "vision.layers.", "encoder.layers.", per_layer);
}

// "audio.*" canonical -> HF Whisper encoder name after the component prefix.
std::string hf_audio_name(const std::string& c) {
  static const name_pair top[] = {{"audio.conv1", "conv1"},
                                  {"audio.conv2", "conv2"},
                                  {"audio.positions", "embed_positions"},
                                  {"audio.norm", "layer_norm"}};
  static const name_pair per_layer[] = {{"q_proj", "self_attn.q_proj"},
                                        {"k_proj", "self_attn.k_proj"},
                                        {"v_proj", "self_attn.v_proj"},
                                        {"o_proj", "self_attn.out_proj"},
                                        {"norm1", "self_attn_layer_norm"},
                                        {"norm2", "final_layer_norm"},
                                        {"fc1", "fc1"},
                                        {"fc2", "fc2"}};
  return component_name(c, top, "audio.layers.", "layers.", per_layer);
}

}  // namespace

result<std::unique_ptr<weight_source>> weight_source::open(const std::string& path) {
  auto src = std::make_unique<weight_source>();
  src->path_ = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return make_error(errc::not_found, path + ": no such file or folder");
  if (S_ISREG(st.st_mode) && ends_with(path, ".gguf")) {
    auto g = gguf_file::open(path);
    if (!g) return std::unexpected(g.error());
    src->gguf_ = std::move(*g);
    return src;
  }
  auto m = safetensors_model::open(path);
  if (!m) return std::unexpected(m.error());
  src->st_ = std::move(*m);
  if (!src->st_->find("model.embed_tokens.weight") &&
      src->st_->find("language_model.model.embed_tokens.weight"))
    src->hf_prefix_ = "language_model.";
  // transformers >= 4.52 saves LLaVA as model.{language_model,vision_tower,multi_modal_projector}.
  if (!src->st_->find("model.embed_tokens.weight") &&
      src->st_->find("model.language_model.embed_tokens.weight"))
    src->llava_model_prefix_ = true;
  if (src->st_->find("model.vision_tower.vision_model.embeddings.patch_embedding.weight"))
    src->vision_prefix_ = "model.vision_tower.vision_model.";
  // transformers 5 drops the CLIP tower's "vision_model." level.
  for (const char* p : {"vision_tower.", "model.vision_tower."})
    if (src->st_->find(std::string(p) + "embeddings.patch_embedding.weight"))
      src->vision_prefix_ = p;
  if (src->st_->find("model.multi_modal_projector.linear_1.weight"))
    src->projector_prefix_ = "model.multi_modal_projector.";
  // A Whisper encoder: whole Whisper checkpoints (model.encoder.), Qwen2-Audio
  // and our own audio models (audio_tower.), a bare WhisperEncoder.
  for (const char* p : {"model.encoder.", "encoder.", "audio_tower.", "model.audio_tower.", ""})
    if (src->st_->find(std::string(p) + "conv1.weight")) {
      src->audio_prefix_ = p;
      break;
    }
  return src;
}

std::string weight_source::file_name(const std::string& canonical) const {
  if (gguf_) return gguf_name(canonical);
  if (canonical.rfind("vision.", 0) == 0) return vision_prefix_ + hf_component_name(canonical);
  if (canonical.rfind("projector.", 0) == 0)
    return projector_prefix_ + hf_component_name(canonical);
  if (canonical.rfind("audio.", 0) == 0) return audio_prefix_ + hf_audio_name(canonical);
  // LLaVA-NeXT's learned newline row (model.image_newline from transformers 4.52).
  if (canonical == "video.image_newline")
    return st_ && st_->find("model.image_newline") ? "model.image_newline" : "image_newline";
  if (canonical.rfind("audio_projector.", 0) == 0)
    return ends_with(canonical, ".bias") ? canonical : canonical + ".weight";
  const std::string name = hf_name(canonical);
  if (llava_model_prefix_ && name.rfind("model.", 0) == 0)
    return "model.language_model." + name.substr(6);
  return hf_prefix_ + name;
}

bool weight_source::has(const std::string& canonical) const {
  const auto name = file_name(canonical);
  return gguf_ ? gguf_->find_tensor(name) != nullptr : st_->find(name) != nullptr;
}

result<kernels::tensor> weight_source::get(const std::string& canonical) const {
  const auto name = file_name(canonical);
  if (gguf_) {
    const auto* t = gguf_->find_tensor(name);
    if (!t) return make_error(errc::not_found, path_ + ": tensor '" + name + "' is missing");
    return gguf_->view(*t);
  }
  const auto* t = st_->find(name);
  if (!t) return make_error(errc::not_found, path_ + ": tensor '" + name + "' is missing");
  return st_->view(*t);
}

result<void> quant_plan::add_override(const std::string& spec) {
  const auto eq = spec.rfind('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size())
    return make_error(errc::invalid_argument,
                      "quant override '" + spec + "' must look like PATTERN=FORMAT");
  auto f = kernels::quant_target_from_string(spec.substr(eq + 1));
  if (!f) return std::unexpected(f.error());
  overrides.emplace_back(spec.substr(0, eq), *f);
  return {};
}

weight_format quant_plan::choose(const std::string& canonical, dtype stored, std::int64_t cols,
                                 const mix_model* model, const std::string& role) const {
  // Decoder tensors (no component prefix) also answer to "text." + name.
  const bool decoder = canonical.rfind("vision.", 0) != 0 &&
                       canonical.rfind("projector.", 0) != 0 && canonical.rfind("audio.", 0) != 0 &&
                       canonical.rfind("audio_projector.", 0) != 0 &&
                       canonical.rfind("video.", 0) != 0;
  const std::string text_name = "text." + canonical;
  const auto pick = [&]() -> weight_format {
    for (auto it = overrides.rbegin(); it != overrides.rend(); ++it) {  // the last match wins
      if (::fnmatch(it->first.c_str(), canonical.c_str(), 0) == 0) return it->second;
      if (decoder && ::fnmatch(it->first.c_str(), text_name.c_str(), 0) == 0) return it->second;
    }
    if (mix)
      return decoder && model ? mix_format(*mix, role.empty() ? canonical : role, cols, *model)
                              : base_format(*mix);
    if (default_format) return *default_format;
    switch (stored) {
      case dtype::f16:
        return weight_format::f16;
      case dtype::bf16:
        return weight_format::bf16;
      default:
        // The GGUF block formats stay as the file holds them.
        if (auto f = kernels::block_format(stored)) return *f;
        return weight_format::f32;
    }
  };
  return shape_fallback(pick(), cols);
}

result<kernels::tensor> to_f32(kernels::memory_pool& pool, const kernels::tensor& stored) {
  auto out = kernels::tensor::empty(pool, dtype::f32, {stored.rows(), stored.cols()});
  if (!out) return out;
  for (std::int64_t r = 0; r < stored.rows(); ++r) {
    float* y = out->row_as<float>(r);
    const std::int64_t n = stored.cols();
    switch (stored.type()) {
      case dtype::f32:
        std::memcpy(y, stored.row(r), sizeof(float) * static_cast<std::size_t>(n));
        break;
      case dtype::f16:
        for (std::int64_t c = 0; c < n; ++c)
          y[c] = kernels::to_f32(stored.row_as<kernels::f16>(r)[c]);
        break;
      case dtype::bf16:
        for (std::int64_t c = 0; c < n; ++c)
          y[c] = kernels::to_f32(stored.row_as<kernels::bf16>(r)[c]);
        break;
      case dtype::q8_0:
        kernels::dequantize_row_q8_0(stored.row_as<kernels::block_q8_0>(r), y, n);
        break;
      case dtype::q4_0:
        kernels::dequantize_row_q4_0(stored.row_as<kernels::block_q4_0>(r), y, n);
        break;
      case dtype::q4_1:
      case dtype::q5_0:
      case dtype::q5_1:
      case dtype::q2_k:
      case dtype::q3_k:
      case dtype::q4_k:
      case dtype::q5_k:
      case dtype::q6_k:
      case dtype::iq4_nl:
      case dtype::iq4_xs:
        kernels::dequantize_row_blocks(stored.type(), stored.row(r), y, n);
        break;
      default:
        return make_error(
            errc::unsupported_dtype,
            "cannot read weights stored as " + std::string(kernels::to_string(stored.type())));
    }
  }
  return out->reshape(stored.shape());
}

result<kernels::tensor> to_f32(kernels::device& dev, const kernels::tensor& stored) {
  if (dev.host_visible()) return to_f32(dev.memory(), stored);
  auto host = to_f32(*kernels::memory_pool::create(), stored);
  if (!host) return host;
  auto out = kernels::tensor::empty(dev.memory(), dtype::f32, host->shape());
  if (!out) return out;
  auto bytes =
      std::span<const std::byte>(static_cast<const std::byte*>(host->data()), host->nbytes());
  if (auto r = dev.write(*out, bytes); !r) return std::unexpected(r.error());
  return out;
}

result<kernels::weight_matrix> convert_weight(kernels::memory_pool& pool,
                                              const kernels::tensor& stored, weight_format format,
                                              int int4_group) {
  if (stored.ndim() != 2)
    return make_error(errc::shape_mismatch,
                      "weight matrices must be 2-D, got " + stored.shape().to_string());
  // Same block format: take the bytes as they are (a copy out of the map).
  if (kernels::block_dtype(format) == stored.type()) {
    auto copy = kernels::tensor::empty(pool, stored.type(), stored.shape());
    if (!copy) return std::unexpected(copy.error());
    std::memcpy(copy->data(), stored.data(), stored.nbytes());
    kernels::weight_matrix w;
    w.format = format;
    w.rows = stored.dim(0);
    w.cols = stored.dim(1);
    w.data = std::move(*copy);
    return w;
  }
  auto f32 = to_f32(pool, stored);
  if (!f32) return std::unexpected(f32.error());
  return kernels::quantize(pool, *f32, format, int4_group);
}

}  // namespace troupe::models
