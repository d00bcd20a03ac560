#include <cstdio>

#include "bench/kernels/bench.hpp"

namespace troupe::bench {
// Placeholder until the matmul kernels land.
void run_bandwidth_and_gemv(const options&) { std::puts("gemv: not built yet"); }
void run_gemm(const options&) { std::puts("gemm: not built yet"); }
}  // namespace troupe::bench
