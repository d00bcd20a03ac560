#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/device.hpp"
#include "kernels/memory_pool.hpp"
#include "kernels/quant.hpp"
#include "models/gguf.hpp"
#include "models/quant_mix.hpp"
#include "models/safetensors.hpp"

namespace troupe::models {

/// Where a checkpoint's tensors come from: a Hugging Face folder
/// (safetensors) or a GGUF file. Tensors are found by canonical name
/// ("embed_tokens", "layers.3.q_proj", "layers.3.input_norm", "norm",
/// "lm_head", ...), whatever the file calls them.
///
/// A LLaVA checkpoint's decoder tensors keep those names (the file's
/// `language_model.model.` or `model.language_model.` prefix is added); its
/// vision tower and projector use the component prefixes `vision.` and
/// `projector.`: "vision.patch_embedding", "vision.class_embedding",
/// "vision.position_embedding", "vision.pre_norm", "vision.layers.N.{q,k,v,o}_proj",
/// "vision.layers.N.{norm1,norm2,fc1,fc2}", "projector.linear_{1,2}"; a ".bias"
/// suffix names the bias (else the weight). The file may say
/// `vision_tower.vision_model.` / `multi_modal_projector.` (transformers < 4.52)
/// or the same under `model.`.
///
/// A Whisper audio encoder uses `audio.`: "audio.conv1", "audio.conv2",
/// "audio.positions", "audio.norm", "audio.layers.N.{q,k,v,o}_proj",
/// "audio.layers.N.{norm1,norm2,fc1,fc2}", found under `model.encoder.`
/// (a Whisper checkpoint), `encoder.`, `audio_tower.` (Qwen2-Audio, troupe's
/// audio models) or no prefix (a bare WhisperEncoder); its projector is
/// "audio_projector.linear_{1,2}".
class weight_source {
 public:
  /// `path`: a GGUF file, or a folder / .safetensors file / index of a HF checkpoint.
  static result<std::unique_ptr<weight_source>> open(const std::string& path);

  bool is_gguf() const { return gguf_.has_value(); }
  const gguf_file* gguf() const { return gguf_ ? &*gguf_ : nullptr; }
  /// A zero-copy view of a canonical tensor; not_found if absent.
  result<kernels::tensor> get(const std::string& canonical) const;
  bool has(const std::string& canonical) const;
  /// The file's own name for a canonical name (for messages).
  std::string file_name(const std::string& canonical) const;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::string hf_prefix_;            ///< "" or "language_model." (LLaVA)
  bool llava_model_prefix_ = false;  ///< decoder under model.language_model. (transformers >= 4.52)
  std::string vision_prefix_ = "vision_tower.vision_model.";
  std::string projector_prefix_ = "multi_modal_projector.";
  std::string audio_prefix_ = "audio_tower.";
  std::optional<gguf_file> gguf_;
  std::optional<safetensors_model> st_;
};

/// Per-tensor precision choice: a default and `pattern=format` overrides
/// (glob patterns on canonical names, e.g. "layers.0.*=f16"). Components
/// of a LLaVA model are told apart by prefix: "vision.*" (vision tower),
/// "projector.*", and "text.*", which matches the decoder's tensors (the
/// canonical names without a component prefix), e.g. "text.*=q4_0".
struct quant_plan {
  std::optional<kernels::weight_format> default_format;  ///< none: keep the file's
  /// llama.cpp's per-tensor mix (--quant q4_k_m): each decoder matrix in the
  /// format llama.cpp's quantizer picks; other matrices in the mix's base
  /// format. Set instead of default_format.
  std::optional<gguf_mix> mix;
  int int4_group = 32;
  std::vector<std::pair<std::string, kernels::weight_format>> overrides;

  /// Parses "pattern=format".
  result<void> add_override(const std::string& spec);
  /// The format for `canonical` ([rows, cols], stored as `stored`): the last
  /// matching override, else the mix's choice (for a decoder matrix, given
  /// `model`; `role` names the matrix the mix judges, the fused tensor where
  /// one is split, else `canonical`), else default_format, else the stored
  /// format; then llama.cpp's fallback (shape_fallback) where the format's
  /// blocks do not divide `cols`.
  kernels::weight_format choose(const std::string& canonical, kernels::dtype stored,
                                std::int64_t cols, const mix_model* model = nullptr,
                                const std::string& role = {}) const;
};

/// Converts a stored tensor (f32/f16/bf16/q8_0/q4_0, 2-D [rows, cols]) into
/// `format`, reusing GGUF blocks unchanged when the format already matches.
result<kernels::weight_matrix> convert_weight(kernels::memory_pool& pool,
                                              const kernels::tensor& stored,
                                              kernels::weight_format format, int int4_group);

/// Converts a stored 1-D tensor (norm weights) to a dense f32 copy.
result<kernels::tensor> to_f32(kernels::memory_pool& pool, const kernels::tensor& stored);
/// The same copy in `dev`'s memory (converted on the host, then written).
result<kernels::tensor> to_f32(kernels::device& dev, const kernels::tensor& stored);

}  // namespace troupe::models
