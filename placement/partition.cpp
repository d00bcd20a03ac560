#include "placement/partition.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace troupe::placement::detail {

namespace {

constexpr double inf = std::numeric_limits<double>::infinity();

/// What best_within minimises, lexicographically: precision loss, then
/// weights moved away from the current plan, then latency. Losses and moved
/// weights are sums of parameter counts, so a relative tolerance absorbs
/// rounding.
struct key {
  double loss = inf;
  double moved = inf;
  double lat = inf;
  key operator+(const key& o) const { return {loss + o.loss, moved + o.moved, lat + o.lat}; }
};

bool close(double a, double b) {
  return std::abs(a - b) <= 1e-9 * std::max(1.0, std::abs(b));
}

bool better(const key& a, const key& b) {
  if (!close(a.loss, b.loss)) return a.loss < b.loss;
  if (!close(a.moved, b.moved)) return a.moved < b.moved;
  return a.lat < b.lat;
}

}  // namespace

partitioner::partitioner(const problem& p) : p_(p) {
  const auto& m = *p.model;
  const auto& w = *p.work;
  layers_ = m.layer_count();
  for (precision q = p.preferred;;) {
    levels_.push_back(q);
    const auto next = lower(q);
    // A decoder held in its own formats (a K-quant mix) stays in them.
    if (q == p.lowest || !next || !at_least(*next, p.lowest) || m.held_at) break;
    q = *next;
  }
  const auto n = static_cast<std::size_t>(layers_) + 1;
  sens_params_.assign(n, 0);
  ns_params_.assign(n, 0);
  sens_bytes_.assign(n, 0);
  ns_bytes_.assign(n, 0);
  flops_.assign(n, 0);
  kv_per_token_.assign(n, 0);
  ns_before_.assign(n, 0);
  ns_prefix_.assign(1, 0);
  for (std::size_t l = 0; l + 1 < n; ++l) {
    const auto& layer = m.layers[l];
    sens_params_[l + 1] = sens_params_[l] + (layer.sensitive ? layer.params : 0);
    ns_params_[l + 1] = ns_params_[l] + (layer.sensitive ? 0 : layer.params);
    const double at_pref = m.layer_bytes(static_cast<int>(l), p.preferred);
    sens_bytes_[l + 1] = sens_bytes_[l] + (layer.sensitive ? at_pref : 0);
    ns_bytes_[l + 1] = ns_bytes_[l] + (layer.sensitive ? 0 : at_pref);
    flops_[l + 1] = flops_[l] + layer.flops_per_token +
                    double(w.context_tokens) * layer.attention_flops_per_context_token;
    kv_per_token_[l + 1] = kv_per_token_[l] + layer.kv_bytes_per_token;
    ns_before_[l + 1] = ns_before_[l] + (layer.sensitive ? 0 : 1);
    if (!layer.sensitive) {
      ns_prefix_.push_back(ns_prefix_.back() + layer.params);
    }
  }
  nodes_by_transfer_.resize(static_cast<std::size_t>(p.node_count));
  for (int a = 0; a < p.node_count; ++a) {
    auto& near = nodes_by_transfer_[static_cast<std::size_t>(a)];
    for (int b = 0; b < p.node_count; ++b) near.push_back(b);
    std::stable_sort(near.begin(), near.end(),
                     [&](int x, int y) { return transfer(a, x) < transfer(a, y); });
  }
}

partitioner::stage_eval partitioner::eval(const unit& u, int i, int j) const {
  const auto& m = *p_.model;
  const auto& w = *p_.work;
  const auto pref = p_.preferred;
  const double bpw_pref = bytes_per_weight(pref);
  const bool first = i == 0, last = j == layers_;
  double head_bytes = 0;
  if (first) head_bytes += m.embedding_bytes(pref);
  if (last) head_bytes += m.head_bytes_on_stage(pref, first);
  const double batch = w.batch, ctx = w.context_tokens;
  const double kv = batch * ctx * (kv_per_token_[j] - kv_per_token_[i]);
  const double n = ns_params_[j] - ns_params_[i];
  // Bytes at the preferred level (a held decoder's own; else params x bpw).
  const double s_bytes = sens_bytes_[j] - sens_bytes_[i], n_bytes = ns_bytes_[j] - ns_bytes_[i];
  double excess = head_bytes + kv + s_bytes + n_bytes - u.capacity_bytes;

  stage_eval e;
  int phase = 0, lowered = 0;
  double lowered_params = 0;
  if (excess > 0) {
    const int q0 = ns_before_[i], q1 = ns_before_[j];
    bool fits = false;
    for (phase = 0; phase + 1 < static_cast<int>(levels_.size()); ++phase) {
      const double delta = bytes_per_weight(levels_[phase]) - bytes_per_weight(levels_[phase + 1]);
      const double full = n * delta;
      if (full >= excess) {
        const double target = ns_prefix_[q0] + excess / delta;
        const auto begin = ns_prefix_.begin() + q0 + 1, end = ns_prefix_.begin() + q1 + 1;
        lowered = static_cast<int>(std::lower_bound(begin, end, target) - begin) + 1;
        if (lowered >= q1 - q0) {
          ++phase;
          lowered = 0;
        }
        lowered_params = ns_prefix_[q0 + lowered] - ns_prefix_[q0];
        fits = true;
        break;
      }
      excess -= full;
    }
    if (!fits) return e;
  }
  const auto& r = u.rates.gemv_bytes_per_s;
  const auto at = levels_[static_cast<std::size_t>(phase)];
  // The non-sensitive layers still at `at` (the preferred level: their
  // bytes there, less the lowered ones').
  const double ns_at = phase == 0 ? n_bytes - lowered_params * bpw_pref
                                  : (n - lowered_params) * bytes_per_weight(at);
  double weights_s = s_bytes / r[index(pref)] + ns_at / r[index(at)];
  if (lowered_params > 0) {
    const auto below = levels_[static_cast<std::size_t>(phase) + 1];
    weights_s += lowered_params * bytes_per_weight(below) / r[index(below)];
  }
  if (last) weights_s += m.lm_head_bytes(pref) / r[index(pref)];
  const double flops = batch * (flops_[j] - flops_[i] + (last ? 2 * m.lm_head_params : 0));
  const double gemm_s = flops / u.rates.gemm_flop_per_s;
  const double kv_s = kv / u.rates.kv_bytes_per_s;
  e.fits = true;
  e.time_s = std::max(weights_s, gemm_s) + kv_s + (j - i) * u.allreduce_per_layer_s + u.extra_s;
  e.loss = n * phase + lowered_params;
  e.phase = phase;
  e.lowered = lowered;
  return e;
}

double partitioner::lower_bound_s(const unit& u, int i, int j) const {
  const auto& m = *p_.model;
  const auto& w = *p_.work;
  const auto& r = u.rates.gemv_bytes_per_s;
  const auto pref = p_.preferred;
  double cheapest = inf;  // seconds per non-sensitive parameter at the cheapest allowed level
  for (auto q : levels_) cheapest = std::min(cheapest, bytes_per_weight(q) / r[index(q)]);
  const bool last = j == layers_;
  const double s_bytes = sens_bytes_[j] - sens_bytes_[i];
  const double n = ns_params_[j] - ns_params_[i];
  // A held decoder has one level: its own bytes; else the cheapest level.
  const double ns_s = m.held_at ? (ns_bytes_[j] - ns_bytes_[i]) / r[index(pref)] : n * cheapest;
  double weights_s = s_bytes / r[index(pref)] + ns_s;
  if (last) weights_s += m.lm_head_bytes(pref) / r[index(pref)];
  const double batch = w.batch, ctx = w.context_tokens;
  const double gemm_s =
      batch * (flops_[j] - flops_[i] + (last ? 2 * m.lm_head_params : 0)) / u.rates.gemm_flop_per_s;
  const double kv_s = batch * ctx * (kv_per_token_[j] - kv_per_token_[i]) / u.rates.kv_bytes_per_s;
  return std::max(weights_s, gemm_s) + kv_s + (j - i) * u.allreduce_per_layer_s + u.extra_s;
}

std::vector<precision> partitioner::precisions(int i, int j, const stage_eval& e) const {
  std::vector<precision> out;
  out.reserve(static_cast<std::size_t>(j - i));
  const auto at = levels_[static_cast<std::size_t>(e.phase)];
  int lowered_left = e.lowered;
  for (int l = i; l < j; ++l) {
    if (p_.model->layers[static_cast<std::size_t>(l)].sensitive) {
      out.push_back(p_.preferred);
    } else if (lowered_left > 0) {
      out.push_back(levels_[static_cast<std::size_t>(e.phase) + 1]);
      --lowered_left;
    } else {
      out.push_back(at);
    }
  }
  return out;
}

double partitioner::min_step(const unit_order& o, int* uncovered) {
  const int L = layers_;
  const auto Lz = static_cast<std::size_t>(L);
  const auto NB = static_cast<std::size_t>(p_.node_count);
  const auto U = o.size();
  f_.assign(U * Lz, inf);
  // node_min[n * L + j]: the best f[pos][j] over the units of node n after
  // the current position.
  std::vector<double> node_min(NB * Lz, inf);
  std::vector<double> front_t, front_v;
  std::vector<std::size_t> front_begin(Lz + 1, 0);
  for (std::size_t pos = U; pos-- > 0;) {
    const unit& u = p_.units[static_cast<std::size_t>(o[pos])];
    const auto& near = nodes_by_transfer_[static_cast<std::size_t>(u.node)];
    double* f = &f_[pos * Lz];
    // Pareto fronts per j of (transfer to the next node, best suffix there):
    // transfer ascending, suffix value strictly descending.
    front_t.clear();
    front_v.clear();
    for (std::size_t j = 1; j < Lz; ++j) {
      front_begin[j] = front_t.size();
      double vmin = inf;
      for (int n : near) {
        const double v = node_min[static_cast<std::size_t>(n) * Lz + j];
        if (v < vmin) {
          vmin = v;
          front_t.push_back(transfer(u.node, n));
          front_v.push_back(v);
        }
      }
    }
    front_begin[Lz] = front_t.size();
    for (int i = 0; i < L; ++i) {
      double best = inf;
      for (int j = i + 1; j <= L; ++j) {
        if (lower_bound_s(u, i, j) >= best) break;
        const auto e = eval(u, i, j);
        if (!e.fits) break;  // more layers fit even less
        const double c = e.time_s;
        double cand = inf;
        if (j == L) {
          cand = c;
        } else {
          const auto jz = static_cast<std::size_t>(j);
          const std::size_t b = front_begin[jz], end = front_begin[jz + 1];
          std::size_t lo = b, hi = end;
          while (lo < hi) {  // first m where c + t_m >= v_m (increasing in m)
            const std::size_t mid = (lo + hi) / 2;
            if (c + front_t[mid] >= front_v[mid])
              hi = mid;
            else
              lo = mid + 1;
          }
          if (lo < end) cand = std::min(cand, c + front_t[lo]);
          if (lo > b) cand = std::min(cand, front_v[lo - 1]);
        }
        best = std::min(best, cand);
      }
      f[i] = best;
    }
    double* nm = &node_min[static_cast<std::size_t>(u.node) * Lz];
    for (std::size_t j = 0; j < Lz; ++j) nm[j] = std::min(nm[j], f[j]);
  }
  double best = inf;
  for (std::size_t pos = 0; pos < U; ++pos) best = std::min(best, f_[pos * Lz]);
  if (uncovered) {
    *uncovered = L;
    for (std::size_t pos = 0; pos < U; ++pos)
      for (int i = 0; i < *uncovered; ++i)
        if (std::isfinite(f_[pos * Lz + static_cast<std::size_t>(i)])) {
          *uncovered = i;
          break;
        }
  }
  return best;
}

double partitioner::moved_params(const unit& u, int i, int j) const {
  const double all =
      (sens_params_[static_cast<std::size_t>(j)] + ns_params_[static_cast<std::size_t>(j)]) -
      (sens_params_[static_cast<std::size_t>(i)] + ns_params_[static_cast<std::size_t>(i)]);
  if (u.stay_params.empty()) return p_.has_current ? all : 0.0;
  return all -
         (u.stay_params[static_cast<std::size_t>(j)] - u.stay_params[static_cast<std::size_t>(i)]);
}

std::optional<partition> partitioner::best_within(const unit_order& o, double limit_s) {
  const int L = layers_;
  const auto Lz = static_cast<std::size_t>(L);
  const auto NB = static_cast<std::size_t>(p_.node_count);
  const auto U = o.size();
  struct entry {
    key k;
    int pos = -1;
  };
  // g[pos * L + i]: best value for layers [i, L) with the stage starting at
  // i on the unit at pos; next_j_ / next_pos_ say how it continues.
  std::vector<key> g(U * Lz);
  next_j_.assign(U * Lz, -1);
  next_pos_.assign(U * Lz, -1);
  std::vector<entry> node_best(NB * Lz);
  std::vector<entry> prefix;  // per j: prefix minima over nodes by transfer
  std::vector<double> near_t;
  for (std::size_t pos = U; pos-- > 0;) {
    const unit& u = p_.units[static_cast<std::size_t>(o[pos])];
    const auto& near = nodes_by_transfer_[static_cast<std::size_t>(u.node)];
    const std::size_t K = near.size();
    near_t.clear();
    for (int n : near) near_t.push_back(transfer(u.node, n));
    prefix.assign(K * Lz, entry{});
    for (std::size_t j = 1; j < Lz; ++j) {
      entry run;
      for (std::size_t m = 0; m < K; ++m) {
        const auto& nb = node_best[static_cast<std::size_t>(near[m]) * Lz + j];
        if (nb.pos >= 0) {
          const key via = nb.k + key{0, 0, near_t[m]};
          if (run.pos < 0 || better(via, run.k)) run = {via, nb.pos};
        }
        prefix[j * K + m] = run;
      }
    }
    const std::size_t row = pos * Lz;
    for (int i = 0; i < L; ++i) {
      entry best;
      int best_j = -1;
      auto consider = [&](const key& k, int j, int next) {
        if (best_j < 0 || better(k, best.k)) {
          best = {k, next};
          best_j = j;
        }
      };
      for (int j = i + 1; j <= L; ++j) {
        if (lower_bound_s(u, i, j) > limit_s) break;
        const auto e = eval(u, i, j);
        if (!e.fits) break;
        const double c = e.time_s;
        if (c > limit_s) continue;  // lowering can make a longer range faster
        const key here{e.loss, moved_params(u, i, j), c};
        if (j == L) {
          consider(here, j, -1);
          continue;
        }
        const auto k = static_cast<std::size_t>(
            std::upper_bound(near_t.begin(), near_t.end(), limit_s - c) - near_t.begin());
        if (k == 0) continue;
        const auto& via = prefix[static_cast<std::size_t>(j) * K + k - 1];
        if (via.pos >= 0) consider(here + via.k, j, via.pos);
      }
      g[row + static_cast<std::size_t>(i)] = best.k;
      next_j_[row + static_cast<std::size_t>(i)] = best_j;
      next_pos_[row + static_cast<std::size_t>(i)] = best.pos;
    }
    for (std::size_t j = 0; j < Lz; ++j) {
      auto& nb = node_best[static_cast<std::size_t>(u.node) * Lz + j];
      if (next_j_[row + j] >= 0 && (nb.pos < 0 || better(g[row + j], nb.k)))
        nb = {g[row + j], static_cast<int>(pos)};
    }
  }
  int start = -1;
  for (std::size_t pos = 0; pos < U; ++pos) {
    const auto cell = pos * Lz;
    if (next_j_[cell] < 0) continue;
    if (start < 0 || better(g[cell], g[static_cast<std::size_t>(start) * Lz]))
      start = static_cast<int>(pos);
  }
  if (start < 0) return std::nullopt;
  partition out;
  int pos = start, i = 0;
  while (pos >= 0 && i < L) {
    const auto cell = static_cast<std::size_t>(pos) * Lz + static_cast<std::size_t>(i);
    const int j = next_j_[cell];
    const int next = next_pos_[cell];
    const int uid = o[static_cast<std::size_t>(pos)];
    const unit& u = p_.units[static_cast<std::size_t>(uid)];
    const auto e = eval(u, i, j);
    chosen_stage st;
    st.unit = uid;
    st.begin = i;
    st.end = j;
    st.precisions = precisions(i, j, e);
    st.compute_s = e.time_s;
    if (next >= 0)
      st.transfer_s = transfer(
          u.node, p_.units[static_cast<std::size_t>(o[static_cast<std::size_t>(next)])].node);
    out.step_s = std::max(out.step_s, st.compute_s + st.transfer_s);
    out.latency_s += st.compute_s + st.transfer_s;
    out.loss += e.loss;
    out.moved += moved_params(u, i, j);
    out.stages.push_back(std::move(st));
    pos = next;
    i = j;
  }
  return out;
}

}  // namespace troupe::placement::detail
