// Tensor parallelism in the cluster (parallelism.tensor_parallel = 2 with
// two pipeline stages over four node processes and a spare): each stage is
// a group of two nodes, each holding half of every layer's heads and FFN
// rows, their all-reduces over a ring on the data plane. Greedy answers
// equal the plain one-process loop's; a rank (another, then the stage's
// rank 0) moves live mid-decode with nothing recomputed; when a rank's node
// is killed mid-decode the stage is placed again on the nodes left; every
// answer is the one of the run before. Two replicas of a tensor-parallel
// stage share the jobs.
#include <gtest/gtest.h>
#include <signal.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "run_cli.hpp"
#include "tests/cli/cluster_harness.hpp"

namespace troupe::test::cluster_harness {
namespace {

nlohmann::json last_json(const std::string& out) {
  const auto at = out.rfind("\n{");
  return nlohmann::json::parse(at == std::string::npos ? out : out.substr(at + 1));
}

// Runs greedy jobs on images `images` at once and checks each answer
// against the plain one-process loop's.
void expect_greedy_answers_of_one_process(client& c, const std::vector<int>& images) {
  std::vector<actors::job_request> jobs;
  for (int i : images) {
    auto j = job(i, 32, false);
    j.has_temperature = true;
    j.temperature = 0;
    jobs.push_back(std::move(j));
  }
  std::vector<std::optional<actors::finish_event>> got(jobs.size());
  std::vector<std::string> errors(jobs.size());
  std::vector<std::thread> threads;
  for (std::size_t k = 0; k < jobs.size(); ++k)
    threads.emplace_back([&, k] {
      auto f = actors::client(c.sys(), c.door()).run(jobs[k]);
      if (f)
        got[k] = std::move(*f);
      else
        errors[k] = f.error().message;
    });
  for (auto& t : threads) t.join();
  for (std::size_t k = 0; k < jobs.size(); ++k) {
    ASSERT_TRUE(got[k].has_value()) << errors[k];
    const auto direct = troupe_cli("generate --direct -i " + jobs[k].images[0].name +
                                       " -p 'Describe the image.' -n 32 --temperature 0 --json",
                                   false);
    ASSERT_EQ(direct.exit_code, 0) << direct.out;
    const auto want = last_json(direct.out)["tokens"].get<std::vector<std::int32_t>>();
    EXPECT_EQ(got[k]->tokens, want) << "image " << images[k] << ": " << got[k]->text;
  }
}

class TensorParallelCluster : public ClusterLoopback {
 protected:
  // n0..n2 and more nodes on every core like n2 (n3, n4, ...), with
  // `parallelism` instead of the three stages.
  void up_nodes(const std::string& name, const std::string& parallelism, int nodes) {
    up(name, "", [parallelism, nodes](std::string& text) {
      text.replace(text.find("pipeline_stages = 3"), 19, parallelism);
      for (int i = 3; i < nodes; ++i)
        text += "[[nodes]]\nname = \"n" + std::to_string(i) +
                "\"\nhost = \"127.0.0.1\"\nport = " + std::to_string(free_port()) +
                "\ndevices = [{ type = \"cpu\", memory = \"4GiB\" }]\n";
    });
  }
  // Moves `rank` of stage `stage` to `to` while `jobs` jobs of `tokens`
  // decode; every answer must be the reference's with nothing recomputed.
  // The placement after it.
  std::string move_mid_decode(client& c, const job_run& ref, int jobs, std::int64_t tokens,
                              const std::string& stage, int rank, const std::string& to) {
    auto run = start_jobs(c, jobs, tokens, true);
    joiner joined{*run};
    EXPECT_TRUE(wait_mid_decode(*run, 1, static_cast<int>(tokens) / 3))
        << "the requests did not all start";
    actors::migrate_request mv{stage, to, 0, rank};
    auto moved = actors::migrate_shard(c.sys(), c.door(), mv, 60s);
    EXPECT_TRUE(moved.has_value()) << (moved ? "" : moved.error());
    join(*run);
    const int recomputed = expect_same_answers(*run, ref);
    EXPECT_EQ(recomputed, 0) << "a live move recomputed requests";
    auto s = c.status();
    if (!s || !moved) return {};
    std::printf(
        "[ tensor parallel ] %s: pause %.1f ms, %lld sequences, %.2f MiB of KV, "
        "%.0f ms in all; now %s\n",
        moved->what.c_str(), moved->pause_ms, static_cast<long long>(moved->sequences),
        static_cast<double>(moved->kv_bytes) / (1 << 20), moved->total_ms, s->placement.c_str());
    return s->placement;
  }
};

TEST_F(TensorParallelCluster, StagesOfTwoRanksAnswerAsOneProcessMoveLiveAndArePlacedAgain) {
  // n0..n3: two stages of two ranks; n4 spare.
  up_nodes("tp", "pipeline_stages = 2\ntensor_parallel = 2", 5);
  if (HasFatalFailure()) return;
  client c(m_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c.wait_for([](const actors::cluster_status& st) { return st.ready; }, 60s))
      << "the cluster did not get ready";
  auto s0 = c.status();
  ASSERT_TRUE(s0.has_value());
  EXPECT_EQ(s0->placement, "n0+n1 [0,2) -> n2+n3 [2,4)");
  for (const char* n : {"n1", "n3"}) {
    const auto* m = c.member(*s0, n);
    ASSERT_NE(m, nullptr) << n;
    EXPECT_NE(m->report.stages.find("tensor-parallel rank 1 of 2"), std::string::npos)
        << n << ": " << m->report.stages;
  }
  const auto* n0 = c.member(*s0, "n0");
  ASSERT_NE(n0, nullptr);
  EXPECT_NE(n0->report.stages.find("tensor-parallel rank 0 of 2"), std::string::npos)
      << n0->report.stages;

  // Greedy answers (images through the head's encoder, then both groups)
  // equal the one-process loop's.
  expect_greedy_answers_of_one_process(c, {0, 3, 7});

  constexpr int jobs = 4;
  constexpr std::int64_t tokens = 300;
  auto ref = reference_run(c, jobs, tokens);

  // Moves that are refused: no rank named, a node holding a rank already.
  auto no_rank = actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"1", "n4"}, 60s);
  ASSERT_FALSE(no_rank.has_value());
  EXPECT_NE(no_rank.error().find("name the rank that moves"), std::string::npos) << no_rank.error();
  auto twice =
      actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"1", "n2", 0, 1}, 60s);
  ASSERT_FALSE(twice.has_value());
  EXPECT_NE(twice.error().find("holds a rank of stage 1 already"), std::string::npos)
      << twice.error();

  // Live moves mid-decode: rank 1 of the second stage to the spare, then
  // its rank 0 (the stage's face) to the node rank 1 left.
  EXPECT_EQ(move_mid_decode(c, *ref, jobs, tokens, "1", 1, "n4"), "n0+n1 [0,2) -> n2+n4 [2,4)");
  EXPECT_EQ(move_mid_decode(c, *ref, jobs, tokens, "1", 0, "n3"), "n0+n1 [0,2) -> n3+n4 [2,4)");
  if (HasFailure()) return;

  // A rank of the second stage is lost mid-decode.
  auto run = start_jobs(c, jobs, tokens, true);
  joiner joined{*run};
  ASSERT_TRUE(wait_mid_decode(*run, 1, static_cast<int>(tokens) - 50))
      << "the requests did not all start";
  const auto killed = steady::now();
  ::kill(pid_of("n4"), SIGKILL);
  auto back = c.wait_for(
      [](const actors::cluster_status& st) {
        return st.replicas.size() == 1 && st.replicas[0].replacements >= 1 && st.ready;
      },
      60s);
  ASSERT_TRUE(back.has_value()) << "the model was not placed again";
  const double back_ms = ms_since(killed);  // (polled every 50 ms)
  join(*run);
  const int recomputed = expect_same_answers(*run, *ref);
  EXPECT_GE(recomputed, 1) << "no request lost its KV";
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  // Four nodes left make the two groups again, in manifest order.
  EXPECT_EQ(after->placement, "n0+n1 [0,2) -> n2+n3 [2,4)");
  std::printf(
      "[ tensor parallel ] SIGKILL of n4 (rank 1 of the second stage) with %d jobs mid-decode: "
      "placed again as %s %.0f ms after the signal; %d recomputed, every answer as before\n",
      jobs, after->placement.c_str(), back_ms, recomputed);
}

// Two replicas of one tensor-parallel stage each: n0+n1 and n2+n3 hold
// the whole model; jobs go to both and answer as one process does.
TEST_F(TensorParallelCluster, TwoReplicasOfATensorParallelStageShareTheJobs) {
  up_nodes("tpr", "pipeline_stages = 1\ntensor_parallel = 2\nreplicas = 2", 4);
  if (HasFatalFailure()) return;
  client c(m_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c.wait_for(
      [](const actors::cluster_status& st) {
        return st.replicas.size() == 2 && st.replicas[0].ready && st.replicas[1].ready;
      },
      60s))
      << "the replicas did not get ready";
  auto s0 = c.status();
  ASSERT_TRUE(s0.has_value());
  EXPECT_EQ(s0->replicas[0].placement, "n0+n1 [0,4)");
  EXPECT_EQ(s0->replicas[1].placement, "n2+n3 [0,4)");
  expect_greedy_answers_of_one_process(c, {1, 2, 4, 5});
  auto s1 = c.status();
  ASSERT_TRUE(s1.has_value());
  EXPECT_GE(s1->replicas[0].routed, 1);
  EXPECT_GE(s1->replicas[1].routed, 1);
  std::printf("[ tensor parallel ] two replicas %s and %s: %lld and %lld of 4 jobs\n",
              s0->replicas[0].placement.c_str(), s0->replicas[1].placement.c_str(),
              static_cast<long long>(s1->replicas[0].routed),
              static_cast<long long>(s1->replicas[1].routed));
}

}  // namespace
}  // namespace troupe::test::cluster_harness
