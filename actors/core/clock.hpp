#pragma once

// The clock seam (LevelDB's Env, for time only): the pure cores read the
// time from a `clock` they are given and never sleep or set timers; they
// say when they next need to run (`next_wakeup`) and their actor shells
// arrange it (CAF's delayed_send, or a test coordinator's virtual time).
// The runtime hands its cores the actor system's clock (actors/clock.hpp);
// tests drive a `manual_clock` and step it forward by hand.

#include <chrono>

namespace troupe::actors::core {

using steady = std::chrono::steady_clock;
using time_point = steady::time_point;
using duration = steady::duration;

/// Milliseconds from `a` to `b`.
inline double ms_between(time_point a, time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

/// Where a core reads the time.
class clock {
 public:
  virtual ~clock() = default;
  virtual time_point now() const = 0;
};

/// A clock that moves only when told to: for tests.
class manual_clock final : public clock {
 public:
  /// Starts at an arbitrary, fixed point (not the epoch, so that code
  /// subtracting durations from `now()` stays well defined).
  manual_clock() : now_(time_point{} + std::chrono::hours(1)) {}
  time_point now() const override { return now_; }
  void advance(duration d) { now_ += d; }

 private:
  time_point now_;
};

}  // namespace troupe::actors::core
