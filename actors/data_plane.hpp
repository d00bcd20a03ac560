#pragma once

// The actors' data plane: where a `tensor_ref` is resolved. In one process
// a tensor is parked in the tensor registry and taken out by the receiver
// (zero copies). Across processes the sender pushes it at once over the
// process's transfer engine (UCX) as a chunked transfer tagged with the
// ref's transfer id, and the receiving actor, not finding the id in its
// own registry, receives it (header validated against the ref's dtype and
// shape). The messages do not change: the same `tensor_ref` travels in
// the CAF message either way.
//
// Transfer ids carry a per-process prefix, so refs from different
// processes never collide in a receiver.

#include <condition_variable>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>

#include "actors/protocol.hpp"
#include "kernels/device.hpp"
#include "kernels/memory_pool.hpp"
#include "kernels/tensor.hpp"
#include "transport/chunked.hpp"
#include "transport/engine.hpp"

namespace troupe::actors {

class data_plane {
 public:
  /// The process's data plane.
  static data_plane& local();

  data_plane();
  ~data_plane();
  data_plane(const data_plane&) = delete;
  data_plane& operator=(const data_plane&) = delete;

  /// Uses `engine` for transfers to and from other processes.
  void attach(std::shared_ptr<transport::transfer_engine> engine,
              transport::chunk_options opt = activation_chunks());
  /// Activations move as few large chunks (a prefill chunk's activations
  /// are a few MiB): 8 MiB chunks, 2 in flight.
  static transport::chunk_options activation_chunks() {
    transport::chunk_options o;
    o.chunk_bytes = std::size_t{8} << 20;
    o.window = 2;
    return o;
  }
  std::shared_ptr<transport::transfer_engine> engine() const;
  /// This process's engine address (empty without an engine).
  std::vector<std::uint8_t> address() const;

  /// Makes a peer process reachable under `key` (e.g. its CAF node id).
  kernels::result<void> connect(const std::string& key, std::span<const std::uint8_t> address);
  bool reachable(const std::string& key) const;
  /// The engine's peer id of `key` (for collectives over the same engine).
  std::optional<transport::peer_id> peer(const std::string& key) const;

  /// Hands `t` to a receiver in the process of `key`: "" (or this
  /// process's own key) parks it here, zero copies; any other key pushes it
  /// there. The one way actors send a tensor: nobody branches on where the
  /// receiver is.
  kernels::result<tensor_ref> send(const std::string& key, const std::string& device,
                                   kernels::tensor t);
  /// Parks `t` for a receiver in this process.
  tensor_ref park(const std::string& device, kernels::tensor t);
  /// Sends `t` to the process `key` now (the transfer proceeds in the
  /// background; `t` is held until it is delivered) and returns its ref.
  kernels::result<tensor_ref> push(const std::string& key, const std::string& device,
                                   kernels::tensor t);
  /// The tensor of `ref`: parked here, or received from the process that
  /// pushed it (into a new tensor from `pool`, a host pool); in host memory.
  kernels::result<kernels::tensor> take(const tensor_ref& ref, kernels::memory_pool& pool);
  /// The tensor of `ref` in `dev`'s memory, wherever it was made: a tensor
  /// parked here by an actor on another device is copied over (through the
  /// host where neither memory is the host's); one from another process is
  /// received into host memory and then written to the device (Debian's
  /// UCX has no CUDA transport).
  kernels::result<kernels::tensor> take(const tensor_ref& ref, kernels::device& dev);
  /// Closes the endpoint to the process `key` (gone: lost or restarted)
  /// and forgets it; pushes still in flight to it fail. A later connect
  /// makes a new endpoint.
  void forget(const std::string& key);
  /// Processes with an open endpoint.
  std::size_t peers() const;
  /// Drops a parked tensor that will not be taken.
  void drop(const tensor_ref& ref);

  /// Pushes still in flight; failed pushes so far (their errors are logged).
  std::size_t pushes_in_flight() const;
  std::size_t failed_pushes() const;
  /// Bytes pushed so far to each peer process, by key (`troupe:transfer_bytes_total`).
  std::map<std::string, std::uint64_t> bytes_sent() const;

 private:
  struct push_rec {
    kernels::tensor t;
    std::unique_ptr<transport::tensor_sender> sender;
  };
  void reap_loop();

  mutable std::mutex mtx_;
  std::condition_variable cv_;
  std::shared_ptr<transport::transfer_engine> engine_;
  transport::chunk_options opt_;
  std::map<std::string, transport::peer_id> peers_;
  std::list<push_rec> pushes_;
  std::size_t failed_ = 0;
  std::map<std::string, std::uint64_t> sent_;
  std::uint64_t prefix_ = 0;
  std::uint64_t next_ = 1;
  bool stop_ = false;
  std::thread reaper_;
};

}  // namespace troupe::actors

namespace troupe::actors {

/// Sets TCP_NODELAY on every TCP socket of this process. CAF 0.17's
/// middleman leaves Nagle's algorithm on, which holds a small step message
/// back until the peer's delayed ACK (~40 ms on Linux); on a listening
/// socket the option is inherited by the connections it accepts. Call after
/// publish / remote_actor. Returns how many sockets were changed.
int enable_tcp_nodelay_everywhere();

/// The data-plane key of `peer`'s process as seen from `self`'s: "" when it
/// is the same process (data_plane::send parks the tensor then).
inline std::string data_plane_key(const caf::node_id& self, const caf::node_id& peer) {
  return peer == self ? std::string{} : to_string(peer);
}

}  // namespace troupe::actors
