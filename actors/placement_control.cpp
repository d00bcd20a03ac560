#include "actors/placement_control.hpp"

#include <algorithm>
#include <map>

namespace troupe::actors {

placement::precision precision_of(kernels::weight_format f) {
  using kernels::weight_format;
  switch (f) {
    case weight_format::f32:
      return placement::precision::f32;
    case weight_format::f16:
    case weight_format::bf16:
      return placement::precision::f16;
    case weight_format::int8_sym:
    case weight_format::int8_asym:
    case weight_format::q8_0:
      return placement::precision::q8_0;
    case weight_format::int4_sym:
    case weight_format::int4_asym:
    case weight_format::q4_0:
      return placement::precision::q4_0;
    default:
      // The other GGUF formats: the tier whose bytes per weight are not
      // below theirs (the planner never counts too little memory).
      return kernels::bits_per_weight(f) <= 4.5 ? placement::precision::q4_0
                                                : placement::precision::q8_0;
  }
}

void hold_as_stored(placement::model_profile& m, const std::vector<models::held_matrix>& held,
                    placement::precision tier) {
  std::vector<double> layer_bytes(m.layers.size(), 0), layer_params(m.layers.size(), 0);
  double embed_bytes = 0, embed_params = 0, head_bytes = 0, head_params = 0;
  bool separate_head = false;
  for (const auto& h : held) {
    const double n = double(h.rows) * double(h.cols);
    const double packed = n * kernels::held_bits_per_weight(h.format) / 8;
    if (h.name == "embed_tokens") {
      embed_bytes = n * kernels::bits_per_weight(h.format) / 8;  // kept as the file's blocks
      embed_params = n;
      if (!separate_head) head_bytes = packed, head_params = n;  // a tied head packs it
    } else if (h.name == "lm_head") {
      separate_head = true;
      head_bytes = packed;
      head_params = n;
    } else if (h.name.rfind("layers.", 0) == 0) {
      const auto l = std::stoul(h.name.substr(7));
      if (l < layer_bytes.size()) layer_bytes[l] += packed, layer_params[l] += n;
    }
  }
  // The rest of each part's parameters (norms, biases) are held in f32.
  const auto rest = [](double all, double counted) { return std::max(0.0, all - counted) * 4.0; };
  for (std::size_t l = 0; l < m.layers.size(); ++l)
    if (layer_params[l] > 0)
      m.layers[l].held_bytes = layer_bytes[l] + rest(m.layers[l].params, layer_params[l]);
  if (embed_params > 0)
    m.embedding_held_bytes = embed_bytes + rest(m.embedding_params, embed_params);
  if (head_params > 0) m.lm_head_held_bytes = head_bytes + rest(m.lm_head_params, head_params);
  m.held_at = tier;
}

placement::result<placement::model_profile> model_profile_of(
    const models::llama_config& t, const std::optional<models::llava_config>& llava,
    const std::string& kv_type) {
  auto m =
      placement::llama_profile(static_cast<int>(t.num_layers), static_cast<int>(t.hidden_size),
                               static_cast<int>(t.intermediate_size), static_cast<int>(t.num_heads),
                               static_cast<int>(t.num_kv_heads), static_cast<int>(t.head_dim),
                               static_cast<int>(t.vocab_size), t.tie_word_embeddings);
  if (!m) return m;
  // llama_profile counts an f16 cache.
  const double scale = kv_type == "f32" ? 2.0 : kv_type == "int8" ? 0.5 : 1.0;
  for (auto& l : m->layers) l.kv_bytes_per_token *= scale;
  if (!llava) return m;
  const auto& v = llava->vision;
  auto vp = placement::clip_profile(
      static_cast<int>(llava->vision_layers_used()), static_cast<int>(v.hidden_size),
      static_cast<int>(v.intermediate_size), static_cast<int>(v.num_patches()));
  if (!vp) return std::unexpected(vp.error());
  return placement::with_vision(std::move(*m), std::move(*vp));
}

std::string device_id(const std::string& node, const std::string& device) {
  return node + ":" + device;
}

placement::cluster_profile cluster_profile_of(const std::vector<node_measure>& nodes,
                                              const std::vector<placement::link_profile>& links,
                                              placement::precision prec) {
  placement::cluster_profile c;
  std::vector<std::string> names;
  for (const auto& n : nodes) {
    const auto& p = n.probe;
    const placement::per_precision gemm{p.gemm_f32, p.gemm_f16, p.gemm_q8_0, p.gemm_q4_0};
    if (p.cores <= 0 || p.gemv_f32 <= 0 || p.gemv_f16 <= 0 || p.gemv_q8_0 <= 0 ||
        p.gemv_q4_0 <= 0 || gemm[placement::index(prec)] <= 0 || p.memory_bytes <= 0)
      continue;
    placement::device_profile d;
    d.id = device_id(n.node, p.device);
    d.node = n.node;
    d.kind = placement::device_kind::cpu;
    d.gemv_bytes_per_s = {p.gemv_f32, p.gemv_f16, p.gemv_q8_0, p.gemv_q4_0};
    d.gemm_flop_per_s = gemm[placement::index(prec)];
    d.memory_bytes = static_cast<double>(p.memory_bytes);
    // A device fully taken by other work is unusable; the planner wants
    // load < 1 for a device it may use.
    d.load = std::clamp(n.load, 0.0, 0.95);
    c.devices.push_back(std::move(d));
    names.push_back(n.node);
  }
  auto known = [&](const std::string& x) {
    return std::find(names.begin(), names.end(), x) != names.end();
  };
  std::optional<placement::link_profile> slowest;
  for (const auto& l : links) {
    if (l.node_a == l.node_b || !known(l.node_a) || !known(l.node_b) ||
        l.bandwidth_bytes_per_s <= 0)
      continue;
    if (std::any_of(c.links.begin(), c.links.end(), [&](const auto& x) {
          return (x.node_a == l.node_a && x.node_b == l.node_b) ||
                 (x.node_a == l.node_b && x.node_b == l.node_a);
        }))
      continue;
    c.links.push_back(l);
    if (!slowest || l.bandwidth_bytes_per_s < slowest->bandwidth_bytes_per_s) slowest = l;
  }
  placement::link_profile def{"", "", 1e9, 100e-6};
  if (slowest) {
    def.bandwidth_bytes_per_s = slowest->bandwidth_bytes_per_s;
    def.latency_s =
        std::max_element(c.links.begin(), c.links.end(), [](const auto& a, const auto& b) {
          return a.latency_s < b.latency_s;
        })->latency_s;
  }
  c.default_remote_link = def;
  return c;
}

std::vector<cluster::stage_slot> fixed_slots(int layers, int stages,
                                             const std::vector<std::string>& usable,
                                             const std::string& head, int tensor_parallel) {
  if (std::find(usable.begin(), usable.end(), head) == usable.end()) return {};
  std::vector<std::string> order{head};
  for (const auto& n : usable)
    if (n != head) order.push_back(n);
  const auto k = static_cast<std::size_t>(std::max(1, tensor_parallel));
  const int groups = static_cast<int>(order.size() / k);
  std::vector<cluster::stage_slot> out;
  if (groups == 0) return out;
  const auto ranges = placement::even_split(layers, std::min(stages > 0 ? stages : groups, groups));
  for (std::size_t s = 0; s < ranges.size(); ++s) {
    cluster::stage_slot slot{order[s * k], ranges[s].first, ranges[s].second};
    for (std::size_t r = 1; r < k; ++r) slot.ranks.push_back(order[s * k + r]);
    out.push_back(std::move(slot));
  }
  return out;
}

placement::result<std::vector<cluster::stage_slot>> slots_of(const placement::plan& p,
                                                             const placement::cluster_profile& c) {
  std::vector<cluster::stage_slot> out;
  for (const auto& s : p.stages) {
    if (s.devices.size() != 1)
      return std::unexpected("the plan has a tensor-parallel stage over " +
                             std::to_string(s.devices.size()) +
                             " devices; the cluster runs one device per stage");
    const auto* d = c.find(s.devices.front());
    if (!d)
      return std::unexpected("the plan names device " + s.devices.front() + ", which no node has");
    out.push_back({d->node, s.layer_begin, s.layer_end});
  }
  return out;
}

placement::result<placement::plan> plan_of(const std::vector<cluster::stage_slot>& slots,
                                           const placement::cluster_profile& c,
                                           placement::precision p,
                                           const std::string& encoder_node) {
  auto on = [&](const std::string& node) -> const placement::device_profile* {
    for (const auto& d : c.devices)
      if (d.node == node) return &d;
    return nullptr;
  };
  placement::plan out;
  out.head_precision = p;
  out.encoder_precision = p;
  out.projector_precision = placement::most_precise(p, placement::precision::f16);
  for (const auto& s : slots) {
    const auto* d = on(s.node);
    if (!d) return std::unexpected("node " + s.node + " has no measured device");
    placement::stage st;
    st.devices = {d->id};
    for (const auto& r : s.ranks) {  // a tensor-parallel stage's other ranks
      const auto* dr = on(r);
      if (!dr) return std::unexpected("node " + r + " has no measured device");
      st.devices.push_back(dr->id);
    }
    st.layer_begin = s.first_layer;
    st.layer_end = s.last_layer;
    st.layer_precision.assign(static_cast<std::size_t>(std::max(0, s.last_layer - s.first_layer)),
                              p);
    out.stages.push_back(std::move(st));
  }
  if (!encoder_node.empty()) {
    const auto* d = on(encoder_node);
    if (!d)
      return std::unexpected("node " + encoder_node + " (the encoder's) has no measured device");
    out.encoder_device = d->id;
  }
  return out;
}

plan_change change_between(const std::vector<cluster::stage_slot>& current,
                           const std::vector<cluster::stage_slot>& target,
                           const std::string& encoder_from, const std::string& encoder_to) {
  plan_change c;
  c.resplit =
      target.size() != current.size() ||
      !std::equal(target.begin(), target.end(), current.begin(), [](const auto& a, const auto& b) {
        return a.first_layer == b.first_layer && a.last_layer == b.last_layer;
      });
  if (!c.resplit)
    for (std::size_t i = 0; i < target.size(); ++i)
      if (target[i].node != current[i].node) c.moves.push_back({std::to_string(i), target[i].node});
  if (!encoder_to.empty() && encoder_to != encoder_from) c.moves.push_back({"vision", encoder_to});
  return c;
}

void token_rate::add(time_point t, std::int64_t tokens, std::chrono::seconds keep) {
  if (!samples_.empty() && t < samples_.back().first) return;
  samples_.emplace_back(t, tokens);
  while (!samples_.empty() && t - samples_.front().first > keep) samples_.pop_front();
}

std::optional<double> token_rate::rate(time_point from, time_point to,
                                       std::chrono::milliseconds min_span) const {
  const std::pair<time_point, std::int64_t>* a = nullptr;
  const std::pair<time_point, std::int64_t>* b = nullptr;
  for (const auto& s : samples_) {
    if (s.first < from || s.first > to) continue;
    if (!a) a = &s;
    b = &s;
  }
  if (!a || !b || a == b) return std::nullopt;
  const auto span = b->first - a->first;
  if (span < min_span) return std::nullopt;
  return static_cast<double>(b->second - a->second) / std::chrono::duration<double>(span).count();
}

}  // namespace troupe::actors
