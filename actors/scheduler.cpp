#include "actors/scheduler.hpp"
#include "actors/log.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>
#include <unordered_set>

#include "actors/clock.hpp"
#include "actors/data_plane.hpp"
#include "actors/tensor_registry.hpp"
#include "models/llava.hpp"
#include "models/sampling.hpp"

namespace troupe::actors {

namespace {

using clock = steady;
/// How long a pipeline that lost a peer may wait for its restoration.
constexpr std::chrono::seconds stall_limit{60};
using kernels::tensor;

enum class phase : std::uint8_t { encoding, waiting, running };

/// One request in the scheduler.
struct request_state {
  generate_request req;  // params live here: stop_checker points at them
  client_sink_actor client;
  std::vector<std::int32_t> tokens;   // expanded prompt, then generated tokens appended
  std::vector<std::int64_t> history;  // the same as int64 (repetition penalty)
  std::int64_t prompt_len = 0;
  std::vector<std::int32_t> generated;
  std::string text;
  std::vector<tensor>
      image_rows;  // per image: the encoder's f32 [tokens_per_image, hidden], not copied
  std::int64_t images_pending = 0;
  std::uint64_t draws = 0;  // the sampler's draw counter (the last stage samples)
  std::optional<models::stop_checker> stop;
  std::optional<models::stream_decoder> decoder;
  phase ph = phase::encoding;
  std::int64_t seq = 0;       // KV sequence id of the current admission (0 = none)
  std::int64_t computed = 0;  // tokens in the KV cache of every stage
  std::int64_t held = 0;      // KV blocks the scheduler books for it
  bool in_flight = false;
  bool cancelled = false;     // ends when its step returns
  bool deadline_hit = false;  // ... because its deadline passed
  std::int64_t preemptions = 0;
  std::uint64_t admit_order = 0;
  clock::time_point submitted, admitted, first_token;
  bool has_first = false;
  std::optional<clock::time_point> deadline;
  double preprocess_ms = 0, encode_ms = 0;
  bool stop_string = false;
};

struct in_flight_step {
  std::vector<std::uint64_t> ids;
  std::vector<std::int64_t> chunk;
  std::vector<std::int64_t> max_new;  // per sequence: tokens it may sample (0: it does not sample)
  bool decode_only = false;           // every sequence decodes one token (no prefill)
  clock::time_point sent;             // when it went to the first stage
};

struct scheduler_state {
  model_frontend model;
  scheduler_options opts;
  std::vector<shard_actor> stages;
  std::vector<kv_store_actor> kv_stores;
  encoder_actor encoder;
  std::shared_ptr<kernels::memory_pool> pool = kernels::memory_pool::create();

  std::map<std::uint64_t, std::unique_ptr<request_state>> requests;
  std::unordered_set<std::uint64_t> seen_ids;
  std::deque<std::uint64_t> waiting;  // FCFS; preempted requests go to the front
  std::int64_t queued = 0;            // encoding + waiting
  std::int64_t used_blocks = 0;       // booked (includes frees not yet confirmed)
  std::int64_t next_seq = 1;
  std::uint64_t next_step = 1;
  std::uint64_t admit_counter = 0;
  std::map<std::uint64_t, in_flight_step> steps;
  scheduler_stats stats;
  double pass_ms = 0;       // measured time of one decode pass (multi-step sizing); 0 = not yet
  std::uint64_t epoch = 0;  // bumped when the node restarts the pipeline
  bool stalled = false;     // a stage died: wait for the node's reset
  std::uint64_t stalled_epoch = 0;  // the epoch it stalled in (a reset bumps it)
  steady::time_point stalled_since;
  std::string failed;               // the node gave up: why
  bool paused = false;              // live migration: no new steps
  bool auto_micro_batches = false;  // one micro-batch per stage, as the stages change
  std::vector<caf::typed_response_promise<std::int64_t>>
      pause_waiters;             // answered once no step is in flight
  clock::time_point busy_since;  // since when a step has been in flight (steps not empty)
};

/// Adds the time the scheduler's own work took to its counters when it goes.
struct own_work {
  scheduler_stats& stats;
  clock::time_point t0 = clock::now();
  ~own_work() { stats.scheduler_ms += ms_between(t0, clock::now()); }
};

/// A step left the books: when none is left, the pipeline's busy span ends.
void step_left(scheduler_state& st, clock::time_point now) {
  if (st.steps.empty()) st.stats.in_flight_ms += ms_between(st.busy_since, now);
}

using self_ptr = scheduler_actor::stateful_pointer<scheduler_state>;

void schedule(self_ptr self);

/// Returns a request's blocks: the stores free them, then the books do.
void release_kv(self_ptr self, request_state& r) {
  if (r.seq == 0) return;
  const std::int64_t blocks = r.held;
  const std::int64_t seq = r.seq;
  r.seq = 0;
  r.held = 0;
  r.computed = 0;
  auto& st = self->state;
  if (st.kv_stores.empty()) {
    st.used_blocks -= blocks;
    return;
  }
  if (st.stalled) return;  // the stores are being replaced; the reset clears the books
  auto remaining = std::make_shared<std::size_t>(st.kv_stores.size());
  const auto epoch = st.epoch;
  auto done = [=] {
    if (--*remaining == 0 && self->state.epoch == epoch) {
      self->state.used_blocks -= blocks;
      schedule(self);
    }
  };
  for (auto& kv : st.kv_stores) {
    self->request(kv, caf::infinite, free_atom::value, std::vector<std::int64_t>{seq})
        .then([=](std::int64_t) { done(); },
              [=](caf::error& e) {
                logging::of("scheduler")
                    .warn("freeing KV of sequence {}: {}", seq, self->system().render(e));
                done();
              });
  }
}

/// Ends a request: the client gets its finish event, the KV is returned.
void finish(self_ptr self, std::uint64_t id, const std::string& reason,
            const std::string& error = {}) {
  auto& st = self->state;
  auto it = st.requests.find(id);
  if (it == st.requests.end()) return;
  auto& r = *it->second;
  if (r.ph != phase::running) --st.queued;
  if (r.ph == phase::waiting)
    st.waiting.erase(std::remove(st.waiting.begin(), st.waiting.end(), id), st.waiting.end());
  release_kv(self, r);
  const auto now = clock::now();
  finish_event f;
  f.id = id;
  f.reason = reason;
  f.error = error;
  f.tokens = r.generated;
  f.text = r.text;
  f.prompt_tokens = r.prompt_len;
  f.preemptions = r.preemptions;
  f.queue_ms = r.ph == phase::running || r.admit_order ? ms_between(r.submitted, r.admitted)
                                                       : ms_between(r.submitted, now);
  f.ttft_ms = r.has_first ? ms_between(r.submitted, r.first_token) : 0;
  f.total_ms = ms_between(r.submitted, now);
  f.stop_string = r.stop_string;
  f.preprocess_ms = r.preprocess_ms;
  f.encode_ms = r.encode_ms;
  self->send(r.client, std::move(f));
  ++st.stats.finished;
  st.stats.prompt_tokens += r.prompt_len;
  st.stats.generated_tokens += static_cast<std::int64_t>(r.generated.size());
  st.requests.erase(it);
}

/// Frees a running request's KV and sends it back to the queue's front; it
/// recomputes its prompt and generated tokens when admitted again (the
/// kernels are chunking- and batch-invariant, so its tokens do not change).
void preempt(self_ptr self, request_state& r, std::uint64_t id) {
  auto& st = self->state;
  release_kv(self, r);
  r.ph = phase::waiting;
  ++r.preemptions;
  ++st.stats.preemptions;
  ++st.queued;
  st.waiting.push_front(id);
}

std::int64_t blocks_after(const scheduler_state& st, std::int64_t committed,
                          std::int64_t reserved) {
  return models::kv_cache::blocks_held(st.opts.kv, committed, reserved);
}

void check_deadlines(self_ptr self) {
  auto& st = self->state;
  const auto now = clock::now();
  std::vector<std::uint64_t> late;
  for (auto& [id, r] : st.requests)
    if (r->deadline && now >= *r->deadline && !r->cancelled) late.push_back(id);
  for (auto id : late) {
    auto& r = *st.requests[id];
    if (r.in_flight) {
      r.cancelled = true;  // ends when its step returns
      r.deadline_hit = true;
    } else {
      finish(self, id, "deadline");
    }
  }
}

void on_step_output(self_ptr self, std::uint64_t step, step_output& out);
void on_step_error(self_ptr self, std::uint64_t step, const caf::error& e);

/// Multi-step decode: when the batch only decodes (one token per sequence,
/// every one sampling) on a one-stage pipeline, lets the shard run as many
/// passes as fit in multi_step_ms, each sequence up to its max_tokens, with
/// KV blocks booked for every token it may add (a sequence whose blocks do
/// not fit stays at one).
void plan_multi_step(scheduler_state& st, step_batch& batch, in_flight_step& fl) {
  const auto& o = st.opts;
  fl.decode_only = true;
  for (std::size_t i = 0; i < batch.seqs.size(); ++i)
    if (fl.chunk[i] != 1 || !batch.seqs[i].sample || !batch.seqs[i].embeddings.empty())
      fl.decode_only = false;
  if (!fl.decode_only || st.stages.size() != 1 || o.max_decode_steps <= 1 || st.pass_ms <= 0)
    return;
  const auto k = static_cast<std::int64_t>(
      std::clamp(o.multi_step_ms / st.pass_ms, 1.0, static_cast<double>(o.max_decode_steps)));
  if (k <= 1) return;
  std::int64_t most = 1;
  for (std::size_t i = 0; i < batch.seqs.size(); ++i) {
    auto& r = *st.requests[fl.ids[i]];
    const auto left = r.req.params.max_tokens - static_cast<std::int64_t>(r.generated.size());
    const auto want = std::clamp<std::int64_t>(left, 1, k);
    const std::int64_t need = blocks_after(st, r.computed, r.computed + want) - r.held;
    if (want <= 1 || st.used_blocks + need > o.kv_blocks) continue;
    st.used_blocks += need;
    r.held += need;
    st.stats.kv_peak_blocks = std::max(st.stats.kv_peak_blocks, st.used_blocks);
    batch.seqs[i].sampling.max_new = want;
    fl.max_new[i] = want;
    most = std::max(most, want);
  }
  batch.decode_steps = static_cast<std::int32_t>(most);
}

/// Fills the pipeline: while fewer than micro_batches steps are in flight,
/// builds one from the running requests not in flight (decode tokens and
/// prefill chunks) and admits waiting requests while KV blocks allow.
void schedule(self_ptr self) {
  auto& st = self->state;
  const own_work timing{st.stats};
  const auto& o = st.opts;
  if (st.paused) {
    if (st.steps.empty()) {
      std::int64_t running = 0;
      for (const auto& [id, r] : st.requests) running += r->ph == phase::running;
      for (auto& w : st.pause_waiters) w.deliver(running);
      st.pause_waiters.clear();
    }
    return;
  }
  if (st.stalled || st.stages.empty()) return;
  while (static_cast<int>(st.steps.size()) < o.micro_batches) {
    // Candidates: running requests not in flight (oldest admission first).
    std::vector<request_state*> running;
    std::int64_t active = 0;
    for (auto& [id, r] : st.requests) {
      if (r->ph != phase::running) continue;
      ++active;
      if (!r->in_flight) running.push_back(r.get());
    }
    std::sort(running.begin(), running.end(), [](const request_state* a, const request_state* b) {
      return a->admit_order < b->admit_order;
    });
    // Split the active sequences evenly over the micro-batches so that all
    // stages have work.
    const std::int64_t cap_seqs = std::max<std::int64_t>(
        1, (active + static_cast<std::int64_t>(st.waiting.size()) + o.micro_batches - 1) /
               o.micro_batches);
    step_batch batch;
    in_flight_step fl;
    // With several micro-batches in flight the pipeline runs at the pace of
    // its largest: aim each one at an even share of the work there is (the
    // tokens waiting to run plus those in flight), so that a prompt
    // arriving next to a few decode tokens is split over the micro-batches
    // instead of making one of them large and leaving the other stages
    // idle. One micro-batch: the whole budget, as before.
    std::int64_t budget = o.token_budget;
    if (o.micro_batches > 1 && o.balance_micro_batches) {
      std::int64_t work = 0;
      for (auto* r : running)
        work +=
            std::max<std::int64_t>(1, static_cast<std::int64_t>(r->tokens.size()) - r->computed);
      for (auto id : st.waiting) {
        const auto& w = *st.requests[id];
        work += std::max<std::int64_t>(1, static_cast<std::int64_t>(w.tokens.size()) - w.computed);
      }
      for (const auto& [step, f] : st.steps)
        for (auto c : f.chunk) work += c;
      const std::int64_t share = (work + o.micro_batches - 1) / o.micro_batches;
      budget = std::clamp<std::int64_t>(share, std::min<std::int64_t>(32, o.token_budget),
                                        o.token_budget);
    }
    auto add = [&](request_state& r) -> bool {
      const std::int64_t remaining = static_cast<std::int64_t>(r.tokens.size()) - r.computed;
      const std::int64_t chunk = std::min({remaining, o.prefill_chunk, budget});
      if (chunk <= 0) return false;
      const std::int64_t need = blocks_after(st, r.computed, r.computed + chunk) - r.held;
      if (st.used_blocks + need > o.kv_blocks) return false;
      st.used_blocks += need;
      r.held += need;
      st.stats.kv_peak_blocks = std::max(st.stats.kv_peak_blocks, st.used_blocks);
      seq_work w;
      w.seq = r.seq;
      w.start = r.computed;
      w.tokens.assign(r.tokens.begin() + r.computed, r.tokens.begin() + r.computed + chunk);
      if (st.model.image_token >= 0 && !r.image_rows.empty()) {
        const auto img = st.model.image_token;
        const auto before = std::count(r.tokens.begin(), r.tokens.begin() + r.computed, img);
        const auto here = std::count(w.tokens.begin(), w.tokens.end(), img);
        if (here > 0) {
          const std::int64_t H = st.model.hidden, per = st.model.tokens_per_image;
          const auto first = before / per, last = (before + here - 1) / per;
          kernels::result<tensor> t =
              first == last
                  // Within one image: a view of the encoder's buffer.
                  ? r.image_rows[static_cast<std::size_t>(first)].slice_rows(before % per, here)
                  // Across images: gather the rows.
                  : tensor::empty(*st.pool, kernels::dtype::f32, {here, H});
          if (!t) return false;
          if (first != last) {
            for (std::int64_t k = 0; k < here; ++k) {
              const std::int64_t row = before + k;
              const auto& src = r.image_rows[static_cast<std::size_t>(row / per)];
              std::copy_n(src.row_as<float>(row % per), H, t->row_as<float>(k));
            }
          }
          w.embed_token = img;
          const auto& first_stage = st.stages.front();
          if (first_stage && first_stage->node() != self->node()) {
            // The first stage runs in another process (moved there by a
            // live migration): the embeddings go over the data plane.
            auto ref =
                data_plane::local().push(to_string(first_stage->node()), "host", std::move(*t));
            if (!ref) return false;
            w.embeddings = std::move(*ref);
          } else {
            w.embeddings = tensor_registry::local().put("host", std::move(*t));
          }
        }
      }
      budget -= chunk;
      w.sample = r.computed + chunk == static_cast<std::int64_t>(r.tokens.size());
      if (w.sample) {
        w.sampling.params = r.req.params;
        w.sampling.draws = r.draws;
        w.sampling.max_new = 1;
        if (r.req.params.repetition_penalty != 1.0) w.sampling.history = r.history;
      }
      fl.max_new.push_back(w.sample ? 1 : 0);
      batch.seqs.push_back(std::move(w));
      fl.ids.push_back(r.req.id);
      fl.chunk.push_back(chunk);
      r.in_flight = true;
      return true;
    };
    for (auto* r : running) {
      if (static_cast<std::int64_t>(batch.seqs.size()) >= cap_seqs || budget <= 0) break;
      if (add(*r)) continue;
      // Out of KV blocks: preempt the youngest running request that is not
      // in flight (possibly this one) and try again later.
      if (budget > 0) {
        request_state* victim = nullptr;
        for (auto* c : running)
          if (!c->in_flight && (!victim || c->admit_order > victim->admit_order)) victim = c;
        if (victim) {
          preempt(self, *victim, victim->req.id);
          if (victim == r) continue;
        }
        break;
      }
    }
    // Admissions (FCFS) while KV blocks and the running cap allow.
    std::int64_t n_running = active;
    while (!st.waiting.empty() && budget > 0 &&
           static_cast<std::int64_t>(batch.seqs.size()) < cap_seqs && n_running < o.max_running) {
      auto& r = *st.requests[st.waiting.front()];
      // Admit only if the whole request's first chunk fits.
      r.seq = st.next_seq++;
      if (!add(r)) {
        r.seq = 0;
        break;
      }
      st.waiting.pop_front();
      --st.queued;
      r.ph = phase::running;
      if (!r.admit_order) r.admitted = clock::now();
      r.admit_order = ++st.admit_counter;
      ++n_running;
    }
    if (batch.seqs.empty()) break;
    plan_multi_step(st, batch, fl);
    batch.return_logits = false;
    batch.step = st.next_step++;
    const auto step = batch.step;
    fl.sent = clock::now();
    if (st.steps.empty()) st.busy_since = fl.sent;
    st.steps.emplace(step, std::move(fl));
    ++st.stats.steps;
    self->request(st.stages.front(), caf::infinite, step_atom::value, std::move(batch))
        .then([=](step_output& out) { on_step_output(self, step, out); },
              [=](caf::error& e) { on_step_error(self, step, e); });
  }
}

void on_step_output(self_ptr self, std::uint64_t step, step_output& out) {
  auto& st = self->state;
  auto node = st.steps.extract(step);
  if (node.empty()) return;
  auto& fl = node.mapped();
  {
    const auto back = clock::now();
    step_left(st, back);
    st.stats.round_trip_ms += ms_between(fl.sent, back);
    st.stats.compute_ms += std::max(0.0, out.compute_ms);
    auto& per = st.stats.stage_compute_ms;
    if (per.size() < out.stage_ms.size() && out.stage_ms.size() <= 1024)
      per.resize(out.stage_ms.size());
    for (std::size_t i = 0; i < out.stage_ms.size() && i < per.size(); ++i)
      per[i] += std::max(0.0, out.stage_ms[i]);
    for (auto c : fl.chunk) st.stats.step_rows += c;
    for (const auto& s : out.sampled)
      st.stats.step_rows += std::max<std::int64_t>(0, static_cast<std::int64_t>(s.size()) - 1);
  }
  std::optional<own_work> timing{std::in_place, st.stats};
  if (!out.logits.empty()) tensor_registry::local().drop(out.logits);
  bool valid = out.sampled.size() == fl.ids.size();
  for (std::size_t i = 0; valid && i < fl.ids.size(); ++i) {
    const auto n = static_cast<std::int64_t>(out.sampled[i].size());
    valid = fl.max_new[i] == 0 ? n == 0 : n >= 1 && n <= fl.max_new[i];
    for (auto t : out.sampled[i]) valid = valid && t >= 0 && t < st.model.vocab;
  }
  if (!valid) {
    const std::string why = "the last stage's sampled tokens do not match the step";
    logging::of("scheduler").error("step {}: {}", step, why);
    for (auto id : fl.ids) {
      auto it = st.requests.find(id);
      if (it != st.requests.end()) {
        it->second->in_flight = false;
        finish(self, id, "error", why);
      }
    }
    timing.reset();
    schedule(self);
    return;
  }
  if (fl.decode_only && out.passes >= 1 && out.compute_ms > 0) {
    const double per_pass = out.compute_ms / out.passes;
    st.pass_ms = st.pass_ms <= 0 ? per_pass : 0.8 * st.pass_ms + 0.2 * per_pass;
  }
  const auto now = clock::now();
  for (std::size_t i = 0; i < fl.ids.size(); ++i) {
    auto it = st.requests.find(fl.ids[i]);
    if (it == st.requests.end()) continue;
    auto& r = *it->second;
    const auto& sampled = out.sampled[i];
    r.in_flight = false;
    // Each pass after the first put the previous sampled token in the KV.
    r.computed +=
        fl.chunk[i] + std::max<std::int64_t>(0, static_cast<std::int64_t>(sampled.size()) - 1);
    const std::int64_t held = models::kv_cache::blocks_held(st.opts.kv, r.computed, r.computed);
    st.used_blocks -= r.held - held;  // the window freed what it no longer needs
    r.held = held;
    if (r.cancelled) {
      finish(self, r.req.id, r.deadline_hit ? "deadline" : "cancelled");
      continue;
    }
    if (sampled.empty()) continue;  // mid-prefill
    if (!r.has_first) {
      r.has_first = true;
      r.first_token = now;
    }
    token_event ev{r.req.id, {}, {}};
    auto reason = models::stop_reason::none;
    for (auto tok : sampled) {  // tokens past a stop are dropped (the KV goes with the request)
      ++r.draws;
      r.tokens.push_back(tok);
      r.history.push_back(tok);
      r.generated.push_back(tok);
      ev.tokens.push_back(tok);
      ++st.stats.tokens_out;
      ev.text += r.stop->feed(tok, r.decoder->push(tok));
      reason = r.stop->reason();
      if (reason != models::stop_reason::none) break;
    }
    if (reason != models::stop_reason::none && reason != models::stop_reason::stop_string)
      ev.text += r.stop->flush();
    r.text += ev.text;
    self->send(r.client, std::move(ev));
    r.stop_string = reason == models::stop_reason::stop_string;
    if (reason != models::stop_reason::none)
      finish(self, r.req.id, reason == models::stop_reason::max_tokens ? "length" : "stop");
  }
  check_deadlines(self);
  timing.reset();
  schedule(self);
}

void on_step_error(self_ptr self, std::uint64_t step, const caf::error& e) {
  auto& st = self->state;
  auto node = st.steps.extract(step);
  if (node.empty()) return;
  step_left(st, clock::now());
  const std::string why = describe(self->system(), e);
  if (troupe_code(e) == static_cast<std::uint8_t>(error_code::stage_failed)) {
    // The stage refused or failed this step: that would happen again.
    logging::of("scheduler").error("step {} failed: {}", step, why);
    for (auto id : node.mapped().ids) {
      auto it = st.requests.find(id);
      if (it == st.requests.end()) continue;
      it->second->in_flight = false;
      finish(self, id, "error", why);
    }
    schedule(self);
    return;
  }
  // A stage is gone (crashed, killed): stop stepping until the node has
  // restarted the pipeline; the requests then recompute.
  logging::of("scheduler").warn("step {}: {}; waiting for the pipeline to restart", step, why);
  if (!st.stalled) {
    st.stalled_epoch = st.epoch;
    st.stalled_since = steady::now();
    // Nobody restores it (a transfer failed, every process alive): the
    // requests fail after a while instead of waiting forever.
    self->delayed_send(self, stall_limit, tick_atom::value);
  }
  st.stalled = true;
  for (auto id : node.mapped().ids) {
    auto it = st.requests.find(id);
    if (it != st.requests.end()) it->second->in_flight = false;
  }
}

/// The node replaced every stage (empty: gave up). All KV is gone: every
/// running request goes back to the queue's front, oldest first, and
/// recomputes; steps still out are forgotten.
void on_reset(self_ptr self, std::vector<shard_actor> stages,
              std::vector<kv_store_actor> kv_stores) {
  auto& st = self->state;
  ++st.epoch;
  if (!st.steps.empty()) {
    st.steps.clear();
    step_left(st, clock::now());
  }
  st.stalled = false;
  st.used_blocks = 0;
  st.stages = std::move(stages);
  st.kv_stores = std::move(kv_stores);
  if (st.auto_micro_batches)
    st.opts.micro_batches = std::max<int>(1, static_cast<int>(st.stages.size()));
  std::vector<request_state*> running;
  for (auto& [id, r] : st.requests) {
    r->in_flight = false;
    r->seq = 0;
    r->held = 0;
    r->computed = 0;
    if (r->ph == phase::running) running.push_back(r.get());
  }
  std::sort(running.begin(), running.end(), [](const request_state* a, const request_state* b) {
    return a->admit_order > b->admit_order;
  });
  for (auto* r : running) {  // youngest first to the front: the oldest ends up first
    r->ph = phase::waiting;
    ++r->preemptions;
    ++st.stats.preemptions;
    ++st.queued;
    st.waiting.push_front(r->req.id);
  }
  std::vector<std::uint64_t> cancelled;
  for (auto& [id, r] : st.requests)
    if (r->cancelled) cancelled.push_back(id);
  for (auto id : cancelled)
    finish(self, id, st.requests[id]->deadline_hit ? "deadline" : "cancelled");
  if (st.stages.empty()) {
    st.failed =
        "the node gave up on the pipeline (a stage failed more often than allowed, or a remote "
        "stage is gone; the node logs why)";
    std::vector<std::uint64_t> ids;
    for (auto& [id, r] : st.requests) ids.push_back(id);
    for (auto id : ids) finish(self, id, "error", st.failed);
    return;
  }
  schedule(self);
}

/// Validates and tokenizes a request; the error names what is wrong.
caf::error prepare(scheduler_state& st, request_state& r) {
  auto& q = r.req;
  if (auto v = q.params.validate(); !v)
    return make_error(error_code::invalid_request, v.error().message);
  std::vector<std::int32_t> ids = q.prompt_tokens;
  if (ids.empty()) {
    if (q.prompt.empty())
      return make_error(error_code::invalid_request,
                        "the request has neither prompt text nor tokens");
    auto enc = st.model.tok->encode(q.prompt, true, true);
    if (!enc) return make_error(error_code::invalid_request, "prompt: " + enc.error().message);
    ids = std::move(*enc);
  }
  if (ids.empty())
    return make_error(error_code::invalid_request, "the prompt encodes to no tokens");
  for (auto t : ids)
    if (t < 0 || t >= st.model.vocab)
      return make_error(error_code::invalid_request,
                        "prompt token " + std::to_string(t) + " outside the vocabulary");
  const auto n_images = static_cast<std::int64_t>(q.images.size());
  if (st.model.image_token < 0) {
    if (n_images > 0)
      return make_error(error_code::invalid_request,
                        "this model has no vision encoder; the request has images");
  } else {
    auto x =
        models::expand_image_tokens(ids, st.model.image_token, st.model.tokens_per_image, n_images);
    if (!x) return make_error(error_code::invalid_request, x.error().message);
    ids = std::move(*x);
  }
  const auto total = static_cast<std::int64_t>(ids.size()) + q.params.max_tokens;
  const auto need = models::kv_cache::blocks_held(st.opts.kv, total - 1, total);
  if (need > st.opts.kv_blocks)
    return make_error(error_code::kv_exhausted,
                      "prompt (" + std::to_string(ids.size()) + " tokens) plus max_tokens (" +
                          std::to_string(q.params.max_tokens) + ") need " + std::to_string(need) +
                          " KV blocks; a stage has " + std::to_string(st.opts.kv_blocks));
  if (auto s = models::sampler::create(q.params); !s)
    return make_error(error_code::invalid_request, s.error().message);
  r.stop.emplace(r.req.params);
  r.decoder.emplace(*st.model.tok, true);
  r.tokens = std::move(ids);
  r.history.assign(r.tokens.begin(), r.tokens.end());
  r.prompt_len = static_cast<std::int64_t>(r.tokens.size());
  return {};
}

}  // namespace

scheduler_actor spawn_scheduler(caf::actor_system& sys, model_frontend model,
                                scheduler_options opts, std::vector<shard_actor> stages,
                                std::vector<kv_store_actor> kv_stores, encoder_actor encoder) {
  auto impl = [](self_ptr self, model_frontend model, scheduler_options opts,
                 std::vector<shard_actor> stages, std::vector<kv_store_actor> kv_stores,
                 encoder_actor encoder) -> scheduler_actor::behavior_type {
    auto& st = self->state;
    st.model = std::move(model);
    st.opts = std::move(opts);
    st.auto_micro_batches = st.opts.micro_batches < 1;
    st.opts.micro_batches = st.auto_micro_batches
                                ? std::max<int>(1, static_cast<int>(stages.size()))
                                : st.opts.micro_batches;
    st.stages = std::move(stages);
    st.kv_stores = std::move(kv_stores);
    st.encoder = std::move(encoder);
    st.stats.kv_total_blocks = st.opts.kv_blocks;
    return {
        [=](submit_atom, generate_request& req,
            client_sink_actor& client) -> caf::result<submit_ack> {
          auto& st = self->state;
          const auto id = req.id;
          if (!st.failed.empty()) return make_error(error_code::stage_failed, st.failed);
          if (id == 0) return make_error(error_code::invalid_request, "request id 0 is reserved");
          if (!st.seen_ids.insert(id).second) {
            ++st.stats.rejected;
            return make_error(error_code::duplicate_id,
                              "request " + std::to_string(id) + " was already submitted");
          }
          if (st.queued >= st.opts.queue_limit) {
            ++st.stats.rejected;
            return make_error(error_code::overloaded,
                              "the queue holds " + std::to_string(st.queued) + " requests (limit " +
                                  std::to_string(st.opts.queue_limit) + "); retry later");
          }
          auto r = std::make_unique<request_state>();
          r->req = std::move(req);
          r->client = std::move(client);
          r->submitted = clock::now();
          if (auto e = prepare(st, *r)) {
            ++st.stats.rejected;
            return e;
          }
          if (r->req.deadline_ms > 0) {
            r->deadline = r->submitted + std::chrono::milliseconds(r->req.deadline_ms);
            self->delayed_send(self, std::chrono::milliseconds(r->req.deadline_ms + 1),
                               tick_atom::value);
          }
          ++st.stats.accepted;
          ++st.queued;
          const auto ahead = st.queued - 1;
          auto& rs = *r;
          st.requests.emplace(id, std::move(r));
          if (rs.req.images.empty()) {
            rs.ph = phase::waiting;
            st.waiting.push_back(id);
            schedule(self);
            return submit_ack{id, ahead};
          }
          if (!st.encoder) {
            finish(self, id, "error", "no encoder for images");
            return submit_ack{id, ahead};
          }
          rs.images_pending = static_cast<std::int64_t>(rs.req.images.size());
          rs.image_rows.resize(rs.req.images.size());
          for (std::size_t k = 0; k < rs.req.images.size(); ++k) {
            encode_request er{id, std::move(rs.req.images[k])};
            self->request(st.encoder, caf::infinite, encode_atom::value, std::move(er))
                .then(
                    [=](encode_reply& rep) {
                      auto& st = self->state;
                      auto emb = tensor_registry::local().take(rep.embeddings);
                      auto it = st.requests.find(id);
                      if (it == st.requests.end()) return;
                      auto& r = *it->second;
                      if (!emb || emb->shape().ndim != 2 ||
                          emb->shape()[0] != st.model.tokens_per_image ||
                          emb->shape()[1] != st.model.hidden) {
                        finish(self, id, "error", "the encoder's output does not match the model");
                        return;
                      }
                      r.image_rows[k] = std::move(*emb);
                      r.preprocess_ms += rep.preprocess_ms;
                      r.encode_ms += rep.encode_ms;
                      if (--r.images_pending == 0 && r.ph == phase::encoding && !r.cancelled) {
                        r.ph = phase::waiting;
                        st.waiting.push_back(id);
                        schedule(self);
                      }
                    },
                    [=](caf::error& e) { finish(self, id, "error", describe(self->system(), e)); });
          }
          rs.req.images.clear();
          return submit_ack{id, ahead};
        },
        [=](cancel_atom, std::uint64_t id) -> bool {
          auto& st = self->state;
          auto it = st.requests.find(id);
          if (it == st.requests.end()) return false;
          if (it->second->in_flight) {
            it->second->cancelled = true;  // ends (and frees its KV) when its step returns
          } else {
            finish(self, id, "cancelled");
            schedule(self);
          }
          return true;
        },
        [=](stats_atom) {
          auto s = self->state.stats;
          s.queued = self->state.queued;
          s.running = static_cast<std::int64_t>(self->state.requests.size()) - self->state.queued;
          s.kv_used_blocks = self->state.used_blocks;
          s.stages = static_cast<std::int64_t>(self->state.stages.size());
          if (!self->state.steps.empty())
            s.in_flight_ms += ms_between(self->state.busy_since, clock::now());
          return s;
        },
        [](version_atom) { return protocol_version; },
        [=](tick_atom) {
          auto& st = self->state;
          if (st.stalled && st.stalled_epoch == st.epoch &&
              steady::now() - st.stalled_since >= stall_limit) {
            st.failed = "a stage's peer process was lost and no restored pipeline came within " +
                        std::to_string(
                            std::chrono::duration_cast<std::chrono::seconds>(stall_limit).count()) +
                        " s";
            logging::of("scheduler").error("{}", st.failed);
            std::vector<std::uint64_t> ids;
            for (auto& [id, r] : st.requests) ids.push_back(id);
            for (auto id : ids) finish(self, id, "error", st.failed);
            st.failed.clear();
            st.stalled = false;
          }
          check_deadlines(self);
          schedule(self);
        },
        [=](reset_atom, std::vector<shard_actor>& stages, std::vector<kv_store_actor>& kv_stores) {
          on_reset(self, std::move(stages), std::move(kv_stores));
        },
        [=](reset_atom, encoder_actor& e) { self->state.encoder = std::move(e); },
        [=](reset_atom, encoder_actor& e, bool drain) -> caf::result<bool> {
          auto old = std::exchange(self->state.encoder, std::move(e));
          if (!drain || !old) return true;
          auto rp = self->make_response_promise<bool>();
          self->send(old, flush_atom::value, std::int64_t{-1});
          self->request(old, std::chrono::seconds(60), version_atom::value)
              .then([rp](std::uint32_t) mutable { rp.deliver(true); },
                    [rp](caf::error&) mutable { rp.deliver(false); });
          return rp;
        },
        [=](pause_atom) -> caf::result<std::int64_t> {
          auto& st = self->state;
          st.paused = true;
          auto rp = self->make_response_promise<std::int64_t>();
          st.pause_waiters.push_back(rp);
          schedule(self);  // answers at once when nothing is in flight
          return rp;
        },
        [=](route_atom, std::int32_t index, shard_actor& shard, kv_store_actor& kv) {
          auto& st = self->state;
          if (index >= 0 && static_cast<std::size_t>(index) < st.stages.size() && shard && kv) {
            st.stages[static_cast<std::size_t>(index)] = std::move(shard);
            st.kv_stores[static_cast<std::size_t>(index)] = std::move(kv);
          } else {
            logging::of("scheduler")
                .error("route to stage {} of {}: ignored", index, st.stages.size());
          }
          st.paused = false;
          schedule(self);
        },
        [=](route_atom) {
          self->state.paused = false;
          schedule(self);
        },
    };
  };
  return sys.spawn(impl, std::move(model), std::move(opts), std::move(stages), std::move(kv_stores),
                   std::move(encoder));
}

}  // namespace troupe::actors
