// Tensor parallelism in the cluster (parallelism.tensor_parallel = 2 with
// two pipeline stages over four node processes): each stage is a group of
// two nodes, each holding half of every layer's heads and FFN rows, their
// all-reduces over a ring on the data plane. Greedy answers equal the
// plain one-process loop's; when a rank's node is killed mid-decode the
// stage is placed again on the nodes left and every answer is the one of
// the run before.
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
  // n0..n3 (n3 on every core like n2), with `parallelism` instead of the
  // three stages.
  void up_four(const std::string& name,
               const std::string& parallelism = "pipeline_stages = 2\ntensor_parallel = 2") {
    up(name, "", [parallelism](std::string& text) {
      text.replace(text.find("pipeline_stages = 3"), 19, parallelism);
      text +=
          "[[nodes]]\nname = \"n3\"\nhost = \"127.0.0.1\"\nport = " + std::to_string(free_port()) +
          "\ndevices = [{ type = \"cpu\", memory = \"4GiB\" }]\n";
    });
  }
};

TEST_F(TensorParallelCluster, StagesOfTwoRanksAnswerAsOneProcessAndALostRankIsPlacedAgain) {
  up_four("tp");
  if (HasFatalFailure()) return;
  client c(m_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(c.wait_for([](const actors::cluster_status& st) { return st.ready; }, 60s))
      << "the cluster did not get ready";
  auto s0 = c.status();
  ASSERT_TRUE(s0.has_value());
  EXPECT_EQ(s0->placement.find("n0+n1 [0,"), 0u) << s0->placement;
  EXPECT_NE(s0->placement.find(" -> n2+n3 ["), std::string::npos) << s0->placement;
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

  // A rank of the second stage is lost mid-decode.
  constexpr int jobs = 4;
  constexpr std::int64_t tokens = 300;
  auto ref = reference_run(c, jobs, tokens);
  auto run = start_jobs(c, jobs, tokens, true);
  joiner joined{*run};
  ASSERT_TRUE(wait_mid_decode(*run, 1, static_cast<int>(tokens) - 50))
      << "the requests did not all start";
  const auto killed = steady::now();
  ::kill(pid_of("n3"), SIGKILL);
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
  // Three nodes left make one group of two: the whole model on n0+n1.
  EXPECT_EQ(after->placement.find("n0+n1 [0,"), 0u) << after->placement;
  EXPECT_EQ(after->placement.find("->"), std::string::npos) << after->placement;
  std::printf(
      "[ tensor parallel ] %s; SIGKILL of n3 (rank 1 of the second stage) with %d jobs "
      "mid-decode: placed again as %s %.0f ms after the signal; %d recomputed, every answer as "
      "before\n",
      s0->placement.c_str(), jobs, after->placement.c_str(), back_ms, recomputed);
}

// Two replicas of one tensor-parallel stage each: n0+n1 and n2+n3 hold
// the whole model; jobs go to both and answer as one process does.
TEST_F(TensorParallelCluster, TwoReplicasOfATensorParallelStageShareTheJobs) {
  up_four("tpr", "pipeline_stages = 1\ntensor_parallel = 2\nreplicas = 2");
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
