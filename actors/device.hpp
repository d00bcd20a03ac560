#pragma once

// The device an actor computes on, opened from its manifest name. Every
// actor placed on a device shares one kernels::device (its worker team
// pinned to its cores, its memory pool, and the run lock that hands the
// team to one actor at a time, for a shard's step or an encoder's batch):
// two teams on the same cores would oversubscribe them, each spinning while
// the other needs the core.

#include <memory>

#include "actors/device_spec.hpp"
#include "kernels/device.hpp"

namespace troupe::actors {

/// A device for `spec`: one worker per core of the spec, pinned (every
/// hardware thread, unpinned, for plain "cpu"). The spec was checked by
/// parse_devices; only CPU devices are opened until a GPU backend exists.
std::shared_ptr<kernels::device> open_device(const device_spec& spec);

}  // namespace troupe::actors
