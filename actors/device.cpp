#include "actors/device.hpp"

#include <thread>

namespace troupe::actors {

std::shared_ptr<device_context> device_context::create(const device_spec& spec) {
  auto d = std::make_shared<device_context>();
  d->spec = spec;
  const int threads = spec.cores.empty() ? static_cast<int>(std::thread::hardware_concurrency())
                                         : static_cast<int>(spec.cores.size());
  d->ctx =
      std::shared_ptr<kernels::cpu::context>(kernels::cpu::context::create(threads, spec.cores));
  return d;
}

}  // namespace troupe::actors
