#pragma once

// What the planner knows about the hardware and the model: device profiles
// (measured bandwidths, FLOP/s, memory, load), links between nodes, and a
// model profile (per-layer parameters, FLOPs and KV bytes). Plain data and
// builders; no I/O. Units are in the names: bytes, seconds (_s), bytes/s,
// FLOP/s.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::placement {

/// Every fallible placement function returns a value or a readable error.
template <class T>
using result = std::expected<T, std::string>;

/// Weight storage formats. q8_0 / q4_0 are ggml's block formats: 32 weights
/// plus one f16 scale per block.
enum class precision : std::uint8_t { f32, f16, q8_0, q4_0 };

/// All precisions, most precise first.
inline constexpr std::array<precision, 4> all_precisions{precision::f32, precision::f16,
                                                         precision::q8_0, precision::q4_0};

/// Array index of `p` (0 for f32 … 3 for q4_0), for per-precision tables.
constexpr std::size_t index(precision p) {
  return static_cast<std::size_t>(p);
}

/// Bytes one weight takes: f32 4, f16 2, q8_0 34/32, q4_0 18/32.
constexpr double bytes_per_weight(precision p) {
  switch (p) {
    case precision::f32:
      return 4.0;
    case precision::f16:
      return 2.0;
    case precision::q8_0:
      return 34.0 / 32.0;
    case precision::q4_0:
      return 18.0 / 32.0;
  }
  return 4.0;
}

/// How precise `p` is: higher = more precise (q4_0 0, q8_0 1, f16 2, f32 3).
constexpr int rank(precision p) {
  return 3 - static_cast<int>(p);
}

/// True when `a` is at least as precise as `b`.
constexpr bool at_least(precision a, precision b) {
  return rank(a) >= rank(b);
}

/// The more precise of the two.
constexpr precision most_precise(precision a, precision b) {
  return at_least(a, b) ? a : b;
}

/// The next less precise format (f16 → q8_0), or nullopt below q4_0.
std::optional<precision> lower(precision p);

/// "f32", "f16", "q8_0", "q4_0".
const char* to_string(precision p);

/// Parses the names `to_string` writes.
std::optional<precision> precision_from_string(std::string_view s);

/// What a device is; the planner only uses it to form tensor-parallel
/// groups of like devices.
enum class device_kind : std::uint8_t { cpu, gpu, npu };

/// "cpu", "gpu", "npu".
const char* to_string(device_kind k);

/// One value per precision, indexed by `index(precision)`.
using per_precision = std::array<double, 4>;

/// The same value for every precision.
constexpr per_precision uniform(double v) {
  return {v, v, v, v};
}

/// One device as measured. A decode step over a layer is bandwidth-bound:
/// it takes weight bytes / GEMV bandwidth at the layer's precision. Prefill
/// and large batches are compute-bound: FLOPs / GEMM FLOP/s. Another
/// workload keeps the device busy a fraction `load` of the time, so every
/// rate is effectively multiplied by (1 - load).
struct device_profile {
  /// Unique in the cluster, e.g. "node1:gpu0".
  std::string id;
  /// The node (host) it sits in; devices of one node share a fast link.
  std::string node;
  device_kind kind = device_kind::cpu;
  /// Weight bytes per second a decode GEMV streams, per precision (bytes/s).
  per_precision gemv_bytes_per_s{};
  /// Dense matrix-multiply throughput (FLOP/s).
  double gemm_flop_per_s = 0;
  /// Memory troupe may use on this device now (bytes).
  double memory_bytes = 0;
  /// Fraction of time busy with other work, in [0, 1]; 1 = unusable.
  double load = 0;

  /// GEMV bandwidth at `p` (bytes/s), before load.
  double gemv(precision p) const { return gemv_bytes_per_s[index(p)]; }
};

/// A link between two nodes (or within one node when node_a == node_b).
/// Sending n bytes takes latency_s + n / bandwidth_bytes_per_s seconds.
struct link_profile {
  std::string node_a;
  std::string node_b;
  /// Bytes per second.
  double bandwidth_bytes_per_s = 0;
  /// Seconds per message.
  double latency_s = 0;
};

/// The devices and the links between their nodes.
struct cluster_profile {
  std::vector<device_profile> devices;
  /// Measured links; order of the two nodes does not matter.
  std::vector<link_profile> links;
  /// Used between two devices of one node when `links` names no link from
  /// that node to itself: an in-process / PCIe copy (20 GB/s, 5 µs).
  link_profile local_link{"", "", 20e9, 5e-6};
  /// Used between two different nodes when `links` names none; without it
  /// a missing link between two nodes that hold devices is an error.
  std::optional<link_profile> default_remote_link;

  /// The link between nodes `a` and `b` (either order): the measured one,
  /// else `local_link` (a == b) or `default_remote_link`; nullopt if none.
  std::optional<link_profile> link(std::string_view a, std::string_view b) const;
  /// The device with this id, or nullptr.
  const device_profile* find(std::string_view id) const;
};

/// Checks ids (non-empty, unique), nodes, rates (> 0, finite), memory
/// (> 0), load (in [0, 1]), links (> 0 bandwidth, >= 0 latency, known
/// nodes, no duplicates) and that every pair of nodes has a link.
std::expected<void, std::string> validate(const cluster_profile& c);

/// One decoder layer.
struct layer_profile {
  /// Weight parameters (count); bytes at p = params × bytes_per_weight(p).
  double params = 0;
  /// FLOPs per token for the matrix products (≈ 2 × params).
  double flops_per_token = 0;
  /// Extra attention FLOPs per token per token of context (QK^T and AV:
  /// 4 × heads × head_dim).
  double attention_flops_per_context_token = 0;
  /// KV-cache bytes one token of context takes in this layer (f16 cache).
  double kv_bytes_per_token = 0;
  /// Keep at the preferred precision even under memory pressure.
  bool sensitive = false;
  /// The bytes a stage holds this layer's weights in, where the model
  /// profile says they are held as a checkpoint's own formats
  /// (model_profile::held_at, e.g. a K-quant mix); 0: params x
  /// bytes_per_weight.
  double held_bytes = 0;

  /// Weight bytes at precision p (`held_at`: the model's held tier).
  double bytes(precision p, std::optional<precision> held_at = std::nullopt) const {
    return held_bytes > 0 && held_at == p ? held_bytes : params * bytes_per_weight(p);
  }
};

/// A vision tower and the projector that maps its output into the text
/// model's hidden size. The projector is always held at f16 or better.
struct vision_profile {
  /// Encoder weight parameters (count).
  double params = 0;
  /// Encoder FLOPs for one image.
  double flops_per_image = 0;
  /// Encoder hidden size and patches (tokens) per image.
  int hidden = 0;
  int patches = 0;
  /// Projector weight parameters (count) and FLOPs for one image.
  double projector_params = 0;
  double projector_flops_per_image = 0;
};

/// A decoder-only model (optionally with a vision part) as the cost model
/// sees it. The embedding is held by the first pipeline stage, the LM head
/// (and final norm) by the last.
struct model_profile {
  std::vector<layer_profile> layers;
  /// Embedding table parameters (count).
  double embedding_params = 0;
  /// LM head plus final norm parameters (count).
  double lm_head_params = 0;
  /// The LM head shares the embedding table: a stage holding both stores
  /// it once.
  bool tied_embeddings = false;
  /// Hidden size; activations between stages are hidden × 4 bytes (f32)
  /// per token.
  int hidden = 0;
  std::optional<vision_profile> vision;
  /// Set where the decoder is held in formats of its own (a GGUF file's
  /// per-tensor mix, or one the stages convert into): at this tier the
  /// layers' held_bytes and the two below are its bytes, exactly; other
  /// tiers count params x bytes_per_weight. The planner does not lower such
  /// a decoder below it.
  std::optional<precision> held_at;
  double embedding_held_bytes = 0;
  double lm_head_held_bytes = 0;  ///< the output matrix (+ final norm)

  /// Bytes sent from one stage to the next per token (hidden × 4).
  double activation_bytes_per_token() const { return 4.0 * hidden; }
  /// Decoder layer count.
  int layer_count() const { return static_cast<int>(layers.size()); }
  /// Every weight parameter (decoder, embedding, LM head, vision part).
  double total_params() const;
  /// Weight bytes of layer l, the embedding, and the LM head at p.
  double layer_bytes(int l, precision p) const {
    return layers[static_cast<std::size_t>(l)].bytes(p, held_at);
  }
  double embedding_bytes(precision p) const {
    return held_at == p && embedding_held_bytes > 0 ? embedding_held_bytes
                                                    : embedding_params * bytes_per_weight(p);
  }
  double lm_head_bytes(precision p) const {
    return held_at == p && lm_head_held_bytes > 0 ? lm_head_held_bytes
                                                  : lm_head_params * bytes_per_weight(p);
  }
  /// The LM head's bytes on a stage, which stores a tied head once with the
  /// embedding when it holds both.
  double head_bytes_on_stage(precision p, bool with_embedding) const {
    return with_embedding && tied_embeddings ? std::max(0.0, lm_head_bytes(p) - embedding_bytes(p))
                                             : lm_head_bytes(p);
  }
};

/// Checks layer count (> 0), params (> 0), FLOPs and KV bytes (>= 0),
/// hidden (> 0) and the vision part.
std::expected<void, std::string> validate(const model_profile& m);

/// A LLaMA-style decoder: attention q, k, v, o (grouped-query: k and v have
/// kv_heads × head_dim outputs), gated FFN (gate, up, down), two RMS norms
/// per layer; FLOPs per token 2 × params + 4 × heads × head_dim per context
/// token; KV f16. The first and last layers are marked sensitive.
result<model_profile> llama_profile(int layers, int hidden, int intermediate, int heads,
                                    int kv_heads, int head_dim, int vocab, bool tied_embeddings);

/// A CLIP-style vision tower: per layer attention 4 × hidden² and an MLP of
/// 2 × hidden × intermediate (plus biases and two layer norms); FLOPs per
/// image 2 × params × patches + 4 × patches² × hidden per layer.
result<vision_profile> clip_profile(int layers, int hidden, int intermediate, int patches);

/// `m` with the vision tower `v` and a LLaVA projector (two linear layers:
/// v.hidden → m.hidden → m.hidden, with biases).
result<model_profile> with_vision(model_profile m, vision_profile v);

}  // namespace troupe::placement
