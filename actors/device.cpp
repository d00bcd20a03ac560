#include "actors/device.hpp"

#include "kernels/cpu/cpu_device.hpp"

namespace troupe::actors {

std::shared_ptr<kernels::device> open_device(const device_spec& spec) {
  kernels::cpu::cpu_device_options o;
  o.name = spec.name;
  o.cores = spec.cores;
  o.check_cores = false;  // parse_devices checked them against the affinity mask
  auto d = kernels::cpu::cpu_device::create(o);
  return std::shared_ptr<kernels::device>(std::move(*d));  // cannot fail without the check
}

}  // namespace troupe::actors
