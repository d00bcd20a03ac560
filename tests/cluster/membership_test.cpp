// The head's membership state machine and placement rule, with the times
// given by the test.
#include "cluster/membership.hpp"

#include <gtest/gtest.h>

namespace {

using namespace troupe::cluster;
using namespace std::chrono_literals;
using tp = membership::time_point;

TEST(Membership, JoinHeartbeatSuspectLostRejoin) {
  membership m({"a", "b"}, membership_options{500ms, 1200ms, 2500ms, 1000ms});
  const tp t0{};
  // Everyone starts joining, and is due for a join attempt once per second.
  EXPECT_EQ(m.due_for_join(t0), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(m.due_for_join(t0 + 500ms).empty());
  EXPECT_EQ(m.due_for_join(t0 + 1000ms).size(), 2u);
  EXPECT_TRUE(m.usable().empty());
  auto j = m.joined("a", t0 + 1s);
  EXPECT_EQ(j.from, member_state::joining);
  EXPECT_EQ(j.to, member_state::up);
  EXPECT_EQ(m.usable(), std::vector<std::string>{"a"});
  // Answers keep it up; silence makes it suspect, then lost.
  EXPECT_FALSE(m.heard("a", t0 + 1500ms).has_value());
  EXPECT_TRUE(m.tick(t0 + 2500ms).empty());
  auto t = m.tick(t0 + 2800ms);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].to, member_state::suspect);
  EXPECT_EQ(m.usable(), std::vector<std::string>{});
  // An answer clears the suspicion.
  auto back = m.heard("a", t0 + 2900ms);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->to, member_state::up);
  t = m.tick(t0 + 5400ms);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].to, member_state::lost);
  EXPECT_NE(t[0].why.find("2500 ms"), std::string::npos) << t[0].why;
  EXPECT_EQ(m.find("a")->losses, 1);
  // A lost node's late answer does not revive it: it must join again.
  EXPECT_FALSE(m.heard("a", t0 + 5500ms).has_value());
  EXPECT_EQ(m.find("a")->state, member_state::lost);
  auto due = m.due_for_join(t0 + 6s);
  EXPECT_NE(std::find(due.begin(), due.end(), "a"), due.end());
  auto again = m.joined("a", t0 + 6s);
  EXPECT_EQ(again.why, "rejoined");
  EXPECT_EQ(m.find("a")->joins, 2);
}

TEST(Membership, AClosedConnectionIsLostAtOnce) {
  membership m({"a"});
  EXPECT_FALSE(m.gone("a", "closed").has_value());  // never joined: nothing to lose
  m.joined("a", tp{});
  auto t = m.gone("a", "its connection closed");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->from, member_state::up);
  EXPECT_EQ(t->to, member_state::lost);
  EXPECT_FALSE(m.gone("a", "again").has_value());
  EXPECT_FALSE(m.gone("nobody", "x").has_value());
}

}  // namespace
