#pragma once

// The CUDA backend of the compute seam (kernels/device.hpp): a device per
// GPU, its tensors in device memory (a pool over cudaMalloc), weights
// uploaded once in their stored format, and the kernels of launch.cu on one
// stream of its own. Ops it does not run yet say so through `supports` and
// the conformance test lists them (tests/kernels/backend_ops_test.cpp).

#include <cstdint>
#include <memory>

#include "kernels/device.hpp"

namespace troupe::kernels::cuda {

struct cuda_device_options {
  int index = 0;
  /// Share of the GPU's free memory (at creation) the pool may hold, like
  /// vLLM's --gpu-memory-utilization.
  double memory_fraction = 0.9;
};

/// A CUDA device, or an error (no such GPU; a build without CUDA).
result<std::unique_ptr<device>> make_device(const cuda_device_options& opts);

}  // namespace troupe::kernels::cuda
