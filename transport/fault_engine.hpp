#pragma once

// A transfer engine that wraps any other and injects faults into chosen
// operations, for tests of what sits on the data plane (chunked tensors,
// the actors' data plane, migration, failover): LevelDB's
// fault_injection_test, for transfers. Everything else goes through to
// the wrapped engine unchanged.
//
// A rule picks operations by kind (and the n-th such operation, or every
// one) and does one of:
// - fail: post answers an error, as if the peer's endpoint broke;
// - drop: the operation never reaches the wrapped engine; it stays in
//   flight until its timeout, then fails with a timeout error (a message
//   lost on the way);
// - delay: the operation reaches the wrapped engine only after a delay;
// - truncate: a send moves only its first `bytes` bytes.

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string_view>
#include <vector>

#include "transport/engine.hpp"

namespace troupe::transport {

enum class fault_kind : std::uint8_t { fail, drop, delay, truncate };

struct fault_rule {
  op_kind kind = op_kind::send;  ///< which operations
  std::size_t min_bytes = 0;     ///< ... of at least this size (smaller ones are not counted)
  std::uint64_t nth = 0;         ///< the n-th of them from 1 (0: every one)
  fault_kind what = fault_kind::fail;
  std::chrono::milliseconds delay{0};  ///< delay
  std::size_t bytes = 0;               ///< truncate: bytes left
};

/// Rules from text, for a process started by a test (`troupe node` reads
/// TROUPE_DATA_PLANE_FAULTS): comma-separated `KIND:NTH:WHAT[:ARG][:min=BYTES]`
/// with KIND send|recv|put|get, NTH a count from 1 or 0 for every one,
/// WHAT fail|drop|delay|truncate, ARG the delay in ms or the bytes kept.
/// Example: "send:1:fail:min=65536" fails the first send of 64 KiB or more.
result<std::vector<fault_rule>> parse_fault_rules(std::string_view text);

class fault_engine final : public transfer_engine {
 public:
  explicit fault_engine(std::shared_ptr<transfer_engine> inner,
                        std::chrono::milliseconds default_timeout = std::chrono::seconds(30));

  /// Adds a rule; the first rule that matches an operation applies.
  void inject(fault_rule rule);
  /// Operations a rule applied to so far.
  std::size_t injected() const;

  const char* name() const override { return "fault"; }
  std::uint32_t capabilities() const override { return inner_->capabilities(); }
  std::vector<std::uint8_t> address() const override { return inner_->address(); }
  result<peer_id> connect(std::span<const std::uint8_t> peer_address) override {
    return inner_->connect(peer_address);
  }
  void disconnect(peer_id peer, bool gone) override { inner_->disconnect(peer, gone); }
  result<region_handle> expose(void* data, std::size_t bytes, remote_region& out) override {
    return inner_->expose(data, bytes, out);
  }
  void unexpose(region_handle region) override { inner_->unexpose(region); }
  result<op_handle> prepare(const op_spec& spec) override;
  result<void> post(op_handle op) override;
  result<op_status> poll(op_handle op) override;
  result<op_status> wait(op_handle op, std::chrono::milliseconds limit) override;
  void release(op_handle op) override;
  std::size_t live_ops() const override;
  std::size_t live_regions() const override { return inner_->live_regions(); }

 private:
  using clock = std::chrono::steady_clock;
  struct op {
    op_handle inner = 0;  ///< 0: none (dropped, or prepared later)
    op_spec spec;
    std::optional<fault_kind> fault;
    std::chrono::milliseconds delay{0};
    bool posted = false;
    bool inner_posted = false;
    clock::time_point posted_at;
  };
  result<op_status> advance(op& o);

  std::shared_ptr<transfer_engine> inner_;
  std::chrono::milliseconds default_timeout_;
  mutable std::mutex mtx_;
  std::vector<fault_rule> rules_;
  std::map<std::ptrdiff_t, std::uint64_t> seen_;  ///< per rule: operations it could pick
  std::map<op_handle, op> ops_;
  op_handle next_ = 1;
  std::size_t injected_ = 0;
};

}  // namespace troupe::transport
