#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/cpu/context.hpp"
#include "kernels/matmul.hpp"
#include "kernels/ops.hpp"
#include "models/kv_cache.hpp"
#include "models/llama_config.hpp"
#include "models/weights.hpp"

namespace troupe::models {

/// One sequence's part of a forward step: its new tokens, appended after
/// the tokens already in its KV cache.
struct step_input {
  seq_id seq = 0;
  std::span<const std::int32_t> tokens;
  bool all_logits = false;  ///< logits for every token (else the last only)
  /// Optional input embeddings (LLaVA image features): the tokens equal to
  /// `embed_token` take, in order, consecutive rows of `embeddings`
  /// (hidden_size floats each) instead of their embedding-table rows. Their
  /// count times hidden_size must equal embeddings.size(). -1 = none.
  std::int32_t embed_token = -1;
  std::span<const float> embeddings{};
};

/// A LLaMA decoder over the CPU kernels: weights packed once at load,
/// batched forward over sequences of different lengths (prefill chunks and
/// decode tokens together). A sequence's logits are bit-identical whatever
/// else is in the batch, the prefill chunking or the thread count.
class llama_model {
 public:
  /// Loads a Hugging Face folder or GGUF file, converting weights per `plan`.
  static result<std::unique_ptr<llama_model>> load(const std::string& path, kernels::cpu::context& ctx,
                                                   const quant_plan& plan = {});
  /// Builds from an open source (the source may be dropped afterwards).
  static result<std::unique_ptr<llama_model>> build(const weight_source& src, const llama_config& cfg,
                                                    kernels::cpu::context& ctx, const quant_plan& plan);

  const llama_config& config() const { return cfg_; }
  /// A KV cache shaped for this model.
  result<kv_cache> make_cache(kernels::memory_pool& pool, const kv_options& opts) const;

  /// Runs one step. Returns f32 logits [n, vocab]: for each input in order,
  /// one row per token when all_logits, else one row (its last token).
  /// On error no sequence's cache length changes.
  result<kernels::tensor> forward(kernels::cpu::context& ctx, kv_cache& cache, std::span<const step_input> inputs,
                                  const kernels::attention_options& attn = {}) const;

  /// Bytes of weights read per decoded token (all matrices incl. the LM
  /// head, plus one embedding row): the memory-bound limit's numerator.
  std::size_t bytes_per_token() const;
  /// Summary of the precision chosen for each kind of tensor.
  std::string describe() const;

 private:
  struct layer {
    kernels::packed_matrix q, k, v, o, gate, up, down;
    kernels::tensor input_norm, post_norm;
  };
  llama_model() = default;

  llama_config cfg_;
  kernels::weight_matrix embed_;
  kernels::packed_matrix lm_head_;
  kernels::tensor norm_;
  std::vector<layer> layers_;
  kernels::rope_params rope_;
};

}  // namespace troupe::models
