#pragma once

#include <chrono>

namespace troupe::actors {

using steady = std::chrono::steady_clock;

/// Milliseconds from `a` to `b`.
inline double ms_between(steady::time_point a, steady::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

}  // namespace troupe::actors
