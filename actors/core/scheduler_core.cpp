#include "actors/core/scheduler_core.hpp"

#include <algorithm>
#include <span>

namespace troupe::actors::core {

struct scheduler_core::request {
  std::uint64_t id = 0;
  models::sampling_params params;     // stop_checker points at them: the request never moves
  std::vector<std::int32_t> tokens;   // expanded prompt, then generated tokens appended
  std::vector<std::int64_t> history;  // the same as int64 (repetition penalty)
  std::int64_t prompt_len = 0;
  std::vector<std::int32_t> generated;
  std::string text;
  std::int64_t images_pending = 0;
  std::uint64_t draws = 0;  // the sampler's draw counter (the last stage samples)
  std::optional<models::stop_checker> stop;
  std::optional<models::stream_decoder> decoder;
  phase ph = phase::encoding;
  std::int64_t seq = 0;       // KV sequence id of the current admission (0 = none)
  std::int64_t computed = 0;  // tokens in the KV cache of every stage
  bool in_flight = false;
  bool cancelled = false;                           // ends when its step returns ...
  finish_reason end_as = finish_reason::cancelled;  // ... as this
  core_error end_error;
  std::int64_t preemptions = 0;
  std::uint64_t admit_order = 0;
  time_point submitted, admitted, first_token;
  bool has_first = false;
  std::optional<time_point> deadline;
  bool stop_string = false;
  bool guided = false;  // one token per step: the shell masks each
  block_chain chain;    // its full blocks' names (prefix caching)
  std::string cache_salt;
  std::int32_t priority = 0;        // lower first
  std::int64_t published = 0;       // blocks of the current admission named so far
  std::int64_t cached_tokens = -1;  // taken from the cache at the first admission
  std::vector<std::optional<block_hash>> image_names;  // per image, once known
  std::vector<std::int64_t> media_rows;                // per item (empty: tokens_per_image each)
  // Preempted: the tokens its KV held (restored or recomputed at the next
  // admission), and the name of its partly filled last block, if named.
  std::int64_t lost = 0;
  std::optional<block_hash> partial;
  // A streamed clip: open until its end came (tokens then end where its
  // rows go, and `tail` follows them at the end); its rows so far.
  bool streamed = false, open = false;
  std::vector<std::int32_t> tail;
  std::int64_t stream_rows = 0;
  bool auto_max = false;  // max_tokens 0: decided when the clip ends
};

namespace {

/// Adds the time the core's own work took to the counters when it goes.
struct own_work {
  scheduler_stats& stats;
  const clock& clk;
  time_point t0 = clk.now();
  ~own_work() { stats.scheduler_ms += ms_between(t0, clk.now()); }
};

std::int64_t count_of(std::int32_t token, std::span<const std::int32_t> tokens) {
  return std::count(tokens.begin(), tokens.end(), token);
}

}  // namespace

scheduler_core::scheduler_core(model_frontend model, scheduler_options opts, int stages,
                               const clock& clk)
    : model_(std::move(model)),
      opts_(std::move(opts)),
      stages_(stages),
      auto_micro_batches_(opts_.micro_batches < 1),
      clock_(&clk),
      books_(opts_.kv, opts_.kv_blocks, opts_.prefix_caching, opts_.host_blocks, opts_.disk_blocks,
             opts_.remote_blocks) {
  if (auto_micro_batches_) opts_.micro_batches = std::max(1, stages_);
  stats_.kv_total_blocks = opts_.kv_blocks;
}

scheduler_core::~scheduler_core() = default;

scheduler_core::request* scheduler_core::find(std::uint64_t id) {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : it->second.get();
}

std::int64_t scheduler_core::running() const {
  std::int64_t n = 0;
  for (const auto& [id, r] : requests_) n += r->ph == phase::running;
  return n;
}

// -- admission -------------------------------------------------------------------------------

std::expected<std::int64_t, core_error> scheduler_core::submit(
    std::uint64_t id, const std::function<std::expected<request_spec, core_error>()>& prepare) {
  auto refuse = [&](error_code code, std::string why) {
    ++stats_.rejected;
    return std::unexpected(core_error{code, std::move(why)});
  };
  if (!failed_.empty()) return std::unexpected(core_error{error_code::stage_failed, failed_});
  if (id == 0)
    return std::unexpected(core_error{error_code::invalid_request, "request id 0 is reserved"});
  if (requests_.count(id) || !seen_ids_.insert(id).second)
    return refuse(error_code::duplicate_id,
                  "request " + std::to_string(id) + " was already submitted");
  seen_order_.push_back(id);
  while (seen_order_.size() > std::max<std::size_t>(opts_.remembered_ids, 1)) {
    seen_ids_.erase(seen_order_.front());
    seen_order_.pop_front();
  }
  if (queued_ >= opts_.queue_limit)
    return refuse(error_code::overloaded, "the queue holds " + std::to_string(queued_) +
                                              " requests (limit " +
                                              std::to_string(opts_.queue_limit) + "); retry later");
  auto spec = prepare();
  if (!spec) return refuse(spec.error().code, spec.error().message);
  auto& q = *spec;
  if (q.stream && q.tokens.empty())
    return refuse(error_code::invalid_request, "a streamed audio clip needs a prompt before it");
  if (!q.stream && !q.tail.empty())
    return refuse(error_code::internal, "a prompt tail without a streamed clip");
  // A streamed request's checks take its prompt without the clip: each
  // piece of the clip is checked as it comes.
  const auto prompt = static_cast<std::int64_t>(q.tokens.size() + q.tail.size());
  const bool auto_max = q.params.max_tokens == 0;
  if (q.params.max_tokens == 0) {
    // Up to the end of the context, or of what the KV cache holds for one
    // sequence, whichever comes first.
    if (model_.context_length < 1)
      return refuse(error_code::invalid_request, "max_tokens is required (no context length)");
    if (prompt >= model_.context_length)
      return refuse(error_code::context_length,
                    *models::context_overflow(model_.context_length, prompt, 1));
    const auto longest = books_.longest_alone(prompt, model_.context_length);
    q.params.max_tokens =
        std::max<std::int64_t>(longest - prompt, 1);  // 1 past the KV: refused below
  }
  if (auto v = q.params.validate(); !v)
    return refuse(error_code::invalid_request, v.error().message);
  if (q.tokens.empty())
    return refuse(error_code::invalid_request, "the prompt encodes to no tokens");
  for (const auto* part : {&q.tokens, &q.tail})
    for (auto t : *part)
      if (t < 0 || t >= model_.vocab)
        return refuse(error_code::invalid_request,
                      "prompt token " + std::to_string(t) + " outside the vocabulary");
  for (const auto* ids : {&q.params.stop_token_ids, &q.params.bias_ids})
    for (auto t : *ids)
      if (t >= model_.vocab)
        return refuse(error_code::invalid_request,
                      std::string(ids == &q.params.bias_ids ? "logit_bias" : "stop") + " token " +
                          std::to_string(t) + " outside the vocabulary (" +
                          std::to_string(model_.vocab) + " tokens)");
  if (q.images > 0 && model_.image_token < 0)
    return refuse(error_code::invalid_request,
                  "this model has no vision encoder; the request has images");
  if (auto over = models::context_overflow(model_.context_length, prompt, q.params.max_tokens))
    return refuse(error_code::context_length, std::move(*over));
  const auto total = prompt + q.params.max_tokens;
  if (!books_.fits_alone(total))
    return refuse(error_code::kv_exhausted,
                  "prompt (" + std::to_string(prompt) + " tokens) plus max_tokens (" +
                      std::to_string(q.params.max_tokens) + ") need " +
                      std::to_string(books_.blocks_for(total - 1, total)) +
                      " KV blocks; a stage has " + std::to_string(books_.total()));
  if (auto s = models::sampler::create(q.params); !s)
    return refuse(error_code::invalid_request, s.error().message);
  if (std::ssize(q.resumed) > q.params.max_tokens)
    return refuse(error_code::invalid_request, "a resumed request with " +
                                                   std::to_string(q.resumed.size()) +
                                                   " tokens generated, more than its max_tokens (" +
                                                   std::to_string(q.params.max_tokens) + ")");
  for (auto t : q.resumed)
    if (t < 0 || t >= model_.vocab)
      return refuse(error_code::invalid_request,
                    "resumed token " + std::to_string(t) + " outside the vocabulary");

  auto r = std::make_unique<request>();
  r->id = id;
  r->params = std::move(q.params);
  r->guided = q.guided;
  r->tokens = std::move(q.tokens);
  r->history.assign(r->tokens.begin(), r->tokens.end());
  r->prompt_len = static_cast<std::int64_t>(r->tokens.size());
  r->streamed = r->open = q.stream;
  r->tail = std::move(q.tail);
  r->auto_max = auto_max && q.stream;
  if (q.stream && !q.resumed.empty())
    return refuse(error_code::invalid_request, "a streamed audio clip cannot be resumed");
  r->stop.emplace(r->params);
  r->decoder.emplace(*model_.tok, true);
  r->submitted = clock_->now();
  if (q.deadline_ms > 0) r->deadline = r->submitted + std::chrono::milliseconds(q.deadline_ms);
  r->images_pending = q.images;
  r->cache_salt = std::move(q.cache_salt);
  r->priority = q.priority;
  r->image_names.resize(static_cast<std::size_t>(q.images));
  r->media_rows = std::move(q.media_rows);
  for (std::size_t k = 0; k < q.image_hashes.size() && k < r->image_names.size(); ++k)
    r->image_names[k] = q.image_hashes[k];
  // Resumed: its generated tokens as if sampled here, without events (the
  // client has them); the text they showed is the text shown so far.
  auto ended_by = models::stop_reason::none;
  for (auto tok : q.resumed) {
    ++r->draws;
    r->tokens.push_back(tok);
    r->history.push_back(tok);
    r->generated.push_back(tok);
    r->text += r->stop->feed(tok, r->decoder->push(tok));
    ended_by = r->stop->reason();
    if (ended_by != models::stop_reason::none) break;
  }
  if (!q.resumed.empty()) {
    r->has_first = true;
    r->first_token = r->submitted;
  }
  if (ended_by != models::stop_reason::none) {
    // The event that carried its last token carried the held-back text too.
    if (ended_by != models::stop_reason::stop_string) r->text += r->stop->flush();
    r->stop_string = ended_by == models::stop_reason::stop_string;
    r->end_as =
        ended_by == models::stop_reason::max_tokens ? finish_reason::length : finish_reason::stop;
    ended_resumed_.push_back(id);
  }
  name_blocks_of(*r);
  r->ph = q.images > 0 ? phase::encoding : phase::waiting;
  ++stats_.accepted;
  ++queued_;
  const auto ahead = queued_ - 1;
  const bool waits = r->ph == phase::waiting && ended_by == models::stop_reason::none;
  requests_.emplace(id, std::move(r));
  if (waits) enqueue(id, false);
  return ahead;
}

void scheduler_core::finish_resumed(core_events& out) {
  auto ids = std::move(ended_resumed_);
  ended_resumed_.clear();
  for (auto id : ids)
    if (auto* r = find(id)) finish(id, r->end_as, {}, out);
}

void scheduler_core::enqueue(std::uint64_t id, bool front) {
  // In order of priority; within one, behind those there (a new request)
  // or ahead of them (a preempted one, admitted before them).
  const auto p = requests_.at(id)->priority;
  auto at = std::find_if(waiting_.begin(), waiting_.end(), [&](std::uint64_t w) {
    const auto q = requests_.at(w)->priority;
    return front ? q >= p : q > p;
  });
  waiting_.insert(at, id);
}

void scheduler_core::name_blocks_of(request& r) {
  // Named once every image is: an image's rows are named by its content.
  // A streamed clip has no name until it ends: such a request is not cached.
  if (!books_.names_blocks() || r.chain.enabled() || r.streamed) return;
  std::vector<block_hash> images;
  for (const auto& n : r.image_names) {
    if (!n) return;
    images.push_back(*n);
  }
  const auto root = root_hash(opts_.cache_namespace, r.cache_salt);
  r.chain = r.media_rows.empty() ? block_chain(root, opts_.kv.block_size, model_.image_token,
                                               model_.tokens_per_image, std::move(images))
                                 : block_chain(root, opts_.kv.block_size, model_.image_token,
                                               r.media_rows, std::move(images));
  r.chain.extend(r.tokens);
}

bool scheduler_core::image_ready(std::uint64_t id, std::int64_t index,
                                 std::optional<block_hash> name, bool cached) {
  auto* r = find(id);
  if (!r || r->ph != phase::encoding) return false;
  ++stats_.images;
  if (cached) ++stats_.image_cache_hits;
  if (name && index >= 0 && index < std::ssize(r->image_names))
    r->image_names[static_cast<std::size_t>(index)] = *name;
  if (--r->images_pending > 0 || r->cancelled) return false;
  name_blocks_of(*r);
  r->ph = phase::waiting;
  enqueue(id, false);
  return true;
}

core_events scheduler_core::fail(std::uint64_t id, error_code code, std::string why) {
  core_events out;
  auto* r = find(id);
  if (!r) return out;
  if (r->in_flight) {
    r->cancelled = true;
    r->end_as = finish_reason::error;
    r->end_error = {code, std::move(why)};
  } else {
    finish(id, finish_reason::error, {code, std::move(why)}, out);
  }
  return out;
}

bool scheduler_core::grow_stream(request& r, std::int64_t rows, std::int64_t more,
                                 core_events& out) {
  auto fail_with = [&](error_code code, std::string why) {
    auto ev = fail(r.id, code, std::move(why));
    out.insert(out.end(), ev.begin(), ev.end());
    return false;
  };
  if (!r.open) return fail_with(error_code::internal, "the streamed clip had already ended");
  if (rows < r.stream_rows)
    return fail_with(error_code::internal, "the streamed clip's rows went from " +
                                               std::to_string(r.stream_rows) + " to " +
                                               std::to_string(rows));
  const auto add = rows - r.stream_rows;
  const auto prompt = static_cast<std::int64_t>(r.tokens.size()) + add + more;
  // max_tokens 0 takes what is left at the end: one token at least.
  const auto need = r.auto_max ? 1 : r.params.max_tokens;
  if (auto over = models::context_overflow(model_.context_length, prompt, need))
    return fail_with(
        error_code::context_length,
        "the streamed audio clip (" + std::to_string(rows) + " tokens so far): " + *over);
  if (!books_.fits_alone(prompt + need))
    return fail_with(error_code::kv_exhausted,
                     "the streamed audio clip (" + std::to_string(rows) +
                         " tokens so far) makes the prompt " + std::to_string(prompt) +
                         " tokens; with max_tokens that needs " +
                         std::to_string(books_.blocks_for(prompt + need - 1, prompt + need)) +
                         " KV blocks, and a stage has " + std::to_string(books_.total()));
  r.tokens.insert(r.tokens.end(), static_cast<std::size_t>(add), model_.image_token);
  r.history.insert(r.history.end(), static_cast<std::size_t>(add), model_.image_token);
  r.prompt_len += add;
  r.stream_rows = rows;
  return true;
}

core_events scheduler_core::extend_stream(std::uint64_t id, std::int64_t rows) {
  core_events out;
  auto* r = find(id);
  if (!r || r->cancelled || !r->streamed) return out;
  grow_stream(*r, rows, static_cast<std::int64_t>(r->tail.size()), out);
  return out;
}

core_events scheduler_core::close_stream(std::uint64_t id, std::int64_t rows) {
  core_events out;
  auto* r = find(id);
  if (!r || r->cancelled || !r->streamed) return out;
  if (!grow_stream(*r, rows, static_cast<std::int64_t>(r->tail.size()), out)) return out;
  if (rows < 1) {
    auto ev = fail(id, error_code::invalid_request,
                   "the streamed audio clip ended shorter than one hop (10 ms)");
    out.insert(out.end(), ev.begin(), ev.end());
    return out;
  }
  r->tokens.insert(r->tokens.end(), r->tail.begin(), r->tail.end());
  r->history.insert(r->history.end(), r->tail.begin(), r->tail.end());
  r->prompt_len += static_cast<std::int64_t>(r->tail.size());
  r->tail.clear();
  r->open = false;
  if (r->auto_max)
    r->params.max_tokens = std::max<std::int64_t>(
        books_.longest_alone(r->prompt_len, model_.context_length) - r->prompt_len, 1);
  return out;
}

std::optional<core_events> scheduler_core::cancel(std::uint64_t id) {
  auto* r = find(id);
  if (!r) return std::nullopt;
  core_events out;
  if (r->in_flight)
    r->cancelled = true;  // ends (and frees its KV) when its step returns
  else
    finish(id, finish_reason::cancelled, {}, out);
  return out;
}

void scheduler_core::publish_blocks(request& r) {
  if (r.seq == 0 || !r.chain.enabled()) return;
  // Blocks wholly in the KV of every stage (`computed`) get their names.
  const auto known = std::min(r.computed, static_cast<std::int64_t>(r.tokens.size()));
  r.chain.extend(std::span(r.tokens).first(static_cast<std::size_t>(known)));
  const auto full = std::min<std::int64_t>(static_cast<std::int64_t>(r.chain.hashes().size()),
                                           known / opts_.kv.block_size);
  for (; r.published < full; ++r.published) {
    const auto& name = r.chain.hashes()[static_cast<std::size_t>(r.published)];
    books_.publish(r.seq, r.published, name);
    books_.back_up(name);  // a copy to the remote tier, if there is one
  }
}

void scheduler_core::release_kv(request& r, core_events& out) {
  if (r.seq == 0) return;
  publish_blocks(r);  // what it computed stays cached
  const std::int64_t blocks = books_.release(r.seq);
  const std::int64_t seq = r.seq;
  r.seq = 0;
  r.computed = 0;
  r.published = 0;
  // Stalled: the stores may be being replaced (a reset clears the books
  // and drops these); a retry on the same stores sends them then.
  if (stalled_)
    stall_releases_.push_back(kv_release{seq, blocks, epoch_});
  else
    out.push_back(kv_release{seq, blocks, epoch_});
}

void scheduler_core::kv_freed(std::int64_t blocks, std::uint64_t epoch) {
  if (epoch == epoch_) books_.freed(blocks);
}

void scheduler_core::finish(std::uint64_t id, finish_reason reason, core_error error,
                            core_events& out) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  auto& r = *it->second;
  if (r.ph != phase::running) --queued_;
  if (r.ph == phase::waiting)
    waiting_.erase(std::remove(waiting_.begin(), waiting_.end(), id), waiting_.end());
  release_kv(r, out);
  const auto now = clock_->now();
  request_done f;
  f.id = id;
  f.reason = reason;
  f.code = error.code;
  f.error = std::move(error.message);
  f.tokens = r.generated;
  f.text = r.text;
  f.prompt_tokens = r.prompt_len;
  f.preemptions = r.preemptions;
  f.cached_tokens = std::max<std::int64_t>(0, r.cached_tokens);
  f.queue_ms = r.ph == phase::running || r.admit_order ? ms_between(r.submitted, r.admitted)
                                                       : ms_between(r.submitted, now);
  f.ttft_ms = r.has_first ? ms_between(r.submitted, r.first_token) : 0;
  f.total_ms = ms_between(r.submitted, now);
  f.stop_string = r.stop_string;
  ++stats_.finished;
  stats_.prompt_tokens += r.prompt_len;
  stats_.generated_tokens += static_cast<std::int64_t>(r.generated.size());
  out.push_back(std::move(f));
  requests_.erase(it);
}

void scheduler_core::fail_all(const core_error& why, core_events& out) {
  std::vector<std::uint64_t> ids;
  for (auto& [id, r] : requests_) ids.push_back(id);
  for (auto id : ids) finish(id, finish_reason::error, why, out);
}

void scheduler_core::preempt(request& r, core_events& out) {
  if (r.seq != 0 && r.chain.enabled()) {
    // Its full blocks stay cached (release_kv names them); so does its
    // partly filled last one, under a name of its own, so that it resumes
    // where it was when nothing evicts them (a lower tier keeps them).
    publish_blocks(r);
    const auto index = r.computed / opts_.kv.block_size;
    r.partial = r.chain.partial(r.tokens, index, r.computed);
    if (r.partial) books_.publish(r.seq, index, *r.partial);
  }
  if (r.seq != 0) r.lost = r.computed;  // (a reset counted it already)
  release_kv(r, out);
  r.ph = phase::waiting;
  ++r.preemptions;
  ++stats_.preemptions;
  ++queued_;
  enqueue(r.id, true);
}

// -- time ------------------------------------------------------------------------------------

void scheduler_core::check_deadlines(core_events& out) {
  const auto now = clock_->now();
  std::vector<std::uint64_t> late;
  for (auto& [id, r] : requests_)
    if (r->deadline && now >= *r->deadline && !r->cancelled) late.push_back(id);
  for (auto id : late) {
    auto& r = *requests_[id];
    if (r.in_flight) {
      r.cancelled = true;  // ends when its step returns
      r.end_as = finish_reason::deadline;
    } else {
      finish(id, finish_reason::deadline, {}, out);
    }
  }
}

void scheduler_core::remote_stored(std::span<const std::pair<std::int32_t, block_hash>> blocks) {
  for (const auto& [slot, name] : blocks) remote_confirmed_ += books_.confirm(slot, name);
}

core_events scheduler_core::tick() {
  core_events out;
  if (stalled_ && stalled_epoch_ == epoch_ && clock_->now() - stall_began_ < opts_.stall_limit &&
      clock_->now() - stalled_since_ >= opts_.stall_retry) {
    // No reset came: every stage is alive and a transfer was lost. The
    // failed steps' requests free their KV (on every stage: some had taken
    // the step, some not) and recompute from the queue's front.
    stalled_ = false;
    for (const auto& rel : stall_releases_) out.emplace_back(std::in_place_type<kv_release>, rel);
    stall_releases_.clear();
    // The failed steps reached some stages and not others (their tier
    // moves too): only the blocks running requests hold stay sure (and
    // the remote tier's, whose store checks every layer).
    books_.forget_names(true);
    std::vector<request*> victims;
    for (auto id : stall_victims_)
      if (auto* r = find(id); r && !r->in_flight && r->ph == phase::running &&
                              std::find(victims.begin(), victims.end(), r) == victims.end())
        victims.push_back(r);
    stall_victims_.clear();
    std::sort(victims.begin(), victims.end(),
              [](const request* a, const request* b) { return a->admit_order > b->admit_order; });
    for (auto* r : victims) {
      if (r->cancelled)
        finish(r->id, r->end_as, r->end_error, out);
      else
        preempt(*r, out);
    }
  }
  if (stalled_ && stalled_epoch_ == epoch_ && clock_->now() - stall_began_ >= opts_.stall_limit) {
    const std::string why =
        "a stage's peer process was lost and no restored pipeline came within " +
        std::to_string(
            std::chrono::duration_cast<std::chrono::seconds>(opts_.stall_limit).count()) +
        " s";
    // The frees go out (stores still alive take them; gone ones fail them).
    stalled_ = false;
    for (const auto& rel : stall_releases_) out.emplace_back(std::in_place_type<kv_release>, rel);
    stall_releases_.clear();
    stall_victims_.clear();
    stall_open_ = false;
    failed_ = why;
    fail_all({error_code::peer_lost, why}, out);
    failed_.clear();
  }
  check_deadlines(out);
  return out;
}

std::optional<time_point> scheduler_core::next_wakeup() const {
  std::optional<time_point> t;
  auto earlier = [&](time_point x) {
    if (!t || x < *t) t = x;
  };
  for (const auto& [id, r] : requests_)
    if (r->deadline && !r->cancelled) earlier(*r->deadline);
  if (stalled_) {
    earlier(stall_began_ + opts_.stall_limit);
    earlier(stalled_since_ + opts_.stall_retry);
  }
  return t;
}

// -- steps -----------------------------------------------------------------------------------

void scheduler_core::step_left(time_point now) {
  if (steps_.empty()) stats_.in_flight_ms += ms_between(busy_since_, now);
}

/// Puts the next chunk of `r` into the step if its KV blocks can be booked.
bool scheduler_core::add_to_step(request& r, std::int64_t& budget, step_plan& plan,
                                 in_flight_step& fl) {
  const std::int64_t remaining = static_cast<std::int64_t>(r.tokens.size()) - r.computed;
  const std::int64_t chunk = std::min({remaining, opts_.prefill_chunk, budget});
  if (chunk <= 0) return false;
  if (!books_.reserve(r.seq, r.computed, r.computed + chunk)) return false;
  planned_seq w;
  w.id = r.id;
  w.seq = r.seq;
  w.start = r.computed;
  w.tokens.assign(r.tokens.begin() + r.computed, r.tokens.begin() + r.computed + chunk);
  // Image rows before the chunk: counted only for a chunk that holds image
  // tokens (decode steps of long sequences would count them every step).
  if (model_.image_token >= 0 && count_of(model_.image_token, w.tokens) > 0)
    w.image_rows_before = count_of(model_.image_token, std::span(r.tokens).first(r.computed));
  budget -= chunk;
  // An open stream's prefill stops where its clip's rows do (no sampling).
  w.sample = r.computed + chunk == static_cast<std::int64_t>(r.tokens.size()) && !r.open;
  if (w.sample) {
    w.params = r.params;
    w.draws = r.draws;
    w.max_new = 1;
    if (r.params.needs_history()) w.history = r.history;
  }
  fl.max_new.push_back(w.sample ? 1 : 0);
  plan.seqs.push_back(std::move(w));
  fl.ids.push_back(r.id);
  fl.chunk.push_back(chunk);
  r.in_flight = true;
  return true;
}

/// Multi-step decode: when the batch only decodes (one token per sequence,
/// every one sampling, no image rows) on a one-stage pipeline, lets the
/// shard run as many passes as fit in multi_step_ms, each sequence up to
/// its max_tokens, with KV blocks booked for every token it may add (a
/// sequence whose blocks do not fit stays at one).
void scheduler_core::plan_multi_step(step_plan& plan, in_flight_step& fl) {
  fl.decode_only = true;
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    const auto& s = plan.seqs[i];
    const bool images = model_.image_token >= 0 && count_of(model_.image_token, s.tokens) > 0;
    if (fl.chunk[i] != 1 || !s.sample || images) fl.decode_only = false;
    if (requests_[fl.ids[i]]->guided) fl.decode_only = false;  // a mask per token
  }
  if (!fl.decode_only || stages_ != 1 || opts_.max_decode_steps <= 1 || pass_ms_ <= 0) return;
  const auto k = static_cast<std::int64_t>(
      std::clamp(opts_.multi_step_ms / pass_ms_, 1.0, static_cast<double>(opts_.max_decode_steps)));
  if (k <= 1) return;
  std::int64_t most = 1;
  for (std::size_t i = 0; i < plan.seqs.size(); ++i) {
    auto& r = *requests_[fl.ids[i]];
    const auto left = r.params.max_tokens - static_cast<std::int64_t>(r.generated.size());
    const auto want = std::clamp<std::int64_t>(left, 1, k);
    if (want <= 1 || !books_.reserve(r.seq, r.computed, r.computed + want)) continue;
    plan.seqs[i].max_new = want;
    fl.max_new[i] = want;
    most = std::max(most, want);
  }
  plan.decode_steps = static_cast<std::int32_t>(most);
}

namespace {

/// Of `running`, the request a more urgent one may preempt: running, not
/// in flight, of the highest priority value, the youngest among those.
template <class Request>
Request* least_urgent(const std::vector<Request*>& running) {
  Request* victim = nullptr;
  for (auto* c : running)
    if (c->ph == decltype(c->ph)::running && !c->in_flight &&
        (!victim ||
         std::pair(c->priority, c->admit_order) > std::pair(victim->priority, victim->admit_order)))
      victim = c;
  return victim;
}

}  // namespace

std::optional<step_plan> scheduler_core::plan_step(core_events& out) {
  const own_work timing{stats_, *clock_};
  if (!ended_resumed_.empty()) finish_resumed(out);
  if (paused_ || stalled_ || stages_ < 1) return std::nullopt;
  if (static_cast<int>(steps_.size()) >= opts_.micro_batches) return std::nullopt;
  const auto& o = opts_;
  // Candidates: running requests not in flight (oldest admission first).
  std::vector<request*> running;
  std::int64_t active = 0;
  for (auto& [id, r] : requests_) {
    if (r->ph != phase::running) continue;
    ++active;
    if (!r->in_flight) running.push_back(r.get());
  }
  // Priority first (a lower value), then the oldest admission.
  std::sort(running.begin(), running.end(), [](const request* a, const request* b) {
    return std::pair(a->priority, a->admit_order) < std::pair(b->priority, b->admit_order);
  });
  // Split the active sequences evenly over the micro-batches so that all
  // stages have work.
  const std::int64_t cap_seqs = std::max<std::int64_t>(
      1, (active + static_cast<std::int64_t>(waiting_.size()) + o.micro_batches - 1) /
             o.micro_batches);
  // With several micro-batches in flight the pipeline runs at the pace of
  // its largest: aim each one at an even share of the work there is (the
  // tokens waiting to run plus those in flight), so that a prompt arriving
  // next to a few decode tokens is split over the micro-batches instead of
  // making one of them large and leaving the other stages idle. One
  // micro-batch: the whole budget.
  std::int64_t budget = o.token_budget;
  if (o.micro_batches > 1 && o.balance_micro_batches) {
    std::int64_t work = 0;
    auto left = [](const request& r) {
      return std::max<std::int64_t>(1, static_cast<std::int64_t>(r.tokens.size()) - r.computed);
    };
    for (auto* r : running) work += left(*r);
    for (auto id : waiting_) work += left(*requests_[id]);
    for (const auto& [step, f] : steps_)
      for (auto c : f.chunk) work += c;
    const std::int64_t share = (work + o.micro_batches - 1) / o.micro_batches;
    budget =
        std::clamp<std::int64_t>(share, std::min<std::int64_t>(32, o.token_budget), o.token_budget);
  }
  // Priorities: while waiting requests are kept out by the running cap or
  // the pool, and a running request (not in flight) has a higher priority
  // value than the next of them, that one is preempted (the least urgent,
  // the youngest among them) before the step takes its running requests:
  // room for each waiting request in turn and those before it.
  {
    std::int64_t want_seqs = 0, want_blocks = 0;
    const std::vector<std::uint64_t> ahead(waiting_.begin(), waiting_.end());
    for (auto id : ahead) {
      const auto& w = *requests_[id];
      auto* v = least_urgent(running);
      if (!v || v->priority <= w.priority) break;
      const auto chunk = std::min<std::int64_t>(
          {static_cast<std::int64_t>(w.tokens.size()) - w.computed, o.prefill_chunk, budget});
      ++want_seqs;
      want_blocks += books_.blocks_for(0, std::max<std::int64_t>(chunk, 1));
      auto kept_out = [&] {
        return active + want_seqs > o.max_running || books_.available() < want_blocks;
      };
      while (kept_out() && v && v->priority > w.priority) {
        preempt(*v, out);
        --active;
        v = least_urgent(running);
      }
      if (kept_out()) break;
    }
  }
  step_plan plan;
  in_flight_step fl;
  bool preempted = false;
  for (auto* r : running) {
    if (r->ph != phase::running) continue;  // preempted below
    // A streamed clip's rows prefilled as far as they came: it waits for more.
    if (r->open && r->computed >= static_cast<std::int64_t>(r->tokens.size())) continue;
    if (static_cast<std::int64_t>(plan.seqs.size()) >= cap_seqs || budget <= 0) break;
    bool added = false;
    while (!(added = add_to_step(*r, budget, plan, fl))) {
      // Out of KV blocks: preempt the running request of the highest
      // priority value, the youngest among them, that is not in flight
      // (possibly this one). Naming books free its blocks at once: try
      // again; counting ones once the stores freed them.
      request* victim = least_urgent(running);
      if (!victim) break;
      preempt(*victim, out);
      preempted = true;
      if (victim == r || !books_.names_blocks()) break;
    }
    if (!added && r->ph == phase::running) break;
  }
  // Admissions (by priority, first come first within one) while KV blocks
  // and the running cap allow; none in a step that had to preempt for its
  // running requests (as vLLM: the pool is short now).
  std::int64_t n_running = active;
  while (!preempted && !waiting_.empty() && budget > 0 &&
         static_cast<std::int64_t>(plan.seqs.size()) < cap_seqs && n_running < o.max_running) {
    auto& r = *requests_[waiting_.front()];
    // Admit only if the request's first chunk fits. Cached blocks that
    // start its tokens are taken first (all but the last token: its logits
    // are needed).
    r.seq = next_seq_++;
    std::int64_t hit = 0;
    if (r.chain.enabled()) {
      const auto B = opts_.kv.block_size;
      auto cap = std::min<std::int64_t>((static_cast<std::int64_t>(r.tokens.size()) - 1) / B,
                                        std::ssize(r.chain.hashes()));
      // A preempted request's partly filled block follows its full ones.
      if (r.partial) cap = std::min(cap, r.lost / B);
      bool took = false;
      const auto full =
          books_.attach(r.seq, std::span(r.chain.hashes()).first(static_cast<std::size_t>(cap)),
                        r.partial && cap == r.lost / B ? &*r.partial : nullptr, &took);
      hit = full * B + (took ? r.lost - full * B : 0);
      r.computed = hit;
      r.published = full;
    }
    if (!add_to_step(r, budget, plan, fl)) {
      // A partly filled block it took is its own: named again, it stays cached.
      if (r.partial && r.computed % opts_.kv.block_size != 0)
        books_.publish(r.seq, r.computed / opts_.kv.block_size, *r.partial);
      books_.release(r.seq);
      r.seq = 0;
      r.computed = 0;
      r.published = 0;
      break;
    }
    if (r.chain.enabled()) {
      stats_.prefix_queries += static_cast<std::int64_t>(r.tokens.size());
      stats_.prefix_hits += hit;
      if (r.cached_tokens < 0) r.cached_tokens = hit;
    }
    if (r.lost > 0) {
      stats_.restored_tokens += std::min(hit, r.lost);
      stats_.recomputed_tokens += std::max<std::int64_t>(0, r.lost - hit);
      r.lost = 0;
    }
    r.partial.reset();
    waiting_.pop_front();
    --queued_;
    r.ph = phase::running;
    if (!r.admit_order) r.admitted = clock_->now();
    r.admit_order = ++admit_counter_;
    ++n_running;
  }
  if (plan.seqs.empty()) return std::nullopt;
  plan_multi_step(plan, fl);
  if (books_.names_blocks()) {
    for (auto& w : plan.seqs) {
      auto d = books_.take_delta(w.seq);
      w.blocks_from = d.from;
      w.blocks = std::move(d.ids);
    }
    plan.moves = books_.take_moves();
    fl.moves = !plan.moves.empty();
  }
  plan.step = next_step_++;
  fl.sent = clock_->now();
  if (steps_.empty()) busy_since_ = fl.sent;
  steps_.emplace(plan.step, std::move(fl));
  ++stats_.steps;
  return plan;
}

void scheduler_core::apply_sampled(request& r, const std::vector<std::int32_t>& sampled,
                                   std::vector<models::token_logprob>* logprobs, time_point now,
                                   core_events& out) {
  if (!r.has_first) {
    r.has_first = true;
    r.first_token = now;
  }
  tokens_out ev{r.id, {}, {}, {}};
  auto reason = models::stop_reason::none;
  for (std::size_t k = 0; k < sampled.size(); ++k) {
    // Tokens past a stop are dropped (the KV goes with the request).
    const auto tok = sampled[k];
    if (logprobs) ev.logprobs.push_back(std::move((*logprobs)[k]));
    ++r.draws;
    r.tokens.push_back(tok);
    r.history.push_back(tok);
    r.generated.push_back(tok);
    ev.tokens.push_back(tok);
    ++stats_.tokens_out;
    ev.text += r.stop->feed(tok, r.decoder->push(tok));
    reason = r.stop->reason();
    if (reason != models::stop_reason::none) break;
  }
  if (reason != models::stop_reason::none && reason != models::stop_reason::stop_string)
    ev.text += r.stop->flush();
  r.text += ev.text;
  out.push_back(std::move(ev));
  r.stop_string = reason == models::stop_reason::stop_string;
  if (reason != models::stop_reason::none)
    finish(r.id,
           reason == models::stop_reason::max_tokens ? finish_reason::length : finish_reason::stop,
           {}, out);
}

core_events scheduler_core::step_done(std::uint64_t step, step_result res) {
  core_events out;
  auto node = steps_.extract(step);
  if (node.empty()) return out;
  if (!stalled_) stall_open_ = false;  // the pipeline carries steps again
  auto& fl = node.mapped();
  {
    const auto back = clock_->now();
    step_left(back);
    stats_.round_trip_ms += ms_between(fl.sent, back);
    stats_.compute_ms += std::max(0.0, res.compute_ms);
    auto& per = stats_.stage_compute_ms;
    if (per.size() < res.stage_ms.size() && res.stage_ms.size() <= 1024)
      per.resize(res.stage_ms.size());
    for (std::size_t i = 0; i < res.stage_ms.size() && i < per.size(); ++i)
      per[i] += std::max(0.0, res.stage_ms[i]);
    for (auto c : fl.chunk) stats_.step_rows += c;
    for (const auto& s : res.sampled)
      stats_.step_rows += std::max<std::int64_t>(0, static_cast<std::int64_t>(s.size()) - 1);
  }
  const own_work timing{stats_, *clock_};
  bool valid = res.sampled.size() == fl.ids.size() &&
               (res.logprobs.empty() || res.logprobs.size() == fl.ids.size());
  for (std::size_t i = 0; valid && i < fl.ids.size(); ++i) {
    const auto n = static_cast<std::int64_t>(res.sampled[i].size());
    valid = fl.max_new[i] == 0 ? n == 0 : n >= 1 && n <= fl.max_new[i];
    if (!res.logprobs.empty() && !res.logprobs[i].empty())
      valid = valid && res.logprobs[i].size() == res.sampled[i].size();
    for (auto t : res.sampled[i]) valid = valid && t >= 0 && t < model_.vocab;
  }
  if (!valid) {
    const std::string why = "the last stage's sampled tokens do not match the step";
    for (auto id : fl.ids)
      if (auto* r = find(id)) {
        r->in_flight = false;
        finish(id, finish_reason::error, {error_code::internal, why}, out);
      }
    return out;
  }
  if (fl.decode_only && res.passes >= 1 && res.compute_ms > 0) {
    const double per_pass = res.compute_ms / res.passes;
    pass_ms_ = pass_ms_ <= 0 ? per_pass : 0.8 * pass_ms_ + 0.2 * per_pass;
  }
  const auto now = clock_->now();
  for (std::size_t i = 0; i < fl.ids.size(); ++i) {
    auto* r = find(fl.ids[i]);
    if (!r) continue;
    const auto& sampled = res.sampled[i];
    r->in_flight = false;
    // Each pass after the first put the previous sampled token in the KV.
    r->computed +=
        fl.chunk[i] + std::max<std::int64_t>(0, static_cast<std::int64_t>(sampled.size()) - 1);
    books_.settle(r->seq, r->computed);  // a window frees what it no longer needs
    publish_blocks(*r);
    if (r->cancelled) {
      finish(r->id, r->end_as, r->end_error, out);
      continue;
    }
    if (sampled.empty()) continue;  // mid-prefill
    auto* lp = !res.logprobs.empty() && !res.logprobs[i].empty() ? &res.logprobs[i] : nullptr;
    apply_sampled(*r, sampled, lp, now, out);
  }
  check_deadlines(out);
  return out;
}

core_events scheduler_core::step_failed(std::uint64_t step, step_failure kind,
                                        const std::string& why) {
  core_events out;
  auto node = steps_.extract(step);
  if (node.empty()) return out;
  step_left(clock_->now());
  if (kind == step_failure::refused) {
    // Some stages may have carried out its tier moves and others not: what
    // the books say the tiers hold is no longer sure.
    if (node.mapped().moves) books_.forget_names(true);
    // The stage refused or failed this step: that would happen again.
    for (auto id : node.mapped().ids)
      if (auto* r = find(id)) {
        r->in_flight = false;
        finish(id, finish_reason::error, {error_code::stage_failed, why}, out);
      }
    return out;
  }
  // A stage is gone (crashed, killed): plan no steps until the pipeline is
  // reset; the requests then recompute. Nobody may restore it (a transfer
  // failed, every process alive): tick fails them after stall_limit.
  if (!stalled_) {
    stalled_epoch_ = epoch_;
    stalled_since_ = clock_->now();
  }
  if (!stall_open_) {
    stall_open_ = true;
    stall_began_ = clock_->now();
  }
  stalled_ = true;
  for (auto id : node.mapped().ids)
    if (auto* r = find(id)) {
      r->in_flight = false;
      stall_victims_.push_back(id);
    }
  return out;
}

// -- the pipeline ----------------------------------------------------------------------------

core_events scheduler_core::reset(int stages) {
  core_events out;
  ++epoch_;
  if (!steps_.empty()) {
    steps_.clear();
    step_left(clock_->now());
  }
  stalled_ = false;
  stall_open_ = false;
  stall_victims_.clear();
  stall_releases_.clear();
  books_.clear();
  stages_ = stages;
  if (auto_micro_batches_) opts_.micro_batches = std::max(1, stages_);
  std::vector<request*> running;
  for (auto& [id, r] : requests_) {
    r->in_flight = false;
    if (r->seq != 0) r->lost = r->computed;
    r->partial.reset();
    r->seq = 0;
    r->computed = 0;
    r->published = 0;
    if (r->ph == phase::running) running.push_back(r.get());
  }
  std::sort(running.begin(), running.end(),
            [](const request* a, const request* b) { return a->admit_order > b->admit_order; });
  for (auto* r : running)
    preempt(*r, out);  // youngest first to the front: the oldest ends up first
  std::vector<std::uint64_t> cancelled;
  for (auto& [id, r] : requests_)
    if (r->cancelled) cancelled.push_back(id);
  for (auto id : cancelled) {
    auto& r = *requests_[id];
    finish(id, r.end_as, r.end_error, out);
  }
  if (stages_ < 1) {
    failed_ =
        "the node gave up on the pipeline (a stage failed more often than allowed, or a remote "
        "stage is gone; the node logs why)";
    fail_all({error_code::stage_failed, failed_}, out);
  }
  return out;
}

scheduler_stats scheduler_core::stats() const {
  auto s = stats_;
  s.queued = queued_;
  s.running = static_cast<std::int64_t>(requests_.size()) - queued_;
  s.kv_used_blocks = books_.used();
  s.kv_peak_blocks = books_.peak();
  s.kv_cached_blocks = books_.named();
  s.kv_cached_free = books_.cached_free();
  s.kv_evictions = books_.evictions();
  using models::kv_tier;
  s.kv_host_blocks = books_.tier_slots(kv_tier::host);
  s.kv_host_used = books_.tier_used(kv_tier::host);
  s.kv_disk_blocks = books_.tier_slots(kv_tier::disk);
  s.kv_disk_used = books_.tier_used(kv_tier::disk);
  s.kv_to_host = books_.moved(kv_tier::device, kv_tier::host);
  s.kv_from_host = books_.moved(kv_tier::host, kv_tier::device);
  s.kv_to_disk =
      books_.moved(kv_tier::device, kv_tier::disk) + books_.moved(kv_tier::host, kv_tier::disk);
  s.kv_from_disk = books_.moved(kv_tier::disk, kv_tier::device);
  s.kv_dropped = books_.dropped();
  s.kv_remote_blocks = books_.tier_slots(kv_tier::remote);
  s.kv_remote_used = books_.tier_used(kv_tier::remote);
  s.kv_remote_pending = books_.remote_pending();
  s.kv_to_remote = books_.moved(kv_tier::device, kv_tier::remote);
  s.kv_from_remote = books_.moved(kv_tier::remote, kv_tier::device);
  s.kv_remote_confirmed = remote_confirmed_;
  s.kv_slot_bytes = opts_.kv_slot_bytes;
  s.stages = stages_;
  if (!steps_.empty()) s.in_flight_ms += ms_between(busy_since_, clock_->now());
  return s;
}

}  // namespace troupe::actors::core
