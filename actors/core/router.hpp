#pragma once

// The router's choice of a replica for a job (actors/head.cpp asks it).
// A job goes where the longest prefix of its prompt is cached, as
// NVIDIA Dynamo's KV router does, as long as that replica is not much
// busier than the least loaded one; else to the least loaded one.

#include <cstdint>
#include <span>

namespace troupe::actors::core {

/// One replica as the router sees it.
struct replica_load {
  bool serving = false;            ///< takes jobs now
  std::int64_t outstanding = 0;    ///< requests waiting or running, and sent since it said so
  std::int64_t cached_blocks = 0;  ///< of the job's prompt, leading full blocks it has cached
  std::int64_t free_blocks = 0;    ///< KV blocks free (or cached and evictable)
};

struct router_options {
  bool prefix = true;              ///< weigh cached prefixes
  std::int64_t max_imbalance = 4;  ///< a prefix wins over at most this many more outstanding
  /// ... and only when it holds at least this share of the prompt's full
  /// blocks more than the least loaded replica does (a short prefix that
  /// every prompt shares, a chat template's, does not pull jobs together).
  double min_share = 0.5;
};

struct route_choice {
  int replica = -1;        ///< -1: none serves
  bool by_prefix = false;  ///< its cached prefix decided (else its load)
};

/// Chooses among `loads`. Ties in load go to the most free KV, then in
/// turn by `turn` (a counter of the caller's), so that equal replicas
/// share the jobs.
/// `prompt_blocks`: the job's prompt's full blocks (what cached_blocks
/// counts within).
route_choice choose_replica(std::span<const replica_load> loads, const router_options& opt,
                            std::int64_t prompt_blocks, std::uint64_t turn);

}  // namespace troupe::actors::core
