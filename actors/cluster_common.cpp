#include "actors/cluster_common.hpp"

namespace troupe::actors::cluster_detail {

joined_registry& joined_nodes() {
  static joined_registry r;
  return r;
}

std::shared_ptr<kernels::device> device_for(const device_spec& d) {
  static std::mutex mtx;
  static std::map<std::string, std::shared_ptr<kernels::device>> devices;
  std::lock_guard lock(mtx);
  auto& c = devices[d.name];
  if (!c) c = open_device(d);
  return c;
}

}  // namespace troupe::actors::cluster_detail
