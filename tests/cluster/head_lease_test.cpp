// A node's head lease (cluster/head_lease.hpp): the first head, then only
// higher terms; an older head or a second head of the same term refused.
#include "cluster/head_lease.hpp"

#include <gtest/gtest.h>

using troupe::cluster::head_lease;
using v = head_lease::verdict;

TEST(HeadLease, GoesToTheFirstHeadAndThenOnlyToHigherTerms) {
  head_lease l;
  EXPECT_FALSE(l.holds("A"));
  EXPECT_EQ(l.offer("A", 100), v::granted);
  EXPECT_TRUE(l.holds("A"));
  EXPECT_EQ(l.offer("A", 100), v::granted) << "the holder joins again";
  EXPECT_EQ(l.offer("B", 100), v::contested);
  EXPECT_EQ(l.offer("B", 99), v::stale);
  EXPECT_TRUE(l.holds("A"));
  EXPECT_FALSE(l.holds("B"));
  // A standby with a higher term takes over; the old head is refused after.
  EXPECT_EQ(l.offer("B", 200), v::granted);
  EXPECT_TRUE(l.holds("B"));
  EXPECT_FALSE(l.holds("A"));
  EXPECT_EQ(l.offer("A", 100), v::stale);
  EXPECT_EQ(l.term(), 200u);
  EXPECT_EQ(l.holder(), "B");
}

TEST(HeadLease, NobodyHoldsItBeforeTheFirstHead) {
  head_lease l;
  EXPECT_FALSE(l.holds(""));
  EXPECT_EQ(l.offer("A", 0), v::granted);
  EXPECT_TRUE(l.holds("A"));
  EXPECT_FALSE(l.holds(""));
}
