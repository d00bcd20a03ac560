#pragma once

// How many replicas of a modality encoder to run, from its load: the pure
// decision behind `[encoders.vision]` (docs/manifest.md). The head feeds
// it one sample per heartbeat (images waiting, images answered since the
// last sample and their summed wait) and adds or drains a replica when it
// says so. Up: overloaded (too many images waiting per replica, or their
// mean wait too long) for `up_after_s` without a break. Down: so lightly
// loaded that one replica fewer would still be far from overloaded, for
// `down_after_s` (the cooldown) without a break. Time comes from the
// clock it is given, so tests step it by hand.

#include <cstdint>
#include <optional>
#include <string>

#include "actors/core/clock.hpp"

namespace troupe::actors::core {

struct encoder_scaling {
  int min = 1;  ///< replicas at least (1 or more)
  int max = 1;  ///< replicas at most (min or more)
  /// Overloaded past this many images waiting (sent to an encoder, not
  /// yet answered) per replica ...
  double up_queue = 4;
  /// ... or past this mean wait per image (sent until answered), over the
  /// images answered since the last sample.
  double up_latency_ms = 1000;
  double up_after_s = 2;     ///< overloaded this long: one replica more
  double down_after_s = 60;  ///< underloaded this long: one replica fewer
};

/// One sample of an encoder service's load.
struct encoder_load {
  int replicas = 0;           ///< serving now
  std::int64_t waiting = 0;   ///< images sent and not yet answered, now
  std::int64_t answered = 0;  ///< images answered since the last sample
  double wait_ms = 0;         ///< their waits, summed
};

/// What the scaler wants after a sample.
struct scale_decision {
  int replicas = 0;    ///< the count it wants (the sample's when no change)
  std::string reason;  ///< why it changes (empty: no change)
};

class encoder_scaler {
 public:
  encoder_scaler(encoder_scaling opt, const clock& clk);

  /// Takes a sample and says how many replicas the service should run. A
  /// change asked for starts both timers over (the next one needs its
  /// full time again).
  scale_decision observe(const encoder_load& load);

  /// Forgets the timers (a replica was lost or added by other means).
  void restart();

  const encoder_scaling& options() const { return opt_; }

 private:
  encoder_scaling opt_;
  const clock* clk_;
  std::optional<time_point> over_since_, under_since_;
};

/// Clamps the options into a usable range (min >= 1, max >= min, the
/// thresholds and times not negative).
encoder_scaling sanitized(encoder_scaling o);

}  // namespace troupe::actors::core
