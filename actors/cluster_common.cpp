#include "actors/cluster_common.hpp"

namespace troupe::actors::cluster_detail {

joined_registry& joined_nodes() {
  static joined_registry r;
  return r;
}

kernels::result<std::shared_ptr<kernels::device>> device_for(const device_spec& d) {
  static std::mutex mtx;
  static std::map<std::string, std::shared_ptr<kernels::device>> devices;
  std::lock_guard lock(mtx);
  if (auto it = devices.find(d.name); it != devices.end()) return it->second;
  auto c = open_device(d);
  if (c) devices[d.name] = *c;
  return c;
}

}  // namespace troupe::actors::cluster_detail
