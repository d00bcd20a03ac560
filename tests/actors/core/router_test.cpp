// The router's choice of a replica (actors/core/router.hpp): load first,
// a cached prefix within the allowed imbalance, ties shared in turn.
#include "actors/core/router.hpp"

#include <gtest/gtest.h>

#include <map>
#include <vector>

namespace {

using troupe::actors::core::choose_replica;
using troupe::actors::core::replica_load;
using troupe::actors::core::router_options;

replica_load at(std::int64_t outstanding, std::int64_t cached = 0, std::int64_t free = 100) {
  return {true, outstanding, cached, free};
}

TEST(Router, NoneServingChoosesNone) {
  std::vector<replica_load> l{at(0), at(0)};
  for (auto& x : l) x.serving = false;
  EXPECT_EQ(choose_replica(l, {}, 10, 0).replica, -1);
  EXPECT_EQ(choose_replica({}, {}, 10, 0).replica, -1);
}

TEST(Router, TheLeastLoadedWithoutACachedPrefix) {
  const std::vector<replica_load> l{at(5), at(2), at(7)};
  const auto c = choose_replica(l, {}, 10, 0);
  EXPECT_EQ(c.replica, 1);
  EXPECT_FALSE(c.by_prefix);
}

TEST(Router, AReplicaNotServingIsSkippedHoweverIdle) {
  std::vector<replica_load> l{at(0), at(3)};
  l[0].serving = false;
  EXPECT_EQ(choose_replica(l, {}, 10, 0).replica, 1);
}

TEST(Router, EqualLoadsGoToTheMostFreeKvThenInTurn) {
  const std::vector<replica_load> l{at(1, 0, 10), at(1, 0, 50), at(1, 0, 50)};
  std::map<int, int> got;
  for (std::uint64_t t = 0; t < 10; ++t) ++got[choose_replica(l, {}, 10, t).replica];
  EXPECT_EQ(got[0], 0);
  EXPECT_EQ(got[1], 5);
  EXPECT_EQ(got[2], 5);
}

TEST(Router, TheLongestCachedPrefixWinsWithinTheImbalance) {
  router_options o;
  o.max_imbalance = 4;
  const std::vector<replica_load> l{at(1, 0), at(4, 6), at(3, 2)};
  const auto c = choose_replica(l, o, 10, 0);
  EXPECT_EQ(c.replica, 1);
  EXPECT_TRUE(c.by_prefix);
}

TEST(Router, APrefixOnAReplicaTooBusyLosesToLoad) {
  router_options o;
  o.max_imbalance = 4;
  // Replica 1 holds the longest prefix but is 6 busier than the least
  // loaded; replica 2 holds a shorter one within the imbalance.
  const std::vector<replica_load> l{at(1, 0), at(7, 9), at(5, 6)};
  const auto c = choose_replica(l, o, 10, 0);
  EXPECT_EQ(c.replica, 2);
  EXPECT_TRUE(c.by_prefix);
  o.max_imbalance = 2;
  const auto d = choose_replica(l, o, 10, 0);
  EXPECT_EQ(d.replica, 0);
  EXPECT_FALSE(d.by_prefix);
}

TEST(Router, EqualPrefixesGoToTheLessLoaded) {
  const std::vector<replica_load> l{at(3, 6), at(2, 6), at(0, 0)};
  EXPECT_EQ(choose_replica(l, {}, 10, 0).replica, 1);
}

TEST(Router, AShortSharedPrefixDoesNotPullJobsTogether) {
  // Two of a 10-block prompt's blocks (a chat template's) are cached on
  // the busier replica: the load decides. Five are: the prefix does.
  const std::vector<replica_load> l{at(2, 2), at(0, 0)};
  EXPECT_EQ(choose_replica(l, {}, 10, 0).replica, 1);
  const std::vector<replica_load> m{at(2, 5), at(0, 0)};
  const auto c = choose_replica(m, {}, 10, 0);
  EXPECT_EQ(c.replica, 0);
  EXPECT_TRUE(c.by_prefix);
  router_options o;
  o.min_share = 0.8;
  EXPECT_EQ(choose_replica(m, o, 10, 0).replica, 1);
}

TEST(Router, PrefixOffRoutesByLoadOnly) {
  router_options o;
  o.prefix = false;
  const std::vector<replica_load> l{at(1, 0), at(2, 9)};
  const auto c = choose_replica(l, o, 10, 0);
  EXPECT_EQ(c.replica, 0);
  EXPECT_FALSE(c.by_prefix);
}

}  // namespace
