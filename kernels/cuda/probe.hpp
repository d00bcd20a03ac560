#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe::kernels::cuda {

struct gpu_info {
  int index = 0;
  std::string name;
  std::uint64_t memory_bytes = 0;
  int multiprocessors = 0;
  int compute_major = 0, compute_minor = 0;
};

/// Result of looking for CUDA devices. `gpus` is empty and `status` says why
/// when there are none (no driver, no device, no CUDA build).
struct probe_result {
  std::vector<gpu_info> gpus;
  std::string status;
  bool built_with_cuda = false;
};

/// Lists CUDA devices; never throws, never aborts.
probe_result probe();

}  // namespace troupe::kernels::cuda
