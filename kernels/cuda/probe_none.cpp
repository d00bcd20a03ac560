#include "kernels/cuda/probe.hpp"

namespace troupe::kernels::cuda {

probe_result probe() {
  probe_result out;
  out.status = "no CUDA device (built without CUDA)";
  return out;
}

}  // namespace troupe::kernels::cuda
