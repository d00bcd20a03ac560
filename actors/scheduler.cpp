#include "actors/scheduler.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <map>
#include <optional>

#include "actors/clock.hpp"
#include "actors/data_plane.hpp"
#include "actors/log.hpp"
#include "models/grammar.hpp"
#include "models/llava.hpp"
#include "models/quant_mix.hpp"

// The scheduler actor is the shell of core::scheduler_core: the core
// decides (admission, steps, what outputs mean, when requests end); the
// shell tokenizes, has media (images, audio clips) encoded, turns planned steps into messages
// to the first stage, frees KV on the stores, streams the core's events to
// the clients and sets the core's timer.
//
// Image rows never pass through here: the encoder holds a request's rows
// until the request ends, and for each step that needs some the shell asks
// it to send them straight to the first stage's process (rows_atom); the
// step goes out once they are there, in planning order.

namespace troupe::actors {

namespace {

using kernels::tensor;

/// What the shell keeps of a request besides the core's state.
struct shell_request {
  client_sink_actor client;
  std::vector<media_data> media;   // kept to encode again if their holder is gone
  std::vector<std::int64_t> rows;  // each item's rows, as the prompt was expanded
  encoder_actor holder;            // the encoder holding the rows
  encoder_actor sent_to;           // the encoder of this round (its media out)
  std::uint64_t round = 0;         // the media's sendings to an encoder so far
  int died_under = 0;              // rounds whose encoder died before it answered
  std::size_t encoded = 0;         // items encoded (this round)
  std::vector<bool> ready;         // items the core was told are ready (admission counts each once)
  double preprocess_ms = 0, encode_ms = 0;
  std::optional<models::grammar_state> guide;  // a constrained request's place in its grammar
  std::vector<std::int64_t> ends;              // its stop tokens (the grammar's end)
  std::vector<std::uint64_t> mask;             // the tokens its grammar allows next
  // A streamed clip (media_data::stream): its item, its rows so far, whether
  // its last chunk came, and when a chunk last came (the idle limit).
  std::int32_t stream = -1;
  bool stream_closed = false;
  core::time_point last_chunk{};
};

/// The rows one sequence of a step needs: `here` image rows of request
/// `id` after the first `before`.
struct rows_fetch {
  std::size_t index = 0;  // of the sequence in the step
  std::uint64_t id = 0;
  std::int64_t before = 0, here = 0;
};

/// A planned step on its way to the first stage, waiting for image rows.
struct outgoing_step {
  std::uint64_t step = 0;
  step_batch batch;
  std::size_t waiting = 0;     // rows not yet at the first stage
  kv_store_actor first_store;  // the first stage's store when planned
};

struct scheduler_state {
  model_frontend model;
  std::optional<actor_clock_source> clk;  // the actor system's clock (virtual under test)
  std::optional<core::scheduler_core> core;
  std::vector<shard_actor> stages;
  std::vector<kv_store_actor> kv_stores;
  // The encoder replicas images go to (the one with the fewest of this
  // scheduler's images unanswered), and the images each encoder has
  // unanswered (also one left out of the pool, until it answers).
  std::vector<encoder_actor> encoders;
  std::vector<std::pair<encoder_actor, std::int64_t>> unanswered;
  std::uint64_t encoder_turn = 0;
  std::int64_t encodes = 0;   // items answered
  double encode_wait_ms = 0;  // their waits, summed
  // The clips among them: admitted, from the cache, out now, answered, waits.
  std::int64_t clips = 0, clip_cache_hits = 0, clips_waiting = 0, clip_encodes = 0;
  double clip_wait_ms = 0;
  // The videos among them, alike.
  std::int64_t videos = 0, video_cache_hits = 0, videos_waiting = 0, video_encodes = 0;
  double video_wait_ms = 0;
  std::map<std::uint64_t, shell_request> requests;
  std::vector<caf::typed_response_promise<std::int64_t>> pause_waiters;  // answered once idle
  std::optional<core::time_point> timer_at;        // the earliest tick already on its way
  std::deque<outgoing_step> outbox;                // planned, in order, not yet sent
  std::uint64_t epoch = 0;                         // pipelines so far (a reset voids the outbox)
  std::shared_ptr<const models::token_trie> trie;  // the vocabulary's, built for the first grammar
  // The books' block events, numbered [events_first, events_next), the
  // last kv_books::max_events kept for the head (kv_events_atom).
  std::deque<kv_block_event> events;
  std::uint64_t events_first = 0, events_next = 0;
  // The remote KV tier's store (none: no remote tier) and its process's
  // data-plane address, named in the steps that copy to or from it.
  kv_vault_actor vault;
  std::vector<std::uint8_t> vault_address;
  load_gauge held;                  // the requests held, for the head's router (may be none)
  std::int64_t stream_idle_ms = 0;  // scheduler_options::stream_idle_ms
};

using self_ptr = scheduler_actor::stateful_pointer<scheduler_state>;

void pump(self_ptr self);

kv_block_event to_message(const core::kv_books::event& e) {
  kv_block_event m;
  m.what = static_cast<std::uint8_t>(e.what);
  m.tier = static_cast<std::uint8_t>(e.tier);
  if (e.what != core::kv_books::event::kind::cleared) m.name.assign(e.name.begin(), e.name.end());
  return m;
}

/// Takes the core's block events into the numbered log.
void collect_events(self_ptr self) {
  auto& st = self->state;
  bool overflowed = false;
  auto fresh = st.core->take_block_events(&overflowed);
  if (overflowed) {  // some were lost: every follower starts over
    st.events.clear();
    st.events_first = st.events_next;
  }
  for (const auto& e : fresh) {
    st.events.push_back(to_message(e));
    ++st.events_next;
  }
  while (st.events.size() > core::kv_books::max_events) {
    st.events.pop_front();
    ++st.events_first;
  }
}

/// The events from number `since` on, or the cache's contents when the
/// log no longer (or never) had that number.
kv_events events_since(self_ptr self, std::uint64_t since) {
  collect_events(self);
  auto& st = self->state;
  kv_events out;
  out.next = st.events_next;
  if (since >= st.events_first && since <= st.events_next) {
    out.events.assign(st.events.begin() + static_cast<std::ptrdiff_t>(since - st.events_first),
                      st.events.end());
    return out;
  }
  out.resync = true;
  out.events.push_back(to_message(core::kv_books::event{core::kv_books::event::kind::cleared}));
  for (const auto& [name, tier] : st.core->books().contents())
    out.events.push_back(
        to_message(core::kv_books::event{core::kv_books::event::kind::stored, name, tier}));
  return out;
}

/// Frees a sequence's blocks on every store; the core's books follow once
/// all have.
void free_kv(self_ptr self, const core::kv_release& rel) {
  auto& st = self->state;
  if (st.kv_stores.empty()) {
    st.core->kv_freed(rel.blocks, rel.epoch);
    return;
  }
  auto remaining = std::make_shared<std::size_t>(st.kv_stores.size());
  auto done = [=] {
    if (--*remaining > 0) return;
    self->state.core->kv_freed(rel.blocks, rel.epoch);
    pump(self);
  };
  for (auto& kv : st.kv_stores) {
    self->request(kv, caf::infinite, free_atom::value, std::vector<std::int64_t>{rel.seq})
        .then([=](std::int64_t) { done(); },
              [=](caf::error& e) {
                logging::of("scheduler")
                    .warn("freeing KV of sequence {}: {}", rel.seq, self->system().render(e));
                done();
              });
  }
}

/// Carries out the core's events: tokens and ends to the clients, KV frees
/// to the stores.
void emit(self_ptr self, core::core_events events) {
  auto& st = self->state;
  for (auto& ev : events) {
    if (auto* t = std::get_if<core::tokens_out>(&ev)) {
      auto it = st.requests.find(t->id);
      if (it == st.requests.end()) continue;
      if (auto& g = it->second.guide) {
        // Advance the grammar, and find what it allows next (the next
        // step's mask) now: a dead end fails the request here.
        bool ok = true, ended = false;
        for (auto tok : t->tokens) {
          const auto& ends = it->second.ends;
          if (std::find(ends.begin(), ends.end(), tok) != ends.end()) {
            ended = true;  // its end: request_done follows
            break;
          }
          ok = static_cast<std::size_t>(tok) < st.trie->vocab() && g->accept(st.trie->piece(tok));
          if (!ok) break;
        }
        if (ok && !ended) {
          it->second.mask = g->allowed(*st.trie, it->second.ends);
          ok = std::any_of(it->second.mask.begin(), it->second.mask.end(),
                           [](std::uint64_t x) { return x != 0; });
        }
        if (!ok) {
          const auto id = t->id;
          logging::of("scheduler").warn("request {}: its grammar allows no token next", id);
          self->send(it->second.client, token_event{id, std::move(t->tokens), std::move(t->text),
                                                    std::move(t->logprobs)});
          emit(self, st.core->fail(id, error_code::invalid_request,
                                   "the grammar reached a point where no token of this model's "
                                   "vocabulary can continue it"));
          continue;
        }
      }
      // Logprobs carry their tokens' bytes: the gateway has no tokenizer.
      auto piece = [&](std::int32_t id) -> std::string {
        if (!st.model.tok) return {};
        auto p = st.model.tok->token_to_piece(id);
        return p ? std::move(*p) : std::string{};
      };
      for (auto& lp : t->logprobs) {
        lp.piece = piece(lp.token);
        lp.top_pieces.clear();
        for (auto id : lp.top_ids) lp.top_pieces.push_back(piece(id));
      }
      self->send(it->second.client, token_event{t->id, std::move(t->tokens), std::move(t->text),
                                                std::move(t->logprobs)});
    } else if (auto* d = std::get_if<core::request_done>(&ev)) {
      auto it = st.requests.find(d->id);
      if (it == st.requests.end()) continue;
      if (d->reason == finish_reason::error)
        logging::of("scheduler").warn("request {} failed: {}", d->id, d->error);
      finish_event f;
      f.id = d->id;
      f.reason = d->reason;
      if (d->reason == finish_reason::error) f.code = d->code;
      f.error = std::move(d->error);
      f.tokens = std::move(d->tokens);
      f.text = std::move(d->text);
      f.prompt_tokens = d->prompt_tokens;
      f.preemptions = d->preemptions;
      f.cached_tokens = d->cached_tokens;
      f.queue_ms = d->queue_ms;
      f.ttft_ms = d->ttft_ms;
      f.total_ms = d->total_ms;
      f.stop_string = d->stop_string;
      f.preprocess_ms = it->second.preprocess_ms;
      f.encode_ms = it->second.encode_ms;
      self->send(it->second.client, std::move(f));
      if (it->second.holder) self->send(it->second.holder, forget_atom::value, d->id);
      // A stream's encoder holds its state from the start (the rows' holder
      // is set only once the other media are encoded).
      if (it->second.stream >= 0 && it->second.sent_to && it->second.sent_to != it->second.holder)
        self->send(it->second.sent_to, forget_atom::value, d->id);
      st.requests.erase(it);
    } else if (auto* k = std::get_if<core::kv_release>(&ev)) {
      free_kv(self, *k);
    }
  }
  if (st.held) st.held->store(static_cast<std::int64_t>(st.core->held()));
}

/// A planned step as the first stage's message, and the image rows its
/// sequences need (fetched from the encoder before it goes).
step_batch to_message(self_ptr self, core::step_plan& plan, std::vector<rows_fetch>& fetches) {
  auto& st = self->state;
  step_batch batch;
  batch.step = plan.step;
  batch.decode_steps = plan.decode_steps;
  batch.return_logits = false;
  batch.moves = std::move(plan.moves);
  for (const auto& m : batch.moves)
    if (m.from == static_cast<std::uint8_t>(models::kv_tier::remote) ||
        m.to == static_cast<std::uint8_t>(models::kv_tier::remote)) {
      batch.vault = st.vault;
      batch.vault_address = st.vault_address;
      break;
    }
  for (auto& p : plan.seqs) {
    seq_work w;
    w.seq = p.seq;
    w.start = p.start;
    w.tokens = std::move(p.tokens);
    w.sample = p.sample;
    w.blocks_from = p.blocks_from;
    w.blocks = std::move(p.blocks);
    if (p.sample) {
      w.sampling.params = std::move(p.params);
      w.sampling.draws = p.draws;
      w.sampling.max_new = p.max_new;
      w.sampling.history = std::move(p.history);
      if (auto it = st.requests.find(p.id); it != st.requests.end() && it->second.guide)
        w.sampling.allowed = it->second.mask;
    }
    const auto img = st.model.image_token;
    const auto here = img >= 0 ? std::count(w.tokens.begin(), w.tokens.end(), img) : 0;
    if (here > 0 && st.requests.count(p.id))
      fetches.push_back({batch.seqs.size(), p.id, p.image_rows_before, here});
    batch.seqs.push_back(std::move(w));
  }
  return batch;
}

void on_step_output(self_ptr self, std::uint64_t step, step_output& out) {
  if (!out.logits.empty()) data_plane::local().drop(out.logits);
  core::step_result res;
  res.sampled = std::move(out.sampled);
  res.logprobs = std::move(out.logprobs);
  res.compute_ms = out.compute_ms;
  res.stage_ms = std::move(out.stage_ms);
  res.passes = out.passes;
  emit(self, self->state.core->step_done(step, std::move(res)));
  pump(self);
}

void on_step_error(self_ptr self, std::uint64_t step, const caf::error& e) {
  const std::string why = describe(self->system(), e);
  const bool refused = troupe_code(e) == static_cast<std::uint8_t>(error_code::stage_failed);
  if (refused)
    logging::of("scheduler").error("step {} failed: {}", step, why);
  else
    logging::of("scheduler").warn("step {}: {}; waiting for the pipeline to restart", step, why);
  emit(self, self->state.core->step_failed(
                 step, refused ? core::step_failure::refused : core::step_failure::peer_lost, why));
  pump(self);
}

/// Has the core's next tick delivered in time.
void arm_timer(self_ptr self) {
  auto& st = self->state;
  const auto when = st.core->next_wakeup();
  if (!when || (st.timer_at && *st.timer_at <= *when)) return;
  st.timer_at = *when;
  const auto delay = std::max(core::duration::zero(), *when - st.clk->now());
  self->delayed_send(
      self,
      std::chrono::duration_cast<std::chrono::microseconds>(delay) + std::chrono::milliseconds(1),
      tick_atom::value);
}

/// Sends the steps at the head of the outbox whose image rows are at the
/// first stage, in planning order.
void send_ready(self_ptr self) {
  auto& st = self->state;
  while (!st.outbox.empty() && st.outbox.front().waiting == 0) {
    auto o = std::move(st.outbox.front());
    st.outbox.pop_front();
    const auto step = o.step;
    self->request(st.stages.front(), caf::infinite, step_atom::value, std::move(o.batch))
        .then([=](step_output& out) { on_step_output(self, step, out); },
              [=](caf::error& e) { on_step_error(self, step, e); });
  }
}

/// Rows sent to a first stage that no step will bring there (the step was
/// voided by a pipeline reset): its process takes and drops them.
void discard(const kv_store_actor& store, const tensor_ref& ref) {
  if (store)
    caf::anon_send(store, discard_atom::value, ref);
  else
    data_plane::local().drop(ref);  // one process, no stores: parked here
}

/// The answer to a rows fetch: the rows' ref, or none (the request failed;
/// its sequence goes without them and is dropped when the step returns).
void settle(self_ptr self, std::uint64_t epoch, std::uint64_t step, const rows_fetch& f,
            std::optional<tensor_ref> ref, const kv_store_actor& store) {
  auto& st = self->state;
  auto it = std::find_if(st.outbox.begin(), st.outbox.end(),
                         [&](const outgoing_step& o) { return o.step == step; });
  if (epoch != st.epoch || it == st.outbox.end()) {
    if (ref) discard(store, *ref);
    return;
  }
  if (ref) {
    auto& w = it->batch.seqs[f.index];
    w.embed_token = st.model.image_token;
    w.embeddings = std::move(*ref);
  }
  --it->waiting;
  send_ready(self);
}

void encode_images(self_ptr self, std::uint64_t id, std::function<void()> again);

/// How long the encoder holding a request's rows may take to send them
/// before they are encoded again elsewhere (a holder on a node that went
/// away answers nothing).
constexpr auto rows_timeout = std::chrono::seconds(30);
constexpr int max_encodes = 3;

/// Has the encoder holding request f.id's rows send those of `f` to the
/// first stage's process. If none holds them any more (the encoder moved,
/// or was lost), the images are encoded again on the current encoder (a
/// few times at most: encoders moving back to back).
void fetch_rows(self_ptr self, std::uint64_t step, rows_fetch f, int encodes_left) {
  auto& st = self->state;
  const auto epoch = st.epoch;
  const auto store = st.kv_stores.empty() ? kv_store_actor{} : st.kv_stores.front();
  auto it = st.requests.find(f.id);
  if (it == st.requests.end()) return settle(self, epoch, step, f, std::nullopt, store);
  auto give_up = [=](error_code code, const std::string& why) {
    auto& st = self->state;
    emit(self, st.core->fail(f.id, code, "image rows for the first stage: " + why));
    settle(self, epoch, step, f, std::nullopt, store);
  };
  auto encode_again = [=] {
    encode_images(self, f.id, [=] { fetch_rows(self, step, f, encodes_left - 1); });
  };
  if (!it->second.holder) {
    if (encodes_left > 0 && !st.encoders.empty()) return encode_again();
    return give_up(error_code::internal, "no encoder holds them");
  }
  media_rows_request q{f.id, f.before, f.here, to_string(st.stages.front()->node())};
  self->request(it->second.holder, rows_timeout, rows_atom::value, std::move(q))
      .then([=](tensor_ref& ref) { settle(self, epoch, step, f, std::move(ref), store); },
            [=](caf::error& e) {
              auto& st = self->state;
              if (epoch != st.epoch) return;  // the step is void anyway
              if (encodes_left > 0 && st.requests.count(f.id) && !st.encoders.empty()) {
                logging::of("scheduler")
                    .warn("image rows of request {}: {}; encoding its images again", f.id,
                          describe(self->system(), e));
                return encode_again();
              }
              const auto code = troupe_code(e);
              give_up(code ? static_cast<error_code>(code) : error_code::internal,
                      describe(self->system(), e));
            });
}

/// The encoder changed: rows held by another one are encoded again on the
/// new one when a step needs them (the old one stops).
void forget_holders(scheduler_state& st, const encoder_actor& old) {
  for (auto& [id, r] : st.requests)
    if (r.holder && (!old || r.holder == old)) r.holder = encoder_actor{};
}

bool in_pool(const scheduler_state& st, const encoder_actor& e) {
  return std::find(st.encoders.begin(), st.encoders.end(), e) != st.encoders.end();
}

std::int64_t& unanswered_of(scheduler_state& st, const encoder_actor& e) {
  for (auto& [enc, n] : st.unanswered)
    if (enc == e) return n;
  return st.unanswered.emplace_back(e, 0).second;
}

/// Drops the counts of encoders out of the pool with nothing unanswered.
void prune_unanswered(scheduler_state& st) {
  std::erase_if(st.unanswered,
                [&](const auto& u) { return u.second <= 0 && !in_pool(st, u.first); });
}

/// The pool's encoder with the fewest images unanswered (ties in turn).
encoder_actor pick_encoder(scheduler_state& st) {
  if (st.encoders.empty()) return {};
  const auto n = st.encoders.size();
  const auto start = static_cast<std::size_t>(st.encoder_turn++ % n);
  encoder_actor best;
  std::int64_t least = 0;
  for (std::size_t k = 0; k < n; ++k) {
    const auto& e = st.encoders[(start + k) % n];
    const auto load = unanswered_of(st, e);
    if (!best || load < least) {
      best = e;
      least = load;
    }
  }
  return best;
}

/// Sends every step the core plans (through the outbox, once its image
/// rows are at the first stage), answers a pause once nothing is in flight
/// and keeps the timer set.
void pump(self_ptr self) {
  auto& st = self->state;
  core::core_events out;
  while (auto plan = st.core->plan_step(out)) {
    std::vector<rows_fetch> fetches;
    outgoing_step o;
    o.step = plan->step;
    o.batch = to_message(self, *plan, fetches);
    o.waiting = fetches.size();
    o.first_store = st.kv_stores.empty() ? kv_store_actor{} : st.kv_stores.front();
    st.outbox.push_back(std::move(o));
    for (const auto& f : fetches) fetch_rows(self, plan->step, f, max_encodes);
  }
  send_ready(self);
  emit(self, std::move(out));
  if (st.core->paused() && st.core->steps_in_flight() == 0) {
    for (auto& w : st.pause_waiters) w.deliver(st.core->running());
    st.pause_waiters.clear();
  }
  arm_timer(self);
  collect_events(self);  // the books' buffer stays small between the head's reads
  if (st.held) st.held->store(static_cast<std::int64_t>(st.core->held()));
}

/// Tokenizes a request and expands its media's placeholders; `rows` gets
/// each item's rows (in prompt order).
std::expected<core::request_spec, core::core_error> prepare(const model_frontend& model,
                                                            const generate_request& q,
                                                            std::vector<std::int64_t>& rows) {
  auto bad = [](std::string why) {
    return std::unexpected(core::core_error{error_code::invalid_request, std::move(why)});
  };
  core::request_spec spec;
  spec.tokens = q.prompt_tokens;
  if (spec.tokens.empty()) {
    if (q.prompt.empty()) return bad("the request has neither prompt text nor tokens");
    auto enc = model.tok->encode(q.prompt, true, true);
    if (!enc) return bad("prompt: " + enc.error().message);
    spec.tokens = std::move(*enc);
  }
  // The media in the order of the prompt's placeholders (the rows of
  // item k follow those of items 0..k-1), each with its rows.
  std::int64_t n_images = 0, n_clips = 0, n_videos = 0;
  for (const auto& m : q.media)
    (m.kind == media_kind::audio   ? n_clips
     : m.kind == media_kind::video ? n_videos
                                   : n_images) += 1;
  if (n_clips != static_cast<std::int64_t>(q.audio_tokens.size()))
    return bad(std::to_string(n_clips) + " audio clips with token counts for " +
               std::to_string(q.audio_tokens.size()));
  if (n_videos != static_cast<std::int64_t>(q.video_tokens.size()))
    return bad(std::to_string(n_videos) + " videos with token counts for " +
               std::to_string(q.video_tokens.size()));
  if (n_clips > 0 && model.audio_token < 0) return bad("audio clips need a model that hears");
  if (n_videos > 0 && model.video_token < 0) return bad("videos need a model that sees video");
  // A streamed clip: one at most, the last of the media (its rows end the
  // prompt's media); its token count grows as it comes (0 now).
  std::int64_t streams = 0;
  for (std::size_t k = 0; k < q.media.size(); ++k) {
    if (!q.media[k].stream) continue;
    if (q.media[k].kind != media_kind::audio) return bad("only audio clips can be streamed");
    if (++streams > 1) return bad("at most one streamed audio clip per request");
    if (k + 1 != q.media.size())
      return bad("a streamed audio clip must be the request's last medium");
    if (!q.media[k].bytes.empty())
      return bad("a streamed audio clip comes in chunks, not with the request");
  }
  for (std::size_t k = 0; k < q.audio_tokens.size(); ++k)
    if (q.audio_tokens[k] < 1 && !(streams > 0 && k + 1 == q.audio_tokens.size()))
      return bad("an audio clip with no tokens");
  if (streams > 0 && q.audio_tokens.back() != 0)
    return bad("a streamed audio clip's token count is not known before it comes (0)");
  for (auto n : q.video_tokens)
    if (n < 1) return bad("a video with no tokens");
  rows.clear();
  std::size_t clip = 0, video = 0;
  for (auto t : spec.tokens) {
    const bool image = t == model.image_token && model.image_token >= 0;
    const bool audio = t == model.audio_token && model.audio_token >= 0;
    const bool vid = t == model.video_token && model.video_token >= 0;
    if (!image && !audio && !vid) continue;
    const auto k = rows.size();
    const auto kind = audio ? media_kind::audio : vid ? media_kind::video : media_kind::image;
    const auto a = [](media_kind m) {
      return std::string(m == media_kind::video ? "a " : "an ") + to_string(m);
    };
    if (k < q.media.size() && q.media[k].kind != kind)
      return bad("media item " + std::to_string(k) + " is " + a(q.media[k].kind) +
                 " but the prompt's placeholder " + std::to_string(k) + " is for " + a(kind));
    if (audio) {
      rows.push_back(clip < q.audio_tokens.size() ? q.audio_tokens[clip] : 0);
      ++clip;
    } else if (vid) {
      rows.push_back(video < q.video_tokens.size() ? q.video_tokens[video] : 0);
      ++video;
    } else {
      rows.push_back(model.tokens_per_image);
    }
  }
  // A stream's placeholder splits the prompt: the tokens before it (with
  // every other medium) and the tail after it, which follows its rows.
  std::vector<std::int32_t> tail;
  std::span<const std::int64_t> clip_tokens(q.audio_tokens);
  if (streams > 0) {
    auto at = std::find(spec.tokens.rbegin(), spec.tokens.rend(), model.audio_token);
    if (at == spec.tokens.rend()) return bad("the streamed audio clip has no placeholder");
    const auto pos = static_cast<std::size_t>(spec.tokens.rend() - at) - 1;
    tail.assign(spec.tokens.begin() + static_cast<std::ptrdiff_t>(pos) + 1, spec.tokens.end());
    spec.tokens.resize(pos);
    clip_tokens = clip_tokens.first(clip_tokens.size() - 1);
    rows.pop_back();
  }
  if (model.image_token >= 0 && !spec.tokens.empty()) {
    auto x = models::expand_media_tokens(spec.tokens, model.image_token, model.tokens_per_image,
                                         n_images, model.audio_token, clip_tokens,
                                         model.video_token, q.video_tokens);
    if (!x) return bad(x.error().message);
    spec.tokens = std::move(*x);
  }
  spec.params = q.params;
  spec.deadline_ms = q.deadline_ms;
  spec.images = static_cast<std::int64_t>(q.media.size()) - streams;
  if (n_clips + n_videos - streams > 0) spec.media_rows = rows;
  spec.stream = streams > 0;
  spec.tail = std::move(tail);
  if (streams > 0) rows.push_back(0);  // the stream's, as it grows
  spec.guided = !q.grammar.empty();
  spec.cache_salt = q.cache_salt;
  spec.priority = q.priority;
  spec.resumed = q.resumed;
  return spec;
}

/// The vocabulary's bytes in a trie, for grammars (special tokens have
/// none: a grammar never allows them by their text).
std::shared_ptr<const models::token_trie> vocabulary_trie(const model_frontend& model) {
  std::vector<std::string> pieces(static_cast<std::size_t>(std::max<std::int64_t>(model.vocab, 0)));
  for (std::size_t id = 0; id < pieces.size() && model.tok; ++id) {
    const auto tid = static_cast<models::token_id>(id);
    if (model.tok->is_special(tid)) continue;
    if (auto p = model.tok->token_to_piece(tid)) pieces[id] = std::move(*p);
  }
  return std::make_shared<const models::token_trie>(pieces);
}

/// Sends a request's images to the encoder, which keeps their rows. The
/// first time (`again` empty) each encoded image counts towards the
/// request's admission; encoding again (the holder is gone), `again` runs
/// once every image has answered, whatever the answers.
void encode_images(self_ptr self, std::uint64_t id, std::function<void()> again) {
  auto& st = self->state;
  auto rit = st.requests.find(id);
  if (rit == st.requests.end()) {
    if (again) again();
    return;
  }
  // A streamed clip's samples were the encoder's alone: lost with it.
  if (rit->second.stream >= 0 && rit->second.round > 0) {
    emit(self, st.core->fail(id, error_code::peer_lost,
                             "the encoder of its streamed audio clip is gone, with the clip"));
    if (again) again();
    return;
  }
  const auto enc = pick_encoder(st);
  if (!enc) {
    emit(self, st.core->fail(id, error_code::unavailable, "no media encoder serves now"));
    if (again) again();
    return;
  }
  rit->second.holder = encoder_actor{};
  rit->second.sent_to = enc;
  rit->second.encoded = 0;
  const auto round = ++rit->second.round;
  const auto n = rit->second.media.size();
  // The items whose rows must all be there before its holder serves them
  // (a stream's come as it goes: with no other item, at once).
  const auto whole = n - (rit->second.stream >= 0 ? 1 : 0);
  if (whole == 0) rit->second.holder = enc;
  unanswered_of(st, enc) += static_cast<std::int64_t>(n);
  const auto sent_at = std::chrono::steady_clock::now();
  // Counts an answer (or an error) of `enc`: its load and the wait.
  auto counted = [self, enc, sent_at](media_kind kind) {
    auto& st = self->state;
    --unanswered_of(st, enc);
    ++st.encodes;
    const double waited =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - sent_at)
            .count();
    st.encode_wait_ms += waited;
    if (kind == media_kind::audio) {
      --st.clips_waiting;
      ++st.clip_encodes;
      st.clip_wait_ms += waited;
    } else if (kind == media_kind::video) {
      --st.videos_waiting;
      ++st.video_encodes;
      st.video_wait_ms += waited;
    }
    prune_unanswered(st);
  };
  auto left = std::make_shared<std::size_t>(n);
  auto answered = [self, again, left] {
    if (--*left == 0 && again) again();
    pump(self);
  };
  for (std::size_t k = 0; k < n; ++k) {
    encode_request er{id, static_cast<std::int32_t>(k), rit->second.media[k]};
    const auto kind = er.item.kind;
    const bool streamed = static_cast<std::int32_t>(k) == rit->second.stream;
    if (kind == media_kind::audio) ++st.clips_waiting;
    if (kind == media_kind::video) ++st.videos_waiting;
    self->request(enc, caf::infinite, encode_atom::value, std::move(er))
        .then(
            [=](encode_reply& rep) {
              counted(kind);
              auto& st = self->state;
              auto it = st.requests.find(id);
              if (it == st.requests.end()) {  // ended meanwhile: the encoder may let go
                self->send(enc, forget_atom::value, id);
                return answered();
              }
              if (rep.rows != it->second.rows[k] || rep.hidden != st.model.hidden) {
                emit(self, st.core->fail(
                               id, error_code::internal,
                               "the encoder's output for " +
                                   std::string(to_string(it->second.media[k].kind)) + " " +
                                   std::to_string(k) + " (" + std::to_string(rep.rows) + "x" +
                                   std::to_string(rep.hidden) + ") does not match the prompt's " +
                                   std::to_string(it->second.rows[k]) + "x" +
                                   std::to_string(st.model.hidden)));
                return answered();
              }
              if (!again) {
                it->second.preprocess_ms += rep.preprocess_ms;
                it->second.encode_ms += rep.encode_ms;
              }
              // A stream's end was its last chunk's answer (the core has
              // its rows): it is neither named nor counted for admission.
              if (streamed) return answered();
              // Only this round's answers count: the images of a round
              // sent to an encoder that was lost went out again since.
              if (round == it->second.round && ++it->second.encoded == whole)
                it->second.holder = enc;
              if (!again) {
                // Once per image, also when it was sent again to an encoder
                // that replaced a lost one.
                auto& ready = it->second.ready;
                ready.resize(it->second.media.size());
                if (!ready[k]) {
                  ready[k] = true;
                  if (kind == media_kind::audio && rep.cached) ++st.clip_cache_hits;
                  if (kind == media_kind::video && rep.cached) ++st.video_cache_hits;
                  // The encoder's name for the image (its pixels) names the
                  // KV of its rows.
                  std::optional<core::block_hash> name;
                  if (rep.hash.size() == 32) {
                    name.emplace();
                    std::copy(rep.hash.begin(), rep.hash.end(), name->begin());
                  }
                  st.core->image_ready(id, static_cast<std::int64_t>(k), name, rep.cached);
                }
              }
              answered();
            },
            [=](caf::error& e) {
              counted(kind);
              auto it = self->state.requests.find(id);
              if (it == self->state.requests.end() || round != it->second.round) {
                // A round that was sent again (its encoder was lost): the
                // new round has these images too.
                answered();
                return;
              }
              // The encoder died (its node lost) before the head's word of
              // it: it leaves the pool and the images go to another, as
              // the head's encoders_atom would have them.
              if (e == caf::sec::request_receiver_down && ++it->second.died_under <= 3) {
                auto& st = self->state;
                std::erase(st.encoders, enc);
                logging::of("scheduler")
                    .warn("request {}: its images' encoder is gone; encoding them again", id);
                encode_images(self, id, again);
                return;
              }
              const auto code = troupe_code(e);
              emit(self, self->state.core->fail(
                             id, code ? static_cast<error_code>(code) : error_code::internal,
                             describe(self->system(), e)));
              answered();
            });
  }
}

/// Checks request `id`'s stream for idleness when its limit may be up.
void arm_stream_timer(self_ptr self, std::uint64_t id) {
  const auto ms = self->state.stream_idle_ms;
  if (ms <= 0) return;
  self->delayed_send(self, std::chrono::milliseconds(ms), chunk_atom::value, id);
}

/// A piece of a request's streamed clip, to the encoder that has the
/// clip; its answer (the windows it completed are encoded) grows the
/// prompt by their rows, or, with the last piece, ends it.
caf::result<stream_progress> take_chunk(self_ptr self, audio_chunk c) {
  auto& st = self->state;
  auto it = st.requests.find(c.id);
  if (it == st.requests.end() || it->second.stream < 0)
    return make_error(error_code::not_found,
                      "request " + std::to_string(c.id) + " has no streamed audio clip here");
  auto& r = it->second;
  if (r.stream_closed)
    return make_error(error_code::invalid_request, "request " + std::to_string(c.id) +
                                                       ": its streamed audio clip already ended");
  if (!r.sent_to)
    return make_error(error_code::unavailable, "request " + std::to_string(c.id) +
                                                   ": no encoder has its streamed audio clip");
  if (c.pcm.size() % 2 != 0) {
    emit(self, st.core->fail(c.id, error_code::invalid_request,
                             "a chunk of its streamed audio clip holds an odd byte count (" +
                                 std::to_string(c.pcm.size()) + "): 16-bit samples are two bytes"));
    pump(self);
    return make_error(error_code::invalid_request, "a chunk of 16-bit PCM with an odd byte count");
  }
  c.index = r.stream;
  r.stream_closed = c.last;
  r.last_chunk = st.clk->now();
  const auto id = c.id;
  const auto k = static_cast<std::size_t>(r.stream);
  auto rp = self->make_response_promise<stream_progress>();
  self->request(r.sent_to, caf::infinite, chunk_atom::value, std::move(c))
      .then(
          [=](stream_progress& p) mutable {
            auto& st = self->state;
            auto it = st.requests.find(id);
            if (it != st.requests.end() && k < it->second.rows.size()) {
              it->second.rows[k] = p.rows;
              emit(self,
                   p.done ? st.core->close_stream(id, p.rows) : st.core->extend_stream(id, p.rows));
              pump(self);
            }
            rp.deliver(p);
          },
          [=](caf::error& e) mutable {
            auto& st = self->state;
            const auto code = troupe_code(e);
            emit(self,
                 st.core->fail(id, code ? static_cast<error_code>(code) : error_code::internal,
                               describe(self->system(), e)));
            pump(self);
            rp.deliver(std::move(e));
          });
  return rp;
}

/// The encoder pool is now `pool`; the encoders in `lost` are gone with
/// their rows: what they were encoding goes out again. Answers the
/// requests whose rows are held by an encoder outside the pool.
std::int64_t set_pool(self_ptr self, std::vector<encoder_actor> pool,
                      const std::vector<encoder_actor>& lost) {
  auto& st = self->state;
  std::erase_if(pool, [](const encoder_actor& e) { return !e; });
  st.encoders = std::move(pool);
  auto gone = [&](const encoder_actor& e) {
    return e && std::find(lost.begin(), lost.end(), e) != lost.end();
  };
  std::erase_if(st.unanswered, [&](const auto& u) { return gone(u.first); });
  prune_unanswered(st);
  std::vector<std::uint64_t> again;
  std::int64_t held_outside = 0;
  for (auto& [id, r] : st.requests) {
    if (gone(r.holder)) r.holder = encoder_actor{};
    if (!r.media.empty() && r.encoded < r.media.size() && gone(r.sent_to)) again.push_back(id);
    if (r.holder && !in_pool(st, r.holder)) ++held_outside;
  }
  for (auto id : again) encode_images(self, id, {});
  pump(self);
  return held_outside;
}

}  // namespace

std::string cache_namespace(const std::string& model, const models::quant_plan& plan,
                            const models::kv_options& kv) {
  std::string s = "model=" + model + ";weights=";
  if (plan.mix)
    s += "mix:" + std::string(models::to_string(*plan.mix));
  else if (plan.default_format)
    s += std::string(kernels::to_string(*plan.default_format));
  else
    s += "as-stored";
  s += ";group=" + std::to_string(plan.int4_group);
  for (const auto& [pattern, f] : plan.overrides)
    s += ";" + pattern + "=" + std::string(kernels::to_string(f));
  s += ";kv=" + std::string(kernels::to_string(kv.type)) + "/" + std::to_string(kv.block_size) +
       (kv.summaries ? "/summaries" : "");
  return s;
}

scheduler_actor spawn_scheduler(caf::actor_system& sys, model_frontend model,
                                scheduler_options opts, std::vector<shard_actor> stages,
                                std::vector<kv_store_actor> kv_stores, encoder_actor encoder,
                                load_gauge held) {
  auto impl = [](self_ptr self, model_frontend model, scheduler_options opts,
                 std::vector<shard_actor> stages, std::vector<kv_store_actor> kv_stores,
                 encoder_actor encoder, load_gauge held) -> scheduler_actor::behavior_type {
    auto& st = self->state;
    st.held = std::move(held);
    st.stream_idle_ms = opts.stream_idle_ms;
    st.model = model;
    st.clk.emplace(self->clock());
    const bool store = opts.remote_blocks > 0;
    st.core.emplace(std::move(model), std::move(opts), static_cast<int>(stages.size()), *st.clk);
    if (store) st.core->remote_online(false);  // until the store is there (vault_atom)
    st.stages = std::move(stages);
    st.kv_stores = std::move(kv_stores);
    if (encoder) st.encoders.push_back(std::move(encoder));
    return {
        [=](submit_atom, generate_request& req,
            client_sink_actor& client) -> caf::result<submit_ack> {
          auto& st = self->state;
          const auto id = req.id;
          // A grammar is compiled, and its first mask found, before the
          // request is taken: one that no token can start is refused.
          std::optional<models::grammar_state> guide;
          std::vector<std::uint64_t> mask;
          if (!req.grammar.empty()) {
            auto g = models::grammar::parse(req.grammar);
            if (!g) return make_error(error_code::invalid_request, g.error().message);
            if (!st.trie) st.trie = vocabulary_trie(st.model);
            guide.emplace(*g);
            // A resumed request's grammar continues after its resumed tokens.
            const auto& ends = req.params.stop_token_ids;
            for (auto tok : req.resumed) {
              if (std::find(ends.begin(), ends.end(), tok) != ends.end()) break;
              if (static_cast<std::size_t>(tok) >= st.trie->vocab() ||
                  !guide->accept(st.trie->piece(tok)))
                return make_error(error_code::invalid_request,
                                  "the resumed tokens do not follow the request's grammar");
            }
            mask = guide->allowed(*st.trie, ends);
            if (std::all_of(mask.begin(), mask.end(), [](std::uint64_t x) { return x == 0; }))
              return make_error(error_code::invalid_request,
                                "no token of this model's vocabulary can start the grammar");
          }
          std::int64_t prompt_tokens = 0;
          std::vector<std::int64_t> rows;
          auto ahead = st.core->submit(id, [&] {
            auto spec = prepare(st.model, req, rows);
            // (A streamed clip's rows are not known yet: the prompt around them.)
            if (spec)
              prompt_tokens = static_cast<std::int64_t>(spec->tokens.size() + spec->tail.size());
            return spec;
          });
          if (!ahead) return make_error(ahead.error().code, ahead.error().message);
          st.requests[id].client = std::move(client);
          if (guide) {
            st.requests[id].guide = std::move(guide);
            st.requests[id].mask = std::move(mask);
            st.requests[id].ends = req.params.stop_token_ids;
          }
          if (!req.media.empty()) {
            st.clips += static_cast<std::int64_t>(req.audio_tokens.size());
            st.videos += std::count_if(req.media.begin(), req.media.end(),
                                       [](const auto& m) { return m.kind == media_kind::video; });
            auto& sr = st.requests[id];
            if (req.media.back().stream) {
              sr.stream = static_cast<std::int32_t>(req.media.size() - 1);
              sr.last_chunk = st.clk->now();
              arm_stream_timer(self, id);
            }
            sr.media = std::move(req.media);
            sr.rows = std::move(rows);
            if (!st.encoders.empty())
              encode_images(self, id, nullptr);
            else
              emit(self, st.core->fail(id, error_code::invalid_request,
                                       "no encoder for the request's media"));
          }
          pump(self);
          return submit_ack{id, *ahead, prompt_tokens};
        },
        [=](chunk_atom, audio_chunk& c) -> caf::result<stream_progress> {
          return take_chunk(self, std::move(c));
        },
        [=](chunk_atom, std::uint64_t id) {
          auto& st = self->state;
          auto it = st.requests.find(id);
          if (it == st.requests.end() || it->second.stream < 0 || it->second.stream_closed) return;
          const auto idle = core::ms_between(it->second.last_chunk, st.clk->now());
          if (idle + 1 < static_cast<double>(st.stream_idle_ms)) return arm_stream_timer(self, id);
          emit(self, st.core->fail(id, error_code::deadline_exceeded,
                                   "its streamed audio clip sent nothing for " +
                                       std::to_string(st.stream_idle_ms / 1000.0).substr(0, 5) +
                                       " s (the scheduler's stream_idle_ms)"));
          pump(self);
        },
        [=](cancel_atom, std::uint64_t id) -> bool {
          auto events = self->state.core->cancel(id);
          if (!events) return false;
          emit(self, std::move(*events));
          pump(self);
          return true;
        },
        [=](stats_atom) {
          auto& st = self->state;
          auto s = st.core->stats();
          for (const auto& [e, n] : st.unanswered) s.encode_waiting += std::max<std::int64_t>(n, 0);
          s.encodes = st.encodes;
          s.encode_wait_ms = st.encode_wait_ms;
          s.clips = st.clips;
          s.clip_cache_hits = st.clip_cache_hits;
          s.clips_waiting = st.clips_waiting;
          s.clip_encodes = st.clip_encodes;
          s.clip_encode_wait_ms = st.clip_wait_ms;
          s.videos = st.videos;
          s.video_cache_hits = st.video_cache_hits;
          s.videos_waiting = st.videos_waiting;
          s.video_encodes = st.video_encodes;
          s.video_encode_wait_ms = st.video_wait_ms;
          return s;
        },
        [=](live_atom) { return self->state.core->ids(); },
        [=](kv_events_atom, std::uint64_t since) { return events_since(self, since); },
        [=](vault_atom, kv_vault_actor& vault, std::vector<std::uint8_t>& address) {
          // A new store (or none): the copies of the one before are gone.
          auto& st = self->state;
          st.core->remote_online(false);
          st.vault = std::move(vault);
          st.vault_address = std::move(address);
          if (st.vault) st.core->remote_online(true);
          collect_events(self);
        },
        [=](vault_ok_atom, const vault_blocks& b) {
          // Only the store now in use confirms (a replaced one's late word is not).
          if (!self->state.vault || self->current_sender() != self->state.vault) return;
          std::vector<std::pair<std::int32_t, core::block_hash>> ok;
          for (std::size_t i = 0; i < b.slots.size() && i < b.names.size(); ++i)
            ok.emplace_back(b.slots[i], b.names[i]);
          self->state.core->remote_stored(ok);
          collect_events(self);
        },
        [=](reset_cache_atom) {
          const auto freed = self->state.core->reset_prefix_cache();
          logging::of("scheduler").info("prefix cache reset: {} cached blocks freed", freed);
          return freed;
        },
        [](version_atom) { return protocol_version; },
        [=](tick_atom) {
          self->state.timer_at.reset();
          emit(self, self->state.core->tick());
          pump(self);
        },
        [=](pipeline_atom, std::vector<shard_actor>& stages,
            std::vector<kv_store_actor>& kv_stores) {
          auto& st = self->state;
          // Steps still waiting for image rows are void with the old
          // pipeline; rows already sent to its first stage are dropped there.
          ++st.epoch;
          for (auto& o : st.outbox)
            for (auto& w : o.batch.seqs)
              if (!w.embeddings.empty()) discard(o.first_store, w.embeddings);
          st.outbox.clear();
          st.stages = std::move(stages);
          st.kv_stores = std::move(kv_stores);
          emit(self, st.core->reset(static_cast<int>(st.stages.size())));
          pump(self);
        },
        [=](encoder_atom, encoder_actor& e) {
          // A new encoder after a restart or a lost node: the old ones and
          // their rows are gone.
          auto lost = std::move(self->state.encoders);
          set_pool(self, e ? std::vector<encoder_actor>{e} : std::vector<encoder_actor>{}, lost);
        },
        [=](encoders_atom, std::vector<encoder_actor>& pool, std::vector<encoder_actor>& lost) {
          return set_pool(self, std::move(pool), lost);
        },
        [=](handover_atom, encoder_actor& old, encoder_actor& fresh,
            bool drain) -> caf::result<bool> {
          auto& pool = self->state.encoders;
          auto at = std::find(pool.begin(), pool.end(), old);
          if (at != pool.end())
            *at = fresh;
          else
            pool.push_back(fresh);
          pool.erase(std::unique(pool.begin(), pool.end()), pool.end());
          // Steps sent from now on fetch no rows from the old encoder, which
          // stops once drained: their images are encoded again on the new one.
          forget_holders(self->state, old);
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
          st.core->pause();
          auto rp = self->make_response_promise<std::int64_t>();
          st.pause_waiters.push_back(rp);
          pump(self);  // answers at once when nothing is in flight
          return rp;
        },
        [=](reroute_atom, std::int32_t index, shard_actor& shard, kv_store_actor& kv) {
          auto& st = self->state;
          if (index >= 0 && static_cast<std::size_t>(index) < st.stages.size() && shard && kv) {
            st.stages[static_cast<std::size_t>(index)] = std::move(shard);
            st.kv_stores[static_cast<std::size_t>(index)] = std::move(kv);
          } else {
            logging::of("scheduler")
                .error("route to stage {} of {}: ignored", index, st.stages.size());
          }
          st.core->stage_moved();  // the new store holds only the live sequences' blocks
          st.core->resume();
          pump(self);
        },
        [=](resume_atom) {
          self->state.core->resume();
          pump(self);
        },
    };
  };
  return sys.spawn(impl, std::move(model), std::move(opts), std::move(stages), std::move(kv_stores),
                   std::move(encoder), std::move(held));
}

}  // namespace troupe::actors
