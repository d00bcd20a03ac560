#include "kernels/cuda/probe.hpp"

namespace troupe::kernels::cuda {

probe_result probe() {
  probe_result out;
  out.status = "no CUDA device (built without CUDA)";
  return out;
}

}  // namespace troupe::kernels::cuda

#include "kernels/cuda/cuda_device.hpp"

namespace troupe::kernels::cuda {

result<std::unique_ptr<device>> make_device(const cuda_device_options&) {
  return make_error(errc::device_unavailable, "troupe was built without CUDA");
}

}  // namespace troupe::kernels::cuda
