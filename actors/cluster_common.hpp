#pragma once

// What the node agent and the head share in one process: the nodes it has
// joined and one compute context per device. Internal to node_agent.cpp
// and the head's files (head_state.hpp and the .cpp files that include
// it), not for use elsewhere.

#include <caf/node_id.hpp>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "actors/clock.hpp"
#include "actors/device.hpp"
#include "actors/device_spec.hpp"

namespace troupe::actors::cluster_detail {

// Milliseconds since `t`.
inline double ms_since(steady::time_point t) {
  return std::chrono::duration<double, std::milli>(steady::now() - t).count();
}

// The node id each node had when this process last joined it: a stage's
// agent joins the next stage's node only when no live connection to that
// incarnation exists yet (the head's joins count too).
struct joined_registry {
  std::mutex mtx;
  std::map<std::string, caf::node_id> ids;
};
joined_registry& joined_nodes();
/// Records that node `name` is the process `id` now. A different process of
/// that name before it (the node restarted) is gone: this process's
/// data-plane endpoint to it is closed (an endpoint per dead peer would
/// otherwise stay open, with its buffers and shared-memory mappings).
void joined_node_is(const std::string& name, const caf::node_id& id);
/// Forgets node `name` (declared lost): closes the data-plane endpoint to
/// its process. If it comes back, it is joined and connected anew.
void forget_joined_node(const std::string& name);

// One compute context per device and process: the head's encoder and the
// stages its agent loads share the device's team and lock.
/// (Opened on first use; an error when it cannot be, as a GPU that is not there.)
kernels::result<std::shared_ptr<kernels::device>> device_for(const device_spec& d);

}  // namespace troupe::actors::cluster_detail
