#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "bench/common/measure.hpp"
#include "kernels/cpu/context.hpp"

namespace troupe::bench {

/// Options shared by the benchmark sections.
struct options {
  int threads = 2;
  bool quick = false;  ///< fewer repetitions and smaller shapes (smoke run)
};

/// Prints a table row: cells padded to fixed widths.
void print_row(const std::vector<std::string>& cells, const std::vector<int>& widths);
std::string fmt(double v, int precision = 2);

// Sections; each prints its own table.
void run_bandwidth_and_gemv(const options& opt);  // matmul_bench.cpp
void run_gemm(const options& opt);                // matmul_bench.cpp
void run_batch(const options& opt);               // matmul_bench.cpp: small-M GEMM (batched decode)
void run_attention(const options& opt);           // attention_bench.cpp

}  // namespace troupe::bench
