#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "kernels/cpu/context.hpp"
#include "kernels/quant.hpp"
#include "kernels/tensor.hpp"

namespace troupe::kernels {

// Element-wise and per-row ops over f32 activations. Every op validates its
// arguments and returns an error instead of crashing; a tensor of any
// dimensionality (1..4, dense) is seen as [rows, cols] with cols its
// innermost extent. Work is split over rows only and each row is computed
// the same way whatever the batch or thread count, so results are
// bit-identical for a row alone, in any batch and with any team size.
// Outputs may alias an input of the same shape (in-place).

/// out[i, :] = row ids[i] of `table` ([vocab, hidden], any weight format),
/// dequantized. `ids`: i32 [n] (any shape, flattened); `out`: f32 [n, hidden].
/// An id outside [0, vocab) is an error and nothing is written.
result<void> embedding(cpu::context& ctx, const weight_matrix& table, const tensor& ids,
                       const tensor& out);

/// RMSNorm as Hugging Face's LlamaRMSNorm: y = w * (x / sqrt(mean(x^2) + eps)).
/// `weight`: f32 [cols].
result<void> rms_norm(cpu::context& ctx, const tensor& x, const tensor& weight, float eps,
                      const tensor& out);

/// LayerNorm over the last dim (biased variance, as torch.nn.LayerNorm).
/// `weight`, `bias`: f32 [cols].
result<void> layer_norm(cpu::context& ctx, const tensor& x, const tensor& weight,
                        const tensor& bias, float eps, const tensor& out);

/// Pairing of rotated elements.
enum class rope_layout : std::uint8_t {
  neox,      ///< HF rotate_half: x[i] with x[i + rot/2] (Llama in transformers)
  adjacent,  ///< GPT-J / Meta original / GGUF: x[2i] with x[2i+1]
};

/// LLaMA-3 frequency scaling (transformers' `_compute_llama3_parameters`).
struct rope_llama3_scaling {
  float factor = 8.0f;
  float low_freq_factor = 1.0f;
  float high_freq_factor = 4.0f;
  std::int64_t original_max_position_embeddings = 8192;
};

/// Rotary embedding parameters.
struct rope_params {
  rope_layout layout = rope_layout::neox;
  float theta = 10000.0f;  ///< base
  int rotary_dims = 0;     ///< rotated leading dims of each head (even); 0 = head_dim
  std::optional<rope_llama3_scaling> llama3;
  /// llama.cpp's per-frequency divisors (GGUF tensor rope_freqs.weight, how
  /// GGUF files carry LLaMA-3 scaling): inv_freq[i] /= freq_factors[i].
  /// Empty = none; else rotary_dims/2 finite positive values.
  std::vector<float> freq_factors;
};

/// Largest head_dim rope accepts.
constexpr int rope_max_head_dim = 1024;

/// The rotary dims' inverse frequencies (rotary_dims/2 floats into `out`),
/// computed in float32 exactly as transformers does:
/// 1 / (theta ** (float(arange(0, rot, 2)) / rot)), then the LLaMA-3 rule.
result<void> rope_inv_freq(const rope_params& params, int head_dim, std::span<float> out);

/// RoPE in place or into `out`: x f32 [tokens, heads, head_dim], one
/// non-negative position per token. The angle is float(pos) * inv_freq in
/// float32 (as transformers), cos/sin in float32 (libm, < 1 ulp); the
/// rotation runs in float32 (no FMA, the same on every ISA path). Dims past
/// rotary_dims pass through unchanged.
result<void> rope(cpu::context& ctx, const tensor& x, std::span<const std::int64_t> positions,
                  const rope_params& params, const tensor& out);
result<void> rope(cpu::context& ctx, const tensor& x, std::span<const std::int32_t> positions,
                  const rope_params& params, const tensor& out);
/// As above with positions an i32 tensor [tokens] (the tensor dtypes have no i64).
result<void> rope(cpu::context& ctx, const tensor& x, const tensor& positions,
                  const rope_params& params, const tensor& out);

/// y = x * sigmoid(x).
result<void> silu(cpu::context& ctx, const tensor& x, const tensor& out);

/// GELU variants.
enum class gelu_kind : std::uint8_t {
  tanh,   ///< 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
  erf,    ///< exact: 0.5 x (1 + erf(x / sqrt(2)))
  quick,  ///< x * sigmoid(1.702 x)
};
result<void> gelu(cpu::context& ctx, const tensor& x, gelu_kind kind, const tensor& out);

/// out = silu(gate) * up; all three the same shape ([rows, ffn]).
result<void> swiglu(cpu::context& ctx, const tensor& gate, const tensor& up, const tensor& out);

/// out = gelu_tanh(gate) * up (GeGLU); the GELU is gelu()'s, bit for bit.
result<void> geglu(cpu::context& ctx, const tensor& gate, const tensor& up, const tensor& out);

/// out = x * s (f32 rows; out may be x).
result<void> scale(cpu::context& ctx, const tensor& x, float s, const tensor& out);
/// out = c * tanh(x / c) over f32 rows (c > 0 and finite): Gemma 2's logit
/// soft-capping. Scalar std::tanh: the same bits on every ISA.
result<void> softcap(cpu::context& ctx, const tensor& x, float c, const tensor& out);

/// Softmax of scale * x over the last dim (max-subtracted). A row whose
/// entries are all -inf gives zeros.
result<void> softmax(cpu::context& ctx, const tensor& x, const tensor& out, float scale = 1.0f);

/// out = a + b (same shapes; out may be a or b).
result<void> add(cpu::context& ctx, const tensor& a, const tensor& b, const tensor& out);

/// The CLIP / ViT patch embedding: conv2d with stride = kernel = `patch`, no
/// padding, plus bias, through oneDNN. Holds the weights and one oneDNN
/// primitive per input shape (created on first use). Images are convolved
/// one at a time with a batch-1 primitive, so an image's result does not
/// depend on its batch-mates.
class patch_embedding {
 public:
  /// `weight` f32 [hidden, channels, patch, patch], `bias` f32 [hidden]
  /// (both copied).
  static result<std::unique_ptr<patch_embedding>> create(const tensor& weight, const tensor& bias);
  ~patch_embedding();
  patch_embedding(const patch_embedding&) = delete;
  patch_embedding& operator=(const patch_embedding&) = delete;

  /// input f32 [batch, channels, H, W] (H, W multiples of patch) →
  /// out f32 [batch, (H/patch)*(W/patch), hidden], patches in row-major order.
  /// Calls ctx.prepare_onednn_thread() itself.
  result<void> run(cpu::context& ctx, const tensor& input, const tensor& out);

  std::int64_t hidden() const;
  std::int64_t channels() const;
  std::int64_t patch() const;

  struct state;

 private:
  explicit patch_embedding(std::unique_ptr<state> s);
  std::unique_ptr<state> state_;
};

}  // namespace troupe::kernels
