#pragma once

// Number formatting for placement's error messages and descriptions
// (internal; g++ 12 has no <format>).

#include <cstdio>
#include <string>

namespace troupe::placement::detail {

/// `v` with `digits` digits after the point.
inline std::string fixed(double v, int digits = 2) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

/// `v` in the shortest %g form.
inline std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

/// Bytes as "1.50 GiB" / "12.0 MiB".
inline std::string bytes(double b) {
  if (b >= 1024.0 * 1024 * 1024) return fixed(b / (1024.0 * 1024 * 1024), 2) + " GiB";
  return fixed(b / (1024.0 * 1024), 1) + " MiB";
}

/// Seconds as "12.345 ms".
inline std::string ms(double s) {
  return fixed(s * 1e3, 3) + " ms";
}

/// Percentage of a fraction: 0.153 → "15.3%".
inline std::string percent(double f) {
  return fixed(f * 100, 1) + "%";
}

}  // namespace troupe::placement::detail
