#pragma once

// Collectives over any transfer engine's tagged messages, for tensor
// parallelism between CPU processes (GPU groups use NCCL instead): a ring
// all-reduce (reduce-scatter, then all-gather) of f32 sums. Every rank ends
// with bit-identical values (each element is summed once, in a fixed order
// set by the ring, then copied around). Messages of one collective carry
// its id, phase, step and the receiving rank in their tag, so concurrent
// collectives, and ranks sharing one in-process hub, never mix.

#include <atomic>
#include <chrono>
#include <cstdint>

#include "transport/engine.hpp"

namespace troupe::transport {

struct ring {
  transfer_engine* engine = nullptr;
  int rank = 0;
  int size = 1;
  peer_id next = 0;  ///< the engine's peer id of rank (rank + 1) % size
  std::chrono::milliseconds timeout{30000};
  /// When set (by whoever learns that a rank is gone), a collective in
  /// flight gives up within ~50 ms instead of waiting for its timeout.
  const std::atomic<bool>* abort = nullptr;
  /// How long a rank polls for its partner's data before it sleeps. The
  /// partner is computing the same layer, so the wait is usually short, and
  /// sleeping costs a wake-up per exchange (measured: TinyLlama TP=2 decode
  /// at 16 sequences, 218 ms per step with the engine's default 0.3 ms
  /// spin, 149 ms spinning 20 ms).
  std::chrono::microseconds spin{10000};
};

/// Sums `data[0, count)` over the ring's ranks in place. `collective_id`
/// (< 2^38) must be the same on every rank and unique among collectives in
/// flight. An error (a peer gone, a timeout) leaves `data` unspecified.
result<void> ring_allreduce_sum(const ring& r, float* data, std::size_t count,
                                std::uint64_t collective_id);

}  // namespace troupe::transport
