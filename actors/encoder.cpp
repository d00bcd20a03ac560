#include "actors/encoder.hpp"

#include <spdlog/spdlog.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <map>

#include "actors/clock.hpp"
#include "actors/data_plane.hpp"

namespace troupe::actors {

namespace {

using clock = steady;
using kernels::tensor;

struct pending_input {
  std::vector<float> pixels;  // [3, side, side]
  caf::typed_response_promise<encode_reply> promise;
  clock::time_point arrived;
  double preprocess_ms = 0;
  std::string dest;  ///< the requester's data-plane key when it is another process ("" here)
};

struct encoder_state {
  // Length buckets: token count -> inputs waiting, oldest first.
  std::map<std::int64_t, std::deque<pending_input>> buckets;
  std::uint64_t batches = 0;
};

using self_ptr = encoder_actor::stateful_pointer<encoder_state>;

void run_batch(self_ptr self, encoder_resources& res, std::int64_t bucket, std::size_t n) {
  auto& q = self->state.buckets[bucket];
  n = std::min(n, q.size());
  if (n == 0) return;
  std::vector<pending_input> batch;
  for (std::size_t i = 0; i < n; ++i) {
    batch.push_back(std::move(q.front()));
    q.pop_front();
  }
  const std::int64_t side = res.model->image_size(), C = res.model->channels();
  const auto t0 = clock::now();
  std::unique_lock device_lock(
      res.dev->run_lock());  // the device's team is ours until the batch is encoded
  auto pix = tensor::empty(res.dev->memory(), kernels::dtype::f32,
                           {static_cast<std::int64_t>(n), C, side, side});
  kernels::result<tensor> out = pix ? kernels::result<tensor>{} : std::unexpected(pix.error());
  if (pix) {
    for (std::size_t i = 0; i < n; ++i)
      std::copy(batch[i].pixels.begin(), batch[i].pixels.end(),
                pix->data_as<float>() + static_cast<std::int64_t>(i) * C * side * side);
    out = res.model->encode_images(*res.dev, *pix);
  }
  device_lock.unlock();
  const double encode_ms = ms_between(t0, clock::now());
  ++self->state.batches;
  const std::int64_t T = res.model->tokens_per_image();
  for (std::size_t i = 0; i < n; ++i) {
    if (!out) {
      batch[i].promise.deliver(
          make_error(error_code::internal,
                     "vision encoder on " + res.device.name + ": " + out.error().message));
      continue;
    }
    auto rows = out->slice_rows(static_cast<std::int64_t>(i) * T, T);
    if (!rows) {
      batch[i].promise.deliver(make_error(error_code::internal, rows.error().message));
      continue;
    }
    encode_reply rep;
    // An encoder moved to another node than the scheduler's sends the
    // embeddings back over the data plane.
    {
      auto ref = data_plane::local().send(batch[i].dest, res.device.name, std::move(*rows));
      if (!ref) {
        batch[i].promise.deliver(make_error(
            error_code::peer_lost, "image embeddings to the scheduler: " + ref.error().message));
        continue;
      }
      rep.embeddings = std::move(*ref);
    }
    rep.preprocess_ms = batch[i].preprocess_ms;
    rep.encode_ms = encode_ms;
    rep.batch = static_cast<std::int64_t>(n);
    batch[i].promise.deliver(std::move(rep));
  }
}

/// Closes what is due in `bucket` (core::decide_batch); re-arms the timer
/// for what is left.
void flush(self_ptr self, encoder_resources& res, const encoder_options& o, std::int64_t bucket) {
  auto& q = self->state.buckets[bucket];
  for (;;) {
    if (q.empty()) return;
    const auto d = core::decide_batch(o, q.size(), q.front().arrived, clock::now());
    if (d.close > 0) {
      run_batch(self, res, bucket, d.close);
      continue;
    }
    if (d.wake_at) {
      const auto delay = std::max(core::duration::zero(), *d.wake_at - clock::now());
      self->delayed_send(self,
                         std::chrono::duration_cast<std::chrono::microseconds>(delay) +
                             std::chrono::microseconds(100),
                         flush_atom::value, bucket);
    }
    return;
  }
}

}  // namespace

kernels::result<std::shared_ptr<encoder_resources>> make_vision_encoder(
    const device_spec& spec, std::shared_ptr<kernels::device> device, const std::string& path,
    const models::quant_plan& plan) {
  auto res = std::make_shared<encoder_resources>();
  res->device = spec;
  res->dev = std::move(device);
  auto m = [&] {  // loading packs on the device's team: hold it, as make_stage does
    std::lock_guard device_lock(res->dev->run_lock());
    return models::llava_model::load(path, *res->dev, plan);
  }();
  if (!m) return std::unexpected(m.error());
  res->model = std::move(*m);
  const std::string dir = std::filesystem::is_directory(path)
                              ? path
                              : std::filesystem::path(path).parent_path().string();
  auto pc = models::load_image_processor_config(dir);
  if (!pc) return std::unexpected(pc.error());
  res->preprocessor = *pc;
  return res;
}

encoder_actor spawn_encoder_relay(caf::actor_system& sys, encoder_actor remote) {
  auto impl = [](encoder_actor::pointer self,
                 encoder_actor remote) -> encoder_actor::behavior_type {
    auto pool = kernels::memory_pool::create();
    return {
        [=](encode_atom, encode_request& req) -> caf::result<encode_reply> {
          auto rp = self->make_response_promise<encode_reply>();
          self->request(remote, caf::infinite, encode_atom::value, std::move(req))
              .then(
                  [rp, pool](encode_reply& r) mutable {
                    // Received on this actor's own thread (it waits for the
                    // transfer), then parked here for the scheduler.
                    auto t = data_plane::local().take(r.embeddings, *pool);
                    if (!t) {
                      rp.deliver(
                          make_error(error_code::peer_lost,
                                     "image embeddings from the encoder: " + t.error().message));
                      return;
                    }
                    r.embeddings = data_plane::local().park("host", std::move(*t));
                    rp.deliver(std::move(r));
                  },
                  [rp](caf::error& e) mutable { rp.deliver(std::move(e)); });
          return rp;
        },
        [=](flush_atom, std::int64_t bucket) { self->send(remote, flush_atom::value, bucket); },
        [=](version_atom) -> caf::result<std::uint32_t> {
          auto rp = self->make_response_promise<std::uint32_t>();
          self->request(remote, caf::infinite, version_atom::value)
              .then([rp](std::uint32_t v) mutable { rp.deliver(v); },
                    [rp](caf::error& e) mutable { rp.deliver(std::move(e)); });
          return rp;
        },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(remote));
}

encoder_actor spawn_encoder(caf::actor_system& sys, std::shared_ptr<encoder_resources> res,
                            encoder_options opts) {
  opts = core::sanitized(opts);
  auto impl = [](self_ptr self, std::shared_ptr<encoder_resources> res,
                 encoder_options o) -> encoder_actor::behavior_type {
    pin_current_thread(res->device.cores);
    return {
        [=](encode_atom, encode_request& req) -> caf::result<encode_reply> {
          const auto t0 = clock::now();
          // The requester's process (before make_response_promise takes the
          // sender out of the current message).
          const auto& sender = self->current_sender();
          std::string dest =
              sender && sender->node() != self->node() ? to_string(sender->node()) : std::string{};
          const std::string name = req.image.name.empty()
                                       ? "image of request " + std::to_string(req.request)
                                       : req.image.name;
          auto img = models::decode_image(req.image.bytes, res->limits);
          if (!img)
            return make_error(error_code::invalid_request, name + ": " + img.error().message);
          auto pv = models::preprocess_image(*img, res->preprocessor);
          if (!pv) return make_error(error_code::invalid_request, name + ": " + pv.error().message);
          const std::int64_t side = res->model->image_size();
          if (pv->height != side || pv->width != side)
            return make_error(error_code::invalid_request,
                              name + ": the preprocessor makes " + std::to_string(pv->height) +
                                  "x" + std::to_string(pv->width) +
                                  " images but the vision tower takes " + std::to_string(side) +
                                  "x" + std::to_string(side));
          // Bucket by the token count the input encodes to (fixed for a CLIP
          // tower; audio clips will differ).
          const std::int64_t bucket = res->model->tokens_per_image();
          auto promise = self->make_response_promise<encode_reply>();
          auto& q = self->state.buckets[bucket];
          q.push_back({std::move(pv->data), promise, clock::now(), ms_between(t0, clock::now()),
                       std::move(dest)});
          if (q.size() >= static_cast<std::size_t>(o.max_batch)) {
            flush(self, *res, o, bucket);
          } else if (q.size() == 1) {
            self->delayed_send(self, std::chrono::milliseconds(o.max_wait_ms), flush_atom::value,
                               bucket);
          }
          return promise;
        },
        [=](flush_atom, std::int64_t bucket) {
          if (bucket >= 0) return flush(self, *res, o, bucket);
          // -1: encode everything waiting now (the encoder is being replaced).
          for (auto& [b, q] : self->state.buckets)
            while (!q.empty()) run_batch(self, *res, b, static_cast<std::size_t>(o.max_batch));
        },
        [](version_atom) { return protocol_version; },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(res), opts);
}

}  // namespace troupe::actors
