// Pipeline and tensor parallelism across processes through the real
// binary.
// - Pipeline: a `troupe worker` serves layers [2,4) of the bundled model,
//   `troupe run --remote-stage` runs layers [0,2) and sends it the
//   activations over UCX (control over CAF). Tokens must equal the
//   one-process plain loop's for the same seed.
// - Tensor parallel: `troupe worker --tp-rank 1 --tp-size 2` holds half of
//   every layer's heads and FFN, `troupe run --tp-peer` the other half;
//   they meet in ring all-reduces over UCX. Sums are split differently, so
//   greedy answers (not sampled bits) must equal the plain loop's.
// Both on one host (shared memory, then TCP only) and between network
// namespaces joined by veth (separate hosts, TCP).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "run_cli.hpp"
#include "tests/multiproc.hpp"

namespace {

using namespace std::chrono_literals;
using troupe::test::child_process;
using troupe::test::troupe_cli;

const std::string image = std::string(TROUPE_FIXTURES_DIR) + "/shapes/shapes_005.png";
const std::string args =
    " -i " + image +
    " -p 'Describe the image.' -n 24 --temperature 0.8 --top-k 20 --seed 11 --json";

nlohmann::json last_json(const std::string& out) {
  const auto at = out.rfind("\n{");
  return nlohmann::json::parse(at == std::string::npos ? out : out.substr(at + 1));
}

// Starts a worker for layers [2,4) (or what `role` says); its port, or 0.
int start_worker(std::unique_ptr<child_process>& w, std::vector<std::string> prefix,
                 std::vector<std::string> env,
                 std::vector<std::string> role = {"--first-layer", "2"}) {
  std::vector<std::string> argv = std::move(prefix);
  for (const char* a : {TROUPE_CLI, "worker", "--port", "0"}) argv.push_back(a);
  argv.insert(argv.end(), role.begin(), role.end());
  w = std::make_unique<child_process>("worker", argv, std::move(env));
  auto line = w->expect("troupe worker:", 60000ms);
  if (!line) return 0;
  const auto at = line->rfind("port ");
  return at == std::string::npos ? 0 : std::stoi(line->substr(at + 5));
}

std::string run_front(const std::string& front_args, std::vector<std::string> prefix = {},
                      std::vector<std::string> env = {}) {
  std::vector<std::string> argv = std::move(prefix);
  argv.push_back("/bin/sh");
  argv.push_back("-c");
  argv.push_back(std::string(TROUPE_CLI) + " " + front_args + " 2>/dev/null");
  child_process front("front", argv, std::move(env));
  std::string out;
  while (auto l = front.read_line(120000ms)) out += *l + "\n";
  return out;
}

void expect_same_tokens(const std::string& out) {
  const auto direct = troupe_cli("generate --direct" + args, false);
  ASSERT_EQ(direct.exit_code, 0) << direct.out;
  ASSERT_NE(out.find("{"), std::string::npos) << out;
  const auto a = last_json(direct.out), b = last_json(out);
  EXPECT_EQ(a["tokens"], b["tokens"]);
  EXPECT_EQ(a["text"], b["text"]);
  EXPECT_NE(b["pipeline"].get<std::string>().find("remote worker layers [2,4)"), std::string::npos)
      << b["pipeline"];
}

// Runs `troupe bench <front_args>` with 5000 requests; once the worker
// prints `joined` (the front reached it), lets requests flow, kills the
// worker and expects every request to end (some failed) within `limit`,
// and the front to exit 0 with its JSON.
void expect_requests_end_after_kill(child_process& worker, const std::string& front_args,
                                    const std::string& joined, std::chrono::milliseconds limit) {
  child_process front("front", {"/bin/sh", "-c",
                                std::string(TROUPE_CLI) + " bench " + front_args +
                                    " -c 16 -n 5000 --max-tokens 256 --json"});
  ASSERT_TRUE(worker.expect(joined, 60000ms)) << "the front never joined";
  std::this_thread::sleep_for(troupe::test::scaled(1500ms));
  worker.kill();
  const auto t0 = std::chrono::steady_clock::now();
  std::string out;
  while (auto l = front.read_line(90000ms)) out += *l + "\n";
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, troupe::test::scaled(limit)) << "the front kept waiting for the dead worker";
  const std::string ended = front.wait_exit(10000ms);
  ASSERT_NE(out.find('{'), std::string::npos) << "front: " << ended << ", stdout:\n" << out;
  EXPECT_EQ(ended, "exit 0");
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  const auto& level = j["levels"][0];
  EXPECT_GT(level["failed"].get<int>(), 0) << j.dump();
  EXPECT_EQ(level["completed"].get<int>() + level["failed"].get<int>(), 5000) << j.dump();
}

}  // namespace

TEST(CliPipelineAcrossProcesses, TokensEqualOneProcessOverSharedMemory) {
  std::unique_ptr<child_process> w;
  const int port = start_worker(w, {}, {});
  ASSERT_GT(port, 0);
  expect_same_tokens(run_front("run --remote-stage 127.0.0.1:" + std::to_string(port) + args));
}

TEST(CliPipelineAcrossProcesses, TokensEqualOneProcessOverTcp) {
  std::unique_ptr<child_process> w;
  const int port = start_worker(w, {}, {"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"});
  ASSERT_GT(port, 0);
  expect_same_tokens(run_front("run --remote-stage 127.0.0.1:" + std::to_string(port) + args, {},
                               {"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"}));
}

TEST(CliPipelineAcrossProcesses, TokensEqualOneProcessBetweenNetworkNamespaces) {
  troupe::test::netns_pair ns(2);
  if (!ns.ok()) GTEST_SKIP() << troupe::test::netns_skipped(ns.why());
  std::unique_ptr<child_process> w;
  const int port =
      start_worker(w, ns.exec_in(false), {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + ns.device(false)});
  ASSERT_GT(port, 0);
  expect_same_tokens(run_front("run --remote-stage 10.77.2.2:" + std::to_string(port) + args,
                               ns.exec_in(true),
                               {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + ns.device(true)}));
}

TEST(CliPipelineAcrossProcesses, SixteenConcurrentRequestsAllComplete) {
  std::unique_ptr<child_process> w;
  const int port = start_worker(w, {}, {});
  ASSERT_GT(port, 0);
  const auto out = run_front("bench --remote-stage 127.0.0.1:" + std::to_string(port) +
                             " -c 16 -n 32 --max-tokens 16 --json");
  ASSERT_NE(out.find('{'), std::string::npos) << out;
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  ASSERT_EQ(j["levels"].size(), 1u) << j.dump();
  EXPECT_EQ(j["levels"][0]["completed"], 32) << j.dump();
  EXPECT_EQ(j["levels"][0]["failed"], 0) << j.dump();
}

TEST(CliPipelineAcrossProcesses, BadRemoteStagesFailWithAMessage) {
  auto r = troupe_cli("run -p hi --remote-stage nonsense");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("expected HOST:PORT"), std::string::npos) << r.out;
  r = troupe_cli("run -p hi --remote-stage 127.0.0.1:" + std::to_string(troupe::test::free_port()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("remote stage 127.0.0.1:"), std::string::npos) << r.out;
  r = troupe_cli("worker --first-layer 9");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("--first-layer must be in [1, 4)"), std::string::npos) << r.out;
}

TEST(CliPipelineAcrossProcesses, AKilledWorkerFailsTheRequestsInsteadOfHanging) {
  std::unique_ptr<child_process> w;
  const int port = start_worker(w, {}, {});
  ASSERT_GT(port, 0);
  // (Killing it before the front joined tests a failed start, which
  // BadRemoteStagesFailWithAMessage covers.)
  expect_requests_end_after_kill(*w, "--remote-stage 127.0.0.1:" + std::to_string(port),
                                 "troupe worker: serving", 30000ms);
}

namespace {

const std::string tp_role_1[] = {"--tp-rank", "1", "--tp-size", "2"};

std::vector<std::string> tp_worker_role() {
  return {std::begin(tp_role_1), std::end(tp_role_1)};
}

// Greedy answers of the bundled model through a TP=2 group equal the plain
// loop's: a caption and questions on three images.
void expect_same_greedy_answers(int port, const std::string& host, std::vector<std::string> prefix,
                                std::vector<std::string> env) {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"shapes_000.png", "Describe the image."},
      {"shapes_003.png", "How many shapes are there?"},
      {"shapes_007.png", "Describe the image."},
  };
  for (const auto& [img, prompt] : cases) {
    const std::string a = " -i " + std::string(TROUPE_FIXTURES_DIR) + "/shapes/" + img + " -p '" +
                          prompt + "' -n 32 --temperature 0 --json";
    const auto direct = troupe_cli("generate --direct" + a, false);
    ASSERT_EQ(direct.exit_code, 0) << direct.out;
    const auto out =
        run_front("run --tp-peer " + host + ":" + std::to_string(port) + a, prefix, env);
    ASSERT_NE(out.find('{'), std::string::npos) << out;
    const auto d = last_json(direct.out), t = last_json(out);
    EXPECT_EQ(d["tokens"], t["tokens"]) << img << ": " << d["text"] << " vs " << t["text"];
    EXPECT_NE(t["pipeline"].get<std::string>().find("tensor-parallel rank 0 of 2, remote rank 1"),
              std::string::npos)
        << t["pipeline"];
  }
}

}  // namespace

TEST(CliTensorParallelAcrossProcesses, GreedyAnswersEqualOneProcessOverSharedMemory) {
  std::unique_ptr<child_process> w;
  const int port = start_worker(w, {}, {}, tp_worker_role());
  ASSERT_GT(port, 0);
  expect_same_greedy_answers(port, "127.0.0.1", {}, {});
}

TEST(CliTensorParallelAcrossProcesses, GreedyAnswersEqualOneProcessBetweenNetworkNamespaces) {
  troupe::test::netns_pair ns(3);
  if (!ns.ok()) GTEST_SKIP() << troupe::test::netns_skipped(ns.why());
  std::unique_ptr<child_process> w;
  const int port =
      start_worker(w, ns.exec_in(false), {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + ns.device(false)},
                   tp_worker_role());
  ASSERT_GT(port, 0);
  expect_same_greedy_answers(port, "10.77.3.2", ns.exec_in(true),
                             {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + ns.device(true)});
}

TEST(CliTensorParallelAcrossProcesses, SixteenConcurrentRequestsAllComplete) {
  std::unique_ptr<child_process> w;
  const int port = start_worker(w, {}, {}, tp_worker_role());
  ASSERT_GT(port, 0);
  const auto out = run_front("bench --tp-peer 127.0.0.1:" + std::to_string(port) +
                             " -c 16 -n 32 --max-tokens 16 --json");
  ASSERT_NE(out.find('{'), std::string::npos) << out;
  const auto j = nlohmann::json::parse(out.substr(out.find('{')));
  EXPECT_EQ(j["levels"][0]["completed"], 32) << j.dump();
  EXPECT_EQ(j["levels"][0]["failed"], 0) << j.dump();
}

TEST(CliTensorParallelAcrossProcesses, WrongGroupsFailWithAMessage) {
  auto r = troupe_cli("worker --tp-rank 0 --tp-size 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("--tp-rank in [1, K)"), std::string::npos) << r.out;
  r = troupe_cli("worker --tp-rank 1 --tp-size 2 --first-layer 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("exclude each other"), std::string::npos) << r.out;
  {
    // A pipeline worker is not a tensor-parallel rank.
    std::unique_ptr<child_process> w;
    const int port = start_worker(w, {}, {});
    ASSERT_GT(port, 0);
    r = troupe_cli("run -p hi --tp-peer 127.0.0.1:" + std::to_string(port));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.out.find("is a pipeline stage, not a tensor-parallel rank"), std::string::npos)
        << r.out;
  }
  {
    // TP does not combine with pipeline stages (yet).
    std::unique_ptr<child_process> w;
    const int port = start_worker(w, {}, {}, tp_worker_role());
    ASSERT_GT(port, 0);
    r = troupe_cli("run -p hi --stages 2 --tp-peer 127.0.0.1:" + std::to_string(port));
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.out.find("does not combine with --stages > 1"), std::string::npos) << r.out;
  }
  // The bundled model has 2 KV heads: no 3-way split.
  r = troupe_cli("worker --tp-rank 1 --tp-size 3");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("KV heads (2) and FFN width (384) must divide evenly"), std::string::npos)
      << r.out;
}

TEST(CliTensorParallelAcrossProcesses, AKilledRankFailsTheRequestsInsteadOfHanging) {
  std::unique_ptr<child_process> w;
  const int port = start_worker(w, {}, {}, tp_worker_role());
  ASSERT_GT(port, 0);
  expect_requests_end_after_kill(*w, "--tp-peer 127.0.0.1:" + std::to_string(port),
                                 "troupe worker: tensor-parallel rank 1 of 2 joined", 20000ms);
}
