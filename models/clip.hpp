#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/device.hpp"
#include "kernels/matmul.hpp"
#include "kernels/ops.hpp"
#include "models/llava_config.hpp"
#include "models/weights.hpp"

namespace troupe::models {

/// A linear layer y = x W^T (+ b): the weight packed once, the bias f32
/// (empty when the layer has none).
struct linear_layer {
  kernels::matrix weight;
  kernels::tensor bias;

  std::int64_t in_features() const { return weight.cols(); }
  std::int64_t out_features() const { return weight.rows(); }
  /// x f32 [rows, in] -> y f32 [rows, out] (y dense, not overlapping x).
  result<void> run(kernels::device& dev, const kernels::tensor& x, kernels::tensor& y) const;
};

/// Loads canonical matrix `name` (shape [rows, cols], converted as `plan`
/// chooses) and, with `bias`, the f32 vector `name.bias` [rows].
result<linear_layer> load_linear(kernels::device& dev, const weight_source& src,
                                 const quant_plan& plan, const std::string& name, std::int64_t rows,
                                 std::int64_t cols, bool bias);

/// Host memory where the towers gather rows and convert weights before
/// they go to a device whose memory host code cannot write (one pool for
/// the vision and audio towers).
kernels::memory_pool& host_staging_pool();

/// Loads canonical tensor `name` as a dense f32 copy of exactly `shape`, in
/// `dev`'s memory.
result<kernels::tensor> load_f32(kernels::device& dev, const weight_source& src,
                                 const std::string& name, const kernels::shape_t& shape);
/// The same in host memory from `pool` (what prepare and prepare_patch_conv take).
result<kernels::tensor> load_f32(kernels::memory_pool& pool, const weight_source& src,
                                 const std::string& name, const kernels::shape_t& shape);

/// Scratch tensors of encoder_layer::run, each [rows, hidden] (f: [rows, ffn]).
struct encoder_scratch {
  kernels::tensor h, q, k, v, att, proj, f;
};

/// One pre-LN transformer encoder layer, as CLIP, SigLIP and Whisper have
/// it: LayerNorm -> self-attention (q/k/v/out projections) -> residual ->
/// LayerNorm -> fc1 -> activation -> fc2 -> residual.
struct encoder_layer {
  linear_layer q, k, v, o, fc1, fc2;
  kernels::tensor norm1_w, norm1_b, norm2_w, norm2_b;

  /// Loads "<prefix>{q,k,v,o}_proj", "<prefix>fc{1,2}" (with biases; the k
  /// projection's only with `k_bias`) and "<prefix>norm{1,2}" (+ ".bias").
  static result<encoder_layer> load(kernels::device& dev, const weight_source& src,
                                    const quant_plan& plan, const std::string& prefix,
                                    std::int64_t hidden, std::int64_t ffn, bool k_bias);
  /// How the layer's rows attend: q, k, v -> out, all [rows, hidden].
  using attend_fn = std::function<result<void>(const kernels::tensor& q, const kernels::tensor& k,
                                               const kernels::tensor& v, kernels::tensor& out)>;
  /// x f32 [rows, hidden], updated in place.
  result<void> run(kernels::device& dev, kernels::tensor& x, encoder_scratch& s, float eps,
                   kernels::gelu_kind activation, const attend_fn& attend) const;
  /// Counts the formats of its six matrices into `counts`.
  void count_formats(std::map<std::string, int>& counts) const;
};

/// "<what> layers=N matrices: f32x12 ..." of a tower's layers.
std::string describe_layers(const std::string& what, const std::vector<encoder_layer>& layers);

/// How the vision tower attends.
struct clip_options {
  /// Exact full (bidirectional) attention by default. The kernels' sliding
  /// window (window, sinks) and sparse block selection (top_k, with a
  /// window) exist only for causal attention: setting causal = true with
  /// them runs the tower with that causal, approximate attention (it then
  /// no longer matches the checkpoint's training exactly).
  kernels::attention_options attention{.causal = false};
  /// Block size of the per-image key cache sparse attention reads.
  int kv_block_size = 16;
  /// Patch embedding through the kernels' oneDNN convolution instead of the
  /// default (patches gathered into rows, then the f32 matmul kernel). Both
  /// are batch-invariant; oneDNN 2.6 runs this first-layer shape (3 input
  /// channels, nhwc output) on its reference implementation, several
  /// milliseconds per small image.
  bool onednn_patch_embedding = false;
};

/// A CLIP ViT vision tower (HF `CLIPVisionModel`) run up to a chosen
/// layer: patch embedding (a convolution with stride = kernel), class token, position
/// embeddings, pre_layrnorm, then pre-LN encoder layers; or a SigLIP one
/// (`SiglipVisionModel`: a biased patch convolution, no class token and no
/// pre_layrnorm, then the same encoder layers) (LayerNorm ->
/// self-attention with biased q/k/v/out projections -> residual ->
/// LayerNorm -> fc1 -> activation -> fc2 -> residual). post_layernorm is
/// never applied (LLaVA reads hidden states, not the pooled output).
/// Each image's output is bit-identical whatever its batch-mates and the
/// thread count.
class clip_vision_tower {
 public:
  /// Loads the tensors of the first `layers` encoder layers from `src`
  /// (canonical names "vision.*"); matrices are converted as `plan` chooses,
  /// embeddings, norms and biases stay f32.
  static result<std::unique_ptr<clip_vision_tower>> build(const weight_source& src,
                                                          const clip_vision_config& cfg,
                                                          std::int64_t layers, kernels::device& dev,
                                                          const quant_plan& plan);

  const clip_vision_config& config() const { return cfg_; }
  /// Encoder layers this tower runs.
  std::int64_t layers() const { return static_cast<std::int64_t>(layers_.size()); }
  /// Rows per image: the class token (CLIP) plus every patch.
  std::int64_t positions() const { return cfg_.positions(); }

  /// pixel_values f32 [N, channels, image_size, image_size] (contiguous,
  /// finite) -> hidden_states[layers()] f32 [N, positions(), hidden]: row 0
  /// of each image is the class token, then the patches in row-major order.
  result<kernels::tensor> forward(kernels::device& dev, const kernels::tensor& pixel_values,
                                  const clip_options& opts = {}) const;

  /// Summary of the precision of each kind of tensor.
  std::string describe() const;

 private:
  clip_vision_tower() = default;
  result<void> attend(kernels::device& dev, const kernels::tensor& q, const kernels::tensor& k,
                      const kernels::tensor& v, kernels::tensor& out, std::int64_t images,
                      const clip_options& opts, kernels::paged_kv_cache* cache) const;

  clip_vision_config cfg_;
  kernels::patch_conv patch_;
  kernels::matrix patch_matrix_;        // [hidden, channels * patch * patch]
  kernels::tensor class_embedding_;     // [hidden] (CLIP)
  kernels::tensor patch_bias_;          // [hidden] (SigLIP)
  kernels::tensor position_embedding_;  // [positions, hidden]
  kernels::tensor pre_norm_w_, pre_norm_b_;
  std::vector<encoder_layer> layers_;
};

}  // namespace troupe::models
