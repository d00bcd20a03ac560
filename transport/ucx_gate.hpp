#pragma once

// The gate in front of UCX's TCP transport: no stranger speaks UCP to a
// troupe process.
//
// Why it exists. UCX 1.13's wire protocol trusts its peers: endpoint and
// request ids travel as raw pointers (ucs_ptr_map's direct keys) that the
// receiver dereferences, so a peer that reaches a worker can crash it (a
// rendezvous RTS with a made-up id segfaults in ucp_rndv_receive), or
// deliver its own bytes into a posted receive with a guessed tag. UCX's TCP
// transport listens on every interface it uses and accepts anyone: there is
// no hook to check a peer before UCP parses what it sends.
//
// What it does. When armed with the cluster's data-plane key
// (`dataplane.key` beside the certificates), every TCP connection UCX
// opens starts with a proof, and every connection UCX accepts must show one
// before UCX reads a byte of it:
//
//   magic "TRPGATE1" | unix seconds (8 bytes, little endian) |
//   HMAC-SHA256(key, "troupe ucx gate v1" | client address | server address | seconds)
//
// The addresses are the connection's own (IP and port of both ends), so a
// proof is good for one connection only, and the time bounds how long it is
// good. The gate sits in the socket calls libucs makes (connect, accept,
// send, sendmsg, recv, close; troupe defines them and forwards to libc, as
// actors/gatekeeper.cpp does for caf_openssl's SSL_read). Calls from
// anything but libucs, and sockets UCX did not open, pass untouched. An
// accepted connection whose proof is wrong, late or absent looks reset to
// UCX, which drops it; UCX's shared-memory transports are not network
// reachable and are not gated (their segments are the user's, mode 0600).
//
// Unarmed (no key: the transport's own tests, `troupe worker`), the gate
// passes everything through.

#include <sys/socket.h>
#include <array>
#include <cstdint>
#include <span>
#include <string>

namespace troupe::transport {

using data_plane_key = std::array<std::uint8_t, 32>;

inline constexpr std::size_t gate_proof_bytes = 48;
using gate_proof = std::array<std::uint8_t, gate_proof_bytes>;

/// How long a proof stays good (either way, for clock skew between hosts).
inline constexpr std::int64_t gate_proof_window_s = 120;

/// Arms the process's gate with `key` (the first engine made with a key
/// does this; a second, different key is refused: one cluster per process).
/// Returns false when a different key is already armed.
bool arm_ucx_gate(const data_plane_key& key);
bool ucx_gate_armed();

struct ucx_gate_counters {
  std::uint64_t admitted = 0;  ///< accepted connections whose proof held
  std::uint64_t refused = 0;   ///< accepted connections dropped (bad or no proof)
  std::uint64_t proved = 0;    ///< outgoing connections that sent a proof
};
ucx_gate_counters ucx_gate_stats();

/// The proof a client at `client` shows server `server` at `unix_seconds`.
/// Addresses are sockaddr_in or sockaddr_in6 (anything else: all zero).
gate_proof make_gate_proof(const data_plane_key& key, const sockaddr_storage& client,
                           const sockaddr_storage& server, std::int64_t unix_seconds);

enum class gate_verdict { ok, bad_magic, stale, bad_mac };
const char* to_string(gate_verdict v);

/// Checks bytes a client sent (exactly gate_proof_bytes of them).
gate_verdict check_gate_proof(const data_plane_key& key, std::span<const std::uint8_t> proof,
                              const sockaddr_storage& client, const sockaddr_storage& server,
                              std::int64_t now_unix_seconds);

/// The same wrappers serve the control plane's guard
/// (actors/control_guard.hpp): every socket accepted by a caller other
/// than libucs is shown to the accept observer (with the caller's return
/// address), which may refuse it (it is then closed before the caller sees
/// it, and the caller gets EAGAIN); every close is shown to the close
/// observer. Set once, before sockets are accepted.
using accept_observer = bool (*)(int fd, const void* caller);
using close_observer = void (*)(int fd);
void set_socket_observers(accept_observer on_accept, close_observer on_close);
/// Every IPv4/IPv6 connect() that starts or completes, by a caller other
/// than libucs, is shown to the connect observer with the address it
/// connects to and the caller's return address. Set once, before
/// connections are made.
using connect_observer = void (*)(int fd, const sockaddr* to, const void* caller);
void set_connect_observer(connect_observer on_connect);

}  // namespace troupe::transport
