#pragma once

// The device an actor computes on, opened from its manifest name. Every
// actor placed on a device shares one kernels::device (its worker team
// pinned to its cores, its memory pool, and the run lock that hands the
// team to one actor at a time, for a shard's step or an encoder's batch):
// two teams on the same cores would oversubscribe them, each spinning while
// the other needs the core.

#include <functional>
#include <memory>
#include <string>

#include "actors/device_spec.hpp"
#include "kernels/device.hpp"

namespace troupe::actors {

/// A device for `spec` (checked by parse_devices): a CPU device with one
/// worker per core of the spec, pinned (every hardware thread, unpinned,
/// for plain "cpu"); the GPU of "cuda:N" (an error when this machine or
/// build has none); or what the opener registered for its kind made.
kernels::result<std::shared_ptr<kernels::device>> open_device(const device_spec& spec);

/// Makes the device KIND:N of a backend that is not built into troupe
/// (a test's device whose memory host code cannot touch, a vendor's NPU).
using device_opener =
    std::function<kernels::result<std::shared_ptr<kernels::device>>(const device_spec&)>;
/// Registers `open` for device names "KIND" and "KIND:N" in this process;
/// "cpu", "cuda" and "npu" are refused. A second registration replaces
/// the first.
kernels::result<void> register_device_kind(const std::string& kind, device_opener open);

}  // namespace troupe::actors
