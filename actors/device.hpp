#pragma once

// One device's compute, shared by every actor placed on it: the worker team
// pinned to its cores (and its memory pool), and the lock that hands the
// team to one actor at a time, for a shard's step or an encoder's batch.
// Two teams on the same cores would oversubscribe them, each spinning while
// the other needs the core.

#include <memory>
#include <mutex>

#include "actors/device_spec.hpp"
#include "kernels/cpu/context.hpp"

namespace troupe::actors {

struct device_context {
  device_spec spec;
  std::shared_ptr<kernels::cpu::context> ctx;
  std::mutex run;  ///< held while an actor computes on the device

  /// A team of one worker per core of `spec` (every hardware thread for
  /// plain "cpu"), pinned when the device names its cores.
  static std::shared_ptr<device_context> create(const device_spec& spec);
};

}  // namespace troupe::actors
