// The standby head (issue 28, item 5): a manifest names n1 as standby;
// the head n0 is killed (SIGKILL) while jobs stream, and every job ends
// with the tokens of a run without the fault, each streamed once; a head
// that was SIGSTOPped past the takeover steps down when continued.
#include <gtest/gtest.h>
#include <signal.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <mutex>
#include <sstream>
#include <thread>

#include "tests/cli/cluster_harness.hpp"

namespace {

using namespace troupe;
using namespace troupe::test::cluster_harness;

class StandbyHead : public ClusterLoopback {
 protected:
  void up_with_standby(const std::string& name) {
    up(name, "", [](std::string& text) {
      const std::string at = "head = \"n0\"\n";
      text.replace(text.find(at), at.size(), at + "standby = \"n1\"\n");
    });
  }
  /// Waits until the head says its standby follows.
  bool standby_follows(client& c) {
    return c
        .wait_for(
            [](const actors::cluster_status& s) {
              return s.standby.find(": following") != std::string::npos;
            },
            60s)
        .has_value();
  }
};

/// Jobs run through clients that fail over (what troupe submit and the
/// gateway do with a standby): each stream as received, and the end.
struct failover_run {
  std::vector<std::thread> threads;
  std::vector<std::vector<std::int32_t>> streamed;
  std::vector<std::atomic<int>> count;
  std::vector<steady::time_point> last;  ///< per job: its last token's arrival
  std::vector<double> worst_gap_ms;      ///< per job: the longest wait between tokens
  std::vector<std::optional<actors::finish_event>> done;
  std::vector<std::string> errors;
  std::atomic<std::int64_t> reattached{0};
  std::mutex mtx;
  explicit failover_run(std::size_t n)
      : streamed(n), count(n), last(n), worst_gap_ms(n), done(n), errors(n) {}
  ~failover_run() {
    for (auto& t : threads)
      if (t.joinable()) t.join();
  }
};

std::unique_ptr<failover_run> start_failover_jobs(client& c, const cluster::manifest& m, int n,
                                                  std::int64_t max_tokens) {
  auto r = std::make_unique<failover_run>(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    r->threads.emplace_back([&c, &m, run = r.get(), i, max_tokens] {
      actors::client::failover fo;
      fo.reconnect = [&c, &m] { return actors::connect_client(c.sys(), m, 2s); };
      fo.window = 60s;
      actors::client cl(c.sys(), c.door(), fo);
      const auto k = static_cast<std::size_t>(i);
      auto f = cl.run(job(i + 1, max_tokens, true), [run, k](const actors::token_event& e) {
        {
          std::lock_guard lock(run->mtx);
          run->streamed[k].insert(run->streamed[k].end(), e.tokens.begin(), e.tokens.end());
          const auto now = steady::now();
          if (!run->streamed[k].empty() && run->last[k] != steady::time_point{})
            run->worst_gap_ms[k] =
                std::max(run->worst_gap_ms[k],
                         std::chrono::duration<double, std::milli>(now - run->last[k]).count());
          run->last[k] = now;
        }
        run->count[k] += static_cast<int>(e.tokens.size());
      });
      run->reattached += cl.reattached();
      std::lock_guard lock(run->mtx);
      if (f)
        run->done[k] = *f;
      else
        run->errors[k] = f.error().message;
    });
  return r;
}

std::string node_log(const cluster::manifest& m, const std::string& node) {
  for (const auto& n : cluster::read_launched(m))
    if (n.node == node) {
      std::ifstream f(n.log);
      return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    }
  return {};
}

TEST_F(StandbyHead, TheHeadKilledUnderLoadLosesNoJobAndNoStreamRepeatsOrMissesAToken) {
  up_with_standby("standby-kill");
  client c(m_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(standby_follows(c)) << "the standby never followed the head";
  constexpr int jobs = 4;
  constexpr std::int64_t tokens = 96;
  auto ref = reference_run(c, jobs, tokens);
  ASSERT_FALSE(HasFailure());

  auto run = start_failover_jobs(c, m_, jobs, tokens);
  // Every job well into its decode, none done: then the head goes.
  const auto t0 = steady::now();
  auto within = [&] {
    for (auto& k : run->count)
      if (k < 8 || k > tokens - 24) return false;
    return true;
  };
  while (ms_since(t0) < 60000 && !within()) std::this_thread::sleep_for(2ms);
  ASSERT_TRUE(within()) << "the jobs were not mid-decode together";
  std::vector<int> at_kill;
  for (auto& k : run->count) at_kill.push_back(k);
  const auto killed = steady::now();
  ASSERT_EQ(::kill(pid_of("n0"), SIGKILL), 0);

  // The standby takes over: a client of it sees a higher term, ready.
  client after(m_);
  ASSERT_TRUE(after.ok());
  std::optional<actors::cluster_status> st;
  const auto ready_ms = after.wait_for(
      [&](const actors::cluster_status& s) {
        st = s;
        return s.head == "n1" && s.ready;
      },
      60s);
  ASSERT_TRUE(ready_ms.has_value()) << "no head took over: " << (st ? st->last_event : "");
  for (auto& t : run->threads) t.join();
  const double takeover_ms = ms_since(killed);  // (an upper bound: every job is done by now)

  for (int i = 0; i < jobs; ++i) {
    const auto k = static_cast<std::size_t>(i);
    ASSERT_TRUE(run->done[k].has_value()) << "job " << i << " was lost: " << run->errors[k];
    EXPECT_EQ(run->done[k]->reason, actors::finish_reason::length)
        << to_string(run->done[k]->reason) << ": " << run->done[k]->error;
    EXPECT_EQ(run->done[k]->tokens, ref->done[k]->tokens) << "job " << i << " answered otherwise";
    EXPECT_EQ(run->streamed[k], ref->done[k]->tokens)
        << "job " << i << ": the stream repeated or missed tokens (" << run->streamed[k].size()
        << " streamed, " << at_kill[k] << " before the kill)";
  }
  EXPECT_EQ(run->reattached.load(), jobs) << "every open job attaches to the new head";
  auto s = after.status();
  ASSERT_TRUE(s.has_value());
  EXPECT_GT(s->term, 0u);
  EXPECT_NE(s->standby.find("took over from head n0"), std::string::npos) << s->standby;
  EXPECT_NE(s->standby.find(std::to_string(jobs) + " job(s) resumed"), std::string::npos)
      << s->standby;
  double worst = 0;
  for (auto g : run->worst_gap_ms) worst = std::max(worst, g);
  std::printf(
      "[ standby ] head killed with %d jobs mid-decode: the new head served after %.0f "
      "ms (status poll), every job done %.0f ms after the kill, the longest wait "
      "between two tokens of a stream %.0f ms; %s\n",
      jobs, *ready_ms, takeover_ms, worst, s->last_event.c_str());
  // New jobs run on the new head.
  auto f = actors::client(after.sys(), after.door()).run(job(2, 8, true));
  ASSERT_TRUE(f.has_value()) << f.error().message;
  EXPECT_EQ(f->reason, actors::finish_reason::length);

  // The old head's node restarted: its standby serves, so it becomes the
  // standby (it does not take the cluster back with a newer term).
  test::child_process n0("n0", {TROUPE_CLI, "node", "--manifest", cs_.manifest, "--name", "n0"});
  const auto follows = after.wait_for(
      [](const actors::cluster_status& s) {
        return s.standby.find("standby n0 follows") != std::string::npos;
      },
      60s);
  EXPECT_TRUE(follows.has_value()) << "the restarted head did not become the standby";
  auto now = after.status();
  ASSERT_TRUE(now.has_value());
  EXPECT_EQ(now->head, "n1");
  EXPECT_TRUE(now->ready);
  auto g = actors::client(after.sys(), after.door()).run(job(3, 8, true));
  ASSERT_TRUE(g.has_value()) << g.error().message;
  EXPECT_EQ(g->reason, actors::finish_reason::length);
}

TEST_F(StandbyHead, AHeadStoppedPastTheTakeoverStepsDownWhenContinued) {
  up_with_standby("standby-stop");
  client c(m_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(standby_follows(c));
  const auto old_head = pid_of("n0");
  ASSERT_EQ(::kill(old_head, SIGSTOP), 0);
  // The standby declares it lost (no answer for lost_after) and takes over.
  client after(m_);
  ASSERT_TRUE(after.ok());
  const auto took = after.wait_for(
      [](const actors::cluster_status& s) { return s.head == "n1" && s.ready; }, 60s);
  ASSERT_TRUE(took.has_value()) << "the standby did not take over from a stopped head";
  auto f = actors::client(after.sys(), after.door()).run(job(1, 8, true));
  ASSERT_TRUE(f.has_value()) << f.error().message;
  EXPECT_EQ(f->reason, actors::finish_reason::length);
  // Continued, the old head finds its nodes follow a higher term: it steps
  // down (its process ends), and the new head keeps serving.
  ASSERT_EQ(::kill(old_head, SIGCONT), 0);
  const auto t0 = steady::now();
  while (cluster::process_alive(old_head) && ms_since(t0) < 60000)
    std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(cluster::process_alive(old_head)) << "the old head did not step down";
  EXPECT_NE(node_log(m_, "n0").find("steps down"), std::string::npos);
  auto s = after.status();
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->head, "n1");
  EXPECT_TRUE(s->ready);
  auto g = actors::client(after.sys(), after.door()).run(job(2, 8, true));
  ASSERT_TRUE(g.has_value()) << g.error().message;
  EXPECT_EQ(g->reason, actors::finish_reason::length);
}

}  // namespace

namespace {

std::string run_curl(const std::string& args) {
  const std::string cmd = "curl -s -S " + args + " 2>&1";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, p)) out += buf;
  ::pclose(p);
  return out;
}

/// The text of an SSE completion stream, chunk by chunk, and whether it
/// ended with [DONE] and no error.
std::pair<std::string, bool> stream_text(const std::string& sse) {
  std::string text;
  bool done = false, error = false;
  std::istringstream in(sse);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("data: ", 0) != 0) continue;
    const auto data = line.substr(6);
    if (data == "[DONE]") {
      done = true;
      continue;
    }
    auto j = nlohmann::json::parse(data, nullptr, false);
    if (j.is_discarded() || j.contains("error")) {
      error = true;
      continue;
    }
    if (j.contains("choices") && !j["choices"].empty()) text += j["choices"][0].value("text", "");
  }
  return {text, done && !error};
}

}  // namespace

// Through the HTTP gateway, whose process survives: the head is killed
// mid-stream and the client's SSE stream goes on, with the text of an
// uninterrupted run.
TEST_F(StandbyHead, AStreamThroughTheGatewayGoesOnAcrossTheTakeover) {
  up_with_standby("standby-gw");
  client c(m_);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(standby_follows(c));
  const int port = test::free_port();
  test::child_process serve("serve",
                            std::vector<std::string>{TROUPE_CLI, "serve", cs_.manifest, "--port",
                                                     std::to_string(port), "--grpc-port", "0"});
  ASSERT_TRUE(serve.expect("troupe serve:", 60000ms)) << "troupe serve did not start";
  const std::string url = "http://127.0.0.1:" + std::to_string(port) + "/v1/completions";
  const std::string body = cs_.dir + "/body.json";
  auto write_body = [&](bool stream) {
    std::ofstream(body) << nlohmann::json{
        {"prompt", "Once upon a time"},
        {"max_tokens", 120},
        {"temperature", 0},
        {"ignore_eos", true},
        {"stream", stream}}.dump();
  };
  write_body(false);
  const auto ref = nlohmann::json::parse(
      run_curl("-H 'Content-Type: application/json' --data-binary @" + body + " " + url), nullptr,
      false);
  ASSERT_FALSE(ref.is_discarded());
  ASSERT_TRUE(ref.contains("choices")) << ref.dump();
  const std::string want = ref["choices"][0]["text"];
  ASSERT_FALSE(want.empty());

  write_body(true);
  const std::string out = cs_.dir + "/stream.txt";
  std::thread streaming([&] {
    run_curl("-N -o " + out + " -H 'Content-Type: application/json' --data-binary @" + body + " " +
             url);
  });
  // A few chunks in, the head goes.
  const auto t0 = steady::now();
  auto chunks = [&] {
    std::ifstream f(out);
    const std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::size_t n = 0;
    for (auto at = s.find("data: "); at != std::string::npos; at = s.find("data: ", at + 1)) ++n;
    return n;
  };
  while (chunks() < 6 && ms_since(t0) < 60000) std::this_thread::sleep_for(2ms);
  const auto before = chunks();
  ASSERT_EQ(::kill(pid_of("n0"), SIGKILL), 0);
  streaming.join();
  std::ifstream f(out);
  const std::string sse((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto [text, clean] = stream_text(sse);
  EXPECT_TRUE(clean) << "the stream did not end cleanly:\n" << sse;
  EXPECT_EQ(text, want) << before << " chunks before the kill";
  EXPECT_LT(before, 100u) << "the stream was (nearly) over before the kill";
  client after(m_);
  ASSERT_TRUE(after.ok());
  auto s = after.status();
  ASSERT_TRUE(s.has_value());
  EXPECT_NE(s->standby.find("1 job(s) resumed"), std::string::npos)
      << "the stream did not go on at the new head: " << s->standby;
}
