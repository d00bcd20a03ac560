#include "cluster/membership.hpp"

#include <algorithm>

namespace troupe::cluster {

const char* to_string(member_state s) {
  switch (s) {
    case member_state::joining:
      return "joining";
    case member_state::up:
      return "up";
    case member_state::suspect:
      return "suspect";
    case member_state::lost:
      return "lost";
  }
  return "unknown";
}

membership::membership(std::vector<std::string> names, membership_options opt) : opt_(opt) {
  for (auto& n : names) {
    member m;
    m.name = std::move(n);
    index_.emplace(m.name, members_.size());
    members_.push_back(std::move(m));
  }
}

membership::member* membership::get(const std::string& name) {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &members_[it->second];
}

const membership::member* membership::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &members_[it->second];
}

membership::transition membership::joined(const std::string& name, time_point now) {
  auto* m = get(name);
  if (!m) return {name, member_state::lost, member_state::lost, "not a member"};
  transition t{name, m->state, member_state::up,
               m->state == member_state::lost ? "rejoined" : "joined"};
  m->state = member_state::up;
  m->last_seen = now;
  ++m->joins;
  return t;
}

std::optional<membership::transition> membership::heard(const std::string& name, time_point now) {
  auto* m = get(name);
  if (!m || m->state == member_state::lost || m->state == member_state::joining)
    return std::nullopt;  // rejoin first
  m->last_seen = now;
  if (m->state == member_state::suspect) {
    m->state = member_state::up;
    return transition{name, member_state::suspect, member_state::up, "answered again"};
  }
  return std::nullopt;
}

std::optional<membership::transition> membership::gone(const std::string& name,
                                                       const std::string& why) {
  auto* m = get(name);
  if (!m || m->state == member_state::lost || m->state == member_state::joining)
    return std::nullopt;
  transition t{name, m->state, member_state::lost, why};
  m->state = member_state::lost;
  ++m->losses;
  return t;
}

std::vector<membership::transition> membership::tick(time_point now) {
  std::vector<transition> out;
  for (auto& m : members_) {
    if ((m.state != member_state::up && m.state != member_state::suspect) || !m.last_seen) continue;
    const auto silent = now - *m.last_seen;
    if (silent >= opt_.lost_after) {
      out.push_back(
          {m.name, m.state, member_state::lost,
           "no heartbeat answer for " +
               std::to_string(
                   std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()) +
               " ms"});
      m.state = member_state::lost;
      ++m.losses;
    } else if (silent >= opt_.suspect_after && m.state == member_state::up) {
      out.push_back({m.name, m.state, member_state::suspect, "a heartbeat went unanswered"});
      m.state = member_state::suspect;
    }
  }
  return out;
}

std::vector<std::string> membership::due_for_join(time_point now) {
  std::vector<std::string> out;
  for (auto& m : members_) {
    if (m.state != member_state::joining && m.state != member_state::lost) continue;
    if (m.last_try && now - *m.last_try < opt_.rejoin_every) continue;
    m.last_try = now;
    out.push_back(m.name);
  }
  return out;
}

std::vector<std::string> membership::usable() const {
  std::vector<std::string> out;
  for (const auto& m : members_)
    if (m.state == member_state::up && m.holds_stages) out.push_back(m.name);
  return out;
}

void membership::holds_no_stages(const std::string& name) {
  if (auto* m = get(name)) m->holds_stages = false;
}

bool membership::is_up(const std::string& name) const {
  const auto* m = find(name);
  return m && m->state == member_state::up;
}

std::string describe(const std::vector<stage_slot>& plan) {
  std::string s;
  for (const auto& p : plan) {
    if (!s.empty()) s += " -> ";
    s += p.node;
    for (const auto& r : p.ranks) s += "+" + r;
    s += " [" + std::to_string(p.first_layer) + "," + std::to_string(p.last_layer) + ")";
  }
  return s;
}

}  // namespace troupe::cluster
