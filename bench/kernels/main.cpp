// bench/kernels: every kernel figure of issue "Foundation" in one run.
//   bench_kernels [--threads N] [--quick] [--only bandwidth|gemm|batch|attention]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bench/kernels/bench.hpp"
#include "kernels/cpu/isa.hpp"

namespace troupe::bench {

void print_row(const std::vector<std::string>& cells, const std::vector<int>& widths) {
  std::string line;
  for (std::size_t i = 0; i < cells.size(); ++i) {
    const int w = i < widths.size() ? widths[i] : 12;
    std::string c = cells[i];
    if (static_cast<int>(c.size()) < w) c.append(static_cast<std::size_t>(w) - c.size(), ' ');
    line += c + " ";
  }
  std::puts(line.c_str());
  std::fflush(stdout);
}

std::string fmt(double v, int precision) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", precision, v);
  return buf;
}

}  // namespace troupe::bench

int main(int argc, char** argv) {
  troupe::bench::options opt;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) {
      opt.threads = std::atoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--quick")) {
      opt.quick = true;
    } else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: %s [--threads N] [--quick] [--only bandwidth|gemm|batch|attention]\n",
                   argv[0]);
      return 2;
    }
  }
  if (opt.threads < 1 || opt.threads > 256) {
    std::fprintf(stderr, "--threads must be 1..256\n");
    return 2;
  }
  std::printf(
      "troupe bench/kernels: threads=%d isa=%s%s\n", opt.threads,
      std::string(troupe::kernels::cpu::to_string(troupe::kernels::cpu::detect_isa())).c_str(),
      opt.quick ? " (quick)" : "");
  if (only.empty() || only == "bandwidth") troupe::bench::run_bandwidth_and_gemv(opt);
  if (only.empty() || only == "gemm") troupe::bench::run_gemm(opt);
  if (only.empty() || only == "batch") troupe::bench::run_batch(opt);
  if (only.empty() || only == "attention") troupe::bench::run_attention(opt);
  return 0;
}
