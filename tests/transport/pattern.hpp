#pragma once
// The bytes troupe_transport_peer sends for a seed; the multi-process tests
// compute their expected checksums from the same generator.
#include <cstdint>
#include <vector>

namespace troupe::test {

inline void fill_pattern(std::vector<std::uint8_t>& v, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (auto& b : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    b = static_cast<std::uint8_t>(x);
  }
}

}  // namespace troupe::test
