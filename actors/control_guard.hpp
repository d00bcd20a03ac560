#pragma once

// What the control plane's connections may cost before CAF sees them.
//
// CAF 0.17 (libcaf_io, libcaf_openssl; Debian's, not patchable) reads a
// 32-byte BASP header and then allocates the payload length it announces,
// up to 4 GiB, before any of it arrives; and it keeps every accepted
// connection, with its TLS state, for as long as the peer leaves it open
// before finishing the handshake. troupe's code in front of those calls
// (actors/gatekeeper.cpp wraps SSL_read/SSL_accept/SSL_free; the socket
// calls are wrapped in transport/ucx_gate.cpp) asks these two classes:
//
// - basp_stream_guard follows one connection's decrypted byte stream as
//   header / payload / header ... and refuses a header announcing more than
//   a control message may be, or more than the process's budget of
//   announced-but-unread payload bytes has left (so many connections
//   announcing large messages at once cannot add up either);
// - connection_admission counts accepted connections that have not
//   finished their TLS handshake, per peer address and in all, refuses
//   those over the caps at once, and names those past their deadline.
//
// Both are plain C++ without CAF or sockets, so tests and the fuzzers
// drive them directly.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace troupe::actors {

/// A BASP (CAF 0.17) header: operation, 2 padding bytes, flags, payload
/// length (big endian), operation data, source and destination actor ids.
inline constexpr std::size_t basp_header_bytes = 32;
/// The largest control-plane message: a job with its images (the gateway
/// caps request bodies at 96 MiB, docs/serve.md) fits with room.
inline constexpr std::uint32_t max_control_message_bytes = 128u << 20;
/// Payload bytes announced and not yet read, over all connections of a
/// process, at most.
inline constexpr std::uint64_t control_payload_budget = 512ull << 20;

class basp_stream_guard {
 public:
  /// `budget` counts announced-but-unread payload bytes across the
  /// process's connections (shared; may be null for no shared budget).
  explicit basp_stream_guard(std::atomic<std::uint64_t>* budget = nullptr,
                             std::uint32_t max_payload = max_control_message_bytes,
                             std::uint64_t budget_limit = control_payload_budget);
  ~basp_stream_guard();
  basp_stream_guard(const basp_stream_guard&) = delete;
  basp_stream_guard& operator=(const basp_stream_guard&) = delete;

  /// Follows bytes as they were read from the connection. Returns why the
  /// connection must close, once a header announces too much; from then on
  /// every call returns it again.
  std::optional<std::string> feed(std::span<const std::uint8_t> bytes);

  /// Payload bytes this connection announced and has not delivered yet.
  std::uint64_t outstanding() const { return payload_left_; }
  std::uint64_t messages() const { return messages_; }

 private:
  void release_budget();

  std::atomic<std::uint64_t>* budget_;
  std::uint32_t max_payload_;
  std::uint64_t budget_limit_;
  std::uint8_t header_[basp_header_bytes]{};
  std::size_t header_have_ = 0;
  std::uint64_t payload_left_ = 0;
  std::uint64_t messages_ = 0;
  std::optional<std::string> refused_;
};

class connection_admission {
 public:
  using clock = std::chrono::steady_clock;
  struct limits {
    std::size_t per_address = 32;  ///< handshakes in progress from one address
    std::size_t total = 128;       ///< handshakes in progress in all
    std::chrono::milliseconds handshake_deadline{10000};
  };
  enum class verdict { admit, refuse_address, refuse_total };

  connection_admission() = default;
  explicit connection_admission(limits l) : limits_(l) {}

  /// A connection was accepted from `address`: counted, or refused (then
  /// not counted: the caller closes it).
  verdict accepted(int fd, const std::string& address, clock::time_point now);
  /// Its handshake finished: no longer counted.
  void authenticated(int fd);
  /// It was closed (whatever its state).
  void closed(int fd);
  /// Connections still in their handshake past the deadline; each is named
  /// once (the caller shuts it down; it stays counted until closed).
  std::vector<int> overdue(clock::time_point now);

  std::size_t pending() const { return pending_.size(); }
  std::size_t pending_from(const std::string& address) const;
  const limits& caps() const { return limits_; }

 private:
  struct entry {
    std::string address;
    clock::time_point since;
    bool expired = false;
  };
  limits limits_{};
  std::map<int, entry> pending_;
  std::map<std::string, std::size_t> per_address_;
};

const char* to_string(connection_admission::verdict v);

}  // namespace troupe::actors
