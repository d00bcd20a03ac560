#include "actors/core/router.hpp"

#include <algorithm>
#include <vector>

namespace troupe::actors::core {

route_choice choose_replica(std::span<const replica_load> loads, const router_options& opt,
                            std::int64_t prompt_blocks, std::uint64_t turn) {
  route_choice out;
  // The least loaded: fewest outstanding, then most free KV; among equals
  // the turn picks.
  std::vector<int> least;
  for (std::size_t i = 0; i < loads.size(); ++i) {
    const auto& l = loads[i];
    if (!l.serving) continue;
    if (least.empty()) {
      least.push_back(static_cast<int>(i));
      continue;
    }
    const auto& b = loads[static_cast<std::size_t>(least.front())];
    if (l.outstanding < b.outstanding ||
        (l.outstanding == b.outstanding && l.free_blocks > b.free_blocks)) {
      least.assign(1, static_cast<int>(i));
    } else if (l.outstanding == b.outstanding && l.free_blocks == b.free_blocks) {
      least.push_back(static_cast<int>(i));
    }
  }
  if (least.empty()) return out;
  out.replica = least[turn % least.size()];
  if (!opt.prefix) return out;
  const auto floor = loads[static_cast<std::size_t>(out.replica)].outstanding;
  // The longest cached prefix among those within the imbalance; equal
  // prefixes go to the less loaded.
  int best = -1;
  for (std::size_t i = 0; i < loads.size(); ++i) {
    const auto& l = loads[i];
    if (!l.serving || l.cached_blocks <= 0 || l.outstanding > floor + opt.max_imbalance) continue;
    if (best < 0) {
      best = static_cast<int>(i);
      continue;
    }
    const auto& b = loads[static_cast<std::size_t>(best)];
    if (l.cached_blocks > b.cached_blocks ||
        (l.cached_blocks == b.cached_blocks && l.outstanding < b.outstanding))
      best = static_cast<int>(i);
  }
  if (best >= 0) {
    const auto gain = loads[static_cast<std::size_t>(best)].cached_blocks -
                      loads[static_cast<std::size_t>(out.replica)].cached_blocks;
    const auto need = opt.min_share * static_cast<double>(std::max<std::int64_t>(prompt_blocks, 1));
    if (gain > 0 && static_cast<double>(gain) >= need) out.replica = best;
  }
  out.by_prefix = loads[static_cast<std::size_t>(out.replica)].cached_blocks > 0;
  return out;
}

}  // namespace troupe::actors::core
