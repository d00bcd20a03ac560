// The actor pipeline (scheduler, encoder, shards, KV stores) against the
// plain generation loop: token-identical outputs alone and among concurrent
// requests, admission limits, cancellation, preemption and sliding windows.
#include <gtest/gtest.h>

#include "actor_test.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "llava_reference.hpp"

#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>

#include "actors/device.hpp"
#include "actors/pipeline_stats.hpp"
#include "actors/runtime.hpp"
#include "actors/tensor_registry.hpp"
#include "models/generate.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"
#include "models/llava.hpp"
#include "models/tokenizer.hpp"
#include "tests/remote_memory_device.hpp"
#include "tests/temp_path.hpp"

namespace troupe::actors {
namespace {

const std::string model_dir = TROUPE_BUNDLED_MODEL;
const std::string shapes_dir = std::string(TROUPE_FIXTURES_DIR) + "/shapes";

std::vector<std::uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

struct prompt_case {
  std::string text;   // user turn
  std::string image;  // file name in tests/fixtures/shapes ("" = text only)
  models::sampling_params params;
  bool no_eos = false;  // run to max_tokens
};

/// The reference: the bundled model through models::generate_batch alone,
/// as `troupe generate` runs it.
class reference : test::llava_parts {
 public:
  reference() : llava_parts(model_dir) {}

  std::vector<std::int32_t> prompt_ids(const prompt_case& c) const {
    const std::string text =
        "USER: " + std::string(c.image.empty() ? "" : "<image>\n") + c.text + " ASSISTANT:";
    auto ids = tok_->encode(text, true, true);
    EXPECT_TRUE(ids);
    return *ids;
  }

  models::sampling_params params(const prompt_case& c) const {
    auto p = c.params;
    if (auto eos = tok_->special_ids().eos; eos && !c.no_eos) p.stop_token_ids.push_back(*eos);
    return p;
  }

  std::vector<std::int32_t> solo(const prompt_case& c, const models::kv_options& kv = {}) {
    auto ids = prompt_ids(c);
    kernels::tensor pixels;
    models::pixel_values pv;
    if (!c.image.empty()) {
      auto img = models::load_image(shapes_dir + "/" + c.image);
      EXPECT_TRUE(img);
      auto p = models::preprocess_image(*img, pre_);
      EXPECT_TRUE(p);
      pv = std::move(*p);
      pixels =
          *kernels::tensor::view(pv.data.data(), kernels::dtype::f32, {1, 3, pv.height, pv.width});
    }
    auto prep = model_->prepare(*ctx_, ids, pixels);
    EXPECT_TRUE(prep) << (prep ? "" : prep.error().message);
    return prep ? generate_alone(*prep, params(c), kv) : std::vector<std::int32_t>{};
  }

  generate_request request(const prompt_case& c, std::uint64_t id) const {
    generate_request r;
    r.id = id;
    r.prompt_tokens = prompt_ids(c);
    if (!c.image.empty())
      r.media.push_back({c.image, read_bytes(shapes_dir + "/" + c.image), media_kind::image});
    r.params = params(c);
    return r;
  }
};

reference& ref() {
  static reference r;
  return r;
}

std::vector<prompt_case> mixed_cases(int n) {
  const std::vector<std::string> questions = {"Describe the image.", "How many shapes are there?",
                                              "What shape is on the left?",
                                              "What color is the shape in the center?"};
  std::vector<prompt_case> out;
  for (int i = 0; i < n; ++i) {
    prompt_case c;
    char name[32];
    std::snprintf(name, sizeof name, "shapes_%03d.png", i % 12);
    if (i % 4 != 3) c.image = name;  // every fourth is text only
    c.text = i % 4 == 3 ? "Describe the image. Describe the image."
                        : questions[static_cast<std::size_t>(i) % questions.size()];
    c.params.max_tokens = 24;
    if (i % 3 == 1) {  // seeded sampling: the same draws in any batch
      c.params.temperature = 0.9;
      c.params.top_k = 20;
      c.params.seed = 1000 + static_cast<std::uint64_t>(i);
    }
    out.push_back(c);
  }
  return out;
}

struct pipeline_test : ::testing::Test {
  caf::actor_system sys{test::actor_config()};

  /// `long_context`: serve past the bundled model's 256 positions (tests of
  /// cancellation, deadlines, restarts and sliding windows generate for
  /// thousands of tokens; output there is out of distribution, which they
  /// do not judge).
  std::unique_ptr<local_runtime> start(int stages, runtime_config cfg = {},
                                       bool long_context = true) {
    cfg.model = model_dir;
    cfg.stages = stages;
    if (long_context && cfg.scheduler.context.max_model_len == 0)
      cfg.scheduler.context = {1 << 16, true};
    if (cfg.devices.empty()) {
      auto d = parse_devices(stages > 1 ? "cpu:0-0,cpu:1-1" : "cpu");
      EXPECT_TRUE(d);
      cfg.devices = *d;
    }
    auto rt = local_runtime::start(sys, cfg);
    EXPECT_TRUE(rt) << (rt ? "" : rt.error().message);
    return std::move(*rt);
  }

  /// Every store's blocks are free again.
  void expect_kv_free(local_runtime& rt) {
    caf::scoped_actor self{sys};
    for (auto& kv : rt.kv_stores()) {
      self->request(kv, caf::infinite, usage_atom::value)
          .receive(
              [&](const kv_usage_info& u) {
                EXPECT_EQ(u.free_blocks, u.total_blocks) << u.device;
                EXPECT_EQ(u.sequences, 0) << u.device;
              },
              [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    }
  }
};

/// Submits all cases at once and waits for every finish.
using test::run_all;

TEST_F(pipeline_test, one_request_matches_plain_generation_on_one_and_two_stages) {
  for (int stages : {1, 2}) {
    auto rt = start(stages);
    client c(sys, rt->scheduler());
    for (const auto& pc : mixed_cases(4)) {
      const auto want = ref().solo(pc);
      std::vector<std::int32_t> streamed;
      auto f = c.run(ref().request(pc, client::next_id()), [&](const token_event& e) {
        streamed.insert(streamed.end(), e.tokens.begin(), e.tokens.end());
      });
      ASSERT_TRUE(f) << f.error().message;
      EXPECT_EQ(f->tokens, want) << stages << " stage(s): " << pc.text << " " << pc.image;
      EXPECT_EQ(streamed, f->tokens);
      EXPECT_TRUE(f->reason == finish_reason::stop || f->reason == finish_reason::length)
          << to_string(f->reason) << " " << f->error;
    }
    expect_kv_free(*rt);
  }
}

TEST_F(pipeline_test, sixteen_concurrent_requests_match_their_solo_runs) {
  const auto cases = mixed_cases(16);
  std::vector<std::vector<std::int32_t>> want;
  for (const auto& pc : cases) want.push_back(ref().solo(pc));
  for (int stages : {1, 2}) {
    auto rt = start(stages);
    client c(sys, rt->scheduler());
    std::vector<generate_request> reqs;
    for (const auto& pc : cases) reqs.push_back(ref().request(pc, client::next_id()));
    auto got = run_all(c, reqs);
    for (std::size_t i = 0; i < cases.size(); ++i)
      EXPECT_EQ(got[i].tokens, want[i])
          << stages << " stage(s), request " << i << ": " << got[i].error;
    expect_kv_free(*rt);
    EXPECT_EQ(tensor_registry::local().pending(), 0u);
  }
}

// Stages and the vision encoder on devices whose memory host code cannot
// touch (tests/remote_memory_device.hpp: a GPU's situation, on the CPU's
// kernels): activations between stages, image rows from the encoder, input
// embeddings and logits all cross through the data plane and the device,
// and the tokens are the CPU's. Mixed: one stage on the CPU, one there.
TEST_F(pipeline_test, on_devices_whose_memory_is_not_the_hosts_the_tokens_are_the_cpus) {
  ASSERT_TRUE(register_device_kind("remote", [](const device_spec&) {
    return kernels::result<std::shared_ptr<kernels::device>>(
        std::make_shared<test::remote_memory_device>(1));
  }));
  const auto cases = mixed_cases(4);
  std::vector<std::vector<std::int32_t>> want;
  for (const auto& pc : cases) want.push_back(ref().solo(pc));
  for (const char* list : {"remote:0,remote:1", "cpu:0-0,remote:0", "remote:0,cpu:1-1"}) {
    runtime_config cfg;
    auto d = parse_devices(list);
    ASSERT_TRUE(d) << d.error().message;
    cfg.devices = *d;
    cfg.encoder_device = 1;  // the vision encoder on the second device of the list
    cfg.model = model_dir;
    cfg.stages = 2;
    auto started = local_runtime::start(sys, cfg);
    ASSERT_TRUE(started) << list << ": " << started.error().message;
    auto rt = std::move(*started);
    client c(sys, rt->scheduler());
    std::vector<generate_request> reqs;
    for (const auto& pc : cases) reqs.push_back(ref().request(pc, client::next_id()));
    auto got = run_all(c, reqs);
    for (std::size_t i = 0; i < cases.size(); ++i)
      EXPECT_EQ(got[i].tokens, want[i]) << list << ", request " << i << ": " << got[i].error;
    expect_kv_free(*rt);
    EXPECT_EQ(tensor_registry::local().pending(), 0u);
  }
}

TEST_F(pipeline_test, kv_exhaustion_completes_every_request_through_preemption) {
  runtime_config cfg;
  cfg.kv.capacity_tokens = 16 * 12;  // room for about two image requests at a time
  auto cases = mixed_cases(6);
  for (auto& pc : cases) {  // long answers, so that running requests outgrow the cache
    pc.no_eos = true;
    pc.params.max_tokens = 48;
  }
  std::vector<std::vector<std::int32_t>> want;
  for (const auto& pc : cases) want.push_back(ref().solo(pc));
  const auto dir = test::temp_path("kv-disk-tier");
  std::filesystem::create_directories(dir);
  // No tier; a host tier (issue 27's target: nothing recomputed); a host
  // tier of two blocks over a disk tier (blocks spill to disk and come back
  // from there).
  for (const models::kv_tier_options& tiers :
       {models::kv_tier_options{}, models::kv_tier_options{16 * 64, 0, {}},
        models::kv_tier_options{16 * 2, 16 * 64, dir}}) {
    SCOPED_TRACE("host " + std::to_string(tiers.host_tokens) + ", disk " +
                 std::to_string(tiers.disk_tokens));
    cfg.kv.tiers = tiers;
    auto rt = start(2, cfg);
    client c(sys, rt->scheduler());
    std::vector<generate_request> reqs;
    for (const auto& pc : cases) reqs.push_back(ref().request(pc, client::next_id()));
    auto got = run_all(c, reqs);
    std::int64_t preemptions = 0;
    for (std::size_t i = 0; i < cases.size(); ++i) {
      EXPECT_EQ(got[i].tokens, want[i])
          << "request " << i << ": " << to_string(got[i].reason) << " " << got[i].error;
      preemptions += got[i].preemptions;
    }
    EXPECT_GT(preemptions, 0) << "the test did not exhaust the KV cache";
    const auto st = c.stats();
    EXPECT_LE(st.kv_peak_blocks, st.kv_total_blocks);
    if (tiers.host_tokens > 0) {
      EXPECT_EQ(st.recomputed_tokens, 0);
      EXPECT_GT(st.restored_tokens, 0);
      EXPECT_GT(st.kv_to_host, 0);
      EXPECT_GT(st.kv_from_host + st.kv_from_disk, 0);
    }
    if (tiers.disk_tokens > 0) {
      EXPECT_GT(st.kv_to_disk, 0);
    }
    expect_kv_free(*rt);
  }
}

// Prefix caching (on by default): a request that repeats another's prompt
// takes the KV of its full blocks from the cache and computes only the
// rest, and its tokens are still those of the plain loop; the same
// question about another image shares nothing past the image; with the
// cache off nothing is taken. One and two stages (every stage holds the
// blocks under the same ids). The encoder answers the repeated image from
// its cache either way.
TEST_F(pipeline_test, a_repeated_prompt_takes_its_prefix_from_the_cache_with_the_same_tokens) {
  auto cases = mixed_cases(2);  // an image question, then another image
  cases[1].text = cases[0].text;
  ASSERT_NE(cases[0].image, cases[1].image);
  std::vector<std::vector<std::int32_t>> want;
  for (const auto& pc : cases) want.push_back(ref().solo(pc));
  const auto prompt = static_cast<std::int64_t>(ref().prompt_ids(cases[0]).size());
  for (int stages : {1, 2})
    for (bool caching : {true, false}) {
      SCOPED_TRACE(std::to_string(stages) + " stage(s), caching " + (caching ? "on" : "off"));
      runtime_config cfg;
      cfg.scheduler.prefix_caching = caching;
      auto rt = start(stages, cfg);
      client c(sys, rt->scheduler());
      auto first = c.run(ref().request(cases[0], client::next_id()), {});
      ASSERT_TRUE(first) << first.error().message;
      auto again = c.run(ref().request(cases[0], client::next_id()), {});
      ASSERT_TRUE(again) << again.error().message;
      auto other = c.run(ref().request(cases[1], client::next_id()), {});
      ASSERT_TRUE(other) << other.error().message;
      EXPECT_EQ(first->tokens, want[0]);
      EXPECT_EQ(again->tokens, want[0]);
      EXPECT_EQ(other->tokens, want[1]);
      EXPECT_EQ(first->cached_tokens, 0);
      const auto expanded = again->prompt_tokens;  // image rows included
      EXPECT_GT(expanded, prompt);
      if (caching) {
        // Every full block but the one holding the last prompt token.
        EXPECT_EQ(again->cached_tokens, (expanded - 1) / 16 * 16) << expanded;
        EXPECT_LT(other->cached_tokens, 16) << "another image: only what precedes it can match";
      } else {
        EXPECT_EQ(again->cached_tokens, 0);
        EXPECT_EQ(other->cached_tokens, 0);
      }
      const auto st = c.stats();
      EXPECT_EQ(st.prefix_hits, caching ? again->cached_tokens + other->cached_tokens : 0);
      // The encoder cache: the repeated image was not encoded again.
      EXPECT_EQ(st.images, 3);
      EXPECT_EQ(st.image_cache_hits, 1);
      EXPECT_EQ(again->encode_ms, 0) << "no batch ran for it";
      EXPECT_GT(first->encode_ms, 0);
      expect_kv_free(*rt);
    }
}

// KV tier settings that would do nothing, or could not work, are refused
// at start with the reason.
TEST_F(pipeline_test, kv_tier_settings_that_cannot_work_are_refused) {
  struct bad {
    models::kv_tier_options tiers;
    bool caching;
    const char* why;
  };
  for (const auto& b : {bad{{8, 0, {}}, true, "holds no KV block of 16"},
                        bad{{0, 0, "/tmp"}, true, "--kv-disk-dir without --kv-disk-tokens"},
                        bad{{1024, 0, {}}, false, "need prefix caching"},
                        bad{{0, 1024, "/nonexistent/troupe-kv"}, true, "/nonexistent/troupe-kv"}}) {
    runtime_config cfg;
    cfg.model = model_dir;
    cfg.kv.tiers = b.tiers;
    cfg.scheduler.prefix_caching = b.caching;
    auto rt = local_runtime::start(sys, cfg);
    ASSERT_FALSE(rt) << b.why;
    EXPECT_NE(rt.error().message.find(b.why), std::string::npos) << rt.error().message;
  }
}

// The same new image in two requests sent at once: the second joins the
// first's wait for the vision tower (encoded once, counted as a hit), and
// both answers are the plain loop's.
TEST_F(pipeline_test, the_same_image_sent_twice_at_once_is_encoded_once) {
  const auto pc = mixed_cases(1)[0];
  ASSERT_FALSE(pc.image.empty());
  const auto want = ref().solo(pc);
  runtime_config cfg;
  cfg.encoder.max_wait_ms = 200;  // both arrive within one batch window
  cfg.encoder.min_batch = 4;
  auto rt = start(1, cfg);
  client c(sys, rt->scheduler());
  auto got =
      run_all(c, {ref().request(pc, client::next_id()), ref().request(pc, client::next_id())});
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].tokens, want) << got[0].error;
  EXPECT_EQ(got[1].tokens, want) << got[1].error;
  const auto st = c.stats();
  EXPECT_EQ(st.images, 2);
  EXPECT_EQ(st.image_cache_hits, 1);
  EXPECT_EQ(std::min(got[0].encode_ms, got[1].encode_ms), 0) << "one of them ran no batch";
  expect_kv_free(*rt);
}

TEST_F(pipeline_test, queue_limit_rejects_with_overloaded_and_loses_nothing) {
  runtime_config cfg;
  cfg.scheduler.queue_limit = 64;
  auto rt = start(1, cfg);
  client c(sys, rt->scheduler());
  const std::vector<prompt_case> kinds = {{"How many shapes are there?", "shapes_001.png", {}},
                                          {"Describe the image.", "", {}}};
  std::vector<std::vector<std::int32_t>> want;
  for (auto pc : kinds) {
    pc.params.max_tokens = 8;
    want.push_back(ref().solo(pc));
  }
  std::mutex m;
  std::condition_variable cv;
  std::map<std::uint64_t, std::vector<finish_event>> finished;
  std::map<std::uint64_t, std::size_t> kind_of;
  std::int64_t accepted = 0, rejected = 0;
  for (int i = 0; i < 1000; ++i) {
    auto pc = kinds[static_cast<std::size_t>(i) % kinds.size()];
    pc.params.max_tokens = 8;
    const auto id = client::next_id();
    kind_of[id] = static_cast<std::size_t>(i) % kinds.size();
    client::callbacks cb;
    cb.on_finish = [&](const finish_event& f) {
      std::lock_guard lock(m);
      finished[f.id].push_back(f);
      cv.notify_all();
    };
    auto ack = c.submit(ref().request(pc, id), cb);
    if (ack) {
      ++accepted;
    } else {
      ++rejected;
      EXPECT_EQ(ack.error().code, error_code::overloaded) << ack.error().message;
      EXPECT_NE(ack.error().message.find("overloaded"), std::string::npos) << ack.error().message;
    }
  }
  EXPECT_GT(accepted, 0);
  EXPECT_GT(rejected, 0);
  std::unique_lock lock(m);
  cv.wait(lock, [&] { return static_cast<std::int64_t>(finished.size()) == accepted; });
  lock.unlock();
  for (auto& [id, fs] : finished) {
    ASSERT_EQ(fs.size(), 1u) << "request " << id << " finished " << fs.size() << " times";
    EXPECT_EQ(fs[0].tokens, want[kind_of[id]]) << "request " << id << " " << fs[0].error;
  }
  const auto st = c.stats();
  EXPECT_EQ(st.accepted, accepted);
  EXPECT_EQ(st.rejected, rejected);
  EXPECT_EQ(st.finished, accepted);
  // An id never runs twice.
  auto again = c.submit(ref().request(kinds[1], finished.begin()->first), {});
  ASSERT_FALSE(again);
  EXPECT_EQ(again.error().code, error_code::duplicate_id);
  expect_kv_free(*rt);
}

TEST_F(pipeline_test, cancellation_frees_kv_blocks) {
  auto rt = start(2);
  client c(sys, rt->scheduler());
  prompt_case pc{"Describe the image. Describe the image.", "", {}, true};
  pc.params.max_tokens = 1000;  // far more than the test waits for
  auto req = ref().request(pc, client::next_id());
  std::mutex m;
  std::condition_variable cv;
  std::int64_t tokens = 0;
  std::optional<finish_event> fin;
  client::callbacks cb;
  cb.on_token = [&](const token_event& e) {
    std::lock_guard lock(m);
    tokens += static_cast<std::int64_t>(e.tokens.size());
    cv.notify_all();
  };
  cb.on_finish = [&](const finish_event& f) {
    std::lock_guard lock(m);
    fin = f;
    cv.notify_all();
  };
  const auto id = req.id;
  ASSERT_TRUE(c.submit(req, cb));
  {
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return tokens >= 5 || fin; });
  }
  EXPECT_TRUE(c.cancel(id));
  std::unique_lock lock(m);
  cv.wait(lock, [&] { return fin.has_value(); });
  EXPECT_EQ(fin->reason, finish_reason::cancelled);
  EXPECT_LT(static_cast<std::int64_t>(fin->tokens.size()), 1000);
  lock.unlock();
  EXPECT_FALSE(c.cancel(id));
  // The scheduler's books and every store agree: nothing is held.
  for (int i = 0; i < 100 && c.stats().kv_used_blocks != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(c.stats().kv_used_blocks, 0);
  expect_kv_free(*rt);
}

TEST_F(pipeline_test, bad_image_fails_its_request_with_a_clear_error_and_others_go_on) {
  auto rt = start(1);
  client c(sys, rt->scheduler());
  prompt_case good{"How many shapes are there?", "shapes_002.png", {}};
  good.params.max_tokens = 8;
  auto bad = ref().request(good, client::next_id());
  bad.media[0].bytes.resize(bad.media[0].bytes.size() / 2);  // truncated PNG
  bad.media[0].name = "truncated.png";
  auto f = c.run(bad);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->reason, finish_reason::error);
  EXPECT_NE(f->error.find("truncated.png"), std::string::npos) << f->error;
  auto ok = c.run(ref().request(good, client::next_id()));
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->tokens, ref().solo(good));
  // Wrong requests are refused at admission.
  auto no_image = ref().request(good, client::next_id());
  no_image.media.clear();
  auto r = c.submit(no_image, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, error_code::invalid_request);
  auto bad_params = ref().request(good, client::next_id());
  bad_params.params.top_p = 3;
  r = c.submit(bad_params, {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, error_code::invalid_request);
  expect_kv_free(*rt);
}

TEST_F(pipeline_test, sliding_window_bounds_kv_over_a_long_generation) {
  runtime_config cfg;
  cfg.kv.window = 64;
  cfg.kv.sinks = 4;
  cfg.kv.capacity_tokens = 16 * 16;
  auto rt = start(2, cfg);
  client c(sys, rt->scheduler());
  prompt_case pc{"Describe the image.", "", {}, true};  // no EOS: run to max_tokens
  pc.params.max_tokens = 10000;
  pc.params.temperature = 1.0;
  pc.params.seed = 7;
  auto req = ref().request(pc, client::next_id());
  auto f = c.run(req);
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_EQ(f->reason, finish_reason::length) << f->error;
  EXPECT_EQ(f->tokens.size(), 10000u);
  EXPECT_GT(c.stats().kv_peak_blocks, 0);
  // Bound: the window's blocks, a sink block and the block being written.
  const auto st = c.stats();
  EXPECT_LE(st.kv_peak_blocks, 64 / 16 + 1 + 2) << "peak " << st.kv_peak_blocks;
  // The same with the plain loop and the same window.
  // Token-identical to the plain loop with the same window (a shorter run:
  // the window has slid many times by then).
  pc.params.max_tokens = 1500;
  auto g = c.run(ref().request(pc, client::next_id()));
  ASSERT_TRUE(g) << g.error().message;
  models::kv_options kv;
  kv.window = 64;
  kv.sinks = 4;
  kv.capacity_tokens = 16 * 16;
  EXPECT_EQ(g->tokens, ref().solo(pc, kv));
  expect_kv_free(*rt);
}

TEST_F(pipeline_test, multi_step_decode_gives_the_tokens_of_single_steps) {
  // Cases that stop in every way inside a multi-step run: max_tokens that is
  // no multiple of the passes, a stop token, a stop string, and a
  // repetition penalty (whose history the shard extends itself).
  std::vector<prompt_case> cases = mixed_cases(8);
  cases[0].params.max_tokens = 7;
  cases[1].params.max_tokens = 41;
  cases[1].no_eos = true;
  cases[2].params.repetition_penalty = 1.3;
  cases[2].params.temperature = 0.7;
  cases[2].params.seed = 5;
  cases[3].params.stop_strings = {" triangle"};
  cases[3].params.max_tokens = 40;
  cases[4].params.max_tokens = 1;
  auto run = [&](int max_steps, std::vector<std::size_t>* max_event_tokens) {
    runtime_config cfg;
    cfg.scheduler.max_decode_steps = max_steps;
    cfg.scheduler.multi_step_ms = 1e6;  // as many passes as allowed, whatever a pass costs
    auto rt = start(1, cfg);
    client c(sys, rt->scheduler());
    std::mutex m;
    std::condition_variable cv;
    std::map<std::uint64_t, finish_event> done;
    std::map<std::uint64_t, std::size_t> most;
    std::map<std::uint64_t, std::vector<std::int32_t>> streamed;
    std::map<std::uint64_t, std::string> text;
    std::vector<std::uint64_t> ids;
    for (const auto& pc : cases) {
      auto r = ref().request(pc, client::next_id());
      ids.push_back(r.id);
      client::callbacks cb;
      cb.on_token = [&, id = r.id](const token_event& e) {
        std::lock_guard lock(m);
        most[id] = std::max(most[id], e.tokens.size());
        streamed[id].insert(streamed[id].end(), e.tokens.begin(), e.tokens.end());
        text[id] += e.text;
      };
      cb.on_finish = [&](const finish_event& f) {
        std::lock_guard lock(m);
        done.emplace(f.id, f);
        cv.notify_all();
      };
      EXPECT_TRUE(c.submit(r, cb));
    }
    std::unique_lock lock(m);
    cv.wait(lock, [&] { return done.size() == cases.size(); });
    std::vector<finish_event> out;
    for (auto id : ids) {
      EXPECT_EQ(streamed[id], done[id].tokens) << "the stream and the finish agree";
      EXPECT_EQ(text[id], done[id].text);
      if (max_event_tokens) max_event_tokens->push_back(most[id]);
      out.push_back(done[id]);
    }
    lock.unlock();
    expect_kv_free(*rt);
    return out;
  };
  std::vector<std::size_t> burst;
  const auto single = run(1, nullptr);
  const auto multi = run(16, &burst);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(multi[i].tokens, single[i].tokens) << "case " << i;
    EXPECT_EQ(multi[i].text, single[i].text) << "case " << i;
    EXPECT_EQ(multi[i].reason, single[i].reason) << "case " << i;
    EXPECT_EQ(multi[i].stop_string, single[i].stop_string) << "case " << i;
  }
  EXPECT_EQ(single[0].tokens.size(), 7u);
  EXPECT_EQ(single[1].tokens.size(), 41u);
  EXPECT_EQ(single[4].tokens.size(), 1u);
  EXPECT_TRUE(single[3].stop_string) << single[3].text;
  EXPECT_EQ(single[3].text.find(" triangle"), std::string::npos);
  // Multi-step really ran: some events carried several tokens.
  EXPECT_GT(*std::max_element(burst.begin(), burst.end()), 1u);
  // And the plain loop agrees where it can (no stop strings there).
  EXPECT_EQ(multi[1].tokens, ref().solo(cases[1]));
  EXPECT_EQ(multi[2].tokens, ref().solo(cases[2]));
}

TEST_F(pipeline_test, a_partial_stage_refuses_multi_step) {
  auto rt = start(2);
  caf::scoped_actor self{sys};
  step_batch b;
  b.step = 1;
  b.decode_steps = 4;
  seq_work w;
  w.seq = 99;
  w.tokens = {1, 20, 21};
  w.sample = true;
  b.seqs.push_back(w);
  self->request(rt->shards().front(), caf::infinite, step_atom::value, b)
      .receive(
          [&](step_output&) { ADD_FAILURE() << "a first stage of two ran a multi-step batch"; },
          [&](caf::error& e) {
            EXPECT_EQ(troupe_code(e), static_cast<std::uint8_t>(error_code::stage_failed));
            EXPECT_NE(describe(sys, e).find("whole model"), std::string::npos) << describe(sys, e);
          });
  expect_kv_free(*rt);
}

}  // namespace
}  // namespace troupe::actors

namespace troupe::actors {
namespace {

TEST_F(pipeline_test, a_killed_stage_is_restarted_and_requests_finish_identically) {
  runtime_config cfg;
  cfg.node.max_restarts = 2;
  auto rt = start(2, cfg);
  client c(sys, rt->scheduler());
  auto cases = mixed_cases(4);
  for (auto& pc : cases) {
    pc.no_eos = true;
    pc.params.max_tokens = 300;
  }
  std::vector<std::vector<std::int32_t>> want;
  for (const auto& pc : cases) want.push_back(ref().solo(pc));
  std::vector<generate_request> reqs;
  for (const auto& pc : cases) reqs.push_back(ref().request(pc, client::next_id()));
  // Kill the second stage while the requests run.
  std::thread killer([&] {
    for (int i = 0; i < 200 && c.stats().steps < 20; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    caf::anon_send_exit(rt->shards().back(), caf::exit_reason::kill);
  });
  auto got = run_all(c, reqs);
  killer.join();
  for (std::size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(got[i].tokens, want[i])
        << "request " << i << ": " << to_string(got[i].reason) << " " << got[i].error;
  caf::scoped_actor self{sys};
  self->request(rt->node(), caf::infinite, stats_atom::value)
      .receive([&](const node_status& s) { EXPECT_EQ(s.restarts, 1) << s.last_failure; },
               [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
  expect_kv_free(*rt);
  // Past the limit the node gives up and requests fail with a clear error.
  // Each kill waits until the node has acted on it (restarted, or given up),
  // however loaded the machine is.
  auto node_status_now = [&] {
    node_status out;
    self->request(rt->node(), caf::infinite, stats_atom::value)
        .receive([&](const node_status& s) { out = s; },
                 [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    return out;
  };
  for (int k = 0; k < 2; ++k) {
    caf::anon_send_exit(rt->shards().front(), caf::exit_reason::kill);
    for (int i = 0; i < 2000; ++i) {
      const auto s = node_status_now();
      if (s.failed || s.restarts >= 2 + k) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  EXPECT_TRUE(node_status_now().failed);
  auto r = c.submit(ref().request(cases[0], client::next_id()), {});
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, error_code::stage_failed) << r.error().message;
}

}  // namespace
}  // namespace troupe::actors

namespace troupe::actors {
namespace {

// The model's context length (the bundled model: 256 positions) bounds a
// request's prompt plus max_tokens, with its own code; max_tokens 0 takes
// what the context leaves.
TEST_F(pipeline_test, the_context_length_is_enforced) {
  auto rt = start(2, {}, false);
  client c(sys, rt->scheduler());
  prompt_case pc{"Describe the image.", "", {}, true};
  pc.params.max_tokens = 300;
  auto refused = c.run(ref().request(pc, client::next_id()));
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, error_code::context_length);
  EXPECT_NE(refused.error().message.find("maximum context length is 256 tokens"), std::string::npos)
      << refused.error().message;
  pc.params.max_tokens = 0;  // the rest of the context
  auto req = ref().request(pc, client::next_id());
  const auto prompt = static_cast<std::int64_t>(req.prompt_tokens.size());
  auto f = c.run(req);
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_EQ(f->reason, finish_reason::length);
  EXPECT_EQ(static_cast<std::int64_t>(f->tokens.size()), 256 - prompt);
  expect_kv_free(*rt);
  // A longer one only when asked for, and past the model's only when allowed.
  runtime_config cfg;
  cfg.scheduler.context.max_model_len = 512;
  cfg.model = model_dir;
  cfg.stages = 1;
  cfg.devices = *parse_devices("cpu");
  auto bad = local_runtime::start(sys, cfg);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("past the 256 positions the model was trained on"),
            std::string::npos)
      << bad.error().message;
}

TEST_F(pipeline_test, deadlines_end_requests_and_free_their_kv) {
  auto rt = start(2);
  client c(sys, rt->scheduler());
  prompt_case pc{"Describe the image.", "", {}, true};
  pc.params.max_tokens = 3500;  // seconds of work; fits the default KV
  auto req = ref().request(pc, client::next_id());
  req.deadline_ms = 150;
  const auto t0 = std::chrono::steady_clock::now();
  auto f = c.run(req);
  const double waited =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(f) << f.error().message;
  EXPECT_EQ(f->reason, finish_reason::deadline);
  EXPECT_GT(f->tokens.size(), 0u);
  EXPECT_LT(f->tokens.size(), 3500u);
  EXPECT_GE(waited, 150.0);
  for (int i = 0; i < 100 && c.stats().kv_used_blocks != 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  expect_kv_free(*rt);
}

TEST_F(pipeline_test, scheduler_counts_where_the_pipelines_time_goes) {
  const auto t0 = std::chrono::steady_clock::now();
  auto rt = start(3);  // two devices: stages 0 and 2 share one
  client c(sys, rt->scheduler());
  const auto before = c.stats();
  auto cases = mixed_cases(6);
  for (auto& pc : cases) {
    pc.no_eos = true;
    pc.params.max_tokens = 12;
  }
  std::vector<generate_request> reqs;
  for (const auto& pc : cases) reqs.push_back(ref().request(pc, client::next_id()));
  const auto got = run_all(c, reqs);
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  const auto st = c.stats();
  std::int64_t preemptions = 0;
  for (const auto& f : got) preemptions += f.preemptions;
  ASSERT_EQ(preemptions, 0);
  EXPECT_EQ(st.stages, 3);
  // Every prompt token once, and every generated token but the last fed back.
  EXPECT_EQ(st.step_rows - before.step_rows, st.prompt_tokens + st.generated_tokens - st.finished);
  ASSERT_EQ(st.stage_compute_ms.size(), 3u);
  double sum = 0;
  for (double x : st.stage_compute_ms) {
    EXPECT_GT(x, 0);
    sum += x;
  }
  EXPECT_NEAR(sum, st.compute_ms, 1e-6 * st.compute_ms);
  // A step's round trip holds its stages' compute; a step in flight, the wall time.
  EXPECT_GE(st.round_trip_ms, st.compute_ms);
  EXPECT_GT(st.in_flight_ms, 0);
  EXPECT_LE(st.in_flight_ms, wall_ms);
  EXPECT_GT(st.scheduler_ms, 0);
  const auto p = breakdown_between(before, st, wall_ms / 1e3);
  ASSERT_TRUE(p);
  EXPECT_EQ(p->busy_per_stage.size(), 3u);
  EXPECT_GT(p->round_trip_ms, 0);
  EXPECT_LE(p->compute_ms, p->round_trip_ms);
}

}  // namespace
}  // namespace troupe::actors
