#include "actors/core/encoder_scaler.hpp"

#include <gtest/gtest.h>

#include <chrono>

namespace troupe::actors::core {
namespace {

using std::chrono::milliseconds;

encoder_scaling opts() {
  encoder_scaling o;
  o.min = 1;
  o.max = 3;
  o.up_queue = 4;
  o.up_latency_ms = 1000;
  o.up_after_s = 2;
  o.down_after_s = 30;
  return o;
}

// Feeds the same load every 500 ms (a heartbeat) for `ms`; answers the
// first change asked for, or the sample's count when none came.
scale_decision feed(encoder_scaler& s, manual_clock& clk, encoder_load load, int ms) {
  scale_decision d{load.replicas, {}};
  for (int t = 0; t <= ms; t += 500) {
    d = s.observe(load);
    if (!d.reason.empty()) return d;
    clk.advance(milliseconds(500));
  }
  return d;
}

TEST(EncoderScaler, AQueueKeptLongEnoughAddsOneReplica) {
  manual_clock clk;
  encoder_scaler s(opts(), clk);
  // 9 images over 1 replica: past up_queue (4 per replica).
  EXPECT_TRUE(s.observe({1, 9, 0, 0}).reason.empty());
  clk.advance(milliseconds(1500));
  EXPECT_EQ(s.observe({1, 9, 0, 0}).replicas, 1);  // 1.5 s: not yet
  clk.advance(milliseconds(500));
  const auto d = s.observe({1, 9, 0, 0});  // 2 s overloaded
  EXPECT_EQ(d.replicas, 2);
  EXPECT_NE(d.reason.find("waiting per replica"), std::string::npos) << d.reason;
  // The timer starts over: the next replica needs another 2 s.
  EXPECT_EQ(s.observe({2, 20, 0, 0}).replicas, 2);
  clk.advance(milliseconds(1999));
  EXPECT_EQ(s.observe({2, 20, 0, 0}).replicas, 2);
  clk.advance(milliseconds(1));
  EXPECT_EQ(s.observe({2, 20, 0, 0}).replicas, 3);
}

TEST(EncoderScaler, ABurstShorterThanUpAfterChangesNothing) {
  manual_clock clk;
  encoder_scaler s(opts(), clk);
  EXPECT_EQ(feed(s, clk, {1, 12, 0, 0}, 1500).replicas, 1);
  EXPECT_EQ(s.observe({1, 2, 4, 400}).replicas, 1);  // the burst is over
  clk.advance(milliseconds(500));
  // Overloaded again: the 1.5 s before do not count.
  EXPECT_EQ(feed(s, clk, {1, 12, 0, 0}, 1500).replicas, 1);
  EXPECT_EQ(feed(s, clk, {1, 12, 0, 0}, 500).replicas, 2);
}

TEST(EncoderScaler, LongWaitsAloneAddAReplica) {
  manual_clock clk;
  encoder_scaler s(opts(), clk);
  // Two images waiting (under up_queue), but answered after 1.5 s each.
  const auto d = feed(s, clk, {1, 2, 4, 6000}, 5000);
  EXPECT_EQ(d.replicas, 2);
  EXPECT_NE(d.reason.find("1500 ms"), std::string::npos) << d.reason;
  // Short waits: no change however long.
  encoder_scaler q(opts(), clk);
  EXPECT_TRUE(feed(q, clk, {1, 2, 4, 2000}, 20000).reason.empty());
}

TEST(EncoderScaler, NeverPastMaxNorBelowMin) {
  manual_clock clk;
  encoder_scaler s(opts(), clk);
  EXPECT_TRUE(feed(s, clk, {3, 100, 10, 1e6}, 60000).reason.empty());  // at max
  EXPECT_TRUE(feed(s, clk, {1, 0, 0, 0}, 600000).reason.empty());      // at min, idle
  // Outside the range: back inside at once.
  EXPECT_EQ(s.observe({0, 0, 0, 0}).replicas, 1);
  EXPECT_EQ(s.observe({5, 0, 0, 0}).replicas, 3);
}

TEST(EncoderScaler, IdleForTheCooldownDrainsOneAtATime) {
  manual_clock clk;
  encoder_scaler s(opts(), clk);
  EXPECT_TRUE(s.observe({3, 0, 0, 0}).reason.empty());
  clk.advance(milliseconds(29500));
  EXPECT_EQ(s.observe({3, 0, 0, 0}).replicas, 3);
  clk.advance(milliseconds(500));
  const auto d = s.observe({3, 0, 0, 0});
  EXPECT_EQ(d.replicas, 2);
  EXPECT_NE(d.reason.find("down_after_s 30"), std::string::npos) << d.reason;
  // The next one needs the whole cooldown again.
  clk.advance(milliseconds(29999));
  EXPECT_EQ(s.observe({2, 0, 0, 0}).replicas, 2);
  EXPECT_EQ(s.observe({2, 0, 0, 0}).replicas, 2);
  clk.advance(milliseconds(30000));
  EXPECT_EQ(s.observe({2, 0, 0, 0}).replicas, 1);
}

TEST(EncoderScaler, LoadDuringTheCooldownStartsItOver) {
  manual_clock clk;
  encoder_scaler s(opts(), clk);
  EXPECT_EQ(feed(s, clk, {2, 0, 0, 0}, 25000).replicas, 2);
  // Three images waiting over two replicas: not overloaded, but one
  // replica would hold more than half of up_queue: not quiet either.
  EXPECT_EQ(s.observe({2, 3, 0, 0}).replicas, 2);
  clk.advance(milliseconds(500));
  EXPECT_EQ(feed(s, clk, {2, 0, 0, 0}, 29000).replicas, 2);
  EXPECT_EQ(feed(s, clk, {2, 0, 0, 0}, 1000).replicas, 1);
}

TEST(EncoderScaler, ModerateWaitsKeepTheReplicas) {
  manual_clock clk;
  encoder_scaler s(opts(), clk);
  // Mean wait 600 ms: under up_latency_ms, over half of it.
  EXPECT_TRUE(feed(s, clk, {2, 0, 5, 3000}, 120000).reason.empty());
}

TEST(EncoderScaler, OptionsAreClamped) {
  encoder_scaling o;
  o.min = 0;
  o.max = -2;
  o.up_queue = -1;
  const auto c = sanitized(o);
  EXPECT_EQ(c.min, 1);
  EXPECT_EQ(c.max, 1);
  EXPECT_EQ(c.up_queue, 0);
}

}  // namespace
}  // namespace troupe::actors::core
