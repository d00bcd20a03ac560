#pragma once

// The scheduler's decisions as plain code (vLLM's schedule() ->
// SchedulerOutput / update_from_output()): which requests are admitted,
// what each pipeline step carries, what a step's output means for every
// request, when a request ends and why. No CAF, no threads, no timers:
// the time comes from the injected clock, and `next_wakeup` says when the
// core next needs a `tick`. The actor in actors/scheduler.cpp is its
// shell: it tokenizes, encodes images, sends the planned steps to the
// first stage, frees KV on the stores and streams the events to clients.
//
// A request moves encoding -> waiting -> running; a preempted one (out of
// KV blocks, or a pipeline reset) goes back to the front of the queue and
// recomputes its prompt and generated tokens when admitted again (the
// kernels are batch- and chunking-invariant, so its tokens do not change).

#include <chrono>
#include <cstdint>
#include <deque>
#include <expected>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "actors/core/block_hash.hpp"
#include "actors/core/clock.hpp"
#include "actors/core/errors.hpp"
#include "actors/core/kv_books.hpp"
#include "actors/core/scheduler_stats.hpp"
#include "models/context_length.hpp"
#include "models/kv_cache.hpp"
#include "models/sampling.hpp"
#include "models/tokenizer.hpp"

namespace troupe::actors::core {

/// What the scheduler knows of the model besides its stages.
struct model_frontend {
  std::shared_ptr<const models::tokenizer> tok;
  std::int64_t vocab = 0;
  std::int64_t hidden = 0;
  std::int32_t image_token = -1;  ///< -1: a text-only model
  std::int64_t tokens_per_image = 0;
  /// Prompt plus generated tokens a request may reach (the model's
  /// positions, or the operator's max_model_len); 0: no limit but the KV
  /// cache's.
  std::int64_t context_length = 0;
  /// The `<audio>` placeholder (-1: the model does not hear); a clip's
  /// positions are marked with image_token once expanded.
  std::int32_t audio_token = -1;
  /// The `<video>` placeholder (-1: the model takes no video); likewise.
  std::int32_t video_token = -1;
};

/// Admission and batching policy.
struct scheduler_options {
  std::int64_t queue_limit = 64;     ///< requests waiting for admission (encoding included)
  std::int64_t max_running = 64;     ///< sequences with KV at once
  std::int64_t token_budget = 512;   ///< tokens per micro-batch (prefill chunks + decode tokens)
  std::int64_t prefill_chunk = 512;  ///< prompt tokens per sequence per step
  /// A streamed audio clip that sends nothing for this long fails its
  /// request (the shell's timer; 0: never).
  std::int64_t stream_idle_ms = 30000;
  int micro_batches = 1;  ///< micro-batches in flight (the pipeline's depth); 0: one per stage,
                          ///< following re-placements
  /// With several micro-batches: size each to an even share of the work
  /// (tokens waiting plus in flight) instead of filling it to token_budget.
  bool balance_micro_batches = true;
  /// Multi-step decode (one stage only): a step of decode tokens alone runs
  /// up to this many passes on the shard, which samples and feeds the tokens
  /// back itself, so the round trip to the scheduler is paid once per step.
  /// 1 turns it off.
  int max_decode_steps = 16;
  /// ... as many passes as fit in this many milliseconds (by the measured
  /// time of a pass), so that a waiting request is admitted, and tokens reach
  /// the clients, at least this often. Long steps (a big model) get 1.
  double multi_step_ms = 2.0;
  /// The context length to serve (resolved into model_frontend's by
  /// whoever spawns the scheduler: the head, the local runtime).
  models::context_options context;
  models::kv_options kv;       ///< the stages' KV layout (block accounting)
  std::int64_t kv_blocks = 0;  ///< blocks per stage (the smallest stage's pool)
  /// How long a pipeline that lost a peer may wait for its restoration
  /// before its requests fail (counted from the first failed step).
  std::chrono::milliseconds stall_limit{60000};
  /// Ids of ended requests remembered to refuse a duplicate (a request
  /// still running is always known); the oldest are forgotten past this,
  /// so the scheduler's memory does not grow with every request served.
  std::size_t remembered_ids = 1 << 16;
  /// A stall that no reset ends within this long was a lost transfer, not
  /// a lost process (a lost node is declared in 2.5 s and its pipeline
  /// reset): the requests of the failed steps give their KV back and
  /// recompute on the same stages. A retry that fails again stalls again.
  std::chrono::milliseconds stall_retry{5000};
  /// Prefix caching (on by default, as in vLLM): full KV blocks are named
  /// and kept after their request ends; a request whose prompt starts with
  /// named blocks takes them and computes only the rest. The books then
  /// name every block id (kv_books). A sliding window turns it off (it
  /// drops the prompt's early blocks, which a later prompt would need).
  bool prefix_caching = true;
  /// What makes the same tokens give other KV: the model, its weight
  /// formats, the KV layout (the root of every block name).
  std::string cache_namespace;
  /// Lower KV tiers (prefix caching only), slots per stage: cached blocks
  /// evicted from the device go there instead of being lost, and a
  /// preempted request's blocks (its partly filled last one included) wait
  /// there, so that it resumes without recomputing.
  std::int64_t host_blocks = 0;
  std::int64_t disk_blocks = 0;
  std::int64_t kv_slot_bytes = 0;  ///< bytes of one block over every stage (counters)
  /// The remote tier (prefix caching only): slots of a KV store on another
  /// node that keeps a copy of every full block, so that a pipeline reset
  /// (a node lost) restores the blocks instead of recomputing them.
  std::int64_t remote_blocks = 0;
};

/// A request as the core takes it: the prompt already tokenized, with
/// every image's placeholder expanded to the image's rows.
struct request_spec {
  std::vector<std::int32_t> tokens;
  /// max_tokens 0: as many as the context length and the KV cache leave
  /// (OpenAI's chat default), decided at admission.
  models::sampling_params params;
  std::int64_t deadline_ms = 0;  ///< 0: none; else after submission
  std::int64_t images = 0;       ///< images being encoded: it waits for image_ready
  /// Constrained by a grammar: the shell sends each step's allowed tokens,
  /// so its steps sample one token at a time (no multi-step decode).
  bool guided = false;
  /// Tenants that must not share cached KV give different salts.
  std::string cache_salt;
  /// vLLM's priority: a lower value is served first. Admission takes the
  /// waiting request of the lowest value (first come first within one),
  /// and a waiting request may preempt a running one of a higher value.
  std::int32_t priority = 0;
  /// One content hash per image, in prompt order (their rows' KV is named
  /// by them); missing ones come with image_ready. A request whose images
  /// are not all named is not cached.
  std::vector<block_hash> image_hashes;
  /// Marker tokens of each media item (images and audio clips) in prompt
  /// order, when they differ: empty, every item is an image of
  /// model_frontend::tokens_per_image rows.
  std::vector<std::int64_t> media_rows;
  /// A request resumed on another head (a standby that took over): the
  /// tokens it had already generated, which its client has. They are taken
  /// as generated (the sampler's draws, penalties, stops and the text
  /// follow them), recomputed at admission like a preempted request's, and
  /// never emitted again: its events carry only the tokens after them.
  std::vector<std::int32_t> resumed;
  /// A clip streamed while the request runs (the last of its media):
  /// `tokens` end where its rows go and `tail` is the prompt after them.
  /// The request is admitted once its other media are encoded, prefills
  /// what it has, and grows as the clip's windows are encoded
  /// (extend_stream); it samples only after close_stream. Not cached.
  bool stream = false;
  std::vector<std::int32_t> tail;
};

/// One sequence's part of a planned step.
struct planned_seq {
  std::uint64_t id = 0;              ///< the request
  std::int64_t seq = 0;              ///< its KV sequence (the same on every stage)
  std::int64_t start = 0;            ///< tokens already in its KV cache
  std::vector<std::int32_t> tokens;  ///< the tokens this step puts through
  /// Image tokens before `start` (the image rows this chunk starts after);
  /// set only when `tokens` holds image tokens.
  std::int64_t image_rows_before = 0;
  bool sample = false;  ///< the last stage samples (the chunk ends the known tokens)
  models::sampling_params params;
  std::uint64_t draws = 0;            ///< the sampler's draw counter
  std::int64_t max_new = 0;           ///< tokens it may sample (more than 1: multi-step decode)
  std::vector<std::int64_t> history;  ///< prompt and generated ids; only with a penalty
  /// Naming books (prefix caching): the sequence's block table from entry
  /// `blocks_from` on is `blocks` (-1: unchanged). A new sequence gets its
  /// whole table, cached prefix blocks first (`start` then counts them).
  std::int32_t blocks_from = -1;
  std::vector<std::int32_t> blocks;
};

/// One micro-batch for the pipeline.
struct step_plan {
  std::uint64_t step = 0;
  std::vector<planned_seq> seqs;
  /// Block copies between KV tiers every stage carries out, in order,
  /// before it computes the step.
  std::vector<models::kv_move> moves;
  std::int32_t decode_steps = 1;  ///< multi-step decode passes (one stage only)
};

/// What came back from the last stage.
struct step_result {
  std::vector<std::vector<std::int32_t>> sampled;  ///< per planned sequence
  /// Per planned sequence, one per sampled token where logprobs were asked
  /// for (empty: none asked for in the step).
  std::vector<std::vector<models::token_logprob>> logprobs;
  double compute_ms = 0;
  std::vector<double> stage_ms;
  std::int32_t passes = 1;
};

/// Why a step did not come back.
enum class step_failure : std::uint8_t {
  refused,    ///< a stage refused or failed it: it would fail again, its requests end
  peer_lost,  ///< a stage is gone: wait for the pipeline's reset, then recompute
};

/// New tokens of a request, and the text now safe to show.
struct tokens_out {
  std::uint64_t id = 0;
  std::vector<std::int32_t> tokens;
  std::string text;
  std::vector<models::token_logprob> logprobs;  ///< one per token, when asked for
};

/// A request ended.
struct request_done {
  std::uint64_t id = 0;
  finish_reason reason = finish_reason::stop;
  error_code code = error_code::internal;  ///< with finish_reason::error: whose fault, what kind
  std::string error;                       ///< with finish_reason::error: what went wrong
  std::vector<std::int32_t> tokens;
  std::string text;
  std::int64_t prompt_tokens = 0;
  std::int64_t preemptions = 0;
  std::int64_t cached_tokens = 0;  ///< prompt tokens taken from the prefix cache (first admission)
  double queue_ms = 0;
  double ttft_ms = 0;
  double total_ms = 0;
  bool stop_string = false;
};

/// A sequence's KV blocks are to be freed on every stage's store; the
/// shell calls kv_freed(blocks, epoch) once all have.
struct kv_release {
  std::int64_t seq = 0;
  std::int64_t blocks = 0;
  std::uint64_t epoch = 0;
};

using core_event = std::variant<tokens_out, request_done, kv_release>;
using core_events = std::vector<core_event>;

class scheduler_core {
 public:
  /// `stages`: the pipeline's length now (0: none yet).
  scheduler_core(model_frontend model, scheduler_options opts, int stages, const clock& clk);
  ~scheduler_core();
  scheduler_core(const scheduler_core&) = delete;
  scheduler_core& operator=(const scheduler_core&) = delete;

  // -- admission ---------------------------------------------------------------

  /// Admits request `id` into the queue, or says why not. `prepare` turns
  /// the request into tokens (tokenizing, expanding images); it runs only
  /// after the cheap checks (a failed pipeline, id 0 or a duplicate, a
  /// full queue) passed. Returns the number of requests queued ahead.
  std::expected<std::int64_t, core_error> submit(
      std::uint64_t id, const std::function<std::expected<request_spec, core_error>()>& prepare);
  /// One of a request's images is encoded; true when it now waits for
  /// admission (its last image). `name`: the image's content hash (the
  /// encoder's), which names the KV of its rows; `cached`: the encoder had
  /// it (counted).
  bool image_ready(std::uint64_t id, std::int64_t index = -1,
                   std::optional<block_hash> name = std::nullopt, bool cached = false);
  /// Request `id`'s streamed clip now has `rows` rows encoded (its leading
  /// windows): its prompt grows to hold them and they are prefilled. A
  /// prompt that would pass the context length, or the KV one sequence can
  /// have, fails the request (the events say so).
  core_events extend_stream(std::uint64_t id, std::int64_t rows);
  /// The streamed clip ended with `rows` rows: the rest of the prompt
  /// follows them, and the request samples once they are prefilled.
  core_events close_stream(std::uint64_t id, std::int64_t rows);
  /// Ends a request with an error: now, or when its step returns.
  core_events fail(std::uint64_t id, error_code code, std::string why);
  /// Cancels a request (now, or when its step returns); nullopt when it is
  /// not known (any more).
  std::optional<core_events> cancel(std::uint64_t id);

  // -- steps -------------------------------------------------------------------

  /// The next micro-batch to send to the first stage, or none (the
  /// pipeline is full, paused or stalled, or there is nothing to do). Call
  /// until it returns none. Requests it preempts (out of KV blocks) give
  /// their blocks back through `out`.
  std::optional<step_plan> plan_step(core_events& out);
  /// A step's output came back.
  core_events step_done(std::uint64_t step, step_result out);
  /// A step failed. A lost peer stalls the pipeline until a reset (or,
  /// after stall_retry, tick recomputes the failed steps' requests).
  core_events step_failed(std::uint64_t step, step_failure kind, const std::string& why);

  // -- the pipeline ----------------------------------------------------------------

  /// Every stage was replaced (`stages` of them; 0: the node gave up). All
  /// KV is gone: running requests go back to the queue's front, oldest
  /// first, and recompute; steps still out are forgotten.
  core_events reset(int stages);
  /// The stores freed blocks of an earlier kv_release.
  void kv_freed(std::int64_t blocks, std::uint64_t epoch);
  /// A stage moved to a new store, which holds only the live sequences'
  /// blocks: cached blocks nobody holds are forgotten (the lower tiers too).
  void stage_moved() { books_.forget_names(true); }
  /// The remote store holds every layer of these blocks (slot, name).
  void remote_stored(std::span<const std::pair<std::int32_t, block_hash>> blocks);
  /// The remote store is there (or gone, with its copies).
  void remote_online(bool on) { books_.remote_online(on); }
  /// Empties the prefix cache (an admin call); returns the cached blocks
  /// that became free. Blocks running requests hold stay theirs.
  std::int64_t reset_prefix_cache() { return books_.forget_names(); }
  /// Live migration: plan no more steps until resume.
  void pause() { paused_ = true; }
  void resume() { paused_ = false; }
  bool paused() const { return paused_; }

  // -- time ------------------------------------------------------------------------

  /// Deadlines and the stall limit, as of the clock's now.
  core_events tick();
  /// When tick next has something to do (the earliest deadline, the stall
  /// limit), if ever.
  std::optional<time_point> next_wakeup() const;

  // -- what it holds -------------------------------------------------------------------

  std::size_t steps_in_flight() const { return steps_.size(); }
  std::int64_t running() const;
  std::int64_t queued() const { return queued_; }
  bool knows(std::uint64_t id) const { return requests_.contains(id); }
  /// How many requests it holds (encoding, waiting, running).
  std::size_t held() const { return requests_.size(); }
  /// The ids of every request it holds.
  std::vector<std::uint64_t> ids() const {
    std::vector<std::uint64_t> out;
    out.reserve(requests_.size());
    for (const auto& [id, r] : requests_) out.push_back(id);
    return out;
  }
  bool stalled() const { return stalled_; }
  std::uint64_t epoch() const { return epoch_; }
  int micro_batches() const { return opts_.micro_batches; }
  const kv_books& books() const { return books_; }
  /// The books' block events since the last call (kv_books::take_events).
  std::vector<kv_books::event> take_block_events(bool* overflowed) {
    return books_.take_events(overflowed);
  }
  /// Counters, with the gauges (queued, running, KV, in flight) as of now.
  scheduler_stats stats() const;

 private:
  enum class phase : std::uint8_t { encoding, waiting, running };
  struct request;
  struct in_flight_step {
    std::vector<std::uint64_t> ids;
    std::vector<std::int64_t> chunk;
    std::vector<std::int64_t> max_new;  ///< per sequence: tokens it may sample (0: none)
    bool decode_only = false;           ///< every sequence decodes one token (no prefill)
    bool moves = false;                 ///< it carried tier moves
    time_point sent;
  };

  request* find(std::uint64_t id);
  void finish(std::uint64_t id, finish_reason reason, core_error error, core_events& out);
  void release_kv(request& r, core_events& out);
  void preempt(request& r, core_events& out);
  /// Puts a waiting request in the queue by its priority: behind its
  /// equals, or (`front`: a preempted one) ahead of them.
  void enqueue(std::uint64_t id, bool front);
  void check_deadlines(core_events& out);
  bool add_to_step(request& r, std::int64_t& budget, step_plan& plan, in_flight_step& fl);
  void plan_multi_step(step_plan& plan, in_flight_step& fl);
  void apply_sampled(request& r, const std::vector<std::int32_t>& sampled,
                     std::vector<models::token_logprob>* logprobs, time_point now,
                     core_events& out);
  void step_left(time_point now);
  void publish_blocks(request& r);
  void name_blocks_of(request& r);
  void fail_all(const core_error& why, core_events& out);
  /// A streamed clip's rows grow to `rows` (false: the request failed, in `out`).
  bool grow_stream(request& r, std::int64_t rows, std::int64_t more, core_events& out);
  /// Resumed requests whose resumed tokens already ended them.
  void finish_resumed(core_events& out);

  model_frontend model_;
  scheduler_options opts_;
  int stages_ = 0;
  bool auto_micro_batches_ = false;
  const clock* clock_;
  kv_books books_;

  std::map<std::uint64_t, std::unique_ptr<request>> requests_;
  std::set<std::uint64_t> seen_ids_;          ///< the last `remembered_ids` submitted
  std::deque<std::uint64_t> seen_order_;      ///< the same, oldest first
  std::deque<std::uint64_t> waiting_;         ///< FCFS; preempted requests go to the front
  std::vector<std::uint64_t> ended_resumed_;  ///< ended by their resumed tokens: finish them
  std::int64_t queued_ = 0;                   ///< encoding + waiting
  std::int64_t next_seq_ = 1;
  std::uint64_t next_step_ = 1;
  std::uint64_t admit_counter_ = 0;
  std::map<std::uint64_t, in_flight_step> steps_;
  scheduler_stats stats_;
  double pass_ms_ = 0;       ///< measured time of one decode pass (multi-step sizing); 0 = not yet
  std::uint64_t epoch_ = 0;  ///< bumped by every reset
  std::int64_t remote_confirmed_ = 0;
  bool stalled_ = false;  ///< a stage is gone: wait for the reset
  std::uint64_t stalled_epoch_ = 0;
  time_point stalled_since_{};
  bool stall_open_ = false;   ///< from a failed step until a step comes back or a reset
  time_point stall_began_{};  ///< the first failure of the open stall (stall_limit counts)
  std::vector<std::uint64_t> stall_victims_;  ///< requests of steps that failed while stalled
  std::vector<kv_release> stall_releases_;    ///< frees held back while stalled
  std::string failed_;                        ///< the pipeline was given up on: why
  bool paused_ = false;
  time_point busy_since_{};  ///< since when a step has been in flight
};

}  // namespace troupe::actors::core
