// The scheduler actor (the shell of core::scheduler_core) under CAF's
// test_coordinator: one thread, messages delivered when the test runs
// them, and virtual time that moves only when the test advances it. The
// deadline and stall timers fire through the shell's delayed messages, so
// these tests check the wiring between the core's next_wakeup and CAF's
// clock in milliseconds of real time.
#include <gtest/gtest.h>
#include <caf/all.hpp>
#include <caf/scheduler/test_coordinator.hpp>

#include <memory>

#include "actors/data_plane.hpp"
#include "actors/protocol.hpp"
#include "actors/scheduler.hpp"
#include "tests/actors/core/test_tokenizer.hpp"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;

using test::bundled_tokenizer;

/// What a client sink received.
struct received {
  std::vector<token_event> tokens;
  std::vector<finish_event> finished;
};

/// How the fake stage answers a step.
enum class stage_mode { answer, peer_lost };

struct fixture {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  caf::scheduler::test_coordinator* sched = nullptr;
  std::shared_ptr<received> got = std::make_shared<received>();
  client_sink_actor sink;
  std::shared_ptr<std::int64_t> steps = std::make_shared<std::int64_t>(0);

  fixture() {
    register_protocol(cfg);
    cfg.set("scheduler.policy", caf::atom("testing"));
    cfg.set("logger.file-verbosity", caf::atom("quiet"));
    sys = std::make_unique<caf::actor_system>(cfg);
    sched = &dynamic_cast<caf::scheduler::test_coordinator&>(sys->scheduler());
    sched->clock().current_time += std::chrono::hours(1);
    auto g = got;
    sink = sys->spawn([g]() -> client_sink_actor::behavior_type {
      return {[g](token_event& e) { g->tokens.push_back(std::move(e)); },
              [g](finish_event& f) { g->finished.push_back(std::move(f)); }};
    });
  }
  ~fixture() {
    sched->run();
    caf::anon_send_exit(sink, caf::exit_reason::user_shutdown);
    sched->run();
  }

  shard_actor stage(stage_mode mode) {
    auto n = steps;
    return sys->spawn([mode, n]() -> shard_actor::behavior_type {
      return {
          [mode, n](step_atom, step_batch& b) -> caf::result<step_output> {
            ++*n;
            if (mode == stage_mode::peer_lost)
              return make_error(error_code::peer_lost, "the stage's process is gone");
            step_output o;
            o.step = b.step;
            for (const auto& s : b.seqs)
              o.sampled.push_back(s.sample ? std::vector<std::int32_t>{42}
                                           : std::vector<std::int32_t>{});
            return o;
          },
          [](info_atom) { return shard_info{}; },
          [](version_atom) { return protocol_version; },
          [](forward_atom, caf::strong_actor_ptr) { return true; },
      };
    });
  }

  scheduler_actor scheduler(std::vector<shard_actor> stages, load_gauge held = {}) {
    scheduler_options o;
    o.kv.block_size = 16;
    o.kv_blocks = 64;
    o.max_decode_steps = 1;
    return spawn_scheduler(*sys, model_frontend{bundled_tokenizer(), 397, 32, -1, 0}, o,
                           std::move(stages), {}, {}, std::move(held));
  }

  void submit(const scheduler_actor& s, std::uint64_t id, std::int64_t max_tokens,
              std::int64_t deadline_ms = 0) {
    generate_request r;
    r.id = id;
    r.prompt_tokens = {10, 11, 12, 13};
    r.params.max_tokens = max_tokens;
    r.deadline_ms = deadline_ms;
    caf::anon_send(s, submit_atom::value, std::move(r), sink);
    sched->run();
  }
  /// Moves virtual time on and delivers what became due.
  void advance(caf::timespan d) {
    sched->clock().advance_time(d);
    sched->run();
  }
};

TEST(SchedulerShell, StreamsARequestToItsEnd) {
  fixture f;
  auto s = f.scheduler({f.stage(stage_mode::answer)});
  f.submit(s, 1, 3);
  ASSERT_EQ(f.got->finished.size(), 1u);
  EXPECT_EQ(f.got->finished[0].reason, finish_reason::length);
  EXPECT_EQ(f.got->finished[0].tokens, (std::vector<std::int32_t>{42, 42, 42}));
  EXPECT_EQ(f.got->tokens.size(), 3u);
  EXPECT_EQ(*f.steps, 3);
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

// The block events the head follows: numbered from 0 (a `cleared`
// first), a number already read gives nothing new, and a number the log
// never had gives a resync: `cleared` and then every cached block.
TEST(SchedulerShell, BlockEventsAreNumberedAndAStaleNumberResyncs) {
  fixture f;
  auto s = f.scheduler({f.stage(stage_mode::answer)});
  generate_request r;
  r.id = 1;
  for (std::int32_t t = 10; t < 50; ++t) r.prompt_tokens.push_back(t);  // two full blocks
  r.params.max_tokens = 3;
  caf::anon_send(s, submit_atom::value, std::move(r), f.sink);
  f.sched->run();
  ASSERT_EQ(f.got->finished.size(), 1u);
  auto ask = [&](std::uint64_t since) {
    auto out = std::make_shared<std::optional<kv_events>>();
    f.sys->spawn([s, since, out](caf::event_based_actor* self) {
      self->request(s, caf::infinite, kv_events_atom::value, since).then([out](kv_events& e) {
        *out = std::move(e);
      });
    });
    f.sched->run();
    EXPECT_TRUE(*out);
    return out->value_or(kv_events{});
  };
  const auto first = ask(0);
  EXPECT_FALSE(first.resync);
  ASSERT_EQ(first.events.size(), 3u);
  EXPECT_EQ(first.next, 3u);
  EXPECT_EQ(first.events[0].what, 2) << "cleared";
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(first.events[i].what, 0) << "stored";
    EXPECT_EQ(first.events[i].tier, 0) << "on the device";
    EXPECT_EQ(first.events[i].name.size(), 32u);
  }
  EXPECT_NE(first.events[1].name, first.events[2].name);
  const auto again = ask(first.next);
  EXPECT_FALSE(again.resync);
  EXPECT_TRUE(again.events.empty());
  EXPECT_EQ(again.next, first.next);
  const auto stale = ask(first.next + 100);
  EXPECT_TRUE(stale.resync);
  ASSERT_EQ(stale.events.size(), 3u);
  EXPECT_EQ(stale.events[0].what, 2);
  EXPECT_EQ(stale.next, first.next);
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

// The gauge the head's router reads: the requests the scheduler holds, as
// of its last change, not of the last heartbeat.
TEST(SchedulerShell, ItsLoadGaugeFollowsTheRequestsItHolds) {
  fixture f;
  auto waiting = std::make_shared<std::atomic<std::int64_t>>(-1);
  auto s = f.scheduler({}, waiting);  // no pipeline: requests wait
  for (std::uint64_t id = 1; id <= 3; ++id) f.submit(s, id, 5);
  EXPECT_EQ(waiting->load(), 3);
  caf::anon_send(s, cancel_atom::value, std::uint64_t{2});
  f.sched->run();
  EXPECT_EQ(waiting->load(), 2);
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);

  auto served = std::make_shared<std::atomic<std::int64_t>>(-1);
  auto t = f.scheduler({f.stage(stage_mode::answer)}, served);
  f.submit(t, 7, 3);
  ASSERT_EQ(std::count_if(f.got->finished.begin(), f.got->finished.end(),
                          [](const finish_event& e) { return e.id == 7; }),
            1);
  EXPECT_EQ(served->load(), 0);
  caf::anon_send_exit(t, caf::exit_reason::user_shutdown);
}

TEST(SchedulerShell, ADeadlineFiresOnTheActorClock) {
  fixture f;
  auto s = f.scheduler({});  // no pipeline yet: the request waits
  f.submit(s, 1, 3, /*deadline_ms=*/500);
  EXPECT_TRUE(f.got->finished.empty());
  f.advance(499ms);
  EXPECT_TRUE(f.got->finished.empty()) << "not before its time";
  f.advance(3ms);
  ASSERT_EQ(f.got->finished.size(), 1u);
  EXPECT_EQ(f.got->finished[0].reason, finish_reason::deadline);
  EXPECT_GE(f.got->finished[0].total_ms, 500.0);
  EXPECT_LT(f.got->finished[0].total_ms, 510.0) << "virtual time, not the wall clock";
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

TEST(SchedulerShell, AStalledPipelineFailsItsRequestsAfterTheLimit) {
  fixture f;
  auto s = f.scheduler({f.stage(stage_mode::peer_lost)});
  f.submit(s, 1, 3);
  f.submit(s, 2, 3);
  EXPECT_TRUE(f.got->finished.empty()) << "a lost peer is waited for";
  const auto sent = *f.steps;
  f.advance(59s);
  EXPECT_TRUE(f.got->finished.empty());
  EXPECT_GT(*f.steps, sent) << "no reset came: the requests were tried again on the same stages";
  f.advance(2s);
  ASSERT_EQ(f.got->finished.size(), 2u);
  for (const auto& fin : f.got->finished) {
    EXPECT_EQ(fin.reason, finish_reason::error);
    EXPECT_NE(fin.error.find("no restored pipeline came within 60 s"), std::string::npos)
        << fin.error;
  }
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

TEST(SchedulerShell, AResetBeforeTheLimitRecomputesOnTheNewPipeline) {
  fixture f;
  auto s = f.scheduler({f.stage(stage_mode::peer_lost)});
  f.submit(s, 1, 2);
  f.advance(4s);  // within the retry window (5 s): the reset comes first
  caf::anon_send(s, pipeline_atom::value, std::vector<shard_actor>{f.stage(stage_mode::answer)},
                 std::vector<kv_store_actor>{});
  f.sched->run();
  ASSERT_EQ(f.got->finished.size(), 1u);
  EXPECT_EQ(f.got->finished[0].reason, finish_reason::length);
  EXPECT_EQ(f.got->finished[0].preemptions, 1);
  f.advance(120s);
  EXPECT_EQ(f.got->finished.size(), 1u) << "the stall timer of the old pipeline does nothing";
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

// Images: the encoder holds each request's rows and sends a step's rows
// to the first stage when the shell asks; the rows never pass through the
// shell. A fake encoder numbers its rows (row r of a request carries r), so
// the stage can check it got every row once, in order, chunk by chunk.
struct image_log {
  int encodes = 0, rows_requests = 0, lose = 0;  // lose: rows requests answered "not held"
  std::vector<std::uint64_t> forgotten;
  std::vector<float> rows_seen;     // at the stage, in step order
  std::vector<std::int64_t> chunk;  // image tokens per chunk, and rows with them (checked)
  int mismatches = 0;
};

constexpr std::int32_t image_token = 5;
constexpr std::int64_t per_image = 6, hidden = 32;

encoder_actor fake_encoder(caf::actor_system& sys, std::shared_ptr<image_log> log) {
  return sys.spawn([log]() -> encoder_actor::behavior_type {
    auto pool = kernels::memory_pool::create();
    return {
        [log](encode_atom, const encode_request&) {
          ++log->encodes;
          return encode_reply{per_image, hidden, 0.5, 1.0, 1, {}, false};  // unnamed: not cached
        },
        [log, pool](rows_atom, const media_rows_request& q) -> caf::result<tensor_ref> {
          ++log->rows_requests;
          if (log->lose > 0) {
            --log->lose;
            return make_error(error_code::not_found, "not held here");
          }
          auto t = kernels::tensor::empty(*pool, kernels::dtype::f32, {q.rows, hidden});
          if (!t) return make_error(error_code::internal, t.error().message);
          for (std::int64_t r = 0; r < q.rows; ++r)
            std::fill_n(t->row_as<float>(r), hidden, static_cast<float>(q.first_row + r));
          return data_plane::local().park("encoder", std::move(*t));
        },
        [log](forget_atom, std::uint64_t id) { log->forgotten.push_back(id); },
        [](chunk_atom, const audio_chunk&) -> caf::result<stream_progress> {
          return make_error(error_code::invalid_request, "this encoder takes no stream");
        },
        [](flush_atom, std::int64_t) {},
        [](version_atom) { return protocol_version; },
    };
  });
}

shard_actor image_stage(caf::actor_system& sys, std::shared_ptr<image_log> log) {
  return sys.spawn([log]() -> shard_actor::behavior_type {
    auto pool = kernels::memory_pool::create();
    return {
        [log, pool](step_atom, step_batch& b) -> caf::result<step_output> {
          step_output o;
          o.step = b.step;
          for (const auto& w : b.seqs) {
            const auto images = std::count(w.tokens.begin(), w.tokens.end(), image_token);
            if (images > 0) {
              log->chunk.push_back(images);
              auto t = data_plane::local().take(w.embeddings, *pool);
              if (!t || w.embed_token != image_token || t->dim(0) != images) {
                ++log->mismatches;
              } else {
                for (std::int64_t r = 0; r < t->dim(0); ++r)
                  log->rows_seen.push_back(t->row_as<float>(r)[0]);
              }
            }
            o.sampled.push_back(w.sample ? std::vector<std::int32_t>{42}
                                         : std::vector<std::int32_t>{});
          }
          return o;
        },
        [](info_atom) { return shard_info{}; },
        [](version_atom) { return protocol_version; },
        [](forward_atom, caf::strong_actor_ptr) { return true; },
    };
  });
}

struct image_fixture : fixture {
  std::shared_ptr<image_log> log = std::make_shared<image_log>();

  scheduler_actor scheduler() {
    scheduler_options o;
    o.kv.block_size = 16;
    o.kv_blocks = 64;
    o.max_decode_steps = 1;
    o.prefill_chunk = 4;  // the 15 prompt tokens in 4 chunks; two cross an image's edge
    return spawn_scheduler(*sys,
                           model_frontend{bundled_tokenizer(), 397, hidden, image_token, per_image},
                           o, {image_stage(*sys, log)}, {}, fake_encoder(*sys, log));
  }
  void submit_images(const scheduler_actor& s, std::uint64_t id) {
    generate_request r;
    r.id = id;
    r.prompt_tokens = {10, image_token, 11, image_token, 12};
    r.media = {{"a.png", {1}, media_kind::image}, {"b.png", {2}, media_kind::image}};
    r.params.max_tokens = 2;
    caf::anon_send(s, submit_atom::value, std::move(r), sink);
    sched->run();
  }
};

std::vector<float> every_row() {
  std::vector<float> v;
  for (std::int64_t r = 0; r < 2 * per_image; ++r) v.push_back(static_cast<float>(r));
  return v;
}

TEST(SchedulerShell, ImageRowsGoFromTheEncoderToTheFirstStageChunkByChunk) {
  image_fixture f;
  auto s = f.scheduler();
  f.submit_images(s, 7);
  ASSERT_EQ(f.got->finished.size(), 1u);
  EXPECT_EQ(f.got->finished[0].reason, finish_reason::length) << f.got->finished[0].error;
  EXPECT_EQ(f.log->encodes, 2);
  EXPECT_EQ(f.log->mismatches, 0);
  EXPECT_EQ(f.log->rows_seen, every_row()) << "every image row once, in order";
  EXPECT_EQ(f.log->chunk, (std::vector<std::int64_t>{3, 3, 4, 2}));
  EXPECT_EQ(f.log->rows_requests, 4) << "one rows request per chunk with image tokens";
  EXPECT_EQ(f.log->forgotten, (std::vector<std::uint64_t>{7})) << "the encoder lets go at the end";
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

TEST(SchedulerShell, RowsTheEncoderNoLongerHoldsAreEncodedAgain) {
  image_fixture f;
  f.log->lose = 1;  // the first chunk's rows: "not held here" (an encoder that restarted)
  auto s = f.scheduler();
  f.submit_images(s, 8);
  ASSERT_EQ(f.got->finished.size(), 1u);
  EXPECT_EQ(f.got->finished[0].reason, finish_reason::length) << f.got->finished[0].error;
  EXPECT_EQ(f.log->encodes, 4) << "both images encoded again";
  EXPECT_EQ(f.log->rows_seen, every_row());
  EXPECT_EQ(f.log->mismatches, 0);
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

TEST(SchedulerShell, RowsAnEncoderKeepsLosingFailTheRequestWithTheReason) {
  image_fixture f;
  f.log->lose = 100;
  auto s = f.scheduler();
  f.submit_images(s, 9);
  ASSERT_EQ(f.got->finished.size(), 1u);
  EXPECT_EQ(f.got->finished[0].reason, finish_reason::error);
  EXPECT_EQ(f.got->finished[0].code, error_code::not_found);
  EXPECT_NE(f.got->finished[0].error.find("not held here"), std::string::npos)
      << f.got->finished[0].error;
  EXPECT_EQ(f.log->encodes, 2 + 2 * 3) << "encoded again a few times, then given up";
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

// An encoder that takes images and never answers (its node hangs).
encoder_actor silent_encoder(caf::actor_system& sys, std::shared_ptr<int> taken) {
  return sys.spawn([taken](encoder_actor::pointer self) -> encoder_actor::behavior_type {
    auto held = std::make_shared<std::vector<caf::typed_response_promise<encode_reply>>>();
    return {
        [self, taken, held](encode_atom, const encode_request&) -> caf::result<encode_reply> {
          ++*taken;
          held->push_back(self->make_response_promise<encode_reply>());
          return held->back();
        },
        [](rows_atom, const media_rows_request&) -> caf::result<tensor_ref> {
          return make_error(error_code::not_found, "nothing held here");
        },
        [](forget_atom, std::uint64_t) {},
        [](chunk_atom, const audio_chunk&) -> caf::result<stream_progress> {
          return make_error(error_code::invalid_request, "this encoder takes no stream");
        },
        [](flush_atom, std::int64_t) {},
        [](version_atom) { return protocol_version; },
    };
  });
}

// The encoder replicas ([encoders.vision]): the scheduler sends each
// request's images to the pool's encoder with the fewest unanswered, in
// turn when equal, and every request still gets each of its rows once.
TEST(SchedulerShell, RequestsAreSharedAmongThePoolsEncoders) {
  image_fixture f;
  auto s = f.scheduler();
  auto other_log = std::make_shared<image_log>();
  auto other = fake_encoder(*f.sys, other_log);
  // Its first encoder (another with the same log), and one more.
  auto mine = fake_encoder(*f.sys, f.log);
  caf::anon_send(s, encoders_atom::value, std::vector<encoder_actor>{mine, other},
                 std::vector<encoder_actor>{});
  f.sched->run();
  for (std::uint64_t id = 20; id < 24; ++id) f.submit_images(s, id);
  ASSERT_EQ(f.got->finished.size(), 4u);
  for (const auto& fin : f.got->finished) EXPECT_EQ(fin.reason, finish_reason::length) << fin.error;
  EXPECT_EQ(f.log->encodes + other_log->encodes, 8);
  EXPECT_EQ(other_log->encodes, 4) << "half the requests' images went to the second encoder";
  EXPECT_EQ(f.log->mismatches, 0);
  EXPECT_EQ(f.log->rows_seen.size(), 4 * every_row().size()) << "every row of every request once";
  // Rows come from the encoder that encoded them: each lets go of its own.
  EXPECT_EQ(other_log->forgotten.size(), 2u);
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
}

// An encoder lost with its node: the images it was encoding (and will
// never answer) go to another of the pool, and the request ends as it
// would have.
TEST(SchedulerShell, ALostEncodersImagesGoToAnotherOfThePool) {
  image_fixture f;
  auto s = f.scheduler();
  auto taken = std::make_shared<int>(0);
  auto hung = silent_encoder(*f.sys, taken);
  auto good = fake_encoder(*f.sys, f.log);
  caf::anon_send(s, encoders_atom::value, std::vector<encoder_actor>{hung},
                 std::vector<encoder_actor>{});
  f.sched->run();
  f.submit_images(s, 30);
  EXPECT_EQ(*taken, 2);
  EXPECT_TRUE(f.got->finished.empty()) << "waits on its images";
  caf::anon_send(s, encoders_atom::value, std::vector<encoder_actor>{good},
                 std::vector<encoder_actor>{hung});
  f.sched->run();
  ASSERT_EQ(f.got->finished.size(), 1u);
  EXPECT_EQ(f.got->finished[0].reason, finish_reason::length) << f.got->finished[0].error;
  EXPECT_EQ(f.log->encodes, 2);
  EXPECT_EQ(f.log->rows_seen, every_row());
  // A pool left empty: a request with images is refused with the reason.
  caf::anon_send(s, encoders_atom::value, std::vector<encoder_actor>{},
                 std::vector<encoder_actor>{good});
  f.sched->run();
  f.submit_images(s, 31);
  ASSERT_EQ(f.got->finished.size(), 2u);
  EXPECT_EQ(f.got->finished[1].reason, finish_reason::error);
  EXPECT_NE(f.got->finished[1].error.find("encoder"), std::string::npos)
      << f.got->finished[1].error;
  caf::anon_send_exit(s, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(hung, caf::exit_reason::user_shutdown);
}

}  // namespace
}  // namespace troupe::actors
