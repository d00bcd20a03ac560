// The head renders each job's prompt off its own thread: a prompt that
// takes long (here: a renderer that blocks until the test lets it go)
// holds neither the heartbeats nor other jobs. The head and its node run
// in this process, with the runtime's one CAF worker thread, as a node
// process does.
#include <gtest/gtest.h>

#include <condition_variable>
#include <future>
#include <mutex>
#include <thread>

#include "actors/cluster.hpp"
#include "cluster/manifest.hpp"
#include "tests/temp_path.hpp"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;

/// A door the renderer waits at until the test opens it.
struct gate {
  std::mutex m;
  std::condition_variable cv;
  bool entered = false, open = false;
  void wait() {
    std::unique_lock lock(m);
    entered = true;
    cv.notify_all();
    cv.wait(lock, [&] { return open; });
  }
  bool wait_entered(std::chrono::milliseconds t) {
    std::unique_lock lock(m);
    return cv.wait_for(lock, t, [&] { return entered; });
  }
  void release() {
    std::lock_guard lock(m);
    open = true;
    cv.notify_all();
  }
};

node_config one_node_config(const std::string& dir) {
  auto m = cluster::parse_manifest(R"(
[cluster]
name = "solo"
head = "n0"
certs = "certs"
[model]
path = ")" + std::string(TROUPE_BUNDLED_MODEL) +
                                       R"("
[parallelism]
pipeline_stages = 1
[[nodes]]
name = "n0"
host = "127.0.0.1"
port = 7490
devices = [{ type = "cpu", memory = "2GiB" }]
)",
                                   dir + "/solo.toml");
  EXPECT_TRUE(m) << (m ? "" : m.error().text());
  node_config c;
  c.m = *m;
  c.name = "n0";
  c.model = TROUPE_BUNDLED_MODEL;
  c.device = parse_devices("cpu").value().front();
  c.memory_limit = std::int64_t{2} << 30;
  c.kv.capacity_tokens = 2048;
  return c;
}

TEST(HeadPrompt, ABlockedPromptHoldsNeitherHeartbeatsNorOtherJobs) {
  const std::string dir = test::temp_path("head_prompt");
  caf::actor_system_config cfg;
  configure_runtime(cfg);  // one CAF worker thread, as in a node process
  caf::actor_system sys{cfg};
  auto g = std::make_shared<gate>();
  head_config hc;
  hc.node = one_node_config(dir);
  hc.render = [g](const prompt_setup& s, const prompt_input& in) {
    if (in.prompt == "a prompt that takes long") g->wait();
    return render_prompt(s, in);
  };
  auto agent = spawn_node_agent(sys, hc.node);
  auto door = spawn_head(sys, hc, agent);
  ASSERT_TRUE(door) << door.error().message;
  // Wait until the model is placed.
  bool ready = false;
  for (int i = 0; i < 600 && !ready; ++i) {
    auto s = query_status(sys, *door, 5s);
    ready = s && s->ready;
    if (!ready) std::this_thread::sleep_for(100ms);
  }
  ASSERT_TRUE(ready) << "the head did not place the model";

  job_request slow;
  slow.id = random_job_id();
  slow.prompt = "a prompt that takes long";
  slow.max_tokens = 4;
  auto slow_done = std::make_shared<std::promise<std::string>>();
  auto slow_result = slow_done->get_future();
  client jobs(sys, *door);
  auto slow_submit = std::async(std::launch::async, [&] {
    client::callbacks cb;
    cb.on_finish = [slow_done](const finish_event& f) {
      slow_done->set_value(f.reason == finish_reason::error ? f.error : to_string(f.reason));
    };
    auto r = jobs.submit(slow, std::move(cb));
    if (!r) slow_done->set_value("refused: " + r.error().message);
  });
  ASSERT_TRUE(g->wait_entered(30s)) << "the renderer never ran";

  // While the renderer blocks: another job streams its tokens to its end ...
  job_request quick;
  quick.id = random_job_id();
  quick.prompt = "What shape is it?";
  quick.max_tokens = 6;
  quick.ignore_eos = true;
  auto streamed = std::make_shared<std::atomic<int>>(0);
  auto quick_run = std::async(std::launch::async, [&, streamed] {
    return jobs.run(quick, [streamed](const token_event& e) {
      *streamed += static_cast<int>(e.tokens.size());
    });
  });
  const bool quick_ended = quick_run.wait_for(20s) == std::future_status::ready;
  // ... and the head keeps answering: its status, and its node's heartbeats.
  auto s = query_status(sys, *door, 5s);
  g->release();  // whatever happened, let the blocked renderer go before asserting
  ASSERT_TRUE(quick_ended) << "a job waited behind another job's prompt";
  auto q = quick_run.get();
  ASSERT_TRUE(q) << q.error().message;
  EXPECT_EQ(q->reason, finish_reason::length);
  EXPECT_EQ(q->tokens.size(), 6u);
  EXPECT_EQ(streamed->load(), 6);
  ASSERT_TRUE(s) << "the head did not answer while a prompt was rendered: " << s.error();
  ASSERT_EQ(s->nodes.size(), 1u);
  EXPECT_EQ(s->nodes[0].state, cluster::member_state::up);
  EXPECT_GE(s->nodes[0].last_seen_ms, 0.0);
  EXPECT_LT(s->nodes[0].last_seen_ms, 1200.0) << "heartbeats were not answered in time";

  ASSERT_EQ(slow_result.wait_for(60s), std::future_status::ready);
  EXPECT_EQ(slow_result.get(), "length") << "the released job runs to its end";
  slow_submit.get();
  caf::anon_send_exit(*door, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(agent, caf::exit_reason::user_shutdown);
}

}  // namespace
}  // namespace troupe::actors
