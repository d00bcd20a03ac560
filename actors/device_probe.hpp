#pragma once

// What a node measures about its device when it starts, for the placement
// planner (placement/profile.hpp): the weight bandwidth a one-token GEMV
// reaches in each format with the kernels the stages run, GEMM throughput,
// and the memory troupe may use; and, at every heartbeat, how busy the
// device's cores are with work other than this process's.

#include <cstdint>
#include <vector>

#include "actors/device.hpp"
#include "actors/protocol.hpp"

namespace troupe::actors {

/// Measures `d` on its own worker team, holding its lock (~0.1-0.3 s).
/// `memory_limit` is the manifest's (0: the machine's available memory);
/// the node's resident memory now is subtracted from it.
device_probe measure_device(kernels::device& dev, std::int64_t memory_limit);

/// CPU time on a set of cores not spent by this process, as a share of
/// those cores' time since the previous sample (/proc/stat per core,
/// /proc/self/stat for this process). Cores empty: every core.
class foreign_load {
 public:
  explicit foreign_load(std::vector<int> cores);
  /// The share since the last call (or construction), in [0, 1]; 0 when
  /// /proc cannot be read or no time passed.
  double sample();

 private:
  struct times {
    std::int64_t busy = 0, total = 0, self = 0;
  };
  times read() const;
  std::vector<int> cores_;
  int online_ = 1;
  times last_;
};

}  // namespace troupe::actors
