#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "kernels/quant.hpp"

namespace troupe::models {

/// llama.cpp's quantization "file types" that mix formats per tensor, as
/// `llama-quantize` names them (Q4_K_M, ...). Quantizing to one of them,
/// troupe picks each matrix's format the way llama.cpp's quantizer does for
/// a dense (not mixture-of-experts) model without an importance matrix, and
/// the formats' own quantizers give llama.cpp's bytes (kernels/quant_k.cpp).
enum class gguf_mix : std::uint8_t {
  q2_k,
  q3_k_s,
  q3_k_m,
  q3_k_l,
  q4_k_s,
  q4_k_m,
  q5_k_s,
  q5_k_m,
  q6_k,
  iq4_nl,
  iq4_xs,
};

/// "q4_k_m" -> gguf_mix::q4_k_m (case-insensitive); nullopt for other names.
std::optional<gguf_mix> gguf_mix_from_string(std::string_view name);
std::string_view to_string(gguf_mix m);
/// The format a mix uses where it has no rule for a tensor (Q4_K for Q4_K_M).
kernels::weight_format base_format(gguf_mix m);

/// What llama.cpp's choice depends on besides the tensor itself.
struct mix_model {
  std::int64_t num_layers = 0;
  std::int64_t num_heads = 1;
  std::int64_t num_kv_heads = 1;
  bool tied_output = false;  ///< the output matrix is the token embedding
  bool llama_70b = false;    ///< llama.cpp's 70B type (LLaMA, 80 layers, grouped KV)
};

/// The format llama.cpp's quantizer writes a matrix in under `mix`. `role`
/// is the matrix's canonical name ("embed_tokens", "lm_head",
/// "layers.N.v_proj", ...; a fused Phi-3 "layers.N.qkv_proj" counts as one
/// attention-value matrix, "gate_up_proj" as FFN up), `cols` its row length.
/// Matrices outside the decoder take the mix's base format. The choice then
/// goes through shape_fallback.
kernels::weight_format mix_format(gguf_mix mix, const std::string& role, std::int64_t cols,
                                  const mix_model& model);

/// llama.cpp's fallback for a row length the format's blocks do not divide:
/// Q2_K, Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS ->
/// IQ4_NL, and F16 where even that does not divide. Other formats (and
/// lengths that divide) are returned as they are.
kernels::weight_format shape_fallback(kernels::weight_format f, std::int64_t cols);

}  // namespace troupe::models
