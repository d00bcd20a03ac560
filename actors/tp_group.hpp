#pragma once

// Tensor parallelism of a stage: the group one rank belongs to and, in
// namespace stage_detail (internal to the stage's actors), how rank 0's
// shard passes each step on to the other ranks and joins their answers.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "actors/protocol.hpp"
#include "models/llama.hpp"
#include "transport/collectives.hpp"

namespace troupe::actors {

struct stage_resources;

/// A tensor-parallel group as one rank sees it. Every rank holds slice
/// `rank` of every layer of the stage and runs every step; the ranks' steps
/// meet in the all-reduces over `ring` (to rank (rank + 1) % size). Rank 0
/// is the group's face to the scheduler: its shard forwards each step to
/// the other ranks' shards and answers once all agree; its KV store passes
/// frees on to theirs. Embedding, norms and LM head are replicated and the
/// all-reduce leaves every rank with the same bits, so every rank samples
/// the same tokens (rank 0 checks).
struct tp_group {
  int rank = 0;
  int size = 1;
  transport::ring ring;                  ///< engine null until the ring is connected
  transport::allreduce_stats allreduce;  ///< where the ring's all-reduces spend their time
  /// Rank 0: ranks 1..size-1 (shards, KV stores, data-plane keys: the
  /// step's inputs go there). Written before the group serves, or under
  /// `peers_mtx` when a rank moves (live migration); read through the
  /// accessors below.
  std::vector<shard_actor> peer_shards;
  std::vector<kv_store_actor> peer_kvs;
  std::vector<std::string> peer_keys;
  mutable std::mutex peers_mtx;
  std::chrono::milliseconds reply_timeout{120000};
  /// Set when a rank is gone: all-reduces in flight give up at once
  /// (ring.abort points here).
  std::atomic<bool> broken{false};
  /// Set by the shard before each step (under the device lock): the
  /// all-reduces of a step are numbered from its step number, the same on
  /// every rank.
  std::uint64_t step = 0;
  std::uint32_t calls = 0;

  /// The split to build this rank's model with (its all-reduce runs over
  /// `ring`).
  static models::tensor_split split_of(const std::shared_ptr<tp_group>& g);

  /// Rank 0: peer p (rank p + 1) now.
  shard_actor peer_shard(std::size_t p) const {
    std::lock_guard lock(peers_mtx);
    return p < peer_shards.size() ? peer_shards[p] : shard_actor{};
  }
  std::vector<kv_store_actor> peer_stores() const {
    std::lock_guard lock(peers_mtx);
    return peer_kvs;
  }
  std::vector<std::string> peer_addresses() const {
    std::lock_guard lock(peers_mtx);
    return peer_keys;
  }
  /// Rank 0: rank `rank` (>= 1) is now `shard`, `kv` in process `key` (it
  /// moved; the group is paused).
  void set_peer(int rank, shard_actor shard, kv_store_actor kv, std::string key) {
    std::lock_guard lock(peers_mtx);
    const auto p = static_cast<std::size_t>(rank - 1);
    if (p >= peer_shards.size()) return;
    peer_shards[p] = std::move(shard);
    peer_kvs[p] = std::move(kv);
    peer_keys[p] = std::move(key);
  }
};

namespace stage_detail {

/// Rank 0's view of one step of its tensor-parallel group: its own
/// output and the other ranks' answers; the step is answered once all are
/// in (or at the first error).
struct tp_join {
  std::uint64_t id = 0;
  caf::typed_response_promise<step_output> rp;
  std::size_t pending = 0;
  std::optional<step_output> own;
  std::vector<std::pair<int, std::vector<std::vector<std::int32_t>>>> peers;  // rank, sampled
  /// The group holds the LM head: every rank samples, and rank 0 checks
  /// that they agree. Otherwise `own` is the next stage's answer (rank 0
  /// forwarded the step) and the other ranks' answers only say they ran.
  bool compare_sampled = true;
  bool settled = false;

  void settle(caf::error e);
  void maybe_deliver();
};

/// Rank 0's steps waiting for other ranks, by join id (kept in the shard's
/// state).
struct tp_joins {
  std::unordered_map<std::uint64_t, std::shared_ptr<tp_join>> open;
  std::uint64_t next_id = 0;

  /// Forgets a join that needs nothing more.
  void forget_if_done(const std::shared_ptr<tp_join>& j);
};

/// Passes one step to another rank's shard and its answer back. Rank 0's
/// shard talks to the other ranks through these (event-based, not detached)
/// actors rather than itself: when the detached shard sent its requests to
/// the other node itself, about 1 run in 10 of `troupe bench --tp-peer`
/// left it with one strong reference after it stopped (found with a
/// refcount dump), and CAF's shutdown waits for every detached actor's
/// last reference, so the process never exited. With these in between, 25
/// runs of 25 exited.
using tp_forwarder = caf::typed_actor<caf::replies_to<step_atom, step_batch>::with<step_output>>;

/// The behaviour of a forwarder to `peer`.
tp_forwarder::behavior_type forwarder_impl(tp_forwarder::pointer self, shard_actor peer);
/// The behaviour of a forwarder to rank 0's peer `p` (rank p + 1) of `g`,
/// whoever it is when a step comes (a rank may move).
tp_forwarder::behavior_type peer_forwarder_impl(tp_forwarder::pointer self,
                                                std::shared_ptr<tp_group> g, std::size_t p);

/// Sends the step to the other ranks of rank 0's group (their copies
/// without the logits; image embeddings and the previous stage's
/// activations pushed to each rank's process).
/// `self` is rank 0's shard and `joins` its open joins (in its state).
kernels::result<std::shared_ptr<tp_join>> forward_step(shard_actor::pointer self, tp_joins& joins,
                                                       stage_resources& res, step_batch& b,
                                                       const std::vector<tp_forwarder>& forwarders);

}  // namespace stage_detail

}  // namespace troupe::actors
