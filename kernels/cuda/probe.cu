#include <cuda_runtime.h>

#include "kernels/cuda/probe.hpp"

namespace troupe::kernels::cuda {

probe_result probe() {
  probe_result out;
  out.built_with_cuda = true;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice || count == 0) {
    out.status = std::string("no CUDA device (") + cudaGetErrorName(err) + ")";
    cudaGetLastError();
    return out;
  }
  if (err != cudaSuccess) {
    out.status = std::string("CUDA probe failed: ") + cudaGetErrorString(err);
    cudaGetLastError();
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    gpu_info g;
    g.index = i;
    g.name = prop.name;
    g.memory_bytes = prop.totalGlobalMem;
    g.multiprocessors = prop.multiProcessorCount;
    g.compute_major = prop.major;
    g.compute_minor = prop.minor;
    out.gpus.push_back(g);
  }
  return out;
}

}  // namespace troupe::kernels::cuda
