#include <cstdio>

#include "bench/kernels/bench.hpp"

namespace troupe::bench {
// Placeholder until the attention kernels land.
void run_attention(const options&) { std::puts("attention: not built yet"); }
}  // namespace troupe::bench
