#include "actors/cluster_common.hpp"

#include "actors/data_plane.hpp"

namespace troupe::actors::cluster_detail {

joined_registry& joined_nodes() {
  static joined_registry r;
  return r;
}

void joined_node_is(const std::string& name, const caf::node_id& id) {
  caf::node_id gone;
  {
    auto& r = joined_nodes();
    std::lock_guard lock(r.mtx);
    auto& at = r.ids[name];
    if (at && at != id) gone = at;
    at = id;
  }
  if (gone) data_plane::local().forget(to_string(gone));
}

void forget_joined_node(const std::string& name) {
  caf::node_id gone;
  {
    auto& r = joined_nodes();
    std::lock_guard lock(r.mtx);
    if (auto it = r.ids.find(name); it != r.ids.end()) {
      gone = it->second;
      r.ids.erase(it);
    }
  }
  if (gone) data_plane::local().forget(to_string(gone));
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
