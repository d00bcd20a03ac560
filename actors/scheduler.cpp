#include "actors/scheduler.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>

#include "actors/clock.hpp"
#include "actors/data_plane.hpp"
#include "actors/log.hpp"
#include "models/llava.hpp"

// The scheduler actor is the shell of core::scheduler_core: the core
// decides (admission, steps, what outputs mean, when requests end); the
// shell tokenizes, has images encoded, turns planned steps into messages
// to the first stage (with image rows), frees KV on the stores, streams
// the core's events to the clients and sets the core's timer.

namespace troupe::actors {

namespace {

using kernels::tensor;

/// What the shell keeps of a request besides the core's state.
struct shell_request {
  client_sink_actor client;
  std::vector<tensor> image_rows;  // per image: the encoder's f32 [tokens_per_image, hidden]
  double preprocess_ms = 0, encode_ms = 0;
};

struct scheduler_state {
  model_frontend model;
  std::optional<actor_clock_source> clk;  // the actor system's clock (virtual under test)
  std::optional<core::scheduler_core> core;
  std::vector<shard_actor> stages;
  std::vector<kv_store_actor> kv_stores;
  encoder_actor encoder;
  std::shared_ptr<kernels::memory_pool> pool = kernels::memory_pool::create();
  std::map<std::uint64_t, shell_request> requests;
  std::vector<caf::typed_response_promise<std::int64_t>> pause_waiters;  // answered once idle
  std::optional<core::time_point> timer_at;  // the earliest tick already on its way
};

using self_ptr = scheduler_actor::stateful_pointer<scheduler_state>;

void pump(self_ptr self);

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
      if (it != st.requests.end())
        self->send(it->second.client, token_event{t->id, std::move(t->tokens), std::move(t->text)});
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
      f.queue_ms = d->queue_ms;
      f.ttft_ms = d->ttft_ms;
      f.total_ms = d->total_ms;
      f.stop_string = d->stop_string;
      f.preprocess_ms = it->second.preprocess_ms;
      f.encode_ms = it->second.encode_ms;
      self->send(it->second.client, std::move(f));
      st.requests.erase(it);
    } else if (auto* k = std::get_if<core::kv_release>(&ev)) {
      free_kv(self, *k);
    }
  }
}

/// The image rows of a chunk that starts after `before` image rows and
/// holds `here` of them: a view of one image's buffer, or a gather across
/// images.
kernels::result<tensor> image_rows_of(scheduler_state& st, const shell_request& r,
                                      std::int64_t before, std::int64_t here) {
  const std::int64_t H = st.model.hidden, per = st.model.tokens_per_image;
  const auto first = before / per, last = (before + here - 1) / per;
  if (last >= static_cast<std::int64_t>(r.image_rows.size()))
    return kernels::make_error(kernels::errc::invalid_argument,
                               "more image tokens than encoded images");
  if (first == last)
    return r.image_rows[static_cast<std::size_t>(first)].slice_rows(before % per, here);
  auto t = tensor::empty(*st.pool, kernels::dtype::f32, {here, H});
  if (!t) return t;
  for (std::int64_t k = 0; k < here; ++k) {
    const std::int64_t row = before + k;
    const auto& src = r.image_rows[static_cast<std::size_t>(row / per)];
    std::copy_n(src.row_as<float>(row % per), H, t->row_as<float>(k));
  }
  return t;
}

/// A planned step as the first stage's message. A request whose image
/// rows cannot be handed over fails (when its step returns).
step_batch to_message(self_ptr self, core::step_plan& plan, core::core_events& out) {
  auto& st = self->state;
  step_batch batch;
  batch.step = plan.step;
  batch.decode_steps = plan.decode_steps;
  batch.return_logits = false;
  for (auto& p : plan.seqs) {
    seq_work w;
    w.seq = p.seq;
    w.start = p.start;
    w.tokens = std::move(p.tokens);
    w.sample = p.sample;
    if (p.sample) {
      w.sampling.params = std::move(p.params);
      w.sampling.draws = p.draws;
      w.sampling.max_new = p.max_new;
      w.sampling.history = std::move(p.history);
    }
    const auto img = st.model.image_token;
    const auto here = img >= 0 ? std::count(w.tokens.begin(), w.tokens.end(), img) : 0;
    auto rit = st.requests.find(p.id);
    if (here > 0 && rit != st.requests.end()) {
      auto rows = image_rows_of(st, rit->second, p.image_rows_before, here);
      // The first stage may run in another process (moved there by a live
      // migration): the rows go over the data plane then.
      kernels::result<tensor_ref> ref =
          rows ? data_plane::local().send(data_plane_key(self->node(), st.stages.front()->node()),
                                          "host", std::move(*rows))
               : std::unexpected(rows.error());
      if (ref) {
        w.embed_token = img;
        w.embeddings = std::move(*ref);
      } else {
        auto failed = st.core->fail(p.id, error_code::internal,
                                    "image rows for the first stage: " + ref.error().message);
        out.insert(out.end(), failed.begin(), failed.end());
      }
    }
    batch.seqs.push_back(std::move(w));
  }
  return batch;
}

void on_step_output(self_ptr self, std::uint64_t step, step_output& out) {
  if (!out.logits.empty()) data_plane::local().drop(out.logits);
  core::step_result res;
  res.sampled = std::move(out.sampled);
  res.compute_ms = out.compute_ms;
  res.stage_ms = std::move(out.stage_ms);
  res.passes = out.passes;
  emit(self, self->state.core->step_done(step, res));
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

/// Sends every step the core plans, answers a pause once nothing is in
/// flight and keeps the timer set.
void pump(self_ptr self) {
  auto& st = self->state;
  core::core_events out;
  while (auto plan = st.core->plan_step(out)) {
    const auto step = plan->step;
    auto batch = to_message(self, *plan, out);
    self->request(st.stages.front(), caf::infinite, step_atom::value, std::move(batch))
        .then([=](step_output& o) { on_step_output(self, step, o); },
              [=](caf::error& e) { on_step_error(self, step, e); });
  }
  emit(self, std::move(out));
  if (st.core->paused() && st.core->steps_in_flight() == 0) {
    for (auto& w : st.pause_waiters) w.deliver(st.core->running());
    st.pause_waiters.clear();
  }
  arm_timer(self);
}

/// Tokenizes a request and expands its images' placeholders.
std::expected<core::request_spec, core::core_error> prepare(const model_frontend& model,
                                                            const generate_request& q,
                                                            std::int64_t n_images) {
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
  if (model.image_token >= 0 && !spec.tokens.empty()) {
    auto x = models::expand_image_tokens(spec.tokens, model.image_token, model.tokens_per_image,
                                         n_images);
    if (!x) return bad(x.error().message);
    spec.tokens = std::move(*x);
  }
  spec.params = q.params;
  spec.deadline_ms = q.deadline_ms;
  spec.images = n_images;
  return spec;
}

/// Sends a request's images to the encoder; each row block comes back to
/// the shell and, with the last one, the request may be admitted.
void encode_images(self_ptr self, std::uint64_t id, std::vector<image_data> images) {
  auto& st = self->state;
  st.requests[id].image_rows.resize(images.size());
  for (std::size_t k = 0; k < images.size(); ++k) {
    encode_request er{id, std::move(images[k])};
    self->request(st.encoder, caf::infinite, encode_atom::value, std::move(er))
        .then(
            [=](encode_reply& rep) {
              auto& st = self->state;
              auto emb = data_plane::local().take(rep.embeddings, *st.pool);
              auto it = st.requests.find(id);
              if (it == st.requests.end()) return;
              if (!emb || emb->shape().ndim != 2 || emb->shape()[0] != st.model.tokens_per_image ||
                  emb->shape()[1] != st.model.hidden) {
                emit(self, st.core->fail(id, error_code::internal,
                                         "the encoder's output does not match the model"));
                return;
              }
              it->second.image_rows[k] = std::move(*emb);
              it->second.preprocess_ms += rep.preprocess_ms;
              it->second.encode_ms += rep.encode_ms;
              if (st.core->image_ready(id)) pump(self);
            },
            [=](caf::error& e) {
              const auto code = troupe_code(e);
              emit(self, self->state.core->fail(
                             id, code ? static_cast<error_code>(code) : error_code::internal,
                             describe(self->system(), e)));
              pump(self);
            });
  }
}

}  // namespace

scheduler_actor spawn_scheduler(caf::actor_system& sys, model_frontend model,
                                scheduler_options opts, std::vector<shard_actor> stages,
                                std::vector<kv_store_actor> kv_stores, encoder_actor encoder) {
  auto impl = [](self_ptr self, model_frontend model, scheduler_options opts,
                 std::vector<shard_actor> stages, std::vector<kv_store_actor> kv_stores,
                 encoder_actor encoder) -> scheduler_actor::behavior_type {
    auto& st = self->state;
    st.model = model;
    st.clk.emplace(self->clock());
    st.core.emplace(std::move(model), std::move(opts), static_cast<int>(stages.size()), *st.clk);
    st.stages = std::move(stages);
    st.kv_stores = std::move(kv_stores);
    st.encoder = std::move(encoder);
    return {
        [=](submit_atom, generate_request& req,
            client_sink_actor& client) -> caf::result<submit_ack> {
          auto& st = self->state;
          const auto id = req.id;
          auto images = std::move(req.images);
          const auto n_images = static_cast<std::int64_t>(images.size());
          auto ahead = st.core->submit(id, [&] { return prepare(st.model, req, n_images); });
          if (!ahead) return make_error(ahead.error().code, ahead.error().message);
          st.requests[id].client = std::move(client);
          if (n_images > 0) {
            if (st.encoder)
              encode_images(self, id, std::move(images));
            else
              emit(self, st.core->fail(id, error_code::invalid_request, "no encoder for images"));
          }
          pump(self);
          return submit_ack{id, *ahead};
        },
        [=](cancel_atom, std::uint64_t id) -> bool {
          auto events = self->state.core->cancel(id);
          if (!events) return false;
          emit(self, std::move(*events));
          pump(self);
          return true;
        },
        [=](stats_atom) { return self->state.core->stats(); },
        [](version_atom) { return protocol_version; },
        [=](tick_atom) {
          self->state.timer_at.reset();
          emit(self, self->state.core->tick());
          pump(self);
        },
        [=](pipeline_atom, std::vector<shard_actor>& stages,
            std::vector<kv_store_actor>& kv_stores) {
          auto& st = self->state;
          st.stages = std::move(stages);
          st.kv_stores = std::move(kv_stores);
          emit(self, st.core->reset(static_cast<int>(st.stages.size())));
          pump(self);
        },
        [=](encoder_atom, encoder_actor& e) { self->state.encoder = std::move(e); },
        [=](handover_atom, encoder_actor& e, bool drain) -> caf::result<bool> {
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
                   std::move(encoder));
}

}  // namespace troupe::actors
