#pragma once

// The UCX (ucp) engine: one context and one worker per engine (a process
// makes one), one endpoint per connected peer. Tagged messages for
// activations; RMA put/get into memory a peer exposed for one transfer.
// UCX picks shared memory (posix/sysv/cma) between local processes and TCP
// between hosts; `tls` restricts it (e.g. "tcp" across network namespaces,
// which share IPC and would otherwise be joined by shared memory).
//
// Waiting sleeps on the worker's event fd (ucp_worker_arm + poll), so an
// idle process does not spin a core; a progress thread (on by default)
// serves peers' RMA into exposed memory while the owner computes.
//
// Failure handling: every operation has a deadline; past it a receive is
// cancelled and a send/put/get fails, its peer is marked failed and its
// endpoint closed, so nothing waits forever on a dead peer. With
// `peer_errors` (UCP_ERR_HANDLING_MODE_PEER) UCX also reports a peer's
// death as soon as a transport notices it; in UCX 1.13 that mode excludes
// the shared-memory transports, so it is on by default only when they are
// excluded anyway (tls without shm).
//
// Peer addresses and region keys are framed with a magic and a checksum
// and bounds-checked before UCX sees them; they come from cluster members
// over the (TLS-authenticated) control plane.

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "transport/engine.hpp"
#include "transport/ucx_gate.hpp"

namespace troupe::transport {

struct ucx_options {
  std::string tls;          ///< UCX_TLS for this engine ("" = UCX's default / the environment)
  std::string net_devices;  ///< UCX_NET_DEVICES ("" = default)
  /// The cluster's data-plane key: arms the process's gate in front of
  /// UCX's TCP transport (transport/ucx_gate.hpp), so only peers holding
  /// it can connect. Unset: no gate (tests of the transport itself).
  std::optional<data_plane_key> access_key;
  /// UCP_ERR_HANDLING_MODE_PEER; unset: on when `tls` names no shared
  /// memory transport.
  std::optional<bool> peer_errors;
  std::chrono::milliseconds default_timeout{30000};
  /// Sleep on the event fd while waiting (false: busy-poll, lowest latency).
  bool sleep_when_idle = true;
  /// A thread that progresses the worker whenever it has events, so that
  /// peers' puts and gets into exposed memory and rendezvous sends complete
  /// while this process computes (without RDMA hardware UCX emulates RMA
  /// with messages the target must progress). It sleeps on the event fd
  /// (or spins when !sleep_when_idle).
  bool progress_thread = true;
  /// The progress thread takes over once no thread has been inside wait()
  /// for this long (between the waits of a stream of messages it stays
  /// asleep).
  std::chrono::microseconds progress_quiet{1000};
  /// How long `wait` keeps progressing without an event before it sleeps
  /// on the event fd. Every event starts the spin again, so a long
  /// transfer (a stream of TCP segments or rendezvous fragments) is not
  /// slept through piecemeal, and an idle wait sleeps after this long.
  std::chrono::microseconds spin_before_sleep{1000};
};

/// The network interface that carries `host` (a name or an address of
/// this machine), for UCX_NET_DEVICES: "lo" for 127.0.0.1. UCX's TCP
/// transport then listens on that interface's address only. An error when
/// no interface of this machine has that address.
result<std::string> net_device_for_host(const std::string& host);

class ucx_engine final : public transfer_engine {
 public:
  static result<std::unique_ptr<ucx_engine>> create(const ucx_options& options = {});
  ~ucx_engine() override;

  const char* name() const override { return "ucx"; }
  std::uint32_t capabilities() const override;
  std::vector<std::uint8_t> address() const override;
  result<peer_id> connect(std::span<const std::uint8_t> peer_address) override;
  void disconnect(peer_id peer, bool gone) override;
  result<region_handle> expose(void* data, std::size_t bytes, remote_region& out) override;
  void unexpose(region_handle region) override;
  result<op_handle> prepare(const op_spec& spec) override;
  result<void> post(op_handle op) override;
  result<op_status> poll(op_handle op) override;
  result<op_status> wait(op_handle op, std::chrono::milliseconds limit) override;
  void release(op_handle op) override;
  std::size_t live_ops() const override;
  std::size_t live_regions() const override;

  /// Released operations whose UCX requests have not completed yet. They
  /// complete (and are freed) when the peer answers or its endpoint is
  /// force-closed; with shared memory and no peer error handling, UCX 1.13
  /// completes neither a rendezvous send to a dead peer nor a forced close
  /// of its endpoint (measured), so those few requests (at most the
  /// transfer's window) stay until the engine is destroyed.
  std::size_t stuck_requests() const;

  /// Whether UCP_ERR_HANDLING_MODE_PEER is in use.
  bool peer_errors() const;
  /// The transports UCX chose for a connected peer (ucp_ep_print_info's
  /// lanes, condensed), for logs and benchmarks.
  std::string describe_peer(peer_id peer) const;

  struct impl;

 private:
  explicit ucx_engine(std::unique_ptr<impl> p);
  std::unique_ptr<impl> p_;
};

}  // namespace troupe::transport
