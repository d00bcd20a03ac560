#pragma once

// The data plane's one interface. An engine moves bytes between this
// process and its peers: tagged messages (send/recv) for activations, and
// one-sided RMA (put/get) into memory a peer exposed for one transfer
// (weights, KV blocks). Every operation goes prepare -> post -> poll (or
// wait) -> release; nothing is freed behind the caller's back, and a
// failed or timed-out operation reports why.
//
// transport/ never includes CAF: an engine's address is opaque bytes that
// the actor layer carries to the peer, which passes them to `connect`.
// Engines: in-process (transport/inproc_engine.hpp), UCX
// (transport/ucx_engine.hpp), NCCL (transport/nccl.hpp, collectives only).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.hpp"

namespace troupe::transport {

using kernels::errc;
using kernels::error;
using kernels::make_error;
using kernels::result;

/// What an engine can do (bit set).
enum class capability : std::uint32_t {
  remote = 1u << 0,       ///< reaches other processes / hosts
  rma = 1u << 1,          ///< one-sided put/get into exposed memory
  collectives = 1u << 2,  ///< all-reduce and friends (NCCL)
  zero_copy = 1u << 3,    ///< a receive can hand over the sender's buffer itself
};
constexpr std::uint32_t operator|(capability a, capability b) {
  return static_cast<std::uint32_t>(a) | static_cast<std::uint32_t>(b);
}
constexpr std::uint32_t operator|(std::uint32_t a, capability b) {
  return a | static_cast<std::uint32_t>(b);
}
constexpr bool has(std::uint32_t caps, capability c) {
  return (caps & static_cast<std::uint32_t>(c)) != 0;
}

using peer_id = std::uint32_t;    ///< an engine-local index of a connected peer
using op_handle = std::uint64_t;  ///< an engine-local index of a prepared operation
using region_handle = std::uint64_t;

/// Memory exposed to peers for RMA during one transfer: `key` is what a
/// peer needs to reach it (for UCX: the packed rkey plus the region's
/// bounds); it is worthless once the owner releases the region.
struct remote_region {
  std::vector<std::uint8_t> key;
  std::uint64_t bytes = 0;
};

enum class op_kind : std::uint8_t { send, recv, put, get };
const char* to_string(op_kind k);

/// One operation. For send/recv `tag` matches the two sides (a full 64-bit
/// match); for put/get `remote` and `remote_offset` name the target bytes.
struct op_spec {
  op_kind kind = op_kind::send;
  peer_id peer = 0;  ///< ignored by recv (matched by tag from any peer)
  std::uint64_t tag = 0;
  void* local = nullptr;  ///< recv on a zero-copy engine: may be null (see op_status)
  std::size_t bytes = 0;
  const remote_region* remote = nullptr;  ///< put/get; must outlive prepare
  std::uint64_t remote_offset = 0;
  /// The operation fails with a timeout error this long after `post`
  /// unless it completed (0: the engine's default).
  std::chrono::milliseconds timeout{0};
};

enum class op_state : std::uint8_t { prepared, in_flight, done, failed };

struct op_status {
  op_state state = op_state::prepared;
  std::size_t bytes = 0;  ///< bytes received (recv), else the size moved
  const void* data =
      nullptr;    ///< recv with a null `local` on a zero-copy engine: the sender's buffer
  error failure;  ///< set when state == failed
};

class transfer_engine {
 public:
  virtual ~transfer_engine() = default;
  transfer_engine() = default;
  transfer_engine(const transfer_engine&) = delete;
  transfer_engine& operator=(const transfer_engine&) = delete;

  virtual const char* name() const = 0;
  virtual std::uint32_t capabilities() const = 0;

  /// This engine's address, for peers' `connect`.
  virtual std::vector<std::uint8_t> address() const = 0;
  /// Connects to a peer from its address bytes (validated: garbage gives an
  /// error, never a crash).
  virtual result<peer_id> connect(std::span<const std::uint8_t> peer_address) = 0;
  /// Forgets a peer; its operations in flight fail. `gone`: the peer is
  /// known to be dead or restarted (lost by the cluster), so nothing is
  /// flushed to it and whatever of it was mapped (shared memory) goes now;
  /// otherwise the connection is closed gracefully.
  virtual void disconnect(peer_id peer, bool gone) = 0;

  /// Exposes [data, data + bytes) to peers for RMA until `unexpose`.
  virtual result<region_handle> expose(void* data, std::size_t bytes, remote_region& out) = 0;
  virtual void unexpose(region_handle region) = 0;

  /// Checks `spec` and reserves what the operation needs; nothing moves yet.
  virtual result<op_handle> prepare(const op_spec& spec) = 0;
  /// Starts a prepared operation.
  virtual result<void> post(op_handle op) = 0;
  /// Progresses the engine and reports the operation's state (never blocks).
  virtual result<op_status> poll(op_handle op) = 0;
  /// Blocks until the operation is done or failed, or `limit` passes
  /// (then the state is still in_flight). Sleeps on the engine's event
  /// source instead of spinning where the engine has one.
  virtual result<op_status> wait(op_handle op, std::chrono::milliseconds limit) = 0;
  /// Frees the operation (cancels it if still in flight).
  virtual void release(op_handle op) = 0;

  /// Operations prepared and not yet released, and exposed regions (leak
  /// checks).
  virtual std::size_t live_ops() const = 0;
  virtual std::size_t live_regions() const = 0;
};

/// Posts then waits until done; an error when it failed or timed out. The
/// operation is released either way.
result<op_status> run_op(transfer_engine& engine, const op_spec& spec);

}  // namespace troupe::transport
