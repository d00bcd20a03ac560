#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kernels/status.hpp"

namespace troupe::actors {

/// A device an actor is pinned to. CPU devices are core sets: "cpu" (every
/// core this process may use), "cpu:2" (core 2), "cpu:0-3" (cores 0..3).
/// GPUs are "cuda:N" ("cuda" is cuda:0); a backend registered with
/// register_device_kind is "KIND:N".
struct device_spec {
  std::string name;          ///< "cpu:0-3", "cuda:0" (cuda written alone becomes cuda:0)
  std::vector<int> cores;    ///< CPU devices; empty: every allowed core
  std::string kind = "cpu";  ///< "cpu", "cuda" or a registered kind
  int index = 0;             ///< the N of KIND:N (not for CPU devices)
};

/// Parses a comma-separated device list ("cpu:0-0,cpu:1-1", "cpu:0-0,cuda:0").
/// Checks the cores exist and are allowed for this process, that no two
/// devices share a core and that no device is named twice. Whether a GPU
/// exists is checked when it is opened (open_device). NPU devices are
/// refused: no backend runs on them.
kernels::result<std::vector<device_spec>> parse_devices(std::string_view list);

/// Whether `kind` names a backend registered with register_device_kind
/// (actors/device.hpp).
bool device_kind_registered(const std::string& kind);

/// Binds the calling thread to `cores` (no-op when empty).
void pin_current_thread(const std::vector<int>& cores);

}  // namespace troupe::actors
