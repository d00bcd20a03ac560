// The encoder's batching decision under a manual clock.
#include "actors/core/batching.hpp"

#include <gtest/gtest.h>

namespace troupe::actors::core {
namespace {

using namespace std::chrono_literals;

TEST(Batching, AFullBucketClosesAtOnce) {
  manual_clock clk;
  const batching_options o{.max_batch = 4, .min_batch = 2, .max_wait_ms = 5};
  auto d = decide_batch(o, 9, clk.now(), clk.now());
  EXPECT_EQ(d.close, 4u) << "one full batch at a time";
  EXPECT_FALSE(d.wake_at);
  EXPECT_EQ(decide_batch(o, 4, clk.now(), clk.now()).close, 4u) << "exactly full";
  EXPECT_EQ(decide_batch(o, 3, clk.now(), clk.now()).close, 0u) << "not full, not waited";
}

TEST(Batching, EnoughInputsCloseAfterMaxWait) {
  manual_clock clk;
  const batching_options o{.max_batch = 8, .min_batch = 2, .max_wait_ms = 5};
  const auto oldest = clk.now();
  clk.advance(2ms);
  auto d = decide_batch(o, 3, oldest, clk.now());
  EXPECT_EQ(d.close, 0u);
  ASSERT_TRUE(d.wake_at);
  EXPECT_EQ(*d.wake_at - oldest, 5ms);
  clk.advance(3ms);
  d = decide_batch(o, 3, oldest, clk.now());
  EXPECT_EQ(d.close, 3u);
}

TEST(Batching, TooFewInputsWaitFourTimesLongerThenGoAnyway) {
  manual_clock clk;
  const batching_options o{.max_batch = 8, .min_batch = 3, .max_wait_ms = 5};
  const auto oldest = clk.now();
  clk.advance(5ms);
  auto d = decide_batch(o, 2, oldest, clk.now());
  EXPECT_EQ(d.close, 0u) << "below min_batch at max_wait";
  ASSERT_TRUE(d.wake_at);
  EXPECT_EQ(*d.wake_at - oldest, 20ms);
  clk.advance(14ms);
  EXPECT_EQ(decide_batch(o, 2, oldest, clk.now()).close, 0u);
  clk.advance(1ms);
  EXPECT_EQ(decide_batch(o, 2, oldest, clk.now()).close, 2u) << "nothing waits forever";
}

TEST(Batching, ZeroWaitClosesWhateverIsThere) {
  manual_clock clk;
  const auto o = sanitized({.max_batch = 0, .min_batch = 5, .max_wait_ms = -3});
  EXPECT_EQ(o.max_batch, 1);
  EXPECT_EQ(o.min_batch, 1);
  EXPECT_EQ(o.max_wait_ms, 0);
  EXPECT_EQ(decide_batch(o, 1, clk.now(), clk.now()).close, 1u);
  EXPECT_EQ(decide_batch(o, 0, clk.now(), clk.now()).close, 0u);
  EXPECT_FALSE(decide_batch(o, 0, clk.now(), clk.now()).wake_at);
}

}  // namespace
}  // namespace troupe::actors::core
