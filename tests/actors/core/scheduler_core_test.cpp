// The scheduler's pure core under a manual clock: admission, batching,
// chunked prefill, preemption, deadlines, cancellation and stall recovery,
// with no actors, threads or processes.
#include "actors/core/scheduler_core.hpp"

#include "actors/core/block_index.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <numeric>
#include <set>

#include "tests/actors/core/test_tokenizer.hpp"

namespace troupe::actors::core {
namespace {

using namespace std::chrono_literals;

using test::bundled_tokenizer;

scheduler_options small_options() {
  scheduler_options o;
  o.queue_limit = 8;
  o.max_running = 8;
  o.token_budget = 64;
  o.prefill_chunk = 64;
  o.micro_batches = 1;
  o.max_decode_steps = 1;
  o.kv.block_size = 4;
  o.kv_blocks = 64;
  o.stall_limit = 60s;
  // The tests above the prefix-cache section count blocks (their prompts
  // share prefixes, which a cache would take).
  o.prefix_caching = false;
  return o;
}

/// A core, its manual clock and every event it produced.
struct harness {
  manual_clock clk;
  scheduler_core core;
  core_events events;

  explicit harness(scheduler_options o = small_options(), int stages = 1,
                   std::int32_t image_token = -1, std::int64_t context_length = 0)
      : core(model_frontend{bundled_tokenizer(), 397, 32, image_token, 3, context_length}, o,
             stages, clk) {}

  std::expected<std::int64_t, core_error> submit(std::uint64_t id, std::int64_t prompt,
                                                 std::int64_t max_tokens,
                                                 std::int64_t deadline_ms = 0) {
    return core.submit(id, [&]() -> std::expected<request_spec, core_error> {
      request_spec s;
      s.tokens.resize(static_cast<std::size_t>(prompt));
      std::iota(s.tokens.begin(), s.tokens.end(), 10);
      s.params.max_tokens = max_tokens;
      s.deadline_ms = deadline_ms;
      return s;
    });
  }
  /// Submits a request with exactly these prompt tokens (and images).
  std::expected<std::int64_t, core_error> submit_tokens(std::uint64_t id,
                                                        std::vector<std::int32_t> tokens,
                                                        std::int64_t max_tokens,
                                                        std::string salt = {},
                                                        std::vector<block_hash> images = {}) {
    return core.submit(id, [&]() -> std::expected<request_spec, core_error> {
      request_spec s;
      s.tokens = tokens;
      s.params.max_tokens = max_tokens;
      s.cache_salt = salt;
      s.images = static_cast<std::int64_t>(images.size());
      s.image_hashes = images;
      return s;
    });
  }
  std::optional<step_plan> plan() { return core.plan_step(events); }
  void take(core_events ev) {
    for (auto& e : ev) events.push_back(std::move(e));
  }
  /// Answers a step: every sampling sequence gets `token`.
  void answer(const step_plan& p, std::int32_t token = 42) {
    step_result r;
    for (const auto& s : p.seqs)
      r.sampled.push_back(s.sample ? std::vector<std::int32_t>{token}
                                   : std::vector<std::int32_t>{});
    take(core.step_done(p.step, r));
  }
  std::vector<request_done> done() const {
    std::vector<request_done> d;
    for (const auto& e : events)
      if (auto* x = std::get_if<request_done>(&e)) d.push_back(*x);
    return d;
  }
  std::int64_t released_blocks() const {
    std::int64_t n = 0;
    for (const auto& e : events)
      if (auto* x = std::get_if<kv_release>(&e)) n += x->blocks;
    return n;
  }
  /// Confirms every kv_release so far (the stores freed the blocks).
  void confirm_frees() {
    for (const auto& e : events)
      if (auto* x = std::get_if<kv_release>(&e)) core.kv_freed(x->blocks, x->epoch);
    std::erase_if(events,
                  [](const core_event& e) { return std::holds_alternative<kv_release>(e); });
  }
};

// -- admission -------------------------------------------------------------------------------

TEST(SchedulerCore, AdmissionRefusesPastTheQueueLimitWithOverloaded) {
  auto o = small_options();
  o.queue_limit = 2;
  harness h(o);
  ASSERT_EQ(h.submit(1, 4, 2).value(), 0);
  ASSERT_EQ(h.submit(2, 4, 2).value(), 1);
  auto third = h.submit(3, 4, 2);
  ASSERT_FALSE(third);
  EXPECT_EQ(third.error().code, error_code::overloaded);
  EXPECT_NE(third.error().message.find("limit 2"), std::string::npos) << third.error().message;
  EXPECT_EQ(h.core.stats().rejected, 1);
  EXPECT_EQ(h.core.queued(), 2);
  // Once one is admitted (no longer queued), another fits.
  ASSERT_TRUE(h.plan());
  EXPECT_TRUE(h.submit(4, 4, 2));
}

// Duplicate ids are refused while the request runs and for the last
// `remembered_ids` submissions; older ids are forgotten (the chaos soak saw
// the head grow by ~48 bytes per request served, all of it this set).
TEST(SchedulerCore, RememberedIdsAreBoundedButARunningRequestIsAlwaysKnown) {
  auto o = small_options();
  o.remembered_ids = 4;
  harness h(o);
  ASSERT_TRUE(h.submit(1, 4, 50));  // stays running
  for (std::uint64_t id = 2; id <= 3; ++id) ASSERT_TRUE(h.submit(id, 4, 1));
  EXPECT_EQ(h.submit(2, 4, 1).error().code, error_code::duplicate_id);
  while (h.done().size() < 2) {
    auto p = h.plan();
    ASSERT_TRUE(p);
    h.answer(*p);
    h.confirm_frees();
  }
  for (std::uint64_t id = 10; id < 16; ++id) {
    ASSERT_TRUE(h.submit(id, 4, 1));
    auto p = h.plan();
    ASSERT_TRUE(p);
    h.answer(*p);
    h.confirm_frees();
  }
  EXPECT_EQ(h.submit(1, 4, 1).error().code, error_code::duplicate_id) << "1 still runs";
  EXPECT_EQ(h.submit(15, 4, 1).error().code, error_code::duplicate_id) << "15 is recent";
  EXPECT_TRUE(h.submit(2, 4, 1)) << "2 ended long ago and was forgotten";
}

TEST(SchedulerCore, AdmissionNamesEachRefusal) {
  harness h;
  EXPECT_EQ(h.submit(0, 4, 2).error().code, error_code::invalid_request);
  ASSERT_TRUE(h.submit(7, 4, 2));
  EXPECT_EQ(h.submit(7, 4, 2).error().code, error_code::duplicate_id);
  // 64 blocks of 4 tokens hold 256 tokens: 200 + 100 never fits.
  auto big = h.submit(8, 200, 100);
  ASSERT_FALSE(big);
  EXPECT_EQ(big.error().code, error_code::kv_exhausted);
  EXPECT_NE(big.error().message.find("need 75 KV blocks; a stage has 64"), std::string::npos)
      << big.error().message;
  auto outside = h.core.submit(9, [] {
    request_spec s;
    s.tokens = {5, 397};
    return std::expected<request_spec, core_error>(s);
  });
  ASSERT_FALSE(outside);
  EXPECT_NE(outside.error().message.find("prompt token 397 outside the vocabulary"),
            std::string::npos);
  auto prep = h.core.submit(10, [] {
    return std::expected<request_spec, core_error>(
        std::unexpected(core_error{error_code::invalid_request, "prompt: bad UTF-8"}));
  });
  ASSERT_FALSE(prep);
  EXPECT_EQ(prep.error().message, "prompt: bad UTF-8");
  auto images = h.core.submit(11, [] {
    request_spec s;
    s.tokens = {5};
    s.images = 1;
    return std::expected<request_spec, core_error>(s);
  });
  ASSERT_FALSE(images);
  EXPECT_NE(images.error().message.find("no vision encoder"), std::string::npos);
  EXPECT_EQ(h.core.stats().rejected, 5);  // id 0 is not counted: it is not a request
  EXPECT_EQ(h.core.queued(), 1);
}

/// Runs the core until request `id` ends; its end.
std::optional<request_done> run_to_end(harness& h, std::uint64_t id) {
  for (int i = 0; i < 10000; ++i) {
    for (const auto& d : h.done())
      if (d.id == id) return d;
    auto p = h.plan();
    if (!p) return std::nullopt;
    h.answer(*p);
    h.confirm_frees();
  }
  return std::nullopt;
}

// The model's context length (max_position_embeddings or max_model_len)
// bounds prompt plus max_tokens, with its own code and OpenAI's numbers;
// max_tokens 0 (the chat default) takes what the context and the KV cache
// leave.
TEST(SchedulerCore, TheContextLengthBoundsPromptPlusMaxTokens) {
  harness h(small_options(), 1, -1, 100);  // 64 blocks of 4: 256 tokens of KV
  ASSERT_TRUE(h.submit(1, 60, 40)) << "exactly the context";
  auto over = h.submit(2, 60, 41);
  ASSERT_FALSE(over);
  EXPECT_EQ(over.error().code, error_code::context_length);
  EXPECT_NE(over.error().message.find("context length is 100 tokens; the request needs 101 (60 in "
                                      "the prompt, 41 to generate)"),
            std::string::npos)
      << over.error().message;
  auto full = h.submit(3, 100, 1);
  ASSERT_FALSE(full);
  EXPECT_EQ(full.error().code, error_code::context_length);
  EXPECT_NE(full.error().message.find("the prompt alone holds 100"), std::string::npos)
      << full.error().message;
  EXPECT_EQ(h.submit(4, 100, 0).error().code, error_code::context_length);
  EXPECT_EQ(h.core.stats().rejected, 3);

  ASSERT_TRUE(h.submit(5, 70, 0));
  auto d = run_to_end(h, 5);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->reason, finish_reason::length);
  EXPECT_EQ(d->tokens.size(), 30u) << "the rest of the context";

  // A context longer than the KV cache: the default stops where one
  // sequence's blocks run out (64 x 4 tokens), not at the context.
  harness big(small_options(), 1, -1, 1000);
  ASSERT_TRUE(big.submit(1, 60, 0));
  auto e = run_to_end(big, 1);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->reason, finish_reason::length);
  EXPECT_EQ(e->tokens.size(), 256u - 60u);
  EXPECT_EQ(big.submit(2, 60, 197).error().code, error_code::kv_exhausted);

  // Without a context length a request must say how long it may grow.
  harness none;
  EXPECT_EQ(none.submit(1, 10, 0).error().code, error_code::invalid_request);
  EXPECT_TRUE(none.submit(2, 10, 240)) << "no context length: only the KV cache limits it";
}

TEST(SchedulerCore, ARequestWithImagesWaitsForItsLastImage) {
  harness h(small_options(), 1, /*image_token=*/3);
  ASSERT_TRUE(h.core.submit(1, [] {
    request_spec s;
    s.tokens = {5, 3, 3, 3, 3, 3, 3, 6};  // two images of 3 rows
    s.images = 2;
    s.params.max_tokens = 1;
    return std::expected<request_spec, core_error>(s);
  }));
  EXPECT_FALSE(h.plan());
  EXPECT_FALSE(h.core.image_ready(1));
  EXPECT_FALSE(h.plan());
  EXPECT_TRUE(h.core.image_ready(1));
  auto p = h.plan();
  ASSERT_TRUE(p);
  EXPECT_EQ(p->seqs.at(0).image_rows_before, 0);
  EXPECT_EQ(p->seqs.at(0).tokens.size(), 8u);
}

TEST(SchedulerCore, AStreamedClipIsPrefilledAsItComesAndSamplesOnlyAfterItsEnd) {
  harness h(small_options(), 1, /*image_token=*/3, /*context_length=*/100);
  ASSERT_TRUE(h.core.submit(1, [] {
    request_spec s;
    s.tokens = {5, 3, 3, 7};  // an image of 2 rows, then the stream's place
    s.images = 1;
    s.stream = true;
    s.tail = {8, 9};
    s.params.max_tokens = 0;  // the rest of the context, once the clip ended
    return std::expected<request_spec, core_error>(s);
  }));
  EXPECT_FALSE(h.plan()) << "its image first";
  h.core.image_ready(1);
  // What it has is prefilled, without sampling; then it waits for the clip.
  auto p = h.plan();
  ASSERT_TRUE(p);
  EXPECT_EQ(p->seqs.at(0).tokens, (std::vector<std::int32_t>{5, 3, 3, 7}));
  EXPECT_FALSE(p->seqs.at(0).sample);
  h.answer(*p);
  EXPECT_FALSE(h.plan()) << "nothing to do until the clip's rows come";
  // Two windows' rows: prefilled after the image's, still not sampling.
  h.take(h.core.extend_stream(1, 5));
  p = h.plan();
  ASSERT_TRUE(p);
  EXPECT_EQ(p->seqs.at(0).start, 4);
  EXPECT_EQ(p->seqs.at(0).tokens, (std::vector<std::int32_t>(5, 3)));
  EXPECT_EQ(p->seqs.at(0).image_rows_before, 2) << "the image's rows come before the clip's";
  EXPECT_FALSE(p->seqs.at(0).sample);
  h.answer(*p);
  EXPECT_FALSE(h.plan());
  // The end: its last window's rows and the tail, then it samples.
  h.take(h.core.close_stream(1, 7));
  p = h.plan();
  ASSERT_TRUE(p);
  EXPECT_EQ(p->seqs.at(0).start, 9);
  EXPECT_EQ(p->seqs.at(0).tokens, (std::vector<std::int32_t>{3, 3, 8, 9}));
  EXPECT_TRUE(p->seqs.at(0).sample);
  h.answer(*p);
  auto d = run_to_end(h, 1);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->prompt_tokens, 13);
  EXPECT_EQ(d->reason, finish_reason::length);
  EXPECT_EQ(d->tokens.size(), 100u - 13u) << "max_tokens 0: the context left after the clip";
}

TEST(SchedulerCore, AStreamedClipPastTheContextFailsItsRequestWithTheReason) {
  harness h(small_options(), 1, /*image_token=*/3, /*context_length=*/40);
  ASSERT_TRUE(h.core.submit(1, [] {
    request_spec s;
    s.tokens = {5, 6};
    s.stream = true;
    s.tail = {8};
    s.params.max_tokens = 10;
    return std::expected<request_spec, core_error>(s);
  }));
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.answer(*p);
  h.take(h.core.extend_stream(1, 27));  // 2 + 27 + 1 + 10 = 40: fits exactly
  EXPECT_TRUE(h.done().empty());
  h.take(h.core.extend_stream(1, 28));
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].code, error_code::context_length);
  EXPECT_NE(h.done()[0].error.find("streamed audio clip (28 tokens so far)"), std::string::npos)
      << h.done()[0].error;
  // A clip that ends before one hop gives no row: refused at its end.
  ASSERT_TRUE(h.core.submit(2, [] {
    request_spec s;
    s.tokens = {5, 6};
    s.stream = true;
    s.params.max_tokens = 2;
    return std::expected<request_spec, core_error>(s);
  }));
  h.take(h.core.close_stream(2, 0));
  ASSERT_EQ(h.done().size(), 2u);
  EXPECT_NE(h.done()[1].error.find("shorter than one hop"), std::string::npos);
  // A stream needs a prompt before it.
  auto bare = h.core.submit(3, [] {
    request_spec s;
    s.stream = true;
    s.tail = {8};
    s.params.max_tokens = 2;
    return std::expected<request_spec, core_error>(s);
  });
  ASSERT_FALSE(bare);
  EXPECT_EQ(bare.error().code, error_code::invalid_request);
}

// -- batching --------------------------------------------------------------------------------

TEST(SchedulerCore, TheTokenBudgetCapsAStepAndChunksThePrefill) {
  auto o = small_options();
  o.token_budget = 16;
  o.prefill_chunk = 6;
  harness h(o);
  ASSERT_TRUE(h.submit(1, 14, 1));
  std::vector<std::int64_t> starts, sizes;
  std::vector<bool> sampled;
  while (auto p = h.plan()) {
    ASSERT_EQ(p->seqs.size(), 1u);
    starts.push_back(p->seqs[0].start);
    sizes.push_back(static_cast<std::int64_t>(p->seqs[0].tokens.size()));
    sampled.push_back(p->seqs[0].sample);
    EXPECT_FALSE(h.plan()) << "one micro-batch in flight at most";
    h.answer(*p);
    if (!h.done().empty()) break;
  }
  EXPECT_EQ(starts, (std::vector<std::int64_t>{0, 6, 12}));
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{6, 6, 2}));
  EXPECT_EQ(sampled, (std::vector<bool>{false, false, true}));
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::length);
  EXPECT_EQ(h.done()[0].tokens, (std::vector<std::int32_t>{42}));
}

TEST(SchedulerCore, MicroBatchesSplitTheSequencesEvenly) {
  auto o = small_options();
  o.micro_batches = 2;
  o.balance_micro_batches = false;
  harness h(o, 2);
  for (std::uint64_t id = 1; id <= 4; ++id) ASSERT_TRUE(h.submit(id, 5, 3));
  auto a = h.plan();
  auto b = h.plan();
  ASSERT_TRUE(a && b);
  EXPECT_FALSE(h.plan()) << "two micro-batches in flight fill a two-deep pipeline";
  EXPECT_EQ(a->seqs.size(), 2u);
  EXPECT_EQ(b->seqs.size(), 2u);
  EXPECT_EQ(h.core.steps_in_flight(), 2u);
  h.answer(*a);
  auto c = h.plan();
  ASSERT_TRUE(c);
  EXPECT_EQ(c->seqs.size(), 2u);
  EXPECT_EQ(c->seqs[0].id, a->seqs[0].id) << "the returned micro-batch decodes next";
  EXPECT_EQ(c->seqs[0].start, 5);
}

TEST(SchedulerCore, AFullPipelineTakesNoNewStepUntilOneReturns) {
  harness h;  // one micro-batch
  ASSERT_TRUE(h.submit(1, 4, 3));
  auto a = h.plan();
  ASSERT_TRUE(a);
  ASSERT_TRUE(h.submit(2, 4, 3));
  EXPECT_FALSE(h.plan()) << "request 2 waits: the one micro-batch is in flight";
  h.answer(*a);
  auto b = h.plan();
  ASSERT_TRUE(b);
  ASSERT_EQ(b->seqs.size(), 2u) << "the decode of 1 and the prefill of 2 share the next step";
  EXPECT_EQ(b->seqs[0].id, 1u);
  EXPECT_EQ(b->seqs[1].id, 2u);
}

TEST(SchedulerCore, ASlidingWindowKeepsTheBooksBounded) {
  auto o = small_options();
  o.kv.window = 8;
  o.kv.sinks = 0;
  o.kv_blocks = 12;
  harness h(o);
  ASSERT_TRUE(h.submit(1, 4, 60));  // 64 tokens: 16 blocks without the window
  std::int64_t most = 0, generated = 0;
  for (int i = 0; i < 80 && h.done().empty(); ++i) {
    auto p = h.plan();
    ASSERT_TRUE(p) << "step " << i;
    h.answer(*p);
    ++generated;
    most = std::max(most, h.core.books().used());
    if (h.done().empty()) {
      // What every stage's cache holds now: the prompt and the tokens
      // generated before the last one (that one enters with the next step).
      const auto in_cache = 4 + generated - 1;
      EXPECT_EQ(h.core.books().used(), models::kv_cache::blocks_held(o.kv, in_cache, in_cache))
          << "after step " << i;
    }
  }
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::length);
  EXPECT_EQ(h.done()[0].tokens.size(), 60u);
  EXPECT_LE(most, 4) << "the window's blocks are given back after every step";
}

TEST(SchedulerCore, BalancedMicroBatchesShareAPromptsTokens) {
  auto o = small_options();
  o.micro_batches = 2;
  o.token_budget = 64;
  harness h(o, 2);
  ASSERT_TRUE(h.submit(1, 100, 1));
  auto a = h.plan();
  ASSERT_TRUE(a);
  // An even share of the 100 tokens waiting: 50, not the whole budget.
  EXPECT_EQ(a->seqs.at(0).tokens.size(), 50u);
}

TEST(SchedulerCore, MultiStepDecodeRunsAsManyPassesAsFitTheTime) {
  auto o = small_options();
  o.max_decode_steps = 8;
  o.multi_step_ms = 2.0;
  harness h(o, 1);
  ASSERT_TRUE(h.submit(1, 4, 20));
  auto prefill = h.plan();
  ASSERT_TRUE(prefill);
  EXPECT_EQ(prefill->decode_steps, 1);
  h.answer(*prefill);
  auto first = h.plan();
  ASSERT_TRUE(first);
  EXPECT_EQ(first->decode_steps, 1) << "no pass measured yet";
  step_result r;
  r.sampled = {{43}};
  r.compute_ms = 0.5;  // one pass: 0.5 ms, so 4 fit in 2 ms
  h.take(h.core.step_done(first->step, r));
  auto multi = h.plan();
  ASSERT_TRUE(multi);
  EXPECT_EQ(multi->decode_steps, 4);
  EXPECT_EQ(multi->seqs.at(0).max_new, 4);
  // A second stage turns it off.
  harness two(o, 2);
  EXPECT_EQ(two.core.micro_batches(), 1);
}

// -- KV blocks and preemption ---------------------------------------------------------------

// A request resumed on another head (a standby's takeover): its client
// has the tokens it already generated. They are recomputed with the prompt,
// the sampler continues from its draw counter, and only later tokens are
// emitted; a request its resumed tokens already ended just finishes.
TEST(SchedulerCore, AResumedRequestEmitsOnlyTheTokensAfterTheResumedOnes) {
  harness h;
  auto resumed = [&](std::uint64_t id, std::vector<std::int32_t> had, std::int64_t max_tokens,
                     std::vector<std::int64_t> stops = {}) {
    return h.core.submit(id, [&]() -> std::expected<request_spec, core_error> {
      request_spec s;
      s.tokens.resize(8);
      std::iota(s.tokens.begin(), s.tokens.end(), 10);
      s.params.max_tokens = max_tokens;
      s.params.stop_token_ids = stops;
      s.resumed = had;
      return s;
    });
  };
  ASSERT_TRUE(resumed(1, {42, 43, 44}, 5));
  auto p = h.plan();
  ASSERT_TRUE(p);
  ASSERT_EQ(p->seqs.size(), 1u);
  EXPECT_EQ(p->seqs[0].start, 0);
  ASSERT_EQ(p->seqs[0].tokens.size(), 11u) << "the prompt and the resumed tokens recompute";
  EXPECT_EQ(std::vector<std::int32_t>(p->seqs[0].tokens.end() - 3, p->seqs[0].tokens.end()),
            (std::vector<std::int32_t>{42, 43, 44}));
  EXPECT_TRUE(p->seqs[0].sample);
  EXPECT_EQ(p->seqs[0].draws, 3u) << "the sampler continues where it was";
  h.answer(*p, 45);
  auto q = h.plan();
  ASSERT_TRUE(q);
  EXPECT_EQ(q->seqs[0].draws, 4u);
  h.answer(*q, 46);
  std::vector<std::int32_t> emitted;
  for (const auto& e : h.events)
    if (auto* t = std::get_if<tokens_out>(&e))
      emitted.insert(emitted.end(), t->tokens.begin(), t->tokens.end());
  EXPECT_EQ(emitted, (std::vector<std::int32_t>{45, 46}));
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::length);
  EXPECT_EQ(h.done()[0].tokens, (std::vector<std::int32_t>{42, 43, 44, 45, 46}));

  // Its resumed tokens already reached max_tokens, or a stop token: it
  // ends at the next plan with that reason, no step and no token event.
  h.events.clear();
  ASSERT_TRUE(resumed(2, {42, 43}, 2));
  ASSERT_TRUE(resumed(3, {42, 7, 43}, 9, {7}));
  EXPECT_FALSE(h.plan());
  ASSERT_EQ(h.done().size(), 2u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::length);
  EXPECT_EQ(h.done()[1].reason, finish_reason::stop);
  EXPECT_EQ(h.done()[1].tokens, (std::vector<std::int32_t>{42, 7}));
  for (const auto& e : h.events) EXPECT_FALSE(std::holds_alternative<tokens_out>(e));
  EXPECT_EQ(h.core.queued(), 0);

  // More resumed tokens than max_tokens, or one outside the vocabulary: refused.
  auto over = resumed(4, {1, 2, 3}, 2);
  ASSERT_FALSE(over);
  EXPECT_EQ(over.error().code, error_code::invalid_request);
  EXPECT_FALSE(resumed(5, {100000}, 4));
}

TEST(SchedulerCore, OutOfBlocksPreemptsTheYoungestAndItRecomputesFirst) {
  auto o = small_options();
  o.kv_blocks = 6;  // 24 tokens
  o.token_budget = 64;
  harness h(o);
  ASSERT_TRUE(h.submit(1, 8, 12));  // 2 blocks now, up to 5
  ASSERT_TRUE(h.submit(2, 8, 12));
  auto p = h.plan();
  ASSERT_TRUE(p);
  ASSERT_EQ(p->seqs.size(), 2u);
  h.answer(*p);
  EXPECT_EQ(h.core.books().used(), 4) << "8 tokens in the cache: 2 blocks each";
  // Decode until both cannot grow: planning preempts the younger (2), and
  // that step waits for its blocks to come back.
  for (int i = 0; i < 8; ++i) {
    auto q = h.plan();
    if (!q) break;
    EXPECT_EQ(q->seqs.size(), 2u);
    h.answer(*q);
  }
  EXPECT_EQ(h.core.stats().preemptions, 1);
  EXPECT_EQ(h.core.queued(), 1);
  EXPECT_EQ(h.core.running(), 1);
  // Request 1 keeps decoding alone until it ends, then 2 recomputes from the
  // start: its prompt and the tokens it already generated.
  std::optional<std::int64_t> restart;
  for (int i = 0; i < 40 && h.done().size() < 2; ++i) {
    auto q = h.plan();
    if (!q) {
      h.confirm_frees();
      continue;
    }
    for (const auto& s : q->seqs)
      if (s.id == 2 && s.start == 0) restart = static_cast<std::int64_t>(s.tokens.size());
    h.answer(*q);
    h.confirm_frees();
  }
  ASSERT_EQ(h.done().size(), 2u);
  EXPECT_EQ(h.done()[0].id, 1u);
  EXPECT_EQ(h.done()[1].preemptions, 1);
  ASSERT_TRUE(restart);
  EXPECT_GT(*restart, 8) << "the recompute carries the generated tokens too";
  EXPECT_EQ(h.done()[1].tokens.size(), 12u);
  EXPECT_EQ(h.core.books().used(), 0);
}

TEST(SchedulerCore, BlocksAreNotFreeUntilTheStoresFreedThem) {
  harness h;
  ASSERT_TRUE(h.submit(1, 8, 1));
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.answer(*p);
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.released_blocks(), 2);
  EXPECT_EQ(h.core.books().used(), 2) << "pending until the stores confirm";
  h.confirm_frees();
  EXPECT_EQ(h.core.books().used(), 0);
}

// -- deadlines and cancellation ---------------------------------------------------------------

TEST(SchedulerCore, ADeadlineEndsAWaitingRequestAtItsTime) {
  auto o = small_options();
  harness h(o, 0);  // no pipeline yet: it waits
  ASSERT_TRUE(h.submit(1, 4, 4, /*deadline_ms=*/100));
  ASSERT_TRUE(h.core.next_wakeup());
  EXPECT_EQ(*h.core.next_wakeup() - h.clk.now(), std::chrono::milliseconds(100));
  h.clk.advance(99ms);
  h.take(h.core.tick());
  EXPECT_TRUE(h.done().empty());
  h.clk.advance(1ms);
  h.take(h.core.tick());
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::deadline);
  EXPECT_DOUBLE_EQ(h.done()[0].total_ms, 100.0);
  EXPECT_FALSE(h.core.next_wakeup());
}

TEST(SchedulerCore, ADeadlineInFlightEndsWhenItsStepReturns) {
  harness h;
  ASSERT_TRUE(h.submit(1, 4, 50, 100));
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.clk.advance(150ms);
  h.take(h.core.tick());
  EXPECT_TRUE(h.done().empty()) << "in flight: it ends with its step";
  h.answer(*p);
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::deadline);
  EXPECT_TRUE(h.done()[0].tokens.empty()) << "the step's token is not streamed";
  EXPECT_EQ(h.released_blocks(), 1);
}

TEST(SchedulerCore, CancellationEndsAtOnceOrWhenTheStepReturns) {
  harness h;
  ASSERT_TRUE(h.submit(1, 4, 5));
  ASSERT_TRUE(h.submit(2, 4, 5));
  auto p = h.plan();
  ASSERT_TRUE(p);
  ASSERT_TRUE(h.submit(3, 4, 5));  // waiting
  auto waiting = h.core.cancel(3);
  ASSERT_TRUE(waiting);
  h.take(*waiting);
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::cancelled);
  auto running = h.core.cancel(1);
  ASSERT_TRUE(running);
  EXPECT_TRUE(running->empty());
  h.answer(*p);
  ASSERT_EQ(h.done().size(), 2u);
  EXPECT_EQ(h.done()[1].id, 1u);
  EXPECT_EQ(h.done()[1].reason, finish_reason::cancelled);
  EXPECT_FALSE(h.core.cancel(1)) << "unknown once ended";
  EXPECT_FALSE(h.core.cancel(99));
  EXPECT_TRUE(h.core.knows(2));
}

// -- failures and recovery ------------------------------------------------------------------

TEST(SchedulerCore, ALostPeerStallsUntilTheResetThenRequestsRecompute) {
  harness h;
  ASSERT_TRUE(h.submit(1, 6, 3));
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.answer(*p);
  auto q = h.plan();
  ASSERT_TRUE(q);
  h.take(h.core.step_failed(q->step, step_failure::peer_lost, "peer lost"));
  EXPECT_TRUE(h.core.stalled());
  EXPECT_TRUE(h.done().empty());
  EXPECT_FALSE(h.plan()) << "no steps into a broken pipeline";
  h.clk.advance(10s);
  h.take(h.core.reset(2));
  EXPECT_FALSE(h.core.stalled());
  EXPECT_EQ(h.core.books().used(), 0);
  auto again = h.plan();
  ASSERT_TRUE(again);
  EXPECT_EQ(again->seqs.at(0).start, 0) << "its KV is gone: it recomputes";
  EXPECT_EQ(again->seqs.at(0).tokens.size(), 7u) << "prompt and the token it already had";
  EXPECT_EQ(again->seqs.at(0).draws, 1u) << "the sampler continues where it was";
  EXPECT_GT(again->seqs.at(0).seq, p->seqs.at(0).seq) << "a new KV sequence on the new stages";
  h.answer(*again);
  auto last = h.plan();
  ASSERT_TRUE(last);
  h.answer(*last);
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].preemptions, 1) << "the reset counts as a preemption";
}

TEST(SchedulerCore, AStallPastTheLimitFailsEveryRequest) {
  auto o = small_options();
  o.stall_limit = 5s;
  harness h(o);
  ASSERT_TRUE(h.submit(1, 4, 3));
  ASSERT_TRUE(h.submit(2, 4, 3));
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.take(h.core.step_failed(p->step, step_failure::peer_lost, "peer lost"));
  ASSERT_TRUE(h.core.next_wakeup());
  EXPECT_EQ(*h.core.next_wakeup() - h.clk.now(), std::chrono::milliseconds(5000));
  h.clk.advance(4999ms);
  h.take(h.core.tick());
  EXPECT_TRUE(h.done().empty());
  h.clk.advance(1ms);
  h.take(h.core.tick());
  ASSERT_EQ(h.done().size(), 2u);
  for (const auto& d : h.done()) {
    EXPECT_EQ(d.reason, finish_reason::error);
    EXPECT_EQ(d.code, error_code::peer_lost);
    EXPECT_NE(d.error.find("within 5 s"), std::string::npos) << d.error;
  }
  EXPECT_TRUE(h.submit(3, 4, 3)) << "new requests are taken again";
}

// A step failed with a lost peer, but no reset comes: every process is
// alive and a transfer was lost. After stall_retry the failed step's
// requests free their KV on the stages and recompute there.
TEST(SchedulerCore, AStallThatNoResetEndsIsRetriedOnTheSameStages) {
  harness h;
  ASSERT_TRUE(h.submit(1, 6, 3));
  ASSERT_TRUE(h.submit(2, 5, 3));
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.answer(*p);
  auto q = h.plan();
  ASSERT_TRUE(q);
  ASSERT_EQ(q->seqs.size(), 2u);
  h.take(h.core.step_failed(q->step, step_failure::peer_lost, "activations: transfer failed"));
  EXPECT_TRUE(h.core.stalled());
  ASSERT_TRUE(h.core.next_wakeup());
  EXPECT_EQ(*h.core.next_wakeup() - h.clk.now(), std::chrono::milliseconds(5000));
  h.clk.advance(4999ms);
  h.take(h.core.tick());
  EXPECT_TRUE(h.core.stalled()) << "a reset may still come";
  EXPECT_EQ(h.released_blocks(), 0);
  h.clk.advance(1ms);
  h.take(h.core.tick());
  EXPECT_FALSE(h.core.stalled());
  EXPECT_TRUE(h.done().empty()) << "nothing fails";
  std::vector<std::int64_t> freed;
  for (const auto& e : h.events)
    if (auto* x = std::get_if<kv_release>(&e)) freed.push_back(x->seq);
  std::sort(freed.begin(), freed.end());
  std::vector<std::int64_t> old{q->seqs[0].seq, q->seqs[1].seq};
  std::sort(old.begin(), old.end());
  EXPECT_EQ(freed, old) << "both sequences' KV is freed on every stage";
  h.confirm_frees();
  auto again = h.plan();
  ASSERT_TRUE(again);
  ASSERT_EQ(again->seqs.size(), 2u);
  for (const auto& s : again->seqs) {
    EXPECT_EQ(s.start, 0) << "it recomputes";
    EXPECT_EQ(s.draws, 1u) << "the sampler continues where it was";
  }
  h.answer(*again);
  while (auto n = h.plan()) h.answer(*n);
  ASSERT_EQ(h.done().size(), 2u);
  for (const auto& d : h.done()) {
    EXPECT_EQ(d.reason, finish_reason::length);
    EXPECT_EQ(d.tokens, (std::vector<std::int32_t>{42, 42, 42}));
    EXPECT_EQ(d.preemptions, 1);
  }
  h.confirm_frees();
  EXPECT_EQ(h.core.books().used(), 0) << "every block came back";
}

// Retries that fail again stall again; the limit counts from the first
// failure, so a link that stays broken still ends the requests.
TEST(SchedulerCore, RetriesThatFailAgainEndAtTheStallLimit) {
  auto o = small_options();
  o.stall_limit = 12s;
  harness h(o);
  ASSERT_TRUE(h.submit(1, 4, 3));
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.take(h.core.step_failed(p->step, step_failure::peer_lost, "transfer failed"));
  for (int retry = 0; retry < 2; ++retry) {
    h.clk.advance(5s);
    h.take(h.core.tick());
    auto q = h.plan();
    ASSERT_TRUE(q) << "retry " << retry;
    EXPECT_EQ(q->seqs.at(0).start, 0);
    h.take(h.core.step_failed(q->step, step_failure::peer_lost, "transfer failed"));
  }
  EXPECT_TRUE(h.done().empty());
  h.clk.advance(1999ms);
  h.take(h.core.tick());
  EXPECT_TRUE(h.done().empty());
  h.clk.advance(1ms);
  h.take(h.core.tick());
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].code, error_code::peer_lost);
  EXPECT_EQ(h.done()[0].preemptions, 2);
}

TEST(SchedulerCore, ARefusedStepEndsItsRequestsWithTheError) {
  harness h;
  ASSERT_TRUE(h.submit(1, 4, 3));
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.take(h.core.step_failed(p->step, step_failure::refused, "stage failed: out of memory"));
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::error);
  EXPECT_EQ(h.done()[0].error, "stage failed: out of memory");
  EXPECT_EQ(h.done()[0].code, error_code::stage_failed);
  EXPECT_FALSE(h.core.stalled());
}

TEST(SchedulerCore, AGivenUpPipelineFailsEverythingAndRefusesNewWork) {
  harness h;
  ASSERT_TRUE(h.submit(1, 4, 3));
  ASSERT_TRUE(h.submit(2, 4, 3));
  ASSERT_TRUE(h.plan());
  h.take(h.core.reset(0));
  ASSERT_EQ(h.done().size(), 2u);
  auto later = h.submit(3, 4, 3);
  ASSERT_FALSE(later);
  EXPECT_EQ(later.error().code, error_code::stage_failed);
}

TEST(SchedulerCore, AFailureEndsARequestWithItsCodeWhenItsStepReturns) {
  harness h;
  ASSERT_TRUE(h.submit(1, 4, 3));
  ASSERT_TRUE(h.submit(2, 4, 3));
  auto p = h.plan();
  ASSERT_TRUE(p);
  ASSERT_TRUE(h.submit(3, 4, 3));
  h.take(h.core.fail(3, error_code::invalid_request, "image 1: not a PNG or JPEG"));
  ASSERT_EQ(h.done().size(), 1u) << "not in flight: at once";
  EXPECT_EQ(h.done()[0].code, error_code::invalid_request);
  EXPECT_TRUE(h.core.fail(1, error_code::internal, "image rows").empty()) << "in flight: later";
  h.answer(*p);
  ASSERT_EQ(h.done().size(), 2u);
  EXPECT_EQ(h.done()[1].id, 1u);
  EXPECT_EQ(h.done()[1].reason, finish_reason::error);
  EXPECT_EQ(h.done()[1].error, "image rows");
  EXPECT_TRUE(h.done()[1].tokens.empty()) << "its step's token is not streamed";
  EXPECT_TRUE(h.core.knows(2));
}

TEST(SchedulerCore, OutputThatDoesNotMatchTheStepFailsItsRequests) {
  harness h;
  ASSERT_TRUE(h.submit(1, 4, 3));
  auto p = h.plan();
  ASSERT_TRUE(p);
  step_result r;
  r.sampled = {{500}};  // outside the vocabulary
  h.take(h.core.step_done(p->step, r));
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::error);
}

TEST(SchedulerCore, StopTokensEndTheRequestAndTimesComeFromTheClock) {
  harness h;
  ASSERT_TRUE(h.core.submit(1, [] {
    request_spec s;
    s.tokens = {10, 11, 12};
    s.params.max_tokens = 10;
    s.params.stop_token_ids = {77};
    return std::expected<request_spec, core_error>(s);
  }));
  h.clk.advance(5ms);
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.clk.advance(20ms);
  h.answer(*p, 50);
  auto q = h.plan();
  ASSERT_TRUE(q);
  h.clk.advance(10ms);
  h.answer(*q, 77);
  ASSERT_EQ(h.done().size(), 1u);
  const auto d = h.done()[0];
  EXPECT_EQ(d.reason, finish_reason::stop);
  EXPECT_EQ(d.tokens, (std::vector<std::int32_t>{50, 77}));
  EXPECT_DOUBLE_EQ(d.queue_ms, 5.0);
  EXPECT_DOUBLE_EQ(d.ttft_ms, 25.0);
  EXPECT_DOUBLE_EQ(d.total_ms, 35.0);
  const auto s = h.core.stats();
  EXPECT_DOUBLE_EQ(s.round_trip_ms, 30.0);
  EXPECT_DOUBLE_EQ(s.in_flight_ms, 30.0);
  EXPECT_EQ(s.tokens_out, 2);
}

// Logprobs from the last stage reach the client with their tokens, and
// only for tokens kept (none past a stop).
TEST(SchedulerCore, LogprobsTravelWithTheirTokens) {
  harness h;
  ASSERT_TRUE(h.submit(1, 4, 2));
  auto p = h.plan();
  ASSERT_TRUE(p);
  step_result r;
  for (const auto& s : p->seqs) {
    r.sampled.push_back(s.sample ? std::vector<std::int32_t>{42} : std::vector<std::int32_t>{});
    models::token_logprob lp;
    lp.token = 42;
    lp.logprob = -0.5f;
    r.logprobs.push_back(s.sample ? std::vector<models::token_logprob>{lp}
                                  : std::vector<models::token_logprob>{});
  }
  h.take(h.core.step_done(p->step, r));
  std::vector<models::token_logprob> seen;
  for (const auto& e : h.events)
    if (auto* t = std::get_if<tokens_out>(&e))
      for (const auto& lp : t->logprobs) seen.push_back(lp);
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_FLOAT_EQ(seen[0].logprob, -0.5f);
  // A step whose logprobs do not match its tokens is the stage's error.
  auto q = h.plan();
  ASSERT_TRUE(q);
  step_result bad;
  for (const auto& s : q->seqs) {
    bad.sampled.push_back(s.sample ? std::vector<std::int32_t>{7} : std::vector<std::int32_t>{});
    bad.logprobs.push_back(std::vector<models::token_logprob>(3));
  }
  h.take(h.core.step_done(q->step, bad));
  ASSERT_EQ(h.done().size(), 1u);
  EXPECT_EQ(h.done()[0].reason, finish_reason::error);
}

}  // namespace
}  // namespace troupe::actors::core

// -- prefix caching ------------------------------------------------------------------------------

namespace troupe::actors::core {
namespace {

scheduler_options caching_options() {
  auto o = small_options();
  o.prefix_caching = true;
  o.cache_namespace = "test-model";
  return o;
}

std::vector<std::int32_t> ramp(std::int32_t from, std::size_t n) {
  std::vector<std::int32_t> t(n);
  std::iota(t.begin(), t.end(), from);
  return t;
}

/// The first step that carries request `id`, planned and answered until
/// it comes (other requests' steps are answered on the way).
std::optional<planned_seq> first_step_of(harness& h, std::uint64_t id) {
  for (int i = 0; i < 1000; ++i) {
    auto p = h.plan();
    if (!p) return std::nullopt;
    std::optional<planned_seq> found;
    for (const auto& s : p->seqs)
      if (s.id == id) found = s;
    h.answer(*p);
    if (found) return found;
  }
  return std::nullopt;
}

// A request whose prompt starts with the full blocks of one that ran takes
// them: its first step starts after them, names its whole table (the cached
// ids first) and the counters say so. All but the last prompt token may
// come from the cache (its logits are needed).
TEST(PrefixCache, ASecondRequestTakesTheFirstOnesFullBlocks) {
  harness h(caching_options());
  const auto prompt = ramp(10, 18);  // blocks of 4: four full, two tokens over
  ASSERT_TRUE(h.submit_tokens(1, prompt, 3));
  auto first = first_step_of(h, 1);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->start, 0);
  EXPECT_EQ(first->blocks_from, 0);
  ASSERT_EQ(first->blocks.size(), 5u);  // 18 tokens
  ASSERT_TRUE(run_to_end(h, 1));
  auto ext = prompt;
  for (std::int32_t t : {90, 91, 92, 93, 94}) ext.push_back(t);
  ASSERT_TRUE(h.submit_tokens(2, ext, 2));
  auto second = first_step_of(h, 2);
  ASSERT_TRUE(second);
  EXPECT_EQ(second->start, 16) << "four full blocks of 4 came from the cache";
  EXPECT_EQ(second->tokens, std::vector<std::int32_t>(ext.begin() + 16, ext.end()));
  EXPECT_EQ(second->blocks_from, 0);
  ASSERT_EQ(second->blocks.size(), 6u);  // 23 tokens
  EXPECT_TRUE(std::equal(first->blocks.begin(), first->blocks.begin() + 4, second->blocks.begin()))
      << "the same block ids";
  EXPECT_NE(second->blocks[4], first->blocks[4]) << "the partial block is not shared";
  auto d = run_to_end(h, 2);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->cached_tokens, 16);
  const auto st = h.core.stats();
  EXPECT_EQ(st.prefix_queries, 18 + 23);
  EXPECT_EQ(st.prefix_hits, 16);
  // The same prompt again: everything but its last token's block.
  ASSERT_TRUE(h.submit_tokens(3, prompt, 1));
  auto third = first_step_of(h, 3);
  ASSERT_TRUE(third);
  EXPECT_EQ(third->start, 16);
  // A prompt of exactly four blocks: three come from the cache, the last
  // is computed again for its logits.
  ASSERT_TRUE(h.submit_tokens(4, ramp(10, 16), 1));
  auto fourth = first_step_of(h, 4);
  ASSERT_TRUE(fourth);
  EXPECT_EQ(fourth->start, 12);
}

// No false hits: the same tokens under another salt, with another image in
// the same place, or under another model namespace share nothing; the same
// image does.
TEST(PrefixCache, ADifferentSaltImageOrNamespaceNeverHits) {
  const auto img = std::int32_t{7};  // the model's image token; 3 rows per image
  std::vector<std::int32_t> prompt = {10, 11, img, img, img, 12, 13, 14, 15, 16, 17, 18};
  const auto a = sha256("image a"), b = sha256("image b");
  harness h(caching_options(), 1, img);
  auto run = [&](std::uint64_t id, std::string salt, block_hash image) -> std::int64_t {
    EXPECT_TRUE(h.submit_tokens(id, prompt, 1, salt, {image}));
    h.core.image_ready(id);
    auto d = run_to_end(h, id);
    EXPECT_TRUE(d);
    return d ? d->cached_tokens : -1;
  };
  EXPECT_EQ(run(1, "", a), 0);
  EXPECT_EQ(run(2, "", a), 8) << "the same image: two full blocks of the 12 tokens";
  EXPECT_EQ(run(3, "", b), 0) << "another image in the first block";
  EXPECT_EQ(run(4, "tenant-2", a), 0) << "another salt";
  EXPECT_EQ(run(5, "tenant-2", a), 8) << "the same salt again";

  auto other = caching_options();
  other.cache_namespace = "test-model;weights=q8_0";
  harness g(other, 1, img);
  // Same tokens and image, another namespace: the names differ.
  block_chain x(root_hash("test-model", ""), 4, img, 3, {a});
  block_chain y(root_hash("test-model;weights=q8_0", ""), 4, img, 3, {a});
  x.extend(prompt);
  y.extend(prompt);
  ASSERT_EQ(x.hashes().size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_NE(x.hashes()[i], y.hashes()[i]);
}

// Under a pool too small for everything, cached blocks nobody holds count
// as free: admission keeps going, evicting the least recently used, and a
// request never gets blocks another one still holds.
TEST(PrefixCache, EvictionUnderPressureKeepsAdmissionWorking) {
  auto o = caching_options();
  o.kv_blocks = 12;  // 48 tokens
  harness h(o);
  for (std::uint64_t id = 1; id <= 12; ++id) {
    // Distinct prompts of 24 tokens: 6 blocks each, 5 of them full and named.
    ASSERT_TRUE(h.submit_tokens(id, ramp(static_cast<std::int32_t>(20 * id), 24), 2));
    auto d = run_to_end(h, id);
    ASSERT_TRUE(d) << id;
    EXPECT_EQ(d->reason, finish_reason::length) << id;
    EXPECT_LE(h.core.books().used(), 0) << "nothing held once it ended";
  }
  const auto st = h.core.stats();
  EXPECT_GT(st.kv_evictions, 0);
  EXPECT_LE(st.kv_cached_blocks, 12);
  EXPECT_EQ(st.kv_cached_blocks, st.kv_cached_free);
  // The last prompt is still cached (most recently used).
  ASSERT_TRUE(h.submit_tokens(20, ramp(20 * 12, 24), 1));
  auto d = run_to_end(h, 20);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->cached_tokens, 20);
  // Two requests at once over a pool that holds 12 blocks: the tables
  // never share an id unless it is a named prefix block.
  ASSERT_TRUE(h.submit_tokens(21, ramp(300, 20), 4));
  ASSERT_TRUE(h.submit_tokens(22, ramp(330, 20), 4));
  auto p = h.plan();
  ASSERT_TRUE(p);
  ASSERT_EQ(p->seqs.size(), 2u);
  for (auto x : p->seqs[0].blocks)
    EXPECT_EQ(std::count(p->seqs[1].blocks.begin(), p->seqs[1].blocks.end(), x), 0) << x;
}

// Generated tokens' blocks are named too (a multi-turn chat's next prompt
// repeats the answer), and a preempted request takes its own blocks back.
TEST(PrefixCache, GeneratedBlocksAreCachedAndAPreemptedRequestReusesItsOwn) {
  harness h(caching_options());
  ASSERT_TRUE(h.submit_tokens(1, ramp(10, 6), 6));  // answers 42 x 6
  auto d = run_to_end(h, 1);
  ASSERT_TRUE(d);
  ASSERT_EQ(d->tokens.size(), 6u);
  auto next = ramp(10, 6);
  next.insert(next.end(), d->tokens.begin(), d->tokens.end());  // 12 tokens
  next.push_back(99);
  ASSERT_TRUE(h.submit_tokens(2, next, 1));
  auto again = run_to_end(h, 2);
  ASSERT_TRUE(again);
  // 11 tokens of request 1 are in the KV (its last sampled token never
  // went through the model): two full blocks.
  EXPECT_EQ(again->cached_tokens, 8);
}

// The books and a stage's cache agree on every id: the stage's named
// tables, built from nothing but the steps' deltas, equal the books'.
TEST(PrefixCache, StepDeltasRebuildTheBooksTables) {
  auto o = caching_options();
  o.max_decode_steps = 4;
  o.multi_step_ms = 100;
  harness h(o);
  std::map<std::int64_t, std::vector<std::int32_t>> tables;
  for (std::uint64_t id = 1; id <= 6; ++id)
    ASSERT_TRUE(h.submit_tokens(id, ramp(10 + static_cast<std::int32_t>(id % 2), 9 + id), 7));
  for (int i = 0; i < 200 && h.done().size() < 6; ++i) {
    auto p = h.plan();
    ASSERT_TRUE(p);
    step_result r;
    r.compute_ms = 1;
    r.passes = p->decode_steps;
    for (const auto& s : p->seqs) {
      if (s.blocks_from >= 0) {
        auto& t = tables[s.seq];
        ASSERT_LE(static_cast<std::size_t>(s.blocks_from), t.size());
        t.resize(static_cast<std::size_t>(s.blocks_from));
        t.insert(t.end(), s.blocks.begin(), s.blocks.end());
      }
      const auto have = h.core.books().table(s.seq);
      EXPECT_EQ(tables[s.seq], std::vector<std::int32_t>(have.begin(), have.end()))
          << "seq " << s.seq;
      r.sampled.push_back(
          s.sample ? std::vector<std::int32_t>(
                         static_cast<std::size_t>(std::max<std::int64_t>(1, s.max_new)), 42)
                   : std::vector<std::int32_t>{});
    }
    h.take(h.core.step_done(p->step, r));
  }
  EXPECT_EQ(h.done().size(), 6u);
}

// -- KV tiers ------------------------------------------------------------------------------------

/// What the stages would hold, built from nothing but the steps: every
/// device block, host and disk slot as the tokens in its positions. It
/// carries out each step's moves, takes its table deltas and writes its
/// tokens, and checks that every position a step says is in the KV (before
/// `start`) holds the request's token there: a block the books sent to the
/// wrong place, or brought back into the wrong one, fails it.
struct simulated_stage {
  int B = 4;
  // device, host, disk and the remote store (which outlives the stage)
  std::map<std::int32_t, std::vector<std::int32_t>> tier[4];
  std::map<std::int32_t, block_hash> remote_name;
  std::map<std::int64_t, std::vector<std::int32_t>> tables;
  std::map<std::uint64_t, std::vector<std::int32_t>>* tokens = nullptr;  // per request
  std::int64_t checked = 0;
  /// Copies the remote store took in the last step: what it confirms.
  std::vector<std::pair<std::int32_t, block_hash>> stored;

  /// The node died: a new stage holds nothing; the remote store keeps all.
  void replace() {
    for (int t = 0; t < 3; ++t) tier[t].clear();
    tables.clear();
  }

  void run(const step_plan& p) {
    stored.clear();
    for (const auto& m : p.moves) {
      ASSERT_LT(m.from, 4);
      ASSERT_LT(m.to, 4);
      ASSERT_TRUE(tier[m.from].count(m.from_index))
          << "a move out of tier " << int(m.from) << " slot " << m.from_index << ", never written";
      if (m.from == 3) {
        ASSERT_EQ(remote_name.at(m.from_index), m.name) << "remote slot " << m.from_index;
      }
      tier[m.to][m.to_index] = tier[m.from][m.from_index];
      if (m.to == 3) {
        remote_name[m.to_index] = m.name;
        stored.emplace_back(m.to_index, m.name);
      }
    }
    for (const auto& s : p.seqs) {
      auto& t = tables[s.seq];
      if (s.blocks_from >= 0) {
        ASSERT_LE(static_cast<std::size_t>(s.blocks_from), t.size());
        t.resize(static_cast<std::size_t>(s.blocks_from));
        t.insert(t.end(), s.blocks.begin(), s.blocks.end());
      }
      const auto& want = (*tokens)[s.id];
      for (std::int64_t pos = 0; pos < s.start; ++pos) {
        const auto id = t.at(static_cast<std::size_t>(pos / B));
        ASSERT_TRUE(tier[0].count(id)) << "position " << pos << " of request " << s.id;
        ASSERT_EQ(tier[0][id][static_cast<std::size_t>(pos % B)],
                  want[static_cast<std::size_t>(pos)])
            << "request " << s.id << " position " << pos << " (block " << id << ")";
        ++checked;
      }
      for (std::size_t k = 0; k < s.tokens.size(); ++k) {
        const auto pos = s.start + static_cast<std::int64_t>(k);
        const auto id = t.at(static_cast<std::size_t>(pos / B));
        auto& blk = tier[0][id];
        blk.resize(static_cast<std::size_t>(B), -1);
        blk[static_cast<std::size_t>(pos % B)] = s.tokens[k];
      }
    }
  }
};

struct tier_run {
  scheduler_stats stats;
  std::map<std::uint64_t, std::vector<std::int32_t>> answers;
  std::int64_t checked = 0;
};

/// The last stage's answer to a step: each sampling request's next token
/// depends on its whole history (so a wrong restore changes the answers),
/// appended to `tokens`.
step_result sample_from_history(const step_plan& p,
                                std::map<std::uint64_t, std::vector<std::int32_t>>& tokens) {
  step_result r;
  for (const auto& s : p.seqs) {
    if (!s.sample) {
      r.sampled.emplace_back();
      continue;
    }
    std::int64_t x = static_cast<std::int64_t>(s.id);
    for (auto v : tokens[s.id]) x = (x * 31 + v) % 1000003;
    const auto next = static_cast<std::int32_t>(10 + x % 300);
    r.sampled.push_back({next});
    tokens[s.id].push_back(next);
  }
  return r;
}

/// The run's figures and answers, every request finished by its length.
tier_run collect(harness& h, const simulated_stage& sim, std::uint64_t requests) {
  tier_run out;
  out.stats = h.core.stats();
  out.checked = sim.checked;
  for (const auto& d : h.done()) {
    EXPECT_EQ(d.reason, finish_reason::length) << d.id << " " << d.error;
    out.answers[d.id] = d.tokens;
  }
  EXPECT_EQ(out.answers.size(), requests);
  return out;
}

/// Six requests of distinct prompts over a pool that holds about two of
/// them: preemptions all along. Each answer token depends on the request's
/// whole history, so a wrong restore would also change the answers.
tier_run run_under_pressure(std::int64_t host_blocks, std::int64_t disk_blocks,
                            std::int64_t kv_blocks = 12, std::uint64_t requests = 6,
                            std::int64_t max_tokens = 13) {
  auto o = caching_options();
  o.kv_blocks = kv_blocks;
  o.host_blocks = host_blocks;
  o.disk_blocks = disk_blocks;
  harness h(o);
  std::map<std::uint64_t, std::vector<std::int32_t>> tokens;
  simulated_stage sim;
  sim.tokens = &tokens;
  for (std::uint64_t id = 1; id <= requests; ++id) {
    auto prompt = ramp(static_cast<std::int32_t>(30 * id), 10 + id);
    tokens[id] = prompt;
    EXPECT_TRUE(h.submit_tokens(id, prompt, max_tokens));
  }
  for (int i = 0; i < 5000 && h.done().size() < requests; ++i) {
    auto p = h.plan();
    if (!p) {
      ADD_FAILURE() << "no step planned with " << h.done().size() << " done, running "
                    << h.core.running() << ", queued " << h.core.queued() << ", used "
                    << h.core.books().used() << " of " << h.core.books().total();
      break;
    }
    sim.run(*p);
    if (::testing::Test::HasFatalFailure()) break;
    h.take(h.core.step_done(p->step, sample_from_history(*p, tokens)));
  }
  return collect(h, sim, requests);
}

// The target of issue 27: under a KV pool too small for the load, with a
// host tier, preempted requests resume without recomputing a token (their
// full blocks and their partly filled last one come back from the tier),
// and every token any step reads back is the right one.
TEST(KvTiers, PreemptionWithAHostTierRecomputesNothing) {
  const auto none = run_under_pressure(0, 0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_GT(none.stats.preemptions, 0);
  EXPECT_GT(none.stats.recomputed_tokens, 0) << "without a tier, preemption recomputes";
  const auto host = run_under_pressure(256, 0);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_GT(host.stats.preemptions, 0);
  EXPECT_EQ(host.stats.recomputed_tokens, 0);
  EXPECT_GT(host.stats.restored_tokens, 0);
  EXPECT_GT(host.stats.kv_to_host, 0);
  EXPECT_GT(host.stats.kv_from_host, 0);
  EXPECT_GT(host.checked, none.checked) << "restored positions are read back and checked";
  EXPECT_EQ(host.answers, none.answers);
  // Longer answers: requests are preempted again after they took their
  // partly filled block back (and filled it), which must be named anew.
  const auto twice = run_under_pressure(256, 0, 16, 8, 40);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_GT(twice.stats.preemptions, 8);
  EXPECT_EQ(twice.stats.recomputed_tokens, 0);
}

/// Eight requests decoding past their prompts; at step `reset_at` the node
/// holding the stage dies and a new one replaces it (a pipeline reset).
/// With a remote tier, every full block was copied to a store that
/// outlives the node and confirmed once there.
tier_run run_with_node_loss(std::int64_t remote_blocks, int reset_at) {
  auto o = caching_options();
  o.kv_blocks = 256;
  o.remote_blocks = remote_blocks;
  harness h(o);
  std::map<std::uint64_t, std::vector<std::int32_t>> tokens;
  simulated_stage sim;
  sim.tokens = &tokens;
  constexpr std::uint64_t requests = 8;
  for (std::uint64_t id = 1; id <= requests; ++id) {
    auto prompt = ramp(static_cast<std::int32_t>(40 * id), 17 + id);
    tokens[id] = prompt;
    EXPECT_TRUE(h.submit_tokens(id, prompt, 30));
  }
  for (int i = 0; i < 5000 && h.done().size() < requests; ++i) {
    if (i == reset_at) {
      sim.replace();
      h.take(h.core.reset(1));
    }
    auto p = h.plan();
    if (!p) {
      ADD_FAILURE() << "no step planned";
      break;
    }
    sim.run(*p);
    if (::testing::Test::HasFatalFailure()) break;
    h.take(h.core.step_done(p->step, sample_from_history(*p, tokens)));
    // The store confirms what arrived (after the step: asynchronously).
    h.core.remote_stored(sim.stored);
  }
  return collect(h, sim, requests);
}

// The failover target of issue 27: after a node loss, each request takes
// its full blocks back from the remote store and recomputes at most its
// last block and its partly filled one; every position read back holds the
// right token and the answers are those of a run without the loss.
TEST(KvTiers, ANodeLossRestoresFullBlocksFromTheRemoteStore) {
  const auto clean = run_with_node_loss(0, -1);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const auto recompute = run_with_node_loss(0, 20);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_EQ(recompute.answers, clean.answers);
  EXPECT_EQ(recompute.stats.restored_tokens, 0);
  EXPECT_GT(recompute.stats.recomputed_tokens, 8 * 20) << "everything recomputed";
  const auto restore = run_with_node_loss(1024, 20);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_EQ(restore.answers, clean.answers);
  EXPECT_GT(restore.stats.kv_to_remote, 0);
  EXPECT_GT(restore.stats.kv_from_remote, 0);
  EXPECT_EQ(restore.stats.kv_remote_pending, 0);
  EXPECT_EQ(restore.stats.recomputed_tokens + restore.stats.restored_tokens,
            recompute.stats.recomputed_tokens)
      << "the same tokens were lost";
  EXPECT_GT(restore.stats.restored_tokens, 0);
  // At most the partly filled block per request (block size 4): the last
  // full block was confirmed one step after it filled, before the loss.
  EXPECT_LE(restore.stats.recomputed_tokens, 8 * 4);
  EXPECT_GT(restore.checked, recompute.checked - recompute.stats.recomputed_tokens)
      << "restored positions are read back and checked";
  // A remote tier of two blocks: its least recent copies make room; a
  // late confirmation of one is ignored; what is left restores correctly.
  const auto tight = run_with_node_loss(2, 20);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_EQ(tight.answers, clean.answers);
  EXPECT_LE(tight.stats.kv_remote_used, 2);
  EXPECT_GT(tight.stats.recomputed_tokens, restore.stats.recomputed_tokens);
}

// A host tier of two blocks spills to disk (least recently used first);
// a disk tier alone takes the device's evictions directly. Either way
// nothing is recomputed, and with neither big enough blocks are dropped
// and recomputed, still correctly.
TEST(KvTiers, HostSpillsToDiskAndDiskAloneWorks) {
  const auto ref = run_under_pressure(0, 0);
  const auto spill = run_under_pressure(2, 256);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_GT(spill.stats.kv_to_disk, 0);
  EXPECT_GT(spill.stats.kv_from_disk, 0);
  EXPECT_EQ(spill.stats.recomputed_tokens, 0);
  EXPECT_EQ(spill.answers, ref.answers);
  const auto disk = run_under_pressure(0, 256);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_EQ(disk.stats.kv_to_host, 0);
  EXPECT_GT(disk.stats.kv_from_disk, 0);
  EXPECT_EQ(disk.stats.recomputed_tokens, 0);
  EXPECT_EQ(disk.answers, ref.answers);
  const auto small = run_under_pressure(2, 2);
  ASSERT_FALSE(::testing::Test::HasFailure());
  EXPECT_GT(small.stats.kv_dropped, 0);
  EXPECT_EQ(small.answers, ref.answers);
}

// A prefix evicted from the device comes back from the host tier for a new
// request (not only for the one preempted), and an admin reset forgets the
// tiers too.
TEST(KvTiers, AnEvictedPrefixComesBackFromTheHostTier) {
  auto o = caching_options();
  o.kv_blocks = 8;  // 32 tokens
  o.host_blocks = 64;
  harness h(o);
  const auto system = ramp(100, 20);  // five full blocks
  ASSERT_TRUE(h.submit_tokens(1, system, 1));
  ASSERT_TRUE(run_to_end(h, 1));
  for (std::uint64_t id = 2; id <= 4; ++id) {  // push it out of the device
    ASSERT_TRUE(h.submit_tokens(id, ramp(static_cast<std::int32_t>(200 + 40 * id), 24), 1));
    ASSERT_TRUE(run_to_end(h, id));
  }
  EXPECT_GT(h.core.stats().kv_to_host, 0);
  auto ext = system;
  ext.push_back(7);
  ASSERT_TRUE(h.submit_tokens(5, ext, 1));
  auto d = run_to_end(h, 5);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->cached_tokens, 20);
  EXPECT_GT(h.core.stats().kv_from_host, 0);
  h.core.reset_prefix_cache();
  EXPECT_EQ(h.core.stats().kv_host_used, 0);
  ASSERT_TRUE(h.submit_tokens(6, ext, 1));
  auto e = run_to_end(h, 6);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->cached_tokens, 0);
}

// Block events: an index that follows nothing but the events knows, after
// every step, exactly the blocks the books name and in which tier, through
// evictions to host and disk, promotions, preemptions and an admin reset;
// and it answers a prompt's cached prefix as the books do.
TEST(KvTiers, BlockEventsKeepAnOutsideIndexExact) {
  auto o = caching_options();
  o.kv_blocks = 12;
  o.host_blocks = 4;
  o.disk_blocks = 64;
  harness h(o);
  block_index index;
  auto follow = [&] {
    bool overflowed = false;
    for (const auto& e : h.core.take_block_events(&overflowed)) index.apply(e);
    ASSERT_FALSE(overflowed);
    auto want = h.core.books().contents();
    ASSERT_EQ(index.size(), static_cast<std::int64_t>(want.size()));
    for (const auto& [name, tier] : want) {
      auto got = index.find(name);
      ASSERT_TRUE(got) << to_hex(name);
      EXPECT_EQ(*got, tier) << to_hex(name);
    }
  };
  for (std::uint64_t id = 1; id <= 8; ++id)
    ASSERT_TRUE(h.submit_tokens(id, ramp(static_cast<std::int32_t>(7 * id), 9 + id), 12));
  for (int i = 0; i < 2000 && h.done().size() < 8; ++i) {
    auto p = h.plan();
    ASSERT_TRUE(p);
    h.answer(*p, static_cast<std::int32_t>(40 + i % 50));
    follow();
    if (HasFatalFailure()) return;
  }
  ASSERT_EQ(h.done().size(), 8u);
  const auto st = h.core.stats();
  EXPECT_GT(st.kv_to_host, 0);
  EXPECT_GT(st.kv_to_disk, 0);
  EXPECT_GT(index.count(models::kv_tier::disk), 0);
  // The index answers a prefix lookup as the books do.
  block_chain chain(root_hash("test-model", ""), 4, -1, 0, {});
  chain.extend(ramp(7 * 8, 17));
  EXPECT_EQ(index.cached_prefix(chain.hashes()), h.core.books().cached_prefix(chain.hashes()));
  EXPECT_GT(index.cached_prefix(chain.hashes()), 0);
  h.core.reset_prefix_cache();
  follow();
  EXPECT_EQ(index.size(), 0);
}
// -- priorities -----------------------------------------------------------------------------------

/// Submits a request of `prompt` tokens with a priority.
void submit_with_priority(harness& h, std::uint64_t id, std::int32_t priority,
                          std::int64_t prompt = 6, std::int64_t max_tokens = 4) {
  auto r = h.core.submit(id, [&]() -> std::expected<request_spec, core_error> {
    request_spec q;
    q.tokens = ramp(static_cast<std::int32_t>(10 + id), static_cast<std::size_t>(prompt));
    q.params.max_tokens = max_tokens;
    q.priority = priority;
    return q;
  });
  ASSERT_TRUE(r) << r.error().message;
}

/// Runs steps (10 ms each) until `ids` have all sampled a first token, or
/// `limit` steps; the step each got its first token in (-1: none).
std::map<std::uint64_t, int> first_token_steps(harness& h, const std::vector<std::uint64_t>& ids,
                                               int limit) {
  std::map<std::uint64_t, int> first;
  for (auto id : ids) first[id] = -1;
  for (int step = 0; step < limit; ++step) {
    auto p = h.plan();
    if (!p) break;
    for (const auto& q : p->seqs)
      if (q.sample && first.count(q.id) && first[q.id] < 0) first[q.id] = step;
    h.clk.advance(10ms);
    h.answer(*p);
    if (std::all_of(first.begin(), first.end(), [](const auto& f) { return f.second >= 0; })) break;
  }
  return first;
}

// Admission takes the waiting request of the lowest priority value, first
// come first within one.
TEST(Priority, AdmissionTakesTheLowestValueFirstAndFirstComeWithinOne) {
  auto o = small_options();
  o.max_running = 1;
  harness h(o);
  submit_with_priority(h, 1, -10);  // running first; nobody outranks it
  for (auto [id, p] : {std::pair{2, 5}, {3, 1}, {4, 1}, {5, -3}, {6, 5}})
    submit_with_priority(h, static_cast<std::uint64_t>(id), p, 6, 1);
  std::vector<std::uint64_t> order;
  for (int i = 0; i < 100 && h.done().size() < 6; ++i) {
    auto p = h.plan();
    ASSERT_TRUE(p);
    for (const auto& q : p->seqs)
      if (order.empty() || order.back() != q.id) order.push_back(q.id);
    h.answer(*p);
  }
  EXPECT_EQ(order, (std::vector<std::uint64_t>{1, 5, 3, 4, 2, 6}));
  EXPECT_EQ(h.core.stats().preemptions, 0);
}

// A waiting request of a lower value preempts a running one of a higher
// value when the running cap keeps it out; the preempted one resumes
// (ahead of its equals) and every answer has its length.
TEST(Priority, AMoreUrgentRequestPreemptsTheLeastUrgentRunningOne) {
  auto o = small_options();
  o.max_running = 2;
  harness h(o);
  submit_with_priority(h, 1, 10, 6, 12);
  submit_with_priority(h, 2, 10, 6, 12);
  submit_with_priority(h, 3, 20, 6, 12);  // waits: the cap
  for (int i = 0; i < 3; ++i) {
    auto p = h.plan();
    ASSERT_TRUE(p);
    h.answer(*p);
  }
  submit_with_priority(h, 4, 0, 6, 3);
  auto p = h.plan();
  ASSERT_TRUE(p);
  std::set<std::uint64_t> in;
  for (const auto& q : p->seqs) in.insert(q.id);
  EXPECT_TRUE(in.count(4)) << "the urgent request was not admitted";
  EXPECT_TRUE(in.count(1)) << "the older of the two was preempted";
  EXPECT_FALSE(in.count(2)) << "the youngest of the least urgent was not";
  EXPECT_EQ(h.core.stats().preemptions, 1);
  h.answer(*p);
  for (int i = 0; i < 200 && h.done().size() < 4; ++i) {
    auto q = h.plan();
    ASSERT_TRUE(q);
    h.answer(*q);
  }
  std::map<std::uint64_t, std::size_t> lengths;
  std::vector<std::uint64_t> finish_order;
  for (const auto& d : h.done()) {
    EXPECT_EQ(d.reason, finish_reason::length) << d.id;
    lengths[d.id] = d.tokens.size();
    finish_order.push_back(d.id);
  }
  EXPECT_EQ(lengths, (std::map<std::uint64_t, std::size_t>{{1, 12}, {2, 12}, {3, 12}, {4, 3}}));
  EXPECT_EQ(finish_order.front(), 4u);
  EXPECT_EQ(finish_order.back(), 3u)
      << "the preempted request resumes before a later equal-or-worse one";
}

// Out of KV blocks (naming books), a more urgent request takes the blocks
// of a less urgent running one instead of waiting for it to end.
TEST(Priority, AMoreUrgentRequestTakesKvFromALessUrgentOne) {
  auto o = caching_options();
  o.kv_blocks = 8;  // 32 tokens
  harness h(o);
  submit_with_priority(h, 1, 10, 20, 8);  // 28 tokens: 7 blocks
  auto p = h.plan();
  ASSERT_TRUE(p);
  h.answer(*p);
  submit_with_priority(h, 2, 0, 12, 2);  // needs 3 blocks, 1 is free
  bool admitted = false;
  for (int i = 0; i < 3 && !admitted; ++i) {
    auto q = h.plan();
    ASSERT_TRUE(q);
    for (const auto& s : q->seqs) admitted |= s.id == 2;
    h.answer(*q);
  }
  EXPECT_TRUE(admitted) << "the urgent request waited for the KV of a less urgent one";
  EXPECT_GE(h.core.stats().preemptions, 1);
  for (int i = 0; i < 200 && h.done().size() < 2; ++i) {
    auto q = h.plan();
    ASSERT_TRUE(q);
    h.answer(*q);
  }
  ASSERT_EQ(h.done().size(), 2u);
  EXPECT_EQ(h.done()[0].id, 2u);
  for (const auto& d : h.done()) EXPECT_EQ(d.reason, finish_reason::length) << d.id;
}

// Issue 28's test: with the queue full of low-priority requests (40 of
// them behind a running cap of 4), urgent requests keep the latency they
// have on an idle scheduler; without priorities they wait for the queue.
TEST(Priority, UrgentRequestsKeepTheirLatencyWhileTheQueueIsFullOfLowPriorityOnes) {
  auto run = [](bool loaded, std::int32_t urgent_priority) {
    auto o = small_options();
    o.max_running = 4;
    o.queue_limit = 64;
    o.kv_blocks = 256;
    harness h(o);
    if (loaded) {
      for (std::uint64_t id = 100; id < 140; ++id) submit_with_priority(h, id, 10, 8, 16);
      for (int i = 0; i < 5; ++i) {  // the first four are decoding
        auto p = h.plan();
        if (!p) break;
        h.clk.advance(10ms);
        h.answer(*p);
      }
    }
    std::vector<std::uint64_t> urgent;
    for (std::uint64_t id = 1; id <= 4; ++id) {
      submit_with_priority(h, id, urgent_priority, 8, 4);
      urgent.push_back(id);
    }
    auto first = first_token_steps(h, urgent, 2000);
    int worst = 0;
    for (const auto& [id, step] : first) {
      EXPECT_GE(step, 0) << "request " << id << " never got a token";
      worst = std::max(worst, step);
    }
    return worst;
  };
  const int idle = run(false, 0);
  const int with_priority = run(true, 0);
  const int without = run(true, 10);
  std::printf(
      "[ priority ] steps to the last urgent first token: idle %d, a queue of 40 "
      "low-priority requests: %d with priorities, %d without\n",
      idle, with_priority, without);
  EXPECT_LE(with_priority, idle + 1) << "the urgent requests lost their latency";
  EXPECT_GE(without, 10 * std::max(1, with_priority)) << "the load was not a queue";
}

}  // namespace
}  // namespace troupe::actors::core
