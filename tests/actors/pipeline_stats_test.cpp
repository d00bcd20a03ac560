// The pipeline breakdown of two samples of the scheduler's counters.

#include "actors/pipeline_stats.hpp"

#include <gtest/gtest.h>

namespace troupe::actors {
namespace {

scheduler_stats sample(std::int64_t steps, std::int64_t rows, std::int64_t tokens,
                       double round_trip, std::vector<double> per_stage, double in_flight,
                       double sched) {
  scheduler_stats s;
  s.stages = static_cast<std::int64_t>(per_stage.size());
  s.steps = steps;
  s.step_rows = rows;
  s.tokens_out = tokens;
  s.round_trip_ms = round_trip;
  for (double x : per_stage) s.compute_ms += x;
  s.stage_compute_ms = std::move(per_stage);
  s.in_flight_ms = in_flight;
  s.scheduler_ms = sched;
  return s;
}

TEST(PipelineStats, BreakdownBetweenTwoSamples) {
  // 2 s apart: 40 steps of 8 rows, each 100 ms round trip of which the
  // stages computed 30 + 45 ms; 1.5 s of the 2 s had a step in flight.
  const auto a = sample(10, 100, 50, 1000, {300, 400}, 500, 20);
  const auto b =
      sample(50, 420, 370, 1000 + 40 * 100.0, {300 + 40 * 30.0, 400 + 40 * 45.0}, 2000, 120);
  const auto p = breakdown_between(a, b, 2.0);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->stages, 2);
  EXPECT_DOUBLE_EQ(p->steps_per_s, 20.0);
  EXPECT_DOUBLE_EQ(p->rows_per_s, 160.0);
  EXPECT_DOUBLE_EQ(p->tokens_per_s, 160.0);
  EXPECT_DOUBLE_EQ(p->round_trip_ms, 100.0);
  EXPECT_DOUBLE_EQ(p->compute_ms, 75.0);
  EXPECT_DOUBLE_EQ(p->other_ms, 25.0);
  ASSERT_EQ(p->busy_per_stage.size(), 2u);
  EXPECT_DOUBLE_EQ(p->busy_per_stage[0], 0.6);  // 1200 ms of 2000
  EXPECT_DOUBLE_EQ(p->busy_per_stage[1], 0.9);  // 1800 ms of 2000
  EXPECT_DOUBLE_EQ(p->stage_busy, 0.75);        // 3000 ms over 2 stages x 2000 ms
  EXPECT_DOUBLE_EQ(p->idle, 0.25);
  EXPECT_DOUBLE_EQ(p->scheduler, 0.05);
  const auto text = p->describe();
  EXPECT_NE(text.find("round trip 100.00 ms"), std::string::npos) << text;
  EXPECT_NE(text.find("1: 90%"), std::string::npos) << text;
}

TEST(PipelineStats, NothingWithoutStepsOrWhenCountersGoBack) {
  const auto a = sample(10, 100, 50, 1000, {300, 400}, 500, 20);
  EXPECT_FALSE(breakdown_between(a, a, 2.0));  // no step in between
  auto b = sample(20, 200, 60, 2000, {600, 800}, 900, 30);
  EXPECT_FALSE(breakdown_between(a, b, 0.0));
  EXPECT_FALSE(breakdown_between(b, a, 2.0));  // a restarted scheduler's counters
  // A pipeline that grew a stage: the new stage counts from zero.
  auto c = sample(20, 200, 60, 2000, {600, 800, 100}, 900, 30);
  const auto p = breakdown_between(a, c, 1.0);
  ASSERT_TRUE(p);
  ASSERT_EQ(p->busy_per_stage.size(), 3u);
  EXPECT_DOUBLE_EQ(p->busy_per_stage[2], 0.1);
  // A pipeline that lost one: no per-stage figures, the rest stays.
  auto d = sample(20, 200, 60, 2000, {1500}, 900, 30);
  const auto q = breakdown_between(a, d, 1.0);
  ASSERT_TRUE(q);
  EXPECT_TRUE(q->busy_per_stage.empty());
  EXPECT_DOUBLE_EQ(q->compute_ms, 80.0);
}

}  // namespace
}  // namespace troupe::actors
