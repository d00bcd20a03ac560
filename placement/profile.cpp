#include "placement/profile.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <utility>

#include "placement/format.hpp"

namespace troupe::placement {

namespace {

bool positive(double v) {
  return std::isfinite(v) && v > 0;
}
bool non_negative(double v) {
  return std::isfinite(v) && v >= 0;
}

std::unexpected<std::string> fail(std::string msg) {
  return std::unexpected(std::move(msg));
}

}  // namespace

std::optional<precision> lower(precision p) {
  switch (p) {
    case precision::f32:
      return precision::f16;
    case precision::f16:
      return precision::q8_0;
    case precision::q8_0:
      return precision::q4_0;
    case precision::q4_0:
      return std::nullopt;
  }
  return std::nullopt;
}

const char* to_string(precision p) {
  switch (p) {
    case precision::f32:
      return "f32";
    case precision::f16:
      return "f16";
    case precision::q8_0:
      return "q8_0";
    case precision::q4_0:
      return "q4_0";
  }
  return "unknown";
}

std::optional<precision> precision_from_string(std::string_view s) {
  for (auto p : all_precisions)
    if (s == to_string(p)) return p;
  return std::nullopt;
}

const char* to_string(device_kind k) {
  switch (k) {
    case device_kind::cpu:
      return "cpu";
    case device_kind::gpu:
      return "gpu";
    case device_kind::npu:
      return "npu";
  }
  return "unknown";
}

std::optional<link_profile> cluster_profile::link(std::string_view a, std::string_view b) const {
  for (const auto& l : links)
    if ((l.node_a == a && l.node_b == b) || (l.node_a == b && l.node_b == a)) return l;
  if (a == b) {
    link_profile l = local_link;
    l.node_a = std::string(a);
    l.node_b = std::string(b);
    return l;
  }
  if (default_remote_link) {
    link_profile l = *default_remote_link;
    l.node_a = std::string(a);
    l.node_b = std::string(b);
    return l;
  }
  return std::nullopt;
}

const device_profile* cluster_profile::find(std::string_view id) const {
  for (const auto& d : devices)
    if (d.id == id) return &d;
  return nullptr;
}

namespace {

std::expected<void, std::string> validate_link(const link_profile& l, const std::string& what) {
  if (!positive(l.bandwidth_bytes_per_s))
    return fail(what + ": bandwidth must be > 0 bytes/s (got " +
                detail::num(l.bandwidth_bytes_per_s) + ")");
  if (!non_negative(l.latency_s))
    return fail(what + ": latency must be >= 0 s (got " + detail::num(l.latency_s) + ")");
  return {};
}

}  // namespace

std::expected<void, std::string> validate(const cluster_profile& c) {
  if (c.devices.empty()) return fail("the cluster has no devices");
  std::set<std::string> ids, nodes;
  for (const auto& d : c.devices) {
    if (d.id.empty()) return fail("a device has an empty id");
    if (!ids.insert(d.id).second) return fail("device id '" + d.id + "' appears twice");
    if (d.node.empty()) return fail("device " + d.id + " has no node");
    nodes.insert(d.node);
    for (auto p : all_precisions)
      if (!positive(d.gemv(p)))
        return fail("device " + d.id + ": GEMV bandwidth at " + to_string(p) +
                    " must be > 0 bytes/s (got " + detail::num(d.gemv(p)) + ")");
    if (!positive(d.gemm_flop_per_s))
      return fail("device " + d.id + ": GEMM rate must be > 0 FLOP/s (got " +
                  detail::num(d.gemm_flop_per_s) + ")");
    if (!positive(d.memory_bytes))
      return fail("device " + d.id + ": memory must be > 0 bytes (got " +
                  detail::num(d.memory_bytes) + ")");
    if (!(d.load >= 0 && d.load <= 1))
      return fail("device " + d.id + ": load must be in [0, 1] (got " + detail::num(d.load) + ")");
  }
  if (auto ok = validate_link(c.local_link, "the default local link"); !ok) return ok;
  if (c.default_remote_link)
    if (auto ok = validate_link(*c.default_remote_link, "the default remote link"); !ok) return ok;
  std::set<std::pair<std::string, std::string>> seen;
  for (const auto& l : c.links) {
    const std::string what = "link " + l.node_a + " - " + l.node_b;
    if (!nodes.contains(l.node_a) || !nodes.contains(l.node_b))
      return fail(what + " names a node that holds no device");
    auto key = std::minmax(l.node_a, l.node_b);
    if (!seen.insert({key.first, key.second}).second) return fail(what + " is given twice");
    if (auto ok = validate_link(l, what); !ok) return ok;
  }
  if (!c.default_remote_link)
    for (auto a = nodes.begin(); a != nodes.end(); ++a)
      for (auto b = std::next(a); b != nodes.end(); ++b)
        if (!seen.contains({*a, *b}))
          return fail("no link between nodes " + *a + " and " + *b +
                      " (and no default_remote_link)");
  return {};
}

double model_profile::total_params() const {
  // Tied: the head shares the table; only what it has beyond it (the final
  // norm) is extra.
  double sum =
      embedding_params +
      (tied_embeddings ? std::max(0.0, lm_head_params - embedding_params) : lm_head_params);
  for (const auto& l : layers) sum += l.params;
  if (vision) sum += vision->params + vision->projector_params;
  return sum;
}

std::expected<void, std::string> validate(const model_profile& m) {
  if (m.layers.empty()) return fail("the model has no decoder layers");
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    const auto& l = m.layers[i];
    const std::string what = "layer " + std::to_string(i);
    if (!positive(l.params))
      return fail(what + ": params must be > 0 (got " + detail::num(l.params) + ")");
    if (!non_negative(l.flops_per_token) || !non_negative(l.attention_flops_per_context_token))
      return fail(what + ": FLOPs must be >= 0");
    if (!non_negative(l.kv_bytes_per_token))
      return fail(what + ": KV bytes per token must be >= 0");
  }
  if (!non_negative(m.embedding_params) || !non_negative(m.lm_head_params))
    return fail("embedding and LM head params must be >= 0");
  if (m.hidden <= 0) return fail("hidden size must be > 0 (got " + std::to_string(m.hidden) + ")");
  if (m.vision) {
    const auto& v = *m.vision;
    if (!positive(v.params)) return fail("vision encoder params must be > 0");
    if (!non_negative(v.flops_per_image) || !non_negative(v.projector_params) ||
        !non_negative(v.projector_flops_per_image))
      return fail("vision encoder FLOPs and projector params must be >= 0");
  }
  return {};
}

result<model_profile> llama_profile(int layers, int hidden, int intermediate, int heads,
                                    int kv_heads, int head_dim, int vocab, bool tied_embeddings) {
  if (layers <= 0 || hidden <= 0 || intermediate <= 0 || heads <= 0 || kv_heads <= 0 ||
      head_dim <= 0 || vocab <= 0)
    return fail("llama_profile: every dimension must be > 0 (layers " + std::to_string(layers) +
                ", hidden " + std::to_string(hidden) + ", intermediate " +
                std::to_string(intermediate) + ", heads " + std::to_string(heads) + ", kv_heads " +
                std::to_string(kv_heads) + ", head_dim " + std::to_string(head_dim) + ", vocab " +
                std::to_string(vocab) + ")");
  if (heads % kv_heads != 0)
    return fail("llama_profile: heads (" + std::to_string(heads) +
                ") must be a multiple of kv_heads (" + std::to_string(kv_heads) + ")");
  const double h = hidden, q = double(heads) * head_dim, kv = double(kv_heads) * head_dim;
  const double attention = h * q + 2 * h * kv + q * h;
  const double ffn = 3 * h * intermediate;
  layer_profile l;
  l.params = attention + ffn + 2 * h;
  l.flops_per_token = 2 * (attention + ffn);
  l.attention_flops_per_context_token = 4 * q;
  l.kv_bytes_per_token = 2 * kv * 2;  // k and v, f16
  model_profile m;
  m.layers.assign(static_cast<std::size_t>(layers), l);
  m.layers.front().sensitive = true;
  m.layers.back().sensitive = true;
  m.embedding_params = double(vocab) * h;
  m.lm_head_params = double(vocab) * h + h;  // + final norm
  m.tied_embeddings = tied_embeddings;
  m.hidden = hidden;
  return m;
}

result<vision_profile> clip_profile(int layers, int hidden, int intermediate, int patches) {
  if (layers <= 0 || hidden <= 0 || intermediate <= 0 || patches <= 0)
    return fail("clip_profile: every dimension must be > 0 (layers " + std::to_string(layers) +
                ", hidden " + std::to_string(hidden) + ", intermediate " +
                std::to_string(intermediate) + ", patches " + std::to_string(patches) + ")");
  const double h = hidden, p = patches;
  const double matmul = 4 * h * h + 2 * h * intermediate;
  const double per_layer = matmul + 4 * h + intermediate + h + 4 * h;  // biases + 2 layer norms
  vision_profile v;
  v.params = layers * per_layer;
  v.flops_per_image = layers * (2 * matmul * p + 4 * p * p * h);
  v.hidden = hidden;
  v.patches = patches;
  return v;
}

result<model_profile> with_vision(model_profile m, vision_profile v) {
  if (m.hidden <= 0) return fail("with_vision: the text model has no hidden size");
  if (v.hidden <= 0 || v.patches <= 0 || !positive(v.params))
    return fail("with_vision: the vision profile needs hidden, patches and params > 0");
  const double th = m.hidden, vh = v.hidden;
  const double matmul = vh * th + th * th;
  v.projector_params = matmul + 2 * th;
  v.projector_flops_per_image = 2 * matmul * v.patches;
  m.vision = v;
  return m;
}

}  // namespace troupe::placement
