#pragma once

// Who is in the cluster, as the head sees it, and where the model's stages
// go: plain code (no CAF), driven by the head actor with the times it
// observes, so that every transition is testable on its own.
//
// A node is `joining` until its gatekeeper let the head in, then `up`
// while it answers heartbeats. A missed answer makes it `suspect`; no
// answer for `lost_after`, or its connection closing, makes it `lost`.
// A lost node is tried again every `rejoin_every` and becomes `up` once
// it lets the head in again. Only `up` nodes hold stages.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace troupe::cluster {

enum class member_state { joining, up, suspect, lost };
const char* to_string(member_state s);

struct membership_options {
  std::chrono::milliseconds heartbeat_every{500};
  /// No heartbeat answer for this long: suspect.
  std::chrono::milliseconds suspect_after{1200};
  /// No heartbeat answer for this long: lost (the issue asks for < 5 s).
  std::chrono::milliseconds lost_after{2500};
  std::chrono::milliseconds rejoin_every{1000};
};

class membership {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  struct member {
    std::string name;
    member_state state = member_state::joining;
    std::optional<time_point> last_seen;  ///< last heartbeat answer (or join)
    std::optional<time_point> last_try;   ///< last join attempt
    std::int64_t joins = 0;
    std::int64_t losses = 0;
    bool holds_stages = true;  ///< false: a node of role "kv" (the KV store only)
  };

  /// A change the head acts on.
  struct transition {
    std::string name;
    member_state from, to;
    std::string why;
  };

  membership(std::vector<std::string> names, membership_options opt = {});

  /// The node let the head in (first time or again).
  transition joined(const std::string& name, time_point now);
  /// A heartbeat answer.
  std::optional<transition> heard(const std::string& name, time_point now);
  /// Its connection closed, or it refused the head: lost at once.
  std::optional<transition> gone(const std::string& name, const std::string& why);
  /// Time passes: suspect / lost transitions for silent nodes.
  std::vector<transition> tick(time_point now);
  /// Nodes the head should try to join now (joining or lost ones whose
  /// last attempt is older than rejoin_every); marks the attempt.
  std::vector<std::string> due_for_join(time_point now);

  const member* find(const std::string& name) const;
  const std::vector<member>& members() const { return members_; }
  /// Names of the nodes that may hold stages (up, and not of role "kv"),
  /// in manifest order.
  std::vector<std::string> usable() const;
  /// The node holds no stage (role "kv"): never in usable().
  void holds_no_stages(const std::string& name);
  bool is_up(const std::string& name) const;
  const membership_options& options() const { return opt_; }

 private:
  member* get(const std::string& name);
  std::vector<member> members_;
  std::unordered_map<std::string, std::size_t> index_;  ///< name -> place in members_
  membership_options opt_;
};

/// One stage of a placement.
struct stage_slot {
  std::string node;  ///< its node (rank 0 of a tensor-parallel stage)
  int first_layer = 0;
  int last_layer = 0;
  /// A tensor-parallel stage: the nodes of ranks 1, 2, ... (each holds
  /// that slice of every layer); empty for a stage on one node.
  std::vector<std::string> ranks = {};
  /// Whether `name` holds a part of this stage.
  bool holds(const std::string& name) const {
    return node == name || std::find(ranks.begin(), ranks.end(), name) != ranks.end();
  }
};

/// Whether a stage of `plan` is on node `name`.
inline bool plan_uses(const std::vector<stage_slot>& plan, const std::string& name) {
  return std::any_of(plan.begin(), plan.end(), [&](const stage_slot& s) { return s.holds(name); });
}

/// "node0 [0,2) -> node1 [2,4)"; a tensor-parallel stage is
/// "node0+node1 [0,2)".
std::string describe(const std::vector<stage_slot>& plan);

}  // namespace troupe::cluster
