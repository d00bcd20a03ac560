#include "actors/cluster_common.hpp"

namespace troupe::actors::cluster_detail {

joined_registry& joined_nodes() {
  static joined_registry r;
  return r;
}

std::shared_ptr<device_context> context_for(const device_spec& d) {
  static std::mutex mtx;
  static std::map<std::string, std::shared_ptr<device_context>> contexts;
  std::lock_guard lock(mtx);
  auto& c = contexts[d.name];
  if (!c) c = device_context::create(d);
  return c;
}

}  // namespace troupe::actors::cluster_detail
