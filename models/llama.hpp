#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/device.hpp"
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

/// Which part of the decoder a model object holds (a pipeline stage).
struct layer_range {
  int first = 0;      ///< first decoder layer
  int last = -1;      ///< one past the last layer; -1 = num_layers
  bool embed = true;  ///< holds the embedding table (first stage)
  bool head = true;   ///< holds the final norm and LM head (last stage)
};

/// Tensor parallelism: this model holds rank `rank` of `size` slices of
/// every layer: its share of the attention heads (q rows, k/v rows of its KV
/// heads, o_proj columns) and of the FFN (gate/up rows, down_proj columns).
/// The attention output and FFN down projections give partial sums, which
/// `all_reduce` must sum over the ranks in place (f32 [T, hidden]; e.g.
/// transport::ring_allreduce_sum between processes). Embedding, norms and
/// LM head are replicated, so every rank computes the same logits. Sums are
/// split differently from one process: results agree to rounding, not bits.
struct tensor_split {
  int rank = 0;
  int size = 1;
  std::function<result<void>(kernels::tensor&)> all_reduce;
};

/// What a llama.cpp quantization mix (--quant q4_k_m) decides a decoder's
/// formats by: its shape, and whether the output matrix is the embedding
/// (the config says so, or the checkpoint has no separate one).
mix_model mix_model_of(const llama_config& cfg, const weight_source& src);

/// The matrix a mix judges canonical decoder matrix `name` as: for a
/// family that fuses q/k/v (and gate/up) in one matrix, the fused one
/// (llama.cpp quantizes Phi-3's qkv as one attention-value tensor); else
/// `name`.
std::string mix_role(const llama_config& cfg, const std::string& name);

/// A decoder matrix as a stage will hold it.
struct held_matrix {
  std::string name;  ///< canonical
  kernels::weight_format format;
  std::int64_t rows = 0, cols = 0;
  bool operator==(const held_matrix&) const = default;
};

/// The format every decoder matrix (embedding, separate output matrix,
/// layers) of the checkpoint is held in under `plan`: the file's own or the
/// one the plan converts it to; shapes from the config.
std::vector<held_matrix> decoder_formats(const llama_config& cfg, const weight_source& src,
                                         const quant_plan& plan);

/// A LLaMA decoder over the CPU kernels: weights packed once at load,
/// batched forward over sequences of different lengths (prefill chunks and
/// decode tokens together). A sequence's logits are bit-identical whatever
/// else is in the batch, the prefill chunking or the thread count.
///
/// A model object may hold only a range of the decoder (a pipeline stage,
/// see layer_range): then `embed`, `run_layers` and `head` run its part of
/// a step, and a chain of stages gives bit-identical logits to the whole
/// model (each stage with its own KV cache of its own layers).
class llama_model {
 public:
  /// Loads a Hugging Face folder or GGUF file, converting weights per `plan`;
  /// only the weights `range` needs are read.
  static result<std::unique_ptr<llama_model>> load(const std::string& path, kernels::device& dev,
                                                   const quant_plan& plan = {},
                                                   const layer_range& range = {},
                                                   const tensor_split& split = {});
  /// Builds from an open source (the source may be dropped afterwards),
  /// holding the layers [range.first, range.last) and, as `range` says, the
  /// embedding table and the final norm + LM head. A range that does not fit
  /// the config (first < 0, last > num_layers, first >= last, an embedding
  /// on a stage that does not start at layer 0, a head on one that does not
  /// end at the last layer) is invalid_argument.
  static result<std::unique_ptr<llama_model>> build(const weight_source& src,
                                                    const llama_config& cfg, kernels::device& dev,
                                                    const quant_plan& plan,
                                                    const layer_range& range = {},
                                                    const tensor_split& split = {});

  const llama_config& config() const { return cfg_; }
  /// The part of the decoder held, with `last` resolved (never -1).
  const layer_range& range() const { return range_; }
  /// Whether this model holds every layer, the embedding and the head.
  bool is_full() const;
  /// A KV cache for the layers this model holds (cache layer 0 = layer
  /// range().first).
  result<kv_cache> make_cache(kernels::memory_pool& pool, const kv_options& opts) const;
  /// The cache in `dev`'s memory (for any device; required where host code
  /// cannot touch the device's memory).
  result<kv_cache> make_cache(kernels::device& dev, const kv_options& opts) const;

  /// Runs one step: embed, run_layers and head. Returns f32 logits
  /// [n, vocab]: for each input in order, one row per token when
  /// all_logits, else one row (its last token). Needs a full range.
  /// On error no sequence's cache length changes.
  result<kernels::tensor> forward(kernels::device& dev, kv_cache& cache,
                                  std::span<const step_input> inputs,
                                  const kernels::attention_options& attn = {}) const;

  /// The first stage's part of a step: the input embeddings, f32
  /// [T, hidden] with T the inputs' tokens in order (embedding-table rows,
  /// replaced by the inputs' own embeddings at their embed_token). Checks the
  /// tokens and embeddings; needs the embedding table. Changes no cache.
  result<kernels::tensor> embed(kernels::device& dev, std::span<const step_input> inputs) const;
  /// Runs the held layers over `x` (f32 [T, hidden], contiguous) in place:
  /// reserves room in `cache` (which must have exactly the held layers),
  /// appends the step's keys and values and commits the new lengths. The
  /// inputs' tokens give the per-sequence counts (their ids are checked
  /// against the vocabulary; embeddings are not used). On error no
  /// sequence's cache length changes.
  result<void> run_layers(kernels::device& dev, kv_cache& cache, std::span<const step_input> inputs,
                          kernels::tensor& x, const kernels::attention_options& attn = {}) const;
  /// The last stage's part of a step: final norm and LM head over the rows
  /// of `x` (f32 [T, hidden], the output of run_layers) that need logits;
  /// returns them as forward does. Needs the head.
  result<kernels::tensor> head(kernels::device& dev, std::span<const step_input> inputs,
                               const kernels::tensor& x) const;

  /// Bytes of weights read per decoded token by what this model holds (its
  /// layers' matrices, the LM head if held, one embedding row if held): the
  /// memory-bound limit's numerator.
  std::size_t bytes_per_token() const;
  /// Summary of the precision chosen for each kind of tensor held (and the
  /// layer range when it is not the whole decoder).
  std::string describe() const;

 private:
  struct layer {
    kernels::matrix q, k, v, o, gate, up, down;
    kernels::tensor input_norm, post_norm;
    kernels::tensor q_norm, k_norm;               // qk_norm: [head_dim] each
    kernels::tensor attn_out_norm, ffn_out_norm;  // sandwich_norms: [hidden] each
    kernels::tensor q_bias, k_bias, v_bias;       // qkv_bias: this rank's rows
  };
  // Per-step layout after checking the inputs against the cache.
  struct step_plan {
    std::vector<std::int64_t> offset, start;
  };
  llama_model() = default;
  result<std::int64_t> check_inputs(std::span<const step_input> inputs, bool embeddings) const;
  result<step_plan> layers_step(kernels::device& dev, kv_cache& cache,
                                std::span<const step_input> inputs, kernels::tensor& x,
                                const kernels::attention_options& attn) const;

  llama_config cfg_;
  layer_range range_;
  tensor_split split_;
  std::int64_t nh_ = 0, nkv_ = 0, ffn_ = 0;  // this rank's heads, KV heads, FFN width
  kernels::weight_matrix embed_;
  /// Host memory for converted weights when the device's is not the host's.
  std::shared_ptr<kernels::memory_pool> host_pool_;
  kernels::matrix lm_head_;
  kernels::tensor norm_;
  std::vector<layer> layers_;
  kernels::rope_params rope_;
  kernels::rope_params rope_local_;  // the sliding-window layers' (Gemma 3)
  double attn_scale_ = 0;            // score scale (0: 1/sqrt(head_dim)); YaRN's folded in
};

}  // namespace troupe::models
