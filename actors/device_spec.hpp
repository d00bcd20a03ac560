#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kernels/status.hpp"

namespace troupe::actors {

/// A device an actor is pinned to. CPU devices are core sets: "cpu" (every
/// core this process may use), "cpu:2" (core 2), "cpu:0-3" (cores 0..3).
struct device_spec {
  std::string name;        ///< as written, e.g. "cpu:0-3"
  std::vector<int> cores;  ///< empty: every allowed core
};

/// Parses a comma-separated device list ("cpu:0-0,cpu:1-1"). Checks the
/// cores exist and are allowed for this process and that no two devices
/// share a core. CUDA/NPU devices are refused with a clear message until
/// their backends run shards.
kernels::result<std::vector<device_spec>> parse_devices(std::string_view list);

/// Binds the calling thread to `cores` (no-op when empty).
void pin_current_thread(const std::vector<int>& cores);

}  // namespace troupe::actors
