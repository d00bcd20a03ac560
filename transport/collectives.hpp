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

/// What a ring's all-reduces cost, summed since the ring was made (plain
/// values: a snapshot, or the difference of two).
struct allreduce_totals {
  std::uint64_t calls = 0;
  std::uint64_t bytes = 0;        ///< of the tensors reduced
  std::uint64_t exchanges = 0;    ///< send-and-receive steps (2 (ranks - 1) per call)
  std::uint64_t total_ns = 0;     ///< whole calls
  std::uint64_t exchange_ns = 0;  ///< the exchanges
  /// Per call, its exchanges times its fastest one: the exchanges at the
  /// pace of a transfer with nobody late.
  std::uint64_t paced_ns = 0;
  std::uint64_t reduce_ns = 0;  ///< the additions
  allreduce_totals operator-(const allreduce_totals& o) const {
    return {calls - o.calls,
            bytes - o.bytes,
            exchanges - o.exchanges,
            total_ns - o.total_ns,
            exchange_ns - o.exchange_ns,
            paced_ns - o.paced_ns,
            reduce_ns - o.reduce_ns};
  }
};

/// Where the time of one all-reduce went, on average. A rank that comes
/// late to a call (the ranks compute the same layer, unevenly) stalls the
/// exchanges that need its data, at whatever step of the ring they are;
/// the fastest exchange of a call is a transfer with nobody late. Hence:
/// transfer = the exchanges at that pace, waiting = the rest of the
/// exchanges' time, reduce = the additions.
struct allreduce_breakdown {
  double calls = 0;
  double total_us = 0, waiting_us = 0, transfer_us = 0, reduce_us = 0;
  double kib = 0;  ///< per call
};
allreduce_breakdown breakdown_of(const allreduce_totals& t);

/// Counters a ring adds to (any thread).
struct allreduce_stats {
  std::atomic<std::uint64_t> calls{0}, bytes{0}, exchanges{0}, total_ns{0}, exchange_ns{0},
      paced_ns{0}, reduce_ns{0};
  allreduce_totals snapshot() const {
    return {calls.load(),       bytes.load(),    exchanges.load(), total_ns.load(),
            exchange_ns.load(), paced_ns.load(), reduce_ns.load()};
  }
};

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
  /// Where the all-reduces' time goes (none: not counted).
  allreduce_stats* stats = nullptr;
};

/// Sums `data[0, count)` over the ring's ranks in place. `collective_id`
/// (< 2^38) must be the same on every rank and unique among collectives in
/// flight. An error (a peer gone, a timeout) leaves `data` unspecified.
result<void> ring_allreduce_sum(const ring& r, float* data, std::size_t count,
                                std::uint64_t collective_id);

}  // namespace troupe::transport
