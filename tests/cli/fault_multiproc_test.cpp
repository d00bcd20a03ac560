// Live migration with a fault on the data plane (transport::fault_engine
// under the head's node, through TROUPE_DATA_PLANE_FAULTS): stage 1 moves
// from n1 to n0 while 4 jobs decode, and the head's first data-plane
// receive, the first KV copy, fails. The migration must fail cleanly (the
// stage stays on n1 and keeps serving, nothing is recomputed), every job
// must end with the tokens of a run without the attempt, and a second
// attempt, without the fault, must move the stage.
#include <gtest/gtest.h>

#include <cstdlib>

#include "tests/cli/cluster_harness.hpp"

namespace {

using namespace troupe;
using namespace troupe::test::cluster_harness;

/// The fixture's cluster with fault rules in its nodes' environment.
class ClusterWithFaults : public ClusterLoopback {
 protected:
  void up_with_faults(const std::string& name, const std::string& faults) {
    ::setenv("TROUPE_DATA_PLANE_FAULTS", faults.c_str(), 1);
    up(name);
    ::unsetenv("TROUPE_DATA_PLANE_FAULTS");
  }
};

TEST_F(ClusterWithFaults, AMigrationWhoseKvCopyFailsLeavesTheStageServing) {
  // n0 receives nothing over the data plane until a stage moves there.
  up_with_faults("kvfault", "n0=recv:1:fail");
  client c(m_);
  ASSERT_TRUE(c.ok());
  constexpr int jobs = 4;
  constexpr std::int64_t tokens = 500;
  auto ref = reference_run(c, jobs, tokens);
  ASSERT_FALSE(::testing::Test::HasFailure());
  auto before = c.status();
  ASSERT_TRUE(before.has_value());
  ASSERT_EQ(before->placement, "n0 [0,1) -> n1 [1,2) -> n2 [2,4)");

  auto run = start_jobs(c, jobs, tokens, true);
  ASSERT_TRUE(wait_mid_decode(*run, 20, tokens / 3)) << "the jobs are not all mid-decode";
  auto failed = actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"1", "n0"}, 60s);
  ASSERT_FALSE(failed.has_value()) << "the migration went through a failed KV copy";
  std::printf("[ fault ] the migration failed: %s\n", failed.error().c_str());
  EXPECT_NE(failed.error().find("peer lost"), std::string::npos)
      << "a failed transfer is the link's fault, not the request's";
  auto mid = c.status();
  ASSERT_TRUE(mid.has_value());
  EXPECT_EQ(mid->placement, "n0 [0,1) -> n1 [1,2) -> n2 [2,4)") << "the stage moved anyway";
  EXPECT_EQ(mid->migrations, 0);

  // The fault was the first receive only: the same move now goes through.
  auto moved = actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"1", "n0"}, 60s);
  ASSERT_TRUE(moved.has_value()) << moved.error();
  EXPECT_EQ(moved->to, "n0");
  join(*run);
  for (int i = 0; i < jobs; ++i) {
    const auto& d = run->done[static_cast<std::size_t>(i)];
    ASSERT_TRUE(d.has_value()) << "job " << i << ": " << run->errors[static_cast<std::size_t>(i)];
    EXPECT_EQ(d->reason, actors::finish_reason::length) << to_string(d->reason) << ": " << d->error;
    EXPECT_EQ(d->preemptions, 0) << "job " << i << " was recomputed";
    EXPECT_EQ(d->tokens, ref->done[static_cast<std::size_t>(i)]->tokens)
        << "job " << i << " answered differently";
  }
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->placement, "n0 [0,1) -> n0 [1,2) -> n2 [2,4)");
  EXPECT_EQ(after->migrations, 1);
}

// A lost transfer mid-decode with every process alive: n1 (stage 1) fails
// one of its activation sends to n2. The failed step's requests stall as
// for a lost node; no node is lost, so no reset comes, and after the
// retry window they free their KV and recompute on the same stages. Every
// job ends with the tokens of a run without the fault, nothing is lost, and
// no node was replaced.
TEST_F(ClusterWithFaults, ALostActivationTransferIsRetriedOnTheSameStages) {
  // n1's sends are stage 1's activations to stage 2 (n2), one per step: the
  // 40th is mid-decode of the first run below.
  up_with_faults("sendfault", "n1=send:40:fail");
  client c(m_);
  ASSERT_TRUE(c.ok());
  constexpr int jobs = 4;
  constexpr std::int64_t tokens = 120;
  const auto t0 = steady::now();
  auto run = start_jobs(c, jobs, tokens, true);
  join(*run);
  const double faulted_s = ms_since(t0) / 1e3;
  auto ref = reference_run(c, jobs, tokens);  // the fault is spent: the plain answers
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (const auto& d : ref->done) EXPECT_EQ(d->preemptions, 0) << "the plain run recomputed";
  const int recomputed = expect_same_answers(*run, *ref);
  EXPECT_GE(recomputed, 1) << "no job met the failed transfer";
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->replacements, 0) << "a node was replaced for a lost transfer";
  EXPECT_EQ(after->placement, "n0 [0,1) -> n1 [1,2) -> n2 [2,4)");
  std::printf(
      "[ fault ] a failed activation send: %d of %d jobs recomputed on the same stages, every "
      "answer equal; %.1f s for the run (the retry waits 5 s for a reset)\n",
      recomputed, jobs, faulted_s);
}

}  // namespace
