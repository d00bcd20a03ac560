#pragma once

// The in-process engine: engines in one process exchange buffers through a
// process-wide hub. A receive posted without a buffer (local = nullptr)
// is handed the sender's buffer itself, zero copies; the send completes
// when the receiver releases its receive, so the sender's buffer stays
// valid while the receiver reads it. A receive with a buffer gets a copy.
// Put/get copy into and out of an exposed region, bounds-checked.
// Same contract as the UCX engine, so code and tests run on either.

#include <chrono>
#include <memory>

#include "transport/engine.hpp"

namespace troupe::transport {

class inproc_engine final : public transfer_engine {
 public:
  explicit inproc_engine(
      std::chrono::milliseconds default_timeout = std::chrono::milliseconds(30000));
  ~inproc_engine() override;

  const char* name() const override { return "inproc"; }
  std::uint32_t capabilities() const override { return capability::rma | capability::zero_copy; }
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

  struct impl;

 private:
  std::unique_ptr<impl> p_;
};

}  // namespace troupe::transport
