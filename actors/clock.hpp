#pragma once

// The actors' side of the clock seam (actors/core/clock.hpp): a shell
// hands its core the actor system's clock, so that under CAF's
// test_coordinator (virtual time) the core and the shell's timers see the
// same time.

#include <caf/actor_clock.hpp>

#include "actors/core/clock.hpp"

namespace troupe::actors {

using core::ms_between;
using core::steady;

/// A core::clock reading a CAF actor clock (the system's, or a test
/// coordinator's virtual one).
class actor_clock_source final : public core::clock {
 public:
  explicit actor_clock_source(const caf::actor_clock& c) : clock_(&c) {}
  core::time_point now() const override { return clock_->now(); }

 private:
  const caf::actor_clock* clock_;
};

}  // namespace troupe::actors
