// A whole cluster through the real binary: `troupe up` starts three node
// processes from a manifest (on loopback, and in three network namespaces
// joined by a bridge, as separate hosts), the head places the bundled
// model's decoder over them (PP over nodes), and jobs come in through the
// client actor, as `troupe submit` sends them. Then a node that holds a
// stage is killed (SIGKILL) or hung (SIGSTOP) while requests decode: the
// head must notice, place its stage on the nodes left, and finish every
// accepted request with the tokens of a run without the failure. The node
// then comes back and rejoins; `troupe down` stops everything.
#include <gtest/gtest.h>

#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <algorithm>
#include <atomic>
#include <caf/io/all.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <thread>

#include "../temp_path.hpp"
#include "actors/cluster.hpp"
#include "actors/gatekeeper.hpp"
#include "cluster/certs.hpp"
#include "cluster/launcher.hpp"
#include "cluster_harness.hpp"
#include "cluster_manifest.hpp"
#include "kernels/cuda/probe.hpp"
#include "models/llava_config.hpp"
#include "run_cli.hpp"
#include "tests/multiproc.hpp"
#include "tests/transport/listening_ports.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using namespace troupe;
using steady = std::chrono::steady_clock;
using test::cluster_setup;
using namespace test::cluster_harness;
using test::make_manifest;

// The failure case: a node holding a stage is stopped with `sig` while at
// least 4 requests are mid-decode; `kill_victim` sends the signal,
// `revive` brings it back.
void failure_case(const cluster_setup& cs, const std::string& victim,
                  const std::function<void()>& kill_victim, const std::function<void()>& revive,
                  double detect_limit_ms) {
  auto m = cluster::load_manifest(cs.manifest);
  ASSERT_TRUE(m.has_value());
  client c(*m);
  ASSERT_TRUE(c.ok());
  constexpr int jobs = 6;
  constexpr std::int64_t tokens = 1500;
  // The reference: the same jobs without a failure.
  auto ref = start_jobs(c, jobs, tokens, true);
  join(*ref);
  for (int i = 0; i < jobs; ++i) {
    ASSERT_TRUE(ref->done[static_cast<std::size_t>(i)].has_value())
        << ref->errors[static_cast<std::size_t>(i)];
    ASSERT_EQ(ref->done[static_cast<std::size_t>(i)]->tokens.size(),
              static_cast<std::size_t>(tokens));
  }
  auto before = c.status();
  ASSERT_TRUE(before.has_value());
  const auto* v = c.member(*before, victim);
  ASSERT_NE(v, nullptr);
  ASSERT_EQ(v->state, cluster::member_state::up);
  ASSERT_FALSE(v->report.stages.empty()) << "the victim holds no stage: " << before->placement;
  ASSERT_NE(before->placement.find(victim), std::string::npos) << before->placement;

  auto run = start_jobs(c, jobs, tokens, true);
  // Wait until at least 4 requests are mid-decode.
  const auto t0 = steady::now();
  int decoding = 0;
  while (ms_since(t0) < 60000) {
    decoding = 0;
    for (auto& s : run->streamed) decoding += s > 0 && s < tokens / 2;
    if (decoding >= 4) break;
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_GE(decoding, 4) << "the requests did not start decoding";
  const auto killed = steady::now();
  kill_victim();
  auto detect = c.wait_for(
      [&](const actors::cluster_status& s) {
        const auto* m = c.member(s, victim);
        return m && m->state == cluster::member_state::lost;
      },
      15s);
  ASSERT_TRUE(detect.has_value()) << "the head did not notice the loss of " << victim;
  const double detect_ms = ms_since(killed);
  join(*run);
  const double all_done_ms = ms_since(killed);
  const int recomputed = expect_same_answers(*run, *ref);
  EXPECT_GE(recomputed, 4);
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  EXPECT_GE(after->replacements, 1);
  EXPECT_EQ(after->placement.find(victim), std::string::npos)
      << "still placed on the victim: " << after->placement;
  EXPECT_TRUE(after->ready);
  EXPECT_LT(detect_ms, detect_limit_ms);
  std::printf(
      "[ cluster ] %s: lost %.0f ms after the signal (last heartbeat answer to 'lost': %.0f ms); "
      "requests "
      "resumed %.0f ms after the loss was noticed; all %d done %.0f ms after the signal; placement "
      "now %s\n",
      victim.c_str(), detect_ms, after->detect_ms, after->resume_ms, jobs, all_done_ms,
      after->placement.c_str());
  // What clients saw (issue 22, recovery quality): the longest wait for a
  // token that ended after the signal (tokens already in flight still
  // arrive after it, so the stall is not always the gap spanning the
  // signal), next to the head's "resumed in" and one step (the median over
  // streams of each stream's mean time per token before the signal; tokens
  // can arrive in bursts, so single gaps are not a step).
  double worst_gap_ms = 0;
  std::vector<double> steps;
  for (const auto& a : run->arrivals) {
    std::size_t before = 0;
    for (std::size_t k = 0; k < a.size() && a[k].first < killed; ++k) before = k + 1;
    if (before >= 2)
      steps.push_back(
          std::chrono::duration<double, std::milli>(a[before - 1].first - a[0].first).count() /
          static_cast<double>(before - 1));
    for (std::size_t k = std::max<std::size_t>(before, 1); k < a.size(); ++k)
      worst_gap_ms =
          std::max(worst_gap_ms,
                   std::chrono::duration<double, std::milli>(a[k].first - a[k - 1].first).count());
  }
  std::sort(steps.begin(), steps.end());
  const double step_ms = steps.empty() ? 0 : steps[steps.size() / 2];
  std::printf(
      "[ cluster ] %s: worst client-visible gap after the signal %.0f ms = detection %.0f ms + "
      "%.0f ms; head's resumed in %.0f ms; one step %.1f ms; the issue's target for the part "
      "after detection (2x resumed in + one step) %.0f ms\n",
      victim.c_str(), worst_gap_ms, detect_ms, worst_gap_ms - detect_ms, after->resume_ms, step_ms,
      2 * after->resume_ms + step_ms);
  ::testing::Test::RecordProperty("worst_gap_ms", std::to_string(static_cast<int>(worst_gap_ms)));
  ::testing::Test::RecordProperty("detect_ms", std::to_string(static_cast<int>(detect_ms)));
  ::testing::Test::RecordProperty("resume_ms", std::to_string(static_cast<int>(after->resume_ms)));

  // The node comes back and rejoins.
  revive();
  auto back = c.wait_for(
      [&](const actors::cluster_status& s) {
        const auto* m = c.member(s, victim);
        return m && m->state == cluster::member_state::up && m->joins >= 2;
      },
      20s);
  EXPECT_TRUE(back.has_value()) << victim << " did not rejoin";
  // And the cluster still answers.
  auto f = actors::client(c.sys(), c.door()).run(job(2, 32, false));
  ASSERT_TRUE(f.has_value()) << f.error().message;
  EXPECT_EQ(f->reason, actors::finish_reason::stop) << to_string(f->reason) << ": " << f->error;
}

}  // namespace

TEST_F(ClusterLoopback, UpSubmitStatusDown) {
  up("pp3");
  // The model's decoder is split over the three nodes.
  auto r = test::troupe_cli("status " + cs_.manifest + " --json", false);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* n : {"n0 [", "n1 [", "n2 ["})
    EXPECT_NE(r.out.find(n), std::string::npos) << r.out;
  // An image+text job through `troupe submit` gets the answer of the plain
  // generation loop in one process.
  const std::string img = std::string(TROUPE_FIXTURES_DIR) + "/shapes/shapes_002.png";
  auto direct = test::troupe_cli(
      "generate --direct --image " + img + " --prompt 'Describe the image.' --json", false);
  ASSERT_EQ(direct.exit_code, 0) << direct.out;
  const auto at = direct.out.find("\"text\":");
  ASSERT_NE(at, std::string::npos) << direct.out;
  auto submitted = test::troupe_cli(
      "submit " + cs_.manifest + " --image " + img + " --prompt 'Describe the image.' --json",
      false);
  ASSERT_EQ(submitted.exit_code, 0) << submitted.out;
  const auto text_of = [](const std::string& json) {
    const auto a = json.find("\"text\":\"") + 8;
    return json.substr(a, json.find('"', a) - a);
  };
  EXPECT_EQ(text_of(submitted.out), text_of(direct.out.substr(at))) << submitted.out << "\n"
                                                                    << direct.out;
  EXPECT_NE(text_of(submitted.out).find("circle"), std::string::npos) << submitted.out;
  // A wrong request is refused with a message, and the cluster goes on.
  auto bad =
      test::troupe_cli("submit " + cs_.manifest + " --prompt '<image> <image>' --image " + img);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("placeholders"), std::string::npos) << bad.out;
  r = test::troupe_cli("status " + cs_.manifest);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("cluster pp3: ready"), std::string::npos) << r.out;
  // A second `up` of a running cluster is refused.
  auto again = test::troupe_cli("up " + cs_.manifest + " --detach");
  EXPECT_EQ(again.exit_code, 1) << again.out;
  EXPECT_NE(again.out.find("already running"), std::string::npos) << again.out;
}

// Audio through the cluster (issue 29): a model that hears (the shapes
// model with a random audio tower) answers an image with two clips, sent
// by `troupe submit`, as the plain generation loop does; a clip that does
// not decode is refused by name and the cluster goes on.
TEST_F(ClusterLoopback, AudioClipsAndAnImageThroughTheClusterMatchTheDirectLoop) {
  const std::string fixtures = TROUPE_FIXTURES_DIR;
  up("hear3", "[model]\npath = \"" + fixtures + "/llava_hears\"\n");
  const std::string media = " --image " + fixtures + "/shapes/shapes_002.png --audio " + fixtures +
                            "/audio/speech16k.mp3 --audio " + fixtures +
                            "/audio/stereo44k_24.wav --prompt 'Describe the image.' -n 16 --json";
  auto direct =
      test::troupe_cli("generate --direct -m " + fixtures + "/llava_hears" + media, false);
  ASSERT_EQ(direct.exit_code, 0) << direct.out;
  const auto at = direct.out.find("\"text\":");
  ASSERT_NE(at, std::string::npos) << direct.out;
  const auto text_of = [](const std::string& json) {
    const auto a = json.find("\"text\":\"") + 8;
    return json.substr(a, json.find('"', a) - a);
  };
  ASSERT_FALSE(text_of(direct.out.substr(at)).empty()) << direct.out;
  auto submitted = test::troupe_cli("submit " + cs_.manifest + media, false);
  ASSERT_EQ(submitted.exit_code, 0) << submitted.out;
  EXPECT_EQ(text_of(submitted.out), text_of(direct.out.substr(at))) << submitted.out << "\n"
                                                                    << direct.out;
  // A clip that is not audio: refused by its name; the cluster goes on.
  auto bad = test::troupe_cli("submit " + cs_.manifest + " --audio " + fixtures +
                              "/shapes/shapes_002.png --prompt 'Describe the image.'");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("shapes_002.png"), std::string::npos) << bad.out;
  EXPECT_NE(bad.out.find("not supported"), std::string::npos) << bad.out;
  auto again = test::troupe_cli("submit " + cs_.manifest + media, false);
  ASSERT_EQ(again.exit_code, 0) << again.out;
  EXPECT_EQ(text_of(again.out), text_of(submitted.out));
  // The audio queue's own figures: four clips admitted (the bad one was
  // refused before), the second job's two from the encoder cache.
  client c(m_);
  ASSERT_TRUE(c.ok());
  auto counted = c.wait_for(
      [](const actors::cluster_status& s) {
        return s.scheduler.clips == 4 && s.scheduler.clip_cache_hits == 2 &&
               s.scheduler.clip_encodes == 4 && s.scheduler.clips_waiting == 0;
      },
      20s);
  auto s = c.status();
  ASSERT_TRUE(s.has_value());
  EXPECT_TRUE(counted.has_value())
      << "clips " << s->scheduler.clips << ", hits " << s->scheduler.clip_cache_hits << ", encodes "
      << s->scheduler.clip_encodes << ", waiting " << s->scheduler.clips_waiting;
  // The last clip streamed while the job runs (0.3 s pieces at 20x real
  // time, through the head to the scheduler and the encoder): the answer
  // of the whole clip.
  const std::string first = " --image " + fixtures + "/shapes/shapes_002.png --audio " + fixtures +
                            "/audio/speech16k.mp3 --prompt 'Describe the image.' -n 16 --json";
  const std::string clip = fixtures + "/audio/speech16k.wav";
  auto whole = test::troupe_cli(
      "generate --direct -m " + fixtures + "/llava_hears" + first + " --audio " + clip, false);
  ASSERT_EQ(whole.exit_code, 0) << whole.out;
  const auto w = whole.out.find("\"text\":");
  ASSERT_NE(w, std::string::npos) << whole.out;
  auto streamed = test::troupe_cli("submit " + cs_.manifest + first + " --audio-stream " + clip +
                                       " --stream-piece-ms 300 --stream-speed 20",
                                   false);
  ASSERT_EQ(streamed.exit_code, 0) << streamed.out;
  EXPECT_EQ(text_of(streamed.out), text_of(whole.out.substr(w))) << streamed.out << "\n"
                                                                 << whole.out;
  EXPECT_NE(streamed.out.find("\"ttft_after_audio_ms\":"), std::string::npos) << streamed.out;
  EXPECT_NE(text_of(streamed.out), text_of(submitted.out)) << "another clip, another answer";
}

// A stranger on the host aims plain UCP at every listener of every node
// while jobs decode (transport/ucx_gate.hpp): the nodes drop it before UCP
// reads a byte, nothing is lost, and each node listens on loopback only
// (the manifest's address; UCX's TCP transport included).
TEST_F(ClusterLoopback, StrangersOnTheDataPlaneAreDroppedAndEveryListenerIsOnLoopback) {
  up("rogue");
  client c(m_);
  ASSERT_TRUE(c.ok());
  constexpr int jobs = 3;
  constexpr std::int64_t tokens = 48;
  auto ref = reference_run(c, jobs, tokens);
  std::string attack;
  for (const char* n : {"n0", "n1", "n2"}) {
    const pid_t pid = pid_of(n);
    ASSERT_GT(pid, 0) << n;
    const auto addrs = test::listening_addresses(pid);
    EXPECT_GE(addrs.size(), 2u) << n << ": its control plane and UCX's TCP listener";
    for (const auto& a : addrs) {
      EXPECT_TRUE(a.starts_with("127.")) << n << " listens on " << a;
      attack += std::string(TROUPE_ROGUE_UCX) + " " + a.substr(a.rfind(':') + 1) +
                " 16 65536 >/dev/null 2>&1 & ";
    }
  }
  auto run = start_jobs(c, jobs, tokens, true);
  ASSERT_TRUE(wait_mid_decode(*run, 2, 40));
  EXPECT_EQ(std::system((attack + "wait").c_str()), 0);
  join(*run);
  for (const char* n : {"n0", "n1", "n2"})
    EXPECT_TRUE(cluster::process_alive(pid_of(n))) << "the stranger killed " << n;
  expect_same_answers(*run, *ref);
  auto st = c.status();
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->replacements, 0) << "a node was lost to the stranger";
  // The nodes said so: their gate refused the connections.
  int refusing = 0;
  for (const auto& n : cluster::read_launched(m_)) {
    std::ifstream f(n.log);
    const std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    refusing += text.find("data plane: refused a TCP connection") != std::string::npos;
  }
  EXPECT_EQ(refusing, 3) << "not every node logged a refusal";
}

// Issue 27's failover target: with a KV store on the head's node, every
// full block of every stage is copied there as it fills; SIGKILL of a
// stage node with 8 requests past 500 tokens, and the new stages take the
// blocks back instead of recomputing: at most the last full block and the
// partly filled one per request are recomputed, and every answer is the
// one of a run without the loss. Without the store, the same loss
// recomputes everything (the second test, for the figures beside it).
class ClusterKvStore : public ClusterLoopback {
 protected:
  struct loss {
    std::int64_t restored = 0, recomputed = 0;
    actors::scheduler_stats before, after;
  };
  // TROUPE_KV_STORE_MODEL (a model path) runs these on that model instead
  // of the bundled one, for the figures of docs/performance.md (minutes on
  // a TinyLlama-sized model); CI leaves it unset.
  void lose_n1_past_500(const std::string& name, const std::string& extra, loss& out,
                        const std::function<void(std::string&)>& edit = {}) {
    const char* model = std::getenv("TROUPE_KV_STORE_MODEL");
    const bool big = model != nullptr && *model != 0;
    text_only_jobs() = big;  // (the bundled model's jobs carry an image)
    up(name, big ? extra + "[model]\npath = \"" + model + "\"\nctx = 8192\n" : extra, edit);
    client c(m_);
    ASSERT_TRUE(c.ok());
    constexpr int jobs = 8;
    constexpr std::int64_t tokens = 900;
    auto ref = reference_run(c, jobs, tokens);
    auto before = c.status();
    ASSERT_TRUE(before.has_value());
    out.before = before->scheduler;
    auto run = start_jobs(c, jobs, tokens, true);
    joiner joined{*run};  // an assertion below returns: the jobs' threads are joined first
    ASSERT_TRUE(wait_mid_decode(*run, 500, 600, big ? 600000 : 60000))
        << "the requests did not pass 500 tokens together";
    if (!extra.empty()) {
      // What comes back is what the store confirmed (a block's copy from
      // every stage). On a loaded machine the confirmations trail the
      // decode: in one CI run none had come when n1 was killed, and every
      // token was recomputed. The test is about the restore: it waits for
      // the copies of the 500 tokens (blocks of 16).
      const std::int64_t want = jobs * 500 / 16;
      ASSERT_TRUE(c.wait_for(
          [&](const actors::cluster_status& st) { return st.scheduler.kv_remote_used >= want; },
          30s))
          << "the store did not confirm " << want << " blocks";
      for (const auto& n : run->streamed)
        ASSERT_LT(n.load(), tokens) << "a request ended before the kill";
    }
    const auto killed = steady::now();
    ::kill(pid_of("n1"), SIGKILL);
    join(*run);
    const double all_done_ms = ms_since(killed);
    EXPECT_GE(expect_same_answers(*run, *ref), jobs) << "a request did not lose its KV";
    auto after = c.status();
    ASSERT_TRUE(after.has_value());
    EXPECT_GE(after->replacements, 1);
    out.after = after->scheduler;
    out.recomputed = out.after.recomputed_tokens - out.before.recomputed_tokens;
    out.restored = out.after.restored_tokens - out.before.restored_tokens;
    std::printf(
        "[ kv store ] %s: SIGKILL of n1 with %d requests past 500 tokens: %lld tokens "
        "restored, %lld recomputed; resumed %.0f ms after the loss, all done %.0f ms "
        "after it; %lld blocks copied to the store, %lld back\n",
        extra.empty() ? "no store" : "a store", jobs, static_cast<long long>(out.restored),
        static_cast<long long>(out.recomputed), after->resume_ms, all_done_ms,
        static_cast<long long>(out.after.kv_to_remote),
        static_cast<long long>(out.after.kv_from_remote));
  }
};

TEST_F(ClusterKvStore, SigkillRestoresTheLostStagesKvFromTheStore) {
  loss l;
  lose_n1_past_500("vault", "[kv]\nstore_tokens = 32768\n", l);
  if (HasFatalFailure()) return;
  EXPECT_GT(l.before.kv_remote_blocks, 0);
  EXPECT_GT(l.before.kv_to_remote, 0) << "no block was copied to the store";
  EXPECT_GT(l.after.kv_from_remote, l.before.kv_from_remote) << "nothing came back";
  EXPECT_GT(l.restored, 8 * 500) << "recomputed " << l.recomputed;
  // At most one full block and the partly filled one (16 tokens each) per request.
  EXPECT_LE(l.recomputed, 8 * 2 * 16) << "restored " << l.restored;
}

// The store on a node of its own (role "kv"): it holds no stage (a
// pipeline of n0 and n1), the stages reach it over the data plane, and
// when n1 dies the stage that takes its layers over on n0 fetches them
// from n2. Then the store's own node dies: the cluster serves on without
// it (a loss recomputes again) until the node is back and a new store is
// ordered there.
TEST_F(ClusterKvStore, AStoreOnANodeWithoutStagesServesTheNewStage) {
  loss l;
  lose_n1_past_500("vaultnode", "[kv]\nstore_tokens = 32768\n", l, [](std::string& text) {
    text.replace(text.find("pipeline_stages = 3"), 19, "pipeline_stages = 2");
    text += "role = \"kv\"\n";  // the last [[nodes]] table: n2
  });
  if (HasFatalFailure()) return;
  EXPECT_GT(l.before.kv_to_remote, 0) << "no block was copied to the store";
  EXPECT_GT(l.restored, 8 * 500) << "recomputed " << l.recomputed;
  EXPECT_LE(l.recomputed, 8 * 2 * 16) << "restored " << l.restored;
  client c(m_);
  ASSERT_TRUE(c.ok());
  auto s = c.status();
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->placement.find("n2"), std::string::npos) << "a stage on the store's node";
  const auto* n2 = c.member(*s, "n2");
  ASSERT_NE(n2, nullptr);
  EXPECT_TRUE(n2->report.stages.empty());
  EXPECT_EQ(s->kv_store, "n2");
  EXPECT_EQ(s->kv_stores, 1);
  ASSERT_GE(s->indexed_blocks.size(), 4u);
  EXPECT_GT(s->indexed_blocks[3], 0) << "the head's index does not know the store's blocks";
  // The store's node dies: its copies are forgotten, requests still run.
  ::kill(pid_of("n2"), SIGKILL);
  auto gone = c.wait_for(
      [](const actors::cluster_status& st) {
        return st.kv_store.empty() && st.scheduler.kv_remote_used == 0;
      },
      20s);
  ASSERT_TRUE(gone.has_value()) << "the store's loss was not noticed";
  auto f = actors::client(c.sys(), c.door()).run(job(3, 64, true));
  ASSERT_TRUE(f.has_value()) << f.error().message;
  EXPECT_EQ(f->reason, actors::finish_reason::length) << f->error;
  // Back: a new store there, which takes copies again.
  test::child_process revived("n2-again",
                              {TROUPE_CLI, "node", "--manifest", cs_.manifest, "--name", "n2"});
  auto again = c.wait_for(
      [](const actors::cluster_status& st) { return st.kv_stores >= 2 && st.kv_store == "n2"; },
      30s);
  EXPECT_TRUE(again.has_value()) << "no new store on n2";
  const auto copied = c.status()->scheduler.kv_to_remote;
  auto g = actors::client(c.sys(), c.door()).run(job(4, 64, true));
  ASSERT_TRUE(g.has_value()) << g.error().message;
  auto confirmed = c.wait_for(
      [&](const actors::cluster_status& st) {
        return st.scheduler.kv_to_remote > copied && st.scheduler.kv_remote_used > 0;
      },
      20s);
  EXPECT_TRUE(confirmed.has_value()) << "the new store took no copies";
}

TEST_F(ClusterKvStore, WithoutAStoreTheSameLossRecomputesEverything) {
  loss l;
  lose_n1_past_500("novault", "", l);
  if (HasFatalFailure()) return;
  EXPECT_EQ(l.after.kv_remote_blocks, 0);
  // (Only blocks the prompts share come back: a request readmitted first
  // computes them again, the others find them cached.)
  EXPECT_LT(l.restored, l.recomputed / 10);
  EXPECT_GT(l.recomputed, 8 * 500);
}

TEST_F(ClusterLoopback, SigkillOfAStageNodeMidDecode) {
  up("kill");
  std::unique_ptr<test::child_process> revived;
  failure_case(
      cs_, "n1", [&] { ::kill(pid_of("n1"), SIGKILL); },
      [&] {
        revived = std::make_unique<test::child_process>(
            "n1-again", std::vector<std::string>{TROUPE_CLI, "node", "--manifest", cs_.manifest,
                                                 "--name", "n1"});
      },
      5000);
  // troupe down stops the revived node too: it rejoined, and the head
  // tells every node it knows.
  auto r = test::troupe_cli("down " + cs_.manifest + " --timeout 60");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  if (revived) {
    EXPECT_EQ(revived->wait_exit(30s), "exit 0") << "the revived node did not stop";
  }
}

TEST_F(ClusterLoopback, SigstopOfAStageNodeMidDecode) {
  up("stop");
  const pid_t victim = pid_of("n2");
  failure_case(
      cs_, "n2", [&] { ::kill(victim, SIGSTOP); }, [&] { ::kill(victim, SIGCONT); }, 5000);
}

namespace {
// The cluster on three hosts (network namespaces) joined by a bridge,
// started through the manifest's launch command; node `victim` gets `sig`.
void netns_case(int subnet, const std::string& victim, int sig) {
  test::netns_bridge net(3, subnet);
  if (!net.ok()) GTEST_SKIP() << test::netns_skipped(net.why());
  const int vi = victim.back() - '0';
  auto cs = make_manifest("ns" + std::to_string(subnet), {net.host(0), net.host(1), net.host(2)},
                          "launch = \"ip netns exec " + net.prefix() +
                              "{host} {troupe} node --manifest {manifest} --name {name}\"\n"
                              "[transport]\ntls = \"tcp\"\nnet_devices = \"eth0\"\n");
  auto r = test::troupe_cli("up " + cs.manifest + " --detach --timeout 180");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  ASSERT_NE(r.out.find("launch command"), std::string::npos) << r.out;
  auto m = cluster::load_manifest(cs.manifest);
  ASSERT_TRUE(m.has_value());
  failure_case(
      cs, victim, [&] { net.signal_all(vi, sig); },
      [&] {
        if (sig == SIGSTOP) {
          net.signal_all(vi, SIGCONT);
          return;
        }
        auto l = cluster::launch_node(*m, *m->node(victim), TROUPE_CLI);
        EXPECT_TRUE(l.has_value());
      },
      5000);
  r = test::troupe_cli("down " + cs.manifest + " --timeout 60");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  if (::testing::Test::HasFailure())
    for (const auto& n : cluster::read_launched(*m))
      std::fprintf(stderr, "---- %s ----\n%s\n", n.log.c_str(),
                   cluster::log_tail(n.log, 40).c_str());
  for (int i = 0; i < 3; ++i) net.signal_all(i, SIGKILL);
}
}  // namespace

TEST(ClusterNetns, SigkillAcrossThreeHosts) {
  netns_case(static_cast<int>(::getpid() % 100), "n1", SIGKILL);
}

TEST(ClusterNetns, SigstopAcrossThreeHosts) {
  netns_case(100 + static_cast<int>(::getpid() % 100), "n2", SIGSTOP);
}

// Live migration (make-before-break) of every decoder stage in turn while
// 8 requests are mid-decode: none is dropped or recomputed (their KV moves
// with the stage), every answer equals the one without migration, token
// for token, and no KV is left behind.
TEST_F(ClusterLoopback, LiveMigrationOfEveryStageMidDecode) {
  up("mig");
  client c(m_);
  ASSERT_TRUE(c.ok());
  constexpr int jobs = 8;
  constexpr std::int64_t tokens = 500;
  auto ref = reference_run(c, jobs, tokens);
  ASSERT_FALSE(::testing::Test::HasFailure());
  auto before = c.status();
  ASSERT_TRUE(before.has_value());
  ASSERT_EQ(before->placement, "n0 [0,1) -> n1 [1,2) -> n2 [2,4)");
  ASSERT_EQ(before->migrations, 0);

  auto run = start_jobs(c, jobs, tokens, true);
  ASSERT_TRUE(wait_mid_decode(*run, 20, tokens / 4) || wait_mid_decode(*run, 1, tokens - 1))
      << "the requests are not all mid-decode";

  // The middle stage from n1's one core to n2's two, beside the last stage
  // (n2 decodes while the new stage loads there: loading holds the device),
  // then the first stage away from the head, then the last stage to the
  // head; each while decoding.
  struct move {
    std::string shard, to;
  };
  const std::vector<move> moves{{"1", "n2"}, {"0", "n1"}, {"[2,4)", "n0"}};
  std::vector<std::pair<steady::time_point, steady::time_point>> windows;
  std::vector<std::string> marks(jobs);
  for (const auto& mv : moves) {
    for (int i = 0; i < jobs; ++i)
      marks[static_cast<std::size_t>(i)] +=
          std::to_string(run->streamed[static_cast<std::size_t>(i)]) + "-";
    const auto start = steady::now();
    auto rep =
        actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{mv.shard, mv.to}, 60s);
    windows.emplace_back(start, steady::now());
    for (int i = 0; i < jobs; ++i)
      marks[static_cast<std::size_t>(i)] +=
          std::to_string(run->streamed[static_cast<std::size_t>(i)]) + " ";
    ASSERT_TRUE(rep.has_value()) << mv.shard << " -> " << mv.to << ": " << rep.error();
    EXPECT_EQ(rep->to, mv.to);
    EXPECT_GE(rep->sequences, 1) << "no sequence's KV moved";
    EXPECT_GT(rep->kv_bytes, 0);
    EXPECT_GE(rep->rounds, 1);
    std::printf(
        "[ migrate ] %s %s -> %s: %.0f ms in all, load %.0f ms, %lld sequences, %.3f MiB of KV in "
        "%d live rounds, "
        "steps held %.2f ms for the last %.4f MiB\n",
        rep->what.c_str(), rep->from.c_str(), rep->to.c_str(), rep->total_ms, rep->load_ms,
        static_cast<long long>(rep->sequences), static_cast<double>(rep->kv_bytes) / (1 << 20),
        rep->rounds, rep->pause_ms, static_cast<double>(rep->final_kv_bytes) / (1 << 20));
    // Let decoding go on between moves.
    const int seen = run->streamed[0];
    const auto w0 = steady::now();
    while (run->streamed[0] < std::min<int>(seen + 20, tokens) && ms_since(w0) < 30000)
      std::this_thread::sleep_for(2ms);
  }
  join(*run);
  for (int i = 0; i < jobs; ++i) {
    const auto& d = run->done[static_cast<std::size_t>(i)];
    ASSERT_TRUE(d.has_value()) << "job " << i << ": " << run->errors[static_cast<std::size_t>(i)];
    EXPECT_EQ(d->reason, actors::finish_reason::length) << to_string(d->reason) << ": " << d->error;
    EXPECT_EQ(d->preemptions, 0) << "job " << i
                                 << " was recomputed: its KV did not move with the stage";
    const auto& want = ref->done[static_cast<std::size_t>(i)]->tokens;
    std::size_t same = 0;
    while (same < d->tokens.size() && same < want.size() && d->tokens[same] == want[same]) ++same;
    EXPECT_EQ(same, want.size()) << "job " << i << " answered differently from token " << same
                                 << " on (tokens streamed at "
                                 << "the migrations: " << marks[static_cast<std::size_t>(i)] << ")";
  }
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->placement, "n1 [0,1) -> n2 [1,2) -> n0 [2,4)");
  EXPECT_EQ(after->migrations, 3);
  EXPECT_EQ(after->replacements, 0);
  // Every node let go of what it no longer holds, and every block came back.
  auto clean = c.wait_for(
      [&](const actors::cluster_status& s) {
        int stages = 0;
        for (const auto& n : s.nodes) {
          if (n.report.kv_used_blocks != 0) return false;
          for (auto at = n.report.stages.find("layers"); at != std::string::npos;
               at = n.report.stages.find("layers", at + 1))
            ++stages;
        }
        return stages == 3;
      },
      5s);
  if (!clean) {
    ADD_FAILURE() << "KV blocks or stages left behind";
    if (auto s = c.status())
      for (const auto& n : s->nodes)
        std::fprintf(stderr, "%s: stages '%s', KV %lld/%lld blocks, %lld tokens\n", n.name.c_str(),
                     n.report.stages.c_str(), static_cast<long long>(n.report.kv_used_blocks),
                     static_cast<long long>(n.report.kv_total_blocks),
                     static_cast<long long>(n.report.kv_tokens));
  }
  // A new image request runs on the moved pipeline (its embeddings now
  // travel from the head to the first stage on n1) with the same answer.
  auto again = actors::client(c.sys(), c.door()).run(job(1, tokens, true));
  ASSERT_TRUE(again.has_value()) << again.error().message;
  EXPECT_EQ(again->tokens, ref->done[0]->tokens);

  // Inter-token gaps: the median over the whole run and the longest gap
  // that overlaps a migration (printed; timing is not asserted in tests).
  std::vector<double> gaps;
  double worst = 0;
  for (const auto& a : run->arrivals)
    for (std::size_t k = 1; k < a.size(); ++k) {
      const double g =
          std::chrono::duration<double, std::milli>(a[k].first - a[k - 1].first).count() /
          std::max(1, a[k].second);
      gaps.push_back(g);
      for (const auto& [ws, we] : windows)
        if (a[k].first >= ws && a[k - 1].first <= we) worst = std::max(worst, g);
    }
  ASSERT_FALSE(gaps.empty());
  std::nth_element(gaps.begin(), gaps.begin() + static_cast<std::ptrdiff_t>(gaps.size() / 2),
                   gaps.end());
  const double median = gaps[gaps.size() / 2];
  std::printf(
      "[ migrate ] inter-token gap: median %.2f ms, longest during a migration %.2f ms (%.1fx the "
      "median)\n",
      median, worst, median > 0 ? worst / median : 0.0);
}

// The vision encoder moves (to a node of its own, then to another) while
// image requests arrive and are being encoded: none fails, every answer is
// the one without the moves.
// A reference run of `jobs` jobs, then two more runs while the encoder
// moves to n2 and then to n1: every answer equals the reference's, and the
// encoder ends on n1 after two migrations.
static void move_the_encoder_twice_while_jobs_run(client& c, int jobs, std::int64_t tokens,
                                                  std::unique_ptr<job_run>& ref,
                                                  std::optional<actors::migrate_report>& to_n2,
                                                  std::optional<actors::migrate_report>& to_n1) {
  ref = start_jobs(c, jobs, tokens, true);
  join(*ref);
  auto first = start_jobs(c, jobs, tokens, true);
  auto a = actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"vision", "n2"}, 60s);
  ASSERT_TRUE(a.has_value()) << a.error();
  to_n2 = *a;
  auto second = start_jobs(c, jobs, tokens, true);
  auto b = actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"vision", "n1"}, 60s);
  ASSERT_TRUE(b.has_value()) << b.error();
  to_n1 = *b;
  join(*first);
  join(*second);
  for (auto* run : {ref.get(), first.get(), second.get()})
    for (int i = 0; i < jobs; ++i) {
      const auto& d = run->done[static_cast<std::size_t>(i)];
      ASSERT_TRUE(d.has_value()) << "job " << i << ": " << run->errors[static_cast<std::size_t>(i)];
      EXPECT_EQ(d->tokens, ref->done[static_cast<std::size_t>(i)]->tokens)
          << "job " << i << " answered differently";
    }
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->encoder.rfind("n1 ", 0), 0u) << after->encoder;
  EXPECT_EQ(after->migrations, 2);
}

TEST_F(ClusterLoopback, LiveMigrationOfTheVisionEncoderWhileImagesArrive) {
  up("vis");
  client c(m_);
  ASSERT_TRUE(c.ok());
  constexpr std::int64_t tokens = 48;
  std::unique_ptr<job_run> ref;
  std::optional<actors::migrate_report> to_n2, to_n1;
  move_the_encoder_twice_while_jobs_run(c, 8, tokens, ref, to_n2, to_n1);
  if (::testing::Test::HasFatalFailure()) return;
  // And after the moves, through the encoder on n1.
  auto again = actors::client(c.sys(), c.door()).run(job(3, tokens, true));
  ASSERT_TRUE(again.has_value()) << again.error().message;
  EXPECT_EQ(again->tokens, ref->done[2]->tokens);
  std::printf(
      "[ migrate ] vision encoder %s -> %s: loaded in %.0f ms, %.0f ms in all; %s -> %s: %.0f ms, "
      "%.0f ms\n",
      to_n2->from.c_str(), to_n2->to.c_str(), to_n2->load_ms, to_n2->total_ms, to_n1->from.c_str(),
      to_n1->to.c_str(), to_n1->load_ms, to_n1->total_ms);
}

// The media encoder of a model that hears moves twice while jobs with an
// image and a clip arrive (issue 29: the audio tower is live-migratable
// with the encoder): every answer is the one without moves.
TEST_F(ClusterLoopback, LiveMigrationOfTheMediaEncoderWhileClipsArrive) {
  up("aud", "[model]\npath = \"" + std::string(TROUPE_FIXTURES_DIR) + "/llava_hears\"\n");
  struct reset {
    ~reset() { audio_jobs() = false; }
  } restore;
  audio_jobs() = true;
  client c(m_);
  ASSERT_TRUE(c.ok());
  std::unique_ptr<job_run> ref;
  std::optional<actors::migrate_report> to_n2, to_n1;
  move_the_encoder_twice_while_jobs_run(c, 8, 24, ref, to_n2, to_n1);
  if (::testing::Test::HasFatalFailure()) return;
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->scheduler.clips, 3 * 8);
}

// The node an encoder moved to is lost while image requests wait on it:
// the encoder runs on the head again, the images it had are encoded there,
// and every request ends with the answer it would have had (before, they
// all waited forever and `troupe status` still named the lost node).
TEST_F(ClusterLoopback, LosingTheEncodersNodeReplacesTheEncoder) {
  up("encl");
  client c(m_);
  ASSERT_TRUE(c.ok());
  constexpr int jobs = 6;
  constexpr std::int64_t tokens = 32;
  auto ref = start_jobs(c, jobs, tokens, true);
  join(*ref);
  auto to_n2 =
      actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"vision", "n2"}, 60s);
  ASSERT_TRUE(to_n2.has_value()) << to_n2.error();
  auto run = start_jobs(c, jobs, tokens, true);
  ::kill(pid_of("n2"), SIGKILL);
  join(*run);
  for (int i = 0; i < jobs; ++i) {
    const auto& d = run->done[static_cast<std::size_t>(i)];
    ASSERT_TRUE(d.has_value()) << "job " << i << ": " << run->errors[static_cast<std::size_t>(i)];
    EXPECT_EQ(d->reason, actors::finish_reason::length) << "job " << i << ": " << d->error;
    EXPECT_EQ(d->tokens, ref->done[static_cast<std::size_t>(i)]->tokens)
        << "job " << i << " answered differently";
  }
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->encoder.rfind("n0 ", 0), 0u) << after->encoder;
  auto again = actors::client(c.sys(), c.door()).run(job(1, tokens, true));
  ASSERT_TRUE(again.has_value()) << again.error().message;
  EXPECT_EQ(again->tokens, ref->done[0]->tokens);
}

// Image rows go from the encoder to the first stage's process directly:
// with the first stage moved to n2 and the encoder to n1, an image request
// moves its rows over n1 -> n2 only, and nothing passes through the head
// (n0), where the scheduler runs. Activations cross n2 -> n1 (stage 0 to 1)
// and n1 -> n2 (stage 1 to 2) in equal amounts, so n1 -> n2 carries exactly
// the image rows more than n2 -> n1. Before, the rows went n1 -> n0 (to the
// scheduler) and then n0 -> n2: two hops.
TEST_F(ClusterLoopback, ImageRowsGoFromTheEncoderToTheFirstStageDirectly) {
  up("hops");
  client c(m_);
  ASSERT_TRUE(c.ok());
  constexpr std::int64_t tokens = 8;
  auto want = actors::client(c.sys(), c.door()).run(job(2, tokens, true));
  ASSERT_TRUE(want.has_value()) << want.error().message;
  for (const auto& [shard, to] :
       std::vector<std::pair<std::string, std::string>>{{"0", "n2"}, {"vision", "n1"}}) {
    auto rep = actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{shard, to}, 60s);
    ASSERT_TRUE(rep.has_value()) << shard << " -> " << to << ": " << rep.error();
  }
  // Link counters as the nodes last reported them, once two reports agree.
  auto settled_links = [&]() -> std::map<std::string, std::int64_t> {
    std::map<std::string, std::int64_t> last;
    for (int i = 0; i < 20; ++i) {
      std::this_thread::sleep_for(700ms);  // beyond a heartbeat (500 ms)
      auto s = c.status();
      if (!s) continue;
      std::map<std::string, std::int64_t> now;
      for (std::size_t k = 0; k < s->links.size() && k < s->link_bytes.size(); ++k)
        now[s->links[k]] = s->link_bytes[k];
      if (i > 0 && now == last) return now;
      last = std::move(now);
    }
    ADD_FAILURE() << "the link counters did not settle";
    return last;
  };
  const auto before = settled_links();
  auto got = actors::client(c.sys(), c.door()).run(job(2, tokens, true));
  ASSERT_TRUE(got.has_value()) << got.error().message;
  EXPECT_EQ(got->tokens, want->tokens);
  const auto after = settled_links();
  auto delta = [&](const std::string& link) {
    const auto a = after.count(link) ? after.at(link) : 0;
    const auto b = before.count(link) ? before.at(link) : 0;
    return a - b;
  };
  auto cfg = models::load_llava_config(std::string(TROUPE_FIXTURES_DIR) +
                                       "/../../assets/tiny-llava-shapes/config.json");
  ASSERT_TRUE(cfg) << cfg.error().message;
  const std::int64_t rows_bytes = cfg->tokens_per_image() * cfg->text.hidden_size * 4;
  for (const auto* link : {"n0->n1", "n0->n2", "n1->n0", "n2->n0"})
    EXPECT_EQ(delta(link), 0) << link << ": the head took part in the request's data";
  EXPECT_GT(delta("n2->n1"), 0) << "no activations from the first stage";
  EXPECT_EQ(delta("n1->n2") - delta("n2->n1"), rows_bytes)
      << "n1->n2 " << delta("n1->n2") << " bytes, n2->n1 " << delta("n2->n1") << " bytes";
  std::printf("[ hops ] image rows %lld bytes: n1->n2 %lld, n2->n1 %lld, through n0 0\n",
              static_cast<long long>(rows_bytes), static_cast<long long>(delta("n1->n2")),
              static_cast<long long>(delta("n2->n1")));
}

// Placement: with pipeline_stages = "auto" the head places by the planner
// from the devices and links its nodes measured, and a node that joins
// later makes the policy re-plan. The move here changes the layer split
// (one stage becomes two), so the scheduler holds its steps while the new
// stages load and the running requests recompute: none is dropped and
// every answer is the one the single-node cluster gave.
namespace {
// A loopback manifest for the placement tests: pipeline_stages "auto", one
// node per entry of `cores`, the [placement] keys given; certificates made.
std::string placement_manifest(const std::string& name, const std::string& placement,
                               const std::vector<std::string>& cores) {
  const std::string dir = fs::path(test::temp_path("cluster-" + name)).lexically_normal().string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  // (Jobs of 1,200 tokens: past the bundled model's 256 positions, lifted.)
  std::string text = "[cluster]\nname = \"" + name +
                     "\"\nhead = \"n0\"\ncerts = \"certs\"\n"
                     "[scheduler]\nmax_model_len = 65536\nallow_long_context = true\n"
                     "[placement]\n" +
                     placement;
  for (std::size_t i = 0; i < cores.size(); ++i)
    text += "[[nodes]]\nname = \"n" + std::to_string(i) +
            "\"\nhost = \"127.0.0.1\"\nport = " + std::to_string(test::free_port()) +
            "\ndevices = [{ type = \"cpu\", cores = \"" + cores[i] + "\", memory = \"2GiB\" }]\n";
  const std::string manifest = dir + "/cluster.toml";
  std::ofstream(manifest) << text;
  EXPECT_EQ(test::troupe_cli("certs " + manifest).exit_code, 0);
  return manifest;
}
}  // namespace

TEST(ClusterPlacement, ANodeJoiningMidDecodeTriggersAReplan) {
  const auto manifest = placement_manifest(
      "join", "wait_for_nodes_s = 1\ngain_threshold = 0.05\nmeasure_s = 2\n", {"0-0", "1-1"});
  auto m = cluster::load_manifest(manifest);
  ASSERT_TRUE(m.has_value()) << m.error().text();

  test::child_process n0("n0", {TROUPE_CLI, "node", "--manifest", manifest, "--name", "n0"});
  std::unique_ptr<test::child_process> n1;
  auto stop = [&] {
    auto r = test::troupe_cli("down " + manifest + " --timeout 60");
    EXPECT_EQ(r.exit_code, 0) << r.out;
    EXPECT_EQ(n0.wait_exit(30s), "exit 0");
    if (n1) {
      EXPECT_EQ(n1->wait_exit(30s), "exit 0");
    }
  };
  EXPECT_TRUE(wait_for_head(*m, 20s)) << "the head never listened";
  {
    client c(*m);
    if (!c.ok()) return stop();
    auto placed = c.wait_for(
        [](const actors::cluster_status& s) { return s.ready && !s.placement.empty(); }, 60s);
    if (!placed) {
      ADD_FAILURE() << "n0 alone was not placed";
      return stop();
    }
    auto s0 = c.status();
    ASSERT_TRUE(s0.has_value());
    EXPECT_EQ(s0->placement, "n0 [0,4)");
    // The first decision: the planner's, with a predicted step time from
    // what n0 measured.
    ASSERT_FALSE(s0->decisions.empty());
    EXPECT_EQ(s0->decisions.front().trigger, "start");
    EXPECT_GT(s0->decisions.front().predicted_step_ms_after, 0);
    EXPECT_NE(s0->plan_detail.find("1 stage"), std::string::npos) << s0->plan_detail;
    const auto* me = c.member(*s0, "n0");
    ASSERT_NE(me, nullptr);
    EXPECT_GT(me->report.probe.gemv_f32, 0);
    EXPECT_GT(me->report.probe.gemm_f32, 0);
    EXPECT_GT(me->report.probe.memory_bytes, 0);
    EXPECT_LE(me->report.probe.memory_bytes, std::int64_t{2} << 30);

    constexpr int jobs = 8;
    constexpr std::int64_t tokens = 1200;
    auto ref = start_jobs(c, jobs, tokens, true);
    join(*ref);
    for (int i = 0; i < jobs; ++i)
      ASSERT_TRUE(ref->done[static_cast<std::size_t>(i)].has_value())
          << ref->errors[static_cast<std::size_t>(i)];

    auto run = start_jobs(c, jobs, tokens, true);
    const auto t0 = steady::now();
    int decoding = 0;
    while (ms_since(t0) < 60000) {
      decoding = 0;
      for (auto& s : run->streamed) decoding += s > 0 && s < tokens / 2;
      if (decoding >= 4) break;
      std::this_thread::sleep_for(5ms);
    }
    EXPECT_GE(decoding, 4) << "the requests did not start decoding";
    n1 = std::make_unique<test::child_process>(
        "n1", std::vector<std::string>{TROUPE_CLI, "node", "--manifest", manifest, "--name", "n1"});
    auto replanned = c.wait_for(
        [](const actors::cluster_status& s) {
          return s.ready && s.placement.find("n1") != std::string::npos &&
                 s.placement.find("n0") != std::string::npos;
        },
        60s);
    EXPECT_TRUE(replanned.has_value()) << "no re-plan after n1 joined";
    int unfinished = 0;
    {
      std::lock_guard lock(run->mtx);
      for (const auto& d : run->done) unfinished += !d.has_value();
    }
    join(*run);
    int recomputed = 0;
    for (const auto& d : run->done) recomputed += d && d->preemptions > 0;
    // The move came while they decoded: they recomputed on the new stages.
    EXPECT_GT(unfinished, 0) << "every request had finished before the re-plan";
    EXPECT_GT(recomputed, 0);
    for (int i = 0; i < jobs; ++i) {
      const auto& d = run->done[static_cast<std::size_t>(i)];
      ASSERT_TRUE(d.has_value()) << "job " << i << ": " << run->errors[static_cast<std::size_t>(i)];
      EXPECT_EQ(d->reason, actors::finish_reason::length)
          << to_string(d->reason) << ": " << d->error;
      EXPECT_EQ(d->tokens, ref->done[static_cast<std::size_t>(i)]->tokens)
          << "job " << i << " answered differently";
    }
    auto s1 = c.status();
    ASSERT_TRUE(s1.has_value());
    const actors::placement_decision* joined = nullptr;
    for (const auto& d : s1->decisions)
      if (d.trigger == "node n1 joined") joined = &d;
    ASSERT_NE(joined, nullptr) << "no decision for n1 joining";
    EXPECT_GT(joined->predicted_gain, 0.05);
    EXPECT_LT(joined->predicted_step_ms_after, joined->predicted_step_ms_before);
    EXPECT_NE(joined->state.find("measur"), std::string::npos) << joined->state;
    EXPECT_NE(s1->plan_detail.find("2 stages"), std::string::npos) << s1->plan_detail;
    std::printf("[ placement ] %s: %s; predicted step %.3f -> %.3f ms (%+.0f%% throughput); %s\n",
                joined->trigger.c_str(), joined->action.c_str(), joined->predicted_step_ms_before,
                joined->predicted_step_ms_after, 100 * joined->predicted_gain,
                s1->placement.c_str());
    // The new pipeline answers a new request as the old one did.
    auto f = actors::client(c.sys(), c.door()).run(job(1, tokens, true));
    ASSERT_TRUE(f.has_value()) << f.error().message;
    EXPECT_EQ(f->tokens, ref->done[0]->tokens);
  }
  stop();
}

// The offload policy: a device that other work takes over (a process
// spinning on n1's core) makes the head move n1's stage to a node with
// room, by live migration, and the answers stay the same.
TEST(ClusterPlacement, ALoadedDeviceIsOffloaded) {
  // n2 shares core 0 with n0; the planner cannot know, so a high gain
  // threshold keeps it from spreading to n2 when it joins. A device at
  // 95 % load passes any threshold.
  const auto manifest =
      placement_manifest("offload",
                         "wait_for_nodes_s = 3\ngain_threshold = 0.6\nload_half_life_s = "
                         "0\ninterval_s = 1\nmeasure_s = 2\ncooldown_s = 0\n",
                         {"0-0", "1-1", "0-0"});
  auto m = cluster::load_manifest(manifest);
  ASSERT_TRUE(m.has_value()) << m.error().text();
  test::child_process n0("n0", {TROUPE_CLI, "node", "--manifest", manifest, "--name", "n0"});
  test::child_process n1("n1", {TROUPE_CLI, "node", "--manifest", manifest, "--name", "n1"});
  std::unique_ptr<test::child_process> n2;
  pid_t spinner = 0;
  auto stop = [&] {
    if (spinner > 0) {
      ::kill(spinner, SIGKILL);
      ::waitpid(spinner, nullptr, 0);
    }
    auto r = test::troupe_cli("down " + manifest + " --timeout 60");
    EXPECT_EQ(r.exit_code, 0) << r.out;
    EXPECT_EQ(n0.wait_exit(30s), "exit 0");
    EXPECT_EQ(n1.wait_exit(30s), "exit 0");
    if (n2) {
      EXPECT_EQ(n2->wait_exit(30s), "exit 0");
    }
  };
  EXPECT_TRUE(wait_for_head(*m, 20s)) << "the head never listened";
  {
    client c(*m);
    if (!c.ok()) return stop();
    // n0 and n1 are placed after the grace of 3 s (n2 is not started
    // yet); n2 joins afterwards, and the policy leaves it idle.
    auto placed = c.wait_for(
        [](const actors::cluster_status& s) {
          if (!s.ready) return false;
          for (const auto& d : s.decisions)
            if (d.trigger == "start") return true;
          return false;
        },
        90s);
    if (!placed) {
      ADD_FAILURE() << "not placed";
      return stop();
    }
    n2 = std::make_unique<test::child_process>(
        "n2", std::vector<std::string>{TROUPE_CLI, "node", "--manifest", manifest, "--name", "n2"});
    auto joined = c.wait_for(
        [](const actors::cluster_status& s) {
          for (const auto& d : s.decisions)
            if (d.trigger == "node n2 joined") return true;
          return false;
        },
        30s);
    EXPECT_TRUE(joined.has_value()) << "no decision when n2 joined";
    auto s0 = c.status();
    ASSERT_TRUE(s0.has_value());
    if (s0->placement.find("n1") == std::string::npos) {
      ADD_FAILURE() << "the planner left n1 out: " << s0->placement
                    << " (the test needs a stage there)";
      return stop();
    }
    constexpr int jobs = 4;
    constexpr std::int64_t tokens = 200;
    auto ref = start_jobs(c, jobs, tokens, true);
    join(*ref);
    for (int i = 0; i < jobs; ++i)
      ASSERT_TRUE(ref->done[static_cast<std::size_t>(i)].has_value())
          << ref->errors[static_cast<std::size_t>(i)];

    spinner = ::fork();
    ASSERT_GE(spinner, 0);
    if (spinner == 0) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(1, &set);
      ::sched_setaffinity(0, sizeof set, &set);
      std::atomic<unsigned long> spin{0};
      for (;;) spin.fetch_add(1, std::memory_order_relaxed);
    }
    auto moved = c.wait_for(
        [](const actors::cluster_status& s) {
          return s.ready && s.placement.find("n1") == std::string::npos && !s.decisions.empty() &&
                 s.decisions.back().trigger == "load or memory" &&
                 s.decisions.back().state != "moving";
        },
        60s);
    ::kill(spinner, SIGKILL);
    ::waitpid(spinner, nullptr, 0);
    spinner = 0;
    auto s1 = c.status();
    ASSERT_TRUE(s1.has_value());
    ASSERT_TRUE(moved.has_value())
        << "n1's stage did not move: " << s1->placement
        << "; last decision: " << (s1->decisions.empty() ? "-" : s1->decisions.back().action);
    const auto& d = s1->decisions.back();
    EXPECT_EQ(d.action.rfind("move ", 0), 0u) << d.action;
    EXPECT_GT(d.predicted_gain, 0.6);
    EXPECT_EQ(d.state.find("failed"), std::string::npos) << d.state;
    std::printf("[ placement ] offload: %s -> %s; %s (%s)\n", s0->placement.c_str(),
                s1->placement.c_str(), d.action.c_str(),
                s1->migrations > 0 ? "live migration" : "re-split");
    // The same answers from the new placement.
    auto again = start_jobs(c, jobs, tokens, true);
    join(*again);
    for (int i = 0; i < jobs; ++i) {
      const auto& f = again->done[static_cast<std::size_t>(i)];
      ASSERT_TRUE(f.has_value()) << again->errors[static_cast<std::size_t>(i)];
      EXPECT_EQ(f->tokens, ref->done[static_cast<std::size_t>(i)]->tokens) << "job " << i;
    }
  }
  stop();
}

// Replicas (parallelism.replicas = 2, one stage each): the three nodes
// split into [n0, n1] and [n2]; replica 0 runs on n0 (n1 is its spare),
// replica 1 on n2. Jobs are shared between the two; when n2 dies mid-decode
// replica 1 takes n1 (replica 0 does not use it) and its requests resume
// there, while replica 0's requests never stop. Every answer is the one of
// the run before, whichever replica served it.
class ClusterReplicas : public ClusterLoopback {
 protected:
  void up_two(const std::string& name, const std::string& extra = "") {
    up(name, extra, [](std::string& text) {
      text.replace(text.find("pipeline_stages = 3"), 19, "pipeline_stages = 1\nreplicas = 2");
    });
  }
  static const actors::replica_view* replica(const actors::cluster_status& s, int i) {
    return static_cast<std::size_t>(i) < s.replicas.size()
               ? &s.replicas[static_cast<std::size_t>(i)]
               : nullptr;
  }
};

TEST_F(ClusterReplicas, JobsAreSharedAndALostReplicaIsPlacedAgainWhileTheOtherServes) {
  up_two("replicas");
  if (HasFatalFailure()) return;
  client c(m_);
  ASSERT_TRUE(c.ok());
  auto s0 = c.status();
  ASSERT_TRUE(s0.has_value());
  ASSERT_EQ(s0->replicas.size(), 2u) << s0->placement;
  EXPECT_EQ(s0->replicas[0].nodes, (std::vector<std::string>{"n0", "n1"}));
  EXPECT_EQ(s0->replicas[1].nodes, (std::vector<std::string>{"n2"}));
  EXPECT_EQ(s0->replicas[0].placement.find("n0"), 0u) << s0->replicas[0].placement;
  EXPECT_EQ(s0->replicas[1].placement.find("n2"), 0u) << s0->replicas[1].placement;
  const auto* n1 = c.member(*s0, "n1");
  ASSERT_NE(n1, nullptr);
  EXPECT_TRUE(n1->report.stages.empty()) << "the spare holds " << n1->report.stages;

  constexpr int jobs = 8;
  constexpr std::int64_t tokens = 1000;
  auto ref = reference_run(c, jobs, tokens);
  auto s1 = c.status();
  ASSERT_TRUE(s1.has_value());
  // Both took a share (the router sends each job to the less loaded).
  EXPECT_GE(s1->replicas[0].routed, 2) << s1->replicas[1].routed;
  EXPECT_GE(s1->replicas[1].routed, 2) << s1->replicas[0].routed;
  EXPECT_EQ(s1->replicas[0].routed + s1->replicas[1].routed, jobs);
  EXPECT_EQ(s1->routed_by_load + s1->routed_by_prefix, jobs);

  auto run = start_jobs(c, jobs, tokens, true);
  joiner joined{*run};  // a failed assertion below returns: the jobs' threads are joined first
  // Every job started (the replicas run at their own pace: replica 1's
  // node has both cores, and an image request starts once the head's
  // encoder, on a loaded core, got to it).
  ASSERT_TRUE(wait_mid_decode(*run, 1, static_cast<int>(tokens)))
      << "the requests did not all start";
  auto mid = c.status();
  ASSERT_TRUE(mid.has_value());
  ASSERT_GT(mid->replicas[1].running, 0) << "replica 1 has nothing left to lose";
  const auto on_r1 = mid->replicas[1].routed - s1->replicas[1].routed;
  ASSERT_GT(on_r1, 0);
  ASSERT_LT(on_r1, jobs);
  // Tokens of the jobs on replica 0 (never preempted) after the kill,
  // before replica 1 serves again: replica 0 went on meanwhile.
  std::vector<int> at_kill(jobs);
  for (int i = 0; i < jobs; ++i)
    at_kill[static_cast<std::size_t>(i)] = run->streamed[static_cast<std::size_t>(i)];
  const auto killed = steady::now();
  ::kill(pid_of("n2"), SIGKILL);
  auto back = c.wait_for(
      [](const actors::cluster_status& st) {
        return st.replicas.size() == 2 && st.replicas[1].replacements >= 1 && st.replicas[1].ready;
      },
      30s);
  ASSERT_TRUE(back.has_value()) << "replica 1 was not placed again";
  std::vector<int> at_back(jobs);
  for (int i = 0; i < jobs; ++i)
    at_back[static_cast<std::size_t>(i)] = run->streamed[static_cast<std::size_t>(i)];
  const double back_ms = ms_since(killed);
  join(*run);
  const int recomputed = expect_same_answers(*run, *ref);
  // Only replica 1's requests lose their KV (one of them may have ended
  // before the signal).
  EXPECT_GE(recomputed, 1);
  EXPECT_LE(recomputed, on_r1);
  int served_meanwhile = 0;
  for (int i = 0; i < jobs; ++i) {
    const auto& d = run->done[static_cast<std::size_t>(i)];
    if (d && d->preemptions == 0)
      served_meanwhile +=
          at_back[static_cast<std::size_t>(i)] - at_kill[static_cast<std::size_t>(i)];
  }
  EXPECT_GT(served_meanwhile, 0) << "replica 0 stopped while replica 1 was placed again";
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  const auto* r1 = replica(*after, 1);
  ASSERT_NE(r1, nullptr);
  EXPECT_EQ(r1->placement.find("n1"), 0u) << "replica 1 did not take the spare: " << r1->placement;
  EXPECT_EQ(after->replicas[0].replacements, 0);
  EXPECT_EQ(after->replicas[0].nodes, (std::vector<std::string>{"n0"}));
  std::printf(
      "[ replicas ] SIGKILL of replica 1's node with %d jobs mid-decode (%lld on replica 1): "
      "replica 1 serving again on n1 %.0f ms after the signal (resumed %.0f ms after the loss was "
      "noticed); replica 0 streamed %d tokens meanwhile; every answer as before\n",
      jobs, static_cast<long long>(on_r1), back_ms, r1->resume_ms, served_meanwhile);
}

// The router sends a job where its prompt's prefix is cached: one job
// first, then jobs sharing its long prefix one at a time (equal loads,
// which alone would alternate between the replicas) all go to the replica
// that served the first; a job with another prefix goes by load.
TEST_F(ClusterReplicas, JobsGoWhereTheirPrefixIsCached) {
  up_two("prefix");
  if (HasFatalFailure()) return;
  client c(m_);
  ASSERT_TRUE(c.ok());
  std::string shared;
  for (int i = 0; i < 12; ++i) shared += "The harbour lights blink twice before the ferry leaves. ";
  auto ask = [&](const std::string& prompt) {
    actors::job_request j;
    j.id = actors::random_job_id();
    j.prompt = prompt;
    j.max_tokens = 4;
    auto f = actors::client(c.sys(), c.door()).run(j);
    EXPECT_TRUE(f.has_value()) << (f ? "" : f.error().message);
  };
  ask(shared + "What comes first?");
  std::this_thread::sleep_for(1500ms);  // the head's index takes the blocks in at its heartbeats
  auto s0 = c.status();
  ASSERT_TRUE(s0.has_value());
  ASSERT_EQ(s0->replicas.size(), 2u);
  const int first = s0->replicas[0].routed == 1 ? 0 : 1;
  ASSERT_EQ(s0->replicas[static_cast<std::size_t>(first)].routed, 1);
  EXPECT_GT(s0->replicas[static_cast<std::size_t>(first)].cached_blocks, 0)
      << "the head's index has none of its blocks";
  for (int i = 0; i < 5; ++i) ask(shared + "Question " + std::to_string(i) + "?");
  auto s1 = c.status();
  ASSERT_TRUE(s1.has_value());
  EXPECT_EQ(s1->replicas[static_cast<std::size_t>(first)].routed, 6)
      << "jobs sharing the prefix went elsewhere";
  EXPECT_EQ(s1->routed_by_prefix, 5);
  EXPECT_GT(s1->scheduler.prefix_hits, 0);
  std::printf(
      "[ replicas ] 5 jobs sharing a prefix: %lld to the replica holding it (%lld blocks in the "
      "head's index of it); prefix hits %lld of %lld prompt tokens\n",
      static_cast<long long>(s1->replicas[static_cast<std::size_t>(first)].routed - 1),
      static_cast<long long>(s0->replicas[static_cast<std::size_t>(first)].cached_blocks),
      static_cast<long long>(s1->scheduler.prefix_hits),
      static_cast<long long>(s1->scheduler.prefix_queries));
}

// troupe scale at run time: one replica on n0 becomes three (n1 and n2
// held nothing), jobs spread over them; then back to one while jobs
// decode: replicas 1 and 2 take no more, finish theirs untouched (no
// preemption, the same tokens) and retire, their nodes dropping their
// stages. A fourth replica has no node and is refused with the count.
TEST_F(ClusterReplicas, ScaleUpAndDownWhileJobsRun) {
  up("scale", "", [](std::string& text) {
    text.replace(text.find("pipeline_stages = 3"), 19, "pipeline_stages = 1");
  });
  if (HasFatalFailure()) return;
  client c(m_);
  ASSERT_TRUE(c.ok());
  auto s0 = c.status();
  ASSERT_TRUE(s0.has_value());
  ASSERT_EQ(s0->replicas.size(), 1u);
  auto r = test::troupe_cli("scale " + cs_.manifest + " --replicas 3 --wait 60");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("3 replicas serving"), std::string::npos) << r.out;
  auto s1 = c.status();
  ASSERT_TRUE(s1.has_value());
  ASSERT_EQ(s1->replicas.size(), 3u);
  for (const auto& v : s1->replicas) EXPECT_EQ(v.state, "serving") << v.index;
  EXPECT_EQ(s1->replicas[1].placement.find("n1"), 0u) << s1->replicas[1].placement;
  EXPECT_EQ(s1->replicas[2].placement.find("n2"), 0u) << s1->replicas[2].placement;
  // Cancelling reaches the replica that runs the job (each is asked),
  // whichever it is; a stage migration names its replica, and a node of
  // another replica is refused as its target.
  for (int k = 0; k < 3; ++k) {
    actors::client cl(c.sys(), c.door());
    auto long_job = job(k + 1, 4000, true);
    const auto id = long_job.id;
    std::atomic<int> got{0};
    std::optional<actors::finish_event> ended;
    std::thread t([&] {
      auto f = cl.run(long_job, [&](const actors::token_event& e) {
        got += static_cast<int>(e.tokens.size());
      });
      if (f) ended = *f;
    });
    const auto t0 = steady::now();
    while (got < 8 && ms_since(t0) < 30000) std::this_thread::sleep_for(5ms);
    EXPECT_TRUE(actors::client(c.sys(), c.door()).cancel(id)) << "job " << k;
    t.join();
    ASSERT_TRUE(ended.has_value());
    EXPECT_EQ(ended->reason, actors::finish_reason::cancelled) << "job " << k;
    EXPECT_LT(ended->tokens.size(), 4000u);
  }
  auto moved = actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"0", "n0", 2}, 60s);
  ASSERT_FALSE(moved.has_value());
  EXPECT_NE(moved.error().find("node n0 belongs to replica 0"), std::string::npos) << moved.error();
  auto nowhere =
      actors::migrate_shard(c.sys(), c.door(), actors::migrate_request{"0", "n1", 7}, 60s);
  ASSERT_FALSE(nowhere.has_value());
  EXPECT_NE(nowhere.error().find("no replica 7"), std::string::npos) << nowhere.error();
  auto four = test::troupe_cli("scale " + cs_.manifest + " --replicas 4");
  EXPECT_NE(four.exit_code, 0);
  EXPECT_NE(four.out.find("4 replicas need 1 more node that holds nothing; 0 are free"),
            std::string::npos)
      << four.out;

  constexpr int jobs = 6;
  constexpr std::int64_t tokens = 1500;
  auto ref = reference_run(c, jobs, tokens);
  auto s2 = c.status();
  ASSERT_TRUE(s2.has_value());
  for (const auto& v : s2->replicas) EXPECT_GE(v.routed, 1) << "replica " << v.index;

  auto run = start_jobs(c, jobs, tokens, true);
  joiner joined{*run};
  // Every job streaming (the replicas run at their own pace; an image
  // request starts once the head's encoder, on a loaded core, got to it).
  ASSERT_TRUE(wait_mid_decode(*run, 1, static_cast<int>(tokens)))
      << "the requests did not all start";
  auto pre = c.status();
  ASSERT_TRUE(pre.has_value());
  ASSERT_EQ(pre->replicas.size(), 3u);
  EXPECT_GT(pre->replicas[1].running + pre->replicas[2].running, 0)
      << "nothing left running on the replicas that retire";
  auto down = test::troupe_cli("scale " + cs_.manifest + " --replicas 1 --wait 120");
  EXPECT_EQ(down.exit_code, 0) << down.out;
  join(*run);
  EXPECT_EQ(expect_same_answers(*run, *ref), 0) << "a request was preempted by the scale down";
  auto s3 = c.status();
  ASSERT_TRUE(s3.has_value());
  ASSERT_EQ(s3->replicas.size(), 3u);
  EXPECT_EQ(s3->replicas[0].state, "serving");
  EXPECT_EQ(s3->replicas[1].state, "retired");
  EXPECT_EQ(s3->replicas[2].state, "retired");
  auto dropped = c.wait_for(
      [&](const actors::cluster_status& st) {
        const auto* a = c.member(st, "n1");
        const auto* b = c.member(st, "n2");
        return a && b && a->report.stages.empty() && b->report.stages.empty();
      },
      10s);
  EXPECT_TRUE(dropped.has_value()) << "n1 and n2 still hold stages";
  auto one = actors::client(c.sys(), c.door()).run(job(2, 32, true));
  ASSERT_TRUE(one.has_value()) << one.error().message;
  auto s4 = c.status();
  ASSERT_TRUE(s4.has_value());
  EXPECT_EQ(s4->replicas[0].routed, s3->replicas[0].routed + 1);
  // And up again: a retired slot is taken anew.
  auto again = test::troupe_cli("scale " + cs_.manifest + " --replicas 2 --wait 60");
  EXPECT_EQ(again.exit_code, 0) << again.out;
  std::printf("[ replicas ] scaled 1 -> 3 -> 1 (with %d jobs decoding, none preempted) -> 2: %s\n",
              jobs, again.out.c_str());
}

// The vision encoder as a service of its own ([encoders.vision]): images
// that wait make the head add a replica on a free node (one stage on n0,
// so n1 and n2 hold none); requests keep the answers they would have had
// wherever their images were encoded; a quiet spell drains the replica
// and stops it; and a replica lost with its node hands its images to the
// others while the requests go on.
TEST_F(ClusterLoopback, TheVisionEncoderScalesWithItsQueueAndSurvivesItsNode) {
  up("encsvc",
     "\n[encoders.vision]\nmax = 2\nup_queue = 1\nup_latency_ms = 1\nup_after_s = 0\n"
     "down_after_s = 3\n",
     [](std::string& text) {
       text.replace(text.find("pipeline_stages = 3"), 19, "pipeline_stages = 1");
     });
  if (HasFatalFailure()) return;
  client c(m_);
  ASSERT_TRUE(c.ok());
  auto serving = [](const actors::cluster_status& s) {
    return std::count(s.encoder_states.begin(), s.encoder_states.end(), std::string("serving"));
  };
  auto s0 = c.status();
  ASSERT_TRUE(s0.has_value());
  EXPECT_EQ(serving(*s0), 1) << "no image has come yet";
  EXPECT_EQ(s0->encoder_min, 1);
  EXPECT_EQ(s0->encoder_max, 2);
  EXPECT_EQ(s0->encoder_scale_ups, 0);

  constexpr int jobs = 8;
  constexpr std::int64_t tokens = 24;
  auto ref = reference_run(c, jobs, tokens);
  // Its images waited longer than up_latency_ms: a second replica, on a
  // node that holds no stage.
  auto two = c.wait_for([&](const actors::cluster_status& s) { return serving(s) == 2; }, 30s);
  ASSERT_TRUE(two.has_value()) << "no second vision encoder replica";
  auto s1 = c.status();
  ASSERT_TRUE(s1.has_value());
  ASSERT_EQ(s1->encoder_replicas.size(), 2u);
  EXPECT_EQ(s1->encoder_replicas[0].rfind("n0 ", 0), 0u) << s1->encoder_replicas[0];
  const std::string extra = s1->encoder_replicas[1].substr(0, s1->encoder_replicas[1].find(' '));
  EXPECT_TRUE(extra == "n1" || extra == "n2") << s1->encoder_replicas[1];
  EXPECT_EQ(s1->encoder_scale_ups, 1);
  EXPECT_NE(s1->last_event.find("vision encoder"), std::string::npos) << s1->last_event;
  // The same jobs through both replicas: the same answers.
  {
    auto run = start_jobs(c, jobs, tokens, true);
    join(*run);
    EXPECT_EQ(expect_same_answers(*run, *ref), 0);
  }
  // The replica encoded some of them: its node holds no stage, so what it
  // sent the first stage's process (n0) over the data plane is image rows.
  std::int64_t rows_bytes = 0;
  auto s1b = c.wait_for(
      [&](const actors::cluster_status& s) {
        for (std::size_t i = 0; i < s.links.size() && i < s.link_bytes.size(); ++i)
          if (s.links[i] == extra + "->n0") rows_bytes = s.link_bytes[i];
        return rows_bytes > 0;
      },
      5s);
  EXPECT_TRUE(s1b.has_value()) << "no image rows came from the replica on " << extra;
  // Quiet for down_after_s: drained, then stopped.
  auto one = c.wait_for(
      [&](const actors::cluster_status& s) {
        return s.encoder_replicas.size() == 1 && s.encoder_scale_downs >= 1;
      },
      30s);
  ASSERT_TRUE(one.has_value()) << "the idle replica was not drained";
  // Load again, with images no encoder has cached (cached ones would not
  // wait): a replica again; its node is killed while images arrive.
  struct offset_guard {
    ~offset_guard() { image_offset() = 0; }
  } reset_offset;
  image_offset() = 10;
  ref = reference_run(c, jobs, tokens);
  ASSERT_TRUE(
      c.wait_for([&](const actors::cluster_status& s) { return serving(s) == 2; }, 30s).has_value())
      << "no second replica the second time";
  auto s2 = c.status();
  ASSERT_TRUE(s2.has_value());
  ASSERT_EQ(s2->encoder_replicas.size(), 2u);
  const std::string victim = s2->encoder_replicas[1].substr(0, s2->encoder_replicas[1].find(' '));
  ASSERT_NE(victim, "n0");
  auto run = start_jobs(c, jobs, tokens, true);
  joiner joined{*run};
  ::kill(pid_of(victim), SIGKILL);
  join(*run);
  EXPECT_EQ(expect_same_answers(*run, *ref), 0);
  auto lost = c.wait_for(
      [&](const actors::cluster_status& s) {
        const auto* m = c.member(s, victim);
        if (!m || m->state != cluster::member_state::lost) return false;
        for (const auto& r : s.encoder_replicas)
          if (r.rfind(victim + " ", 0) == 0) return false;
        return true;
      },
      20s);
  EXPECT_TRUE(lost.has_value()) << "the lost node's replica is still listed";
  auto after = actors::client(c.sys(), c.door()).run(job(3, tokens, true));
  ASSERT_TRUE(after.has_value()) << after.error().message;
  EXPECT_EQ(after->tokens, ref->done[2]->tokens);
  auto s3 = c.status();
  ASSERT_TRUE(s3.has_value());
  std::printf(
      "[ encoders ] vision replicas: 1 -> 2 in %.0f ms after the first burst, drained after %.0f "
      "ms quiet (%lld bytes of image rows from it); %lld added, %lld drained; the replica on %s "
      "lost with its node, %d jobs answered "
      "the same\n",
      *two, *one, static_cast<long long>(rows_bytes), static_cast<long long>(s3->encoder_scale_ups),
      static_cast<long long>(s3->encoder_scale_downs), victim.c_str(), jobs);
}

// A manifest may place a node on a GPU; where the machine has none, the
// node refuses to start and `up` says which device, from the node's log.
TEST(ClusterDevices, ANodeOnAMissingGpuRefusesToStartNamingTheDevice) {
  if (!kernels::cuda::probe().gpus.empty()) GTEST_SKIP() << "this machine has a GPU";
  const auto dir = std::filesystem::path(test::temp_path("cluster-nogpu")).lexically_normal();
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto manifest = (dir / "m.toml").string();
  {
    std::ofstream f(manifest);
    f << "[cluster]\nname = \"nogpu\"\nhead = \"n0\"\ncerts = \"certs\"\n[[nodes]]\nname = \"n0\"\n"
      << "host = \"127.0.0.1\"\nport = " << test::free_port() << "\n"
      << "devices = [{ type = \"cuda\", index = 0, memory = \"4GiB\" }]\n";
  }
  ASSERT_EQ(test::troupe_cli("certs " + manifest).exit_code, 0);
  auto r = test::troupe_cli("up " + manifest + " --detach --timeout 60");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("refusing to start: device 'cuda:0'"), std::string::npos) << r.out;
  test::troupe_cli("down " + manifest + " --timeout 10");
}
