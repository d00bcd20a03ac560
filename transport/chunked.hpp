#pragma once

// Chunked, double-buffered tensor transfers over any engine's tagged
// messages. The sender posts a Cap'n Proto header (transport/wire.hpp) and
// the tensor as chunks, keeping `window` chunks in flight; the receiver
// validates the header against what it expects before it accepts a byte,
// then receives chunk i+1 (and up to window-1 more) while its consumer
// works on chunk i.
//
// Tags: the transfer id fills the high 48 bits, the low 16 bits are the
// chunk index (0xffff: the header).

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "transport/engine.hpp"
#include "transport/wire.hpp"

namespace troupe::transport {

constexpr std::uint64_t max_transfer_id = (std::uint64_t{1} << 48) - 1;
constexpr std::uint64_t chunk_tag(std::uint64_t transfer_id, std::uint32_t index) {
  return (transfer_id << 16) | (index & 0xffffu);
}
constexpr std::uint64_t header_tag(std::uint64_t transfer_id) {
  return chunk_tag(transfer_id, 0xffff);
}

struct chunk_options {
  std::size_t chunk_bytes = std::size_t{1} << 20;
  unsigned window = 2;                       ///< chunks in flight (2: double buffering)
  std::chrono::milliseconds timeout{30000};  ///< per operation
  wire_limits limits;
};

/// One chunk handed to a receiver's consumer; `data` is valid only during
/// the call.
struct chunk_view {
  std::uint32_t index = 0;
  std::uint64_t offset = 0;
  const void* data = nullptr;
  std::size_t bytes = 0;
};

/// Sends one tensor. `start` posts the header and the first chunks and
/// returns at once, so the caller can compute while they move; `progress`
/// keeps the window full; `finish` waits for the rest. `data` must stay
/// valid until finish (or the destructor) returns.
class tensor_sender {
 public:
  tensor_sender(transfer_engine& engine, peer_id peer, tensor_header header, const void* data,
                chunk_options opt = {});
  ~tensor_sender();
  tensor_sender(const tensor_sender&) = delete;
  tensor_sender& operator=(const tensor_sender&) = delete;

  result<void> start();
  /// Polls without blocking; true once every chunk is delivered.
  result<bool> progress();
  result<void> finish();
  const tensor_header& header() const { return header_; }

 private:
  result<void> post_next();
  transfer_engine& engine_;
  peer_id peer_;
  tensor_header header_;
  const std::uint8_t* data_;
  chunk_options opt_;
  std::vector<std::uint8_t> header_bytes_;
  std::vector<op_handle> in_flight_;  // header first, then chunks in order
  std::uint32_t next_chunk_ = 0;
  bool started_ = false;
};

class tensor_receiver {
 public:
  /// `expected`: transfer id, payload, dtype and shape the header must
  /// carry (chunk fields are the sender's choice, within opt.limits).
  tensor_receiver(transfer_engine& engine, tensor_header expected, chunk_options opt = {});
  ~tensor_receiver();
  tensor_receiver(const tensor_receiver&) = delete;
  tensor_receiver& operator=(const tensor_receiver&) = delete;

  /// Posts the header receive (call early so it is waiting).
  result<void> start();
  /// Receives every chunk into `window` staging buffers and calls
  /// `consume` for each in order while the next ones arrive. An error from
  /// the consumer stops the transfer and is returned.
  result<tensor_header> receive(const std::function<result<void>(const chunk_view&)>& consume);
  /// Receives straight into `dst` (capacity checked against the header).
  result<tensor_header> receive_into(void* dst, std::size_t capacity);

 private:
  result<tensor_header> take_header();
  // Posts chunk receives into dest(i), `window` ahead, and calls done(i,
  // bytes) for each in order once it has arrived whole.
  result<void> receive_chunks(const tensor_header& h, std::size_t window,
                              const std::function<void*(std::uint32_t)>& dest,
                              const std::function<result<void>(std::uint32_t, std::size_t)>& done);
  transfer_engine& engine_;
  tensor_header expected_;
  chunk_options opt_;
  std::vector<std::uint8_t> header_buf_;
  std::vector<op_handle> ops_;
  op_handle header_op_ = 0;
};

/// Blocking helpers.
result<void> send_tensor(transfer_engine& engine, peer_id peer, const tensor_header& header,
                         const void* data, const chunk_options& opt = {});
result<tensor_header> receive_tensor(transfer_engine& engine, const tensor_header& expected,
                                     void* dst, std::size_t capacity,
                                     const chunk_options& opt = {});

}  // namespace troupe::transport
