#include "actors/encoder.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <filesystem>
#include <list>
#include <map>
#include <optional>
#include <set>

#include "actors/clock.hpp"
#include "actors/core/block_hash.hpp"
#include "actors/data_plane.hpp"
#include "actors/scheduler.hpp"

namespace troupe::actors {

namespace {

using clock = steady;
using kernels::tensor;

struct pending_clip;

struct pending_input {
  std::vector<float> pixels;  // [3, side, side]
  caf::typed_response_promise<encode_reply> promise;
  clock::time_point arrived;
  double preprocess_ms = 0;
  std::uint64_t request = 0;
  std::int32_t index = 0;
  caf::actor_addr owner;  ///< who asked (its requests' rows go when it does)
  core::block_hash key;   ///< the encoder cache's key
  /// The same image asked for again while this one waits: answered with
  /// its rows (encoded once), as cache hits.
  struct follower {
    caf::typed_response_promise<encode_reply> promise;
    double preprocess_ms = 0;
    std::uint64_t request = 0;
    std::int32_t index = 0;
    caf::actor_addr owner;
  };
  std::vector<follower> followers;
  /// A video's frame (promise, key and followers are then the video's):
  /// its rows go to the video's, from row `first_row`.
  std::shared_ptr<pending_clip> video;
  std::int64_t first_row = 0;
};

/// An audio clip (or a video) on its way through a tower: its windows are
/// batched with other clips' windows of the same frame count (a video's
/// frames with the images), and each batch copies its windows' rows into
/// the clip's.
struct pending_clip {
  tensor rows;                          // [tokens, hidden] on the device, filled window by window
  std::vector<std::int64_t> first_row;  // each window's first row in `rows`
  std::size_t left = 0;                 // windows not yet encoded
  bool failed = false;                  // answered with an error already
  caf::typed_response_promise<encode_reply> promise;
  double preprocess_ms = 0, encode_ms = 0;
  std::int64_t batch = 0;  // the largest batch of its windows
  std::uint64_t request = 0;
  std::int32_t index = 0;
  caf::actor_addr owner;
  core::block_hash key;
  std::vector<pending_input::follower> followers;  // the same clip asked for meanwhile
};

struct stream_clip;

struct pending_window {
  std::shared_ptr<pending_clip> clip;
  std::shared_ptr<stream_clip> stream;  // or a streamed clip's window
  std::size_t window = 0;
  std::int64_t samples = 0;     // the window's, for the bound on audio waiting
  std::vector<float> features;  // [num_mel_bins, frames]
  clock::time_point arrived;
};

/// Encoded images by key, least recently used first out, within a byte budget.
class rows_cache {
 public:
  explicit rows_cache(std::int64_t capacity) : capacity_(capacity) {}
  std::optional<tensor> take(const core::block_hash& key) {
    auto it = map_.find(key);
    if (it == map_.end()) return std::nullopt;
    order_.splice(order_.end(), order_, it->second.at);  // most recently used now
    return it->second.rows;
  }
  void put(const core::block_hash& key, tensor rows) {
    const auto bytes = static_cast<std::int64_t>(rows.nbytes());
    if (bytes > capacity_ || map_.contains(key)) return;
    while (used_ + bytes > capacity_ && !order_.empty()) {
      auto old = map_.find(order_.front());
      used_ -= static_cast<std::int64_t>(old->second.rows.nbytes());
      map_.erase(old);
      order_.pop_front();
    }
    used_ += bytes;
    map_.emplace(key, entry{std::move(rows), order_.insert(order_.end(), key)});
  }

 private:
  struct entry {
    tensor rows;
    std::list<core::block_hash>::iterator at;
  };
  std::int64_t capacity_ = 0, used_ = 0;
  std::list<core::block_hash> order_;
  std::map<core::block_hash, entry> map_;
};

std::vector<std::uint8_t> bytes_of(const core::block_hash& h) {
  return {h.begin(), h.end()};
}

/// A request's encoded images, held until the requester forgets them (or
/// goes down): item index -> its rows, f32 [tokens, hidden], in parts (one
/// for an image or a clip; a streamed clip's windows, as they come).
struct held_images {
  std::map<std::int32_t, std::vector<tensor>> rows;
  caf::actor_addr owner;
};

/// A clip streamed while its request runs (media_data::stream), cut into
/// the tower's windows as its samples come: each whole window's features
/// are batched like any clip's, and its rows join the request's held rows
/// once the windows before it are there too. The clip ends with its last
/// chunk (a shorter last window).
struct stream_clip {
  std::uint64_t request = 0;
  std::int32_t index = 0;
  caf::actor_addr owner;
  std::string name;
  std::vector<float> pending;                         // samples past the last whole window
  std::int64_t samples = 0;                           // taken in all
  std::vector<tensor> parts;                          // each window's rows, once encoded
  std::vector<bool> encoded;                          // ... per window
  std::size_t ready = 0;                              // leading windows encoded
  std::int64_t ready_rows = 0;                        // their rows
  bool closed = false, failed = false;                // the last chunk came; an error answered
  caf::typed_response_promise<encode_reply> promise;  // answered at its end
  /// Chunks' answers, each due once `ready` reaches its window count.
  std::vector<std::pair<std::size_t, caf::typed_response_promise<stream_progress>>> waiting;
  double preprocess_ms = 0, encode_ms = 0;
  std::int64_t batch = 0;
};

/// Audio windows are bucketed apart from images: bucket -2 - frames.
constexpr std::int64_t audio_bucket(std::int64_t frames) {
  return -2 - frames;
}

struct encoder_state {
  // Length buckets: token count -> inputs waiting, oldest first.
  std::map<std::int64_t, std::deque<pending_input>> buckets;
  // Audio windows by bucket (audio_bucket(frames)), oldest first, and the
  // clips being encoded by key (the same clip again follows the first).
  std::map<std::int64_t, std::deque<pending_window>> windows;
  std::map<core::block_hash, std::shared_ptr<pending_clip>> clips;
  std::int64_t waiting_samples = 0;  // the samples of the windows waiting (bounded)
  std::uint64_t batches = 0;
  std::map<std::uint64_t, held_images> held;
  // Streamed clips under way, by request and item.
  std::map<std::pair<std::uint64_t, std::int32_t>, std::shared_ptr<stream_clip>> streams;
  std::set<caf::actor_addr> watched;  ///< requesters monitored
  std::optional<rows_cache> cache;
};

using self_ptr = encoder_actor::stateful_pointer<encoder_state>;

/// Runs the batches `q` (a bucket, oldest first) has due now
/// (core::decide_batch) through `run(n)`, and re-arms the bucket's timer
/// for what is left.
template <class Queue, class Run>
void close_due(self_ptr self, const encoder_options& o, std::int64_t bucket, Queue& q, Run run) {
  for (;;) {
    if (q.empty()) return;
    const auto d = core::decide_batch(o, q.size(), q.front().arrived, clock::now());
    if (d.close > 0) {
      run(d.close);
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

/// Holds `rows` as item `index` of `request` (for `owner`) and answers a
/// follower of an item encoded once, or a cache hit: encode_reply with the
/// rows' shape, their name, and cached set.
encode_reply hold_shared(self_ptr self, std::uint64_t request, std::int32_t index,
                         const caf::actor_addr& owner, const tensor& rows,
                         const core::block_hash& key, double preprocess_ms) {
  auto& h = self->state.held[request];
  h.owner = owner;
  h.rows[index] = {rows};
  encode_reply rep;
  rep.rows = rows.dim(0);
  rep.hidden = rows.dim(1);
  rep.preprocess_ms = preprocess_ms;
  rep.hash = bytes_of(key);
  rep.cached = true;
  return rep;
}

void finish_clip(self_ptr self, pending_clip& c);
void fail_clip(self_ptr self, pending_clip& c, const caf::error& e);

/// One part of `c` (an audio window, a video frame) came out of a batch of
/// `batch` that took `encode_ms`, or failed with `e`: `c` fails, or is
/// answered with its last part.
void part_done(self_ptr self, const std::shared_ptr<pending_clip>& c, const caf::error& e,
               double encode_ms, std::size_t batch) {
  auto keep = c;  // alive past finish_clip's erase
  if (e) return fail_clip(self, *keep, e);
  keep->encode_ms += encode_ms;
  keep->batch = std::max<std::int64_t>(keep->batch, static_cast<std::int64_t>(batch));
  if (--keep->left == 0) finish_clip(self, *keep);
}

void run_batch(self_ptr self, encoder_resources& res, std::int64_t bucket, std::size_t n) {
  auto& q = self->state.buckets[bucket];
  n = std::min(n, q.size());
  if (n == 0) return;
  std::vector<pending_input> batch;
  for (std::size_t i = 0; i < n; ++i) {
    batch.push_back(std::move(q.front()));
    q.pop_front();
  }
  // The images first, then the videos' frames (pooled and projected apart).
  std::stable_partition(batch.begin(), batch.end(),
                        [](const pending_input& p) { return !p.video; });
  const auto n_images = static_cast<std::size_t>(
      std::count_if(batch.begin(), batch.end(), [](const pending_input& p) { return !p.video; }));
  const std::int64_t side = res.model->image_size(), C = res.model->channels();
  const auto t0 = clock::now();
  std::unique_lock device_lock(
      res.dev->run_lock());  // the device's team is ours until the batch is encoded
  // The pixels in host memory (the tower takes them to its device).
  static const auto host = kernels::memory_pool::create();
  auto pix = tensor::empty(res.dev->memory().host_accessible() ? res.dev->memory() : *host,
                           kernels::dtype::f32, {static_cast<std::int64_t>(n), C, side, side});
  kernels::result<tensor> out = pix ? kernels::result<tensor>{} : std::unexpected(pix.error());
  if (pix) {
    for (std::size_t i = 0; i < n; ++i)
      std::copy(batch[i].pixels.begin(), batch[i].pixels.end(),
                pix->data_as<float>() + static_cast<std::int64_t>(i) * C * side * side);
    if (n_images == n) {
      out = res.model->encode_images(*res.dev, *pix);
    } else {
      out = res.model->vision_features(*res.dev, *pix);
    }
  }
  const std::int64_t T = res.model->tokens_per_image();
  // A batch with frames: the images' rows projected, the frames' pooled,
  // projected and copied into their videos' rows.
  std::vector<caf::error> frame_errors(n);
  if (!out)
    for (std::size_t i = n_images; i < n; ++i)
      frame_errors[i] = make_error(error_code::internal, "vision encoder on " + res.device.name +
                                                             ": " + out.error().message);
  if (out && n_images < n) {
    auto features = std::move(*out);
    if (n_images > 0) {
      auto f = features.slice_rows(0, static_cast<std::int64_t>(n_images) * T);
      out = f ? res.model->project(*res.dev, *f)
              : kernels::result<tensor>(std::unexpected(f.error()));
    }
    const auto n_frames = static_cast<std::int64_t>(n - n_images);
    auto f = features.slice_rows(static_cast<std::int64_t>(n_images) * T, n_frames * T);
    auto rows = f ? res.model->frame_rows(*res.dev, *f)
                  : kernels::result<tensor>(std::unexpected(f.error()));
    const std::int64_t R = res.model->tokens_per_frame();
    for (std::size_t i = n_images; i < n; ++i) {
      auto& v = *batch[i].video;
      if (v.failed) continue;
      const auto at = static_cast<std::int64_t>(i - n_images) * R;
      auto src =
          rows ? rows->slice_rows(at, R) : kernels::result<tensor>(std::unexpected(rows.error()));
      auto dst = v.rows.slice_rows(batch[i].first_row, R);
      kernels::result<void> r = src && dst ? res.dev->copy(*src, *dst)
                                           : std::unexpected(!src ? src.error() : dst.error());
      if (!r)
        frame_errors[i] = make_error(error_code::internal, "vision encoder on " + res.device.name +
                                                               ": " + r.error().message);
    }
  }
  device_lock.unlock();
  const double encode_ms = ms_between(t0, clock::now());
  ++self->state.batches;
  for (std::size_t i = n_images; i < n; ++i)
    part_done(self, batch[i].video, frame_errors[i], encode_ms, n);
  for (std::size_t i = 0; i < n_images; ++i) {
    auto fail = [&](const caf::error& e) {
      batch[i].promise.deliver(e);
      for (auto& f : batch[i].followers) f.promise.deliver(e);
    };
    if (!out) {
      fail(make_error(error_code::internal,
                      "vision encoder on " + res.device.name + ": " + out.error().message));
      continue;
    }
    auto rows = out->slice_rows(static_cast<std::int64_t>(i) * T, T);
    if (!rows) {
      fail(make_error(error_code::internal, rows.error().message));
      continue;
    }
    // Held here until the scheduler has the first stage take them (rows,
    // below), chunk by chunk: they go from here to the first stage only.
    encode_reply rep;
    rep.rows = rows->dim(0);
    rep.hidden = rows->dim(1);
    rep.hash = bytes_of(batch[i].key);
    if (self->state.cache) {
      // A copy of its own: the batch's output is not kept for one image.
      auto own =
          tensor::empty(res.dev->memory(), kernels::dtype::f32, {rows->dim(0), rows->dim(1)});
      if (own && res.dev->copy(*rows, *own)) self->state.cache->put(batch[i].key, std::move(*own));
    }
    for (auto& f : batch[i].followers)  // the same rows (read only), no encoding of theirs
      f.promise.deliver(
          hold_shared(self, f.request, f.index, f.owner, *rows, batch[i].key, f.preprocess_ms));
    auto& h = self->state.held[batch[i].request];
    h.owner = batch[i].owner;
    h.rows[batch[i].index] = {std::move(*rows)};
    rep.preprocess_ms = batch[i].preprocess_ms;
    rep.encode_ms = encode_ms;
    rep.batch = static_cast<std::int64_t>(n);
    batch[i].promise.deliver(std::move(rep));
  }
}

/// A clip's rows are all there (or it failed): answers it and its
/// followers, and holds (and caches) its rows.
void finish_clip(self_ptr self, pending_clip& c) {
  auto& st = self->state;
  st.clips.erase(c.key);
  if (c.failed) return;
  encode_reply rep;
  rep.rows = c.rows.dim(0);
  rep.hidden = c.rows.dim(1);
  rep.hash = bytes_of(c.key);
  if (st.cache) st.cache->put(c.key, c.rows);  // its own tensor: shared read-only
  for (auto& f : c.followers)
    f.promise.deliver(
        hold_shared(self, f.request, f.index, f.owner, c.rows, c.key, f.preprocess_ms));
  auto& h = st.held[c.request];
  h.owner = c.owner;
  h.rows[c.index] = {c.rows};
  rep.preprocess_ms = c.preprocess_ms;
  rep.encode_ms = c.encode_ms;
  rep.batch = c.batch;
  c.promise.deliver(std::move(rep));
}

void fail_clip(self_ptr self, pending_clip& c, const caf::error& e) {
  if (c.failed) return;
  c.failed = true;
  c.promise.deliver(e);
  for (auto& f : c.followers) f.promise.deliver(e);
  self->state.clips.erase(c.key);
}

void stream_window_done(self_ptr self, const std::shared_ptr<stream_clip>& c, std::size_t window,
                        const caf::error& e, double encode_ms, std::size_t batch);

/// Encodes up to `n` audio windows of `bucket` as one batch.
void run_audio_batch(self_ptr self, encoder_resources& res, std::int64_t bucket, std::size_t n) {
  auto& q = self->state.windows[bucket];
  n = std::min(n, q.size());
  if (n == 0) return;
  std::vector<pending_window> batch;
  for (std::size_t i = 0; i < n; ++i) {
    self->state.waiting_samples -= q.front().samples;
    batch.push_back(std::move(q.front()));
    q.pop_front();
  }
  const auto& m = *res.model;
  const std::int64_t M = m.audio_encoder().config().num_mel_bins;
  const auto frames = static_cast<std::int64_t>(batch.front().features.size()) / M;
  const auto t0 = clock::now();
  std::unique_lock device_lock(res.dev->run_lock());
  auto feats = tensor::empty(
      res.dev->memory().host_accessible() ? res.dev->memory() : models::host_staging_pool(),
      kernels::dtype::f32, {static_cast<std::int64_t>(n), M, frames});
  kernels::result<tensor> out = feats ? kernels::result<tensor>{} : std::unexpected(feats.error());
  if (feats) {
    for (std::size_t i = 0; i < n; ++i)
      std::copy(batch[i].features.begin(), batch[i].features.end(),
                feats->data_as<float>() + static_cast<std::int64_t>(i) * M * frames);
    out = m.encode_audio_windows(*res.dev, *feats);
  }
  // Each window's rows into its clip's (on the device, under its lock).
  std::vector<caf::error> errors(n);
  if (out) {
    const std::int64_t T = out->dim(1), H = out->dim(2);
    auto flat = out->reshape({static_cast<std::int64_t>(n) * T, H});
    for (std::size_t i = 0; i < n; ++i) {
      auto src = flat ? flat->slice_rows(static_cast<std::int64_t>(i) * T, T)
                      : kernels::result<tensor>(std::unexpected(flat.error()));
      if (auto& sc = batch[i].stream) {  // a streamed clip's window: rows of its own
        if (sc->failed) continue;
        auto own = tensor::empty(res.dev->memory(), kernels::dtype::f32, {T, H});
        kernels::result<void> r = src && own ? res.dev->copy(*src, *own)
                                             : std::unexpected(!src ? src.error() : own.error());
        if (r)
          sc->parts[batch[i].window] = std::move(*own);
        else
          errors[i] = make_error(error_code::internal,
                                 "audio encoder on " + res.device.name + ": " + r.error().message);
        continue;
      }
      auto& c = *batch[i].clip;
      if (c.failed) continue;
      auto dst = c.rows.slice_rows(c.first_row[batch[i].window], T);
      kernels::result<void> r = src && dst ? res.dev->copy(*src, *dst)
                                           : std::unexpected(!src ? src.error() : dst.error());
      if (!r)
        errors[i] = make_error(error_code::internal,
                               "audio encoder on " + res.device.name + ": " + r.error().message);
    }
  }
  device_lock.unlock();
  const double encode_ms = ms_between(t0, clock::now());
  ++self->state.batches;
  for (std::size_t i = 0; i < n; ++i) {
    const auto e = !out ? make_error(error_code::internal, "audio encoder on " + res.device.name +
                                                               ": " + out.error().message)
                        : errors[i];
    if (batch[i].stream)
      stream_window_done(self, batch[i].stream, batch[i].window, e, encode_ms, n);
    else
      part_done(self, batch[i].clip, e, encode_ms, n);
  }
}

/// Closes what is due in audio `bucket`; re-arms the timer for the rest.
void flush_audio(self_ptr self, encoder_resources& res, const encoder_options& o,
                 std::int64_t bucket) {
  close_due(self, o, bucket, self->state.windows[bucket],
            [&](std::size_t n) { run_audio_batch(self, res, bucket, n); });
}

/// Takes an audio clip: decoded, resampled, cut into windows whose
/// features wait in their frame count's bucket (or its rows from the cache).
/// `samples` (mono, 16 kHz) cut into the audio tower's windows, with their
/// features, for `c`: their rows from `first_row` on (recorded in
/// c->first_row). Returns the windows; `rows` gets the rows they cover.
std::vector<pending_window> make_windows(const models::llava_model& m,
                                         const std::shared_ptr<pending_clip>& c,
                                         std::span<const float> samples, std::int64_t first_row,
                                         std::int64_t& rows) {
  const auto& cfg = *m.config().audio;
  std::vector<pending_window> ws;
  std::int64_t row = first_row;
  for (const auto piece : m.audio_windows(samples)) {
    pending_window w;
    w.clip = c;
    w.window = c->first_row.size();
    w.samples = static_cast<std::int64_t>(piece.size());
    w.features = m.audio_features(piece);
    const auto frames = m.audio_frames(static_cast<std::int64_t>(piece.size()));
    c->first_row.push_back(row);
    row += cfg.projector.tokens_for((frames + 1) / 2);
    ws.push_back(std::move(w));
  }
  rows = row - first_row;
  return ws;
}

/// Queues windows in their frame count's buckets (and runs the full ones).
void queue_windows(self_ptr self, encoder_resources& res, const encoder_options& o,
                   std::vector<pending_window> ws) {
  auto& st = self->state;
  const auto M = res.model->config().audio->encoder.num_mel_bins;
  std::set<std::int64_t> touched;
  for (auto& w : ws) {
    const auto bucket = audio_bucket(static_cast<std::int64_t>(w.features.size()) / M);
    w.arrived = clock::now();
    st.waiting_samples += w.samples;
    auto& q = st.windows[bucket];
    q.push_back(std::move(w));
    if (q.size() == 1)
      self->delayed_send(self, std::chrono::milliseconds(o.max_wait_ms), flush_atom::value, bucket);
    touched.insert(bucket);
  }
  for (auto b : touched)
    if (st.windows[b].size() >= static_cast<std::size_t>(o.max_batch)) flush_audio(self, res, o, b);
}

/// Whether `samples` more of audio may wait (the bound on the features
/// held); else the overloaded error naming `name`.
caf::error audio_room(self_ptr self, encoder_resources& res, const std::string& name,
                      std::int64_t samples) {
  const auto& st = self->state;
  const auto rate = static_cast<double>(res.model->config().audio->features.sample_rate);
  if (static_cast<double>(st.waiting_samples + samples) / rate <= res.max_waiting_audio_seconds)
    return {};
  return make_error(error_code::overloaded,
                    name + ": the audio encoder holds " +
                        std::to_string(static_cast<long long>(st.waiting_samples / rate)) +
                        " s of audio waiting (limit " +
                        std::to_string(static_cast<long long>(res.max_waiting_audio_seconds)) +
                        " s); send it again later");
}

/// Whether the same item (`key`) is on its way through a tower: `promise`
/// then follows it (answered with its rows, encoded once).
bool follows(self_ptr self, const core::block_hash& key,
             const caf::typed_response_promise<encode_reply>& promise, const encode_request& req,
             const caf::actor_addr& owner, clock::time_point t0) {
  auto it = self->state.clips.find(key);
  if (it == self->state.clips.end()) return false;
  it->second->followers.push_back(
      {promise, ms_between(t0, clock::now()), req.request, req.index, owner});
  return true;
}

caf::result<encode_reply> take_clip(self_ptr self, encoder_resources& res, const encoder_options& o,
                                    encode_request& req, const caf::actor_addr& owner,
                                    clock::time_point t0) {
  const std::string name = req.item.name.empty()
                               ? "audio clip of request " + std::to_string(req.request)
                               : req.item.name;
  const auto& m = *res.model;
  if (!m.has_audio())
    return make_error(error_code::invalid_request, name + ": this model has no audio tower");
  const auto& cfg = *m.config().audio;
  auto clip = models::decode_audio_at(req.item.bytes, cfg.features.sample_rate, res.audio_limits);
  if (!clip) return make_error(error_code::invalid_request, name + ": " + clip.error().message);
  const auto tokens = m.audio_tokens(static_cast<std::int64_t>(clip->samples.size()));
  if (tokens < 1)
    return make_error(error_code::invalid_request,
                      name + ": shorter than one hop of the audio features");
  // The clip's name: the towers and the samples they hear.
  const std::string id = res.weights_id + ";audio";
  const auto key =
      core::sha256(std::span(reinterpret_cast<const std::uint8_t*>(id.data()), id.size()),
                   std::as_bytes(std::span(clip->samples)));
  auto& st = self->state;
  if (auto hit = st.cache ? st.cache->take(key) : std::nullopt)
    return hold_shared(self, req.request, req.index, owner, *hit, key,
                       ms_between(t0, clock::now()));
  // The features of the audio waiting are held here: bounded.
  if (!st.clips.contains(key))
    if (auto full = audio_room(self, res, name, static_cast<std::int64_t>(clip->samples.size())))
      return full;
  auto promise = self->make_response_promise<encode_reply>();
  if (follows(self, key, promise, req, owner, t0)) return promise;
  auto c = std::make_shared<pending_clip>();
  auto rows =
      tensor::empty(res.dev->memory(), kernels::dtype::f32, {tokens, m.config().text.hidden_size});
  if (!rows) return make_error(error_code::internal, name + ": " + rows.error().message);
  c->rows = std::move(*rows);
  c->promise = promise;
  c->request = req.request;
  c->index = req.index;
  c->owner = owner;
  c->key = key;
  // The windows' features (computed here, as an image's pixels are), each
  // with its first row in the clip's.
  std::int64_t row = 0;
  auto ws = make_windows(m, c, clip->samples, 0, row);
  if (row != tokens || ws.empty())
    return make_error(error_code::internal, name + ": its windows' rows do not add up");
  c->left = ws.size();
  c->preprocess_ms = ms_between(t0, clock::now());
  st.clips.emplace(key, c);
  queue_windows(self, res, o, std::move(ws));
  return promise;
}

/// Streamed clips an encoder takes at once (each holds under one window of
/// samples and its rows so far, bounded by the duration limit).
constexpr std::size_t max_streams = 1024;

/// Starts a streamed clip: its samples come in chunks (take_chunk); the
/// answer comes at its end, once its last window is encoded.
caf::result<encode_reply> take_stream(self_ptr self, encoder_resources& res,
                                      const encode_request& req, const caf::actor_addr& owner) {
  const std::string name = req.item.name.empty()
                               ? "streamed audio clip of request " + std::to_string(req.request)
                               : req.item.name;
  if (!res.model->has_audio())
    return make_error(error_code::invalid_request, name + ": this model has no audio tower");
  if (!req.item.bytes.empty())
    return make_error(error_code::invalid_request,
                      name + ": a streamed clip comes in chunks, not with the request");
  auto& st = self->state;
  const auto key = std::pair(req.request, req.index);
  if (st.streams.contains(key))
    return make_error(error_code::duplicate_id, name + ": it is streaming here already");
  if (st.streams.size() >= max_streams)
    return make_error(error_code::overloaded, name + ": this encoder takes " +
                                                  std::to_string(max_streams) +
                                                  " streamed clips at once; retry later");
  auto c = std::make_shared<stream_clip>();
  c->request = req.request;
  c->index = req.index;
  c->owner = owner;
  c->name = name;
  c->promise = self->make_response_promise<encode_reply>();
  st.streams.emplace(key, c);
  st.held[req.request].owner = owner;
  return c->promise;
}

/// Ends a streamed clip with `e`: its chunks waiting and its request's
/// answer get the error.
void fail_stream(self_ptr self, const std::shared_ptr<stream_clip>& c, const caf::error& e) {
  if (c->failed) return;
  c->failed = true;
  for (auto& [need, rp] : c->waiting) rp.deliver(e);
  c->waiting.clear();
  c->promise.deliver(e);
  self->state.streams.erase({c->request, c->index});
}

/// Answers the chunks whose windows are all encoded now and, at the
/// clip's end, the clip (its rows are then all held).
void answer_stream(self_ptr self, const std::shared_ptr<stream_clip>& c) {
  const bool done = c->closed && c->ready == c->parts.size();
  const stream_progress p{c->samples, c->ready_rows, done};
  std::erase_if(c->waiting, [&](auto& w) {
    if (w.first > c->ready) return false;
    w.second.deliver(p);
    return true;
  });
  if (!done) return;
  if (c->ready_rows < 1)
    return fail_stream(self, c,
                       make_error(error_code::invalid_request,
                                  c->name + ": it ended shorter than one hop (10 ms)"));
  encode_reply rep;
  rep.rows = c->ready_rows;
  rep.hidden = c->parts.front().dim(1);
  rep.preprocess_ms = c->preprocess_ms;
  rep.encode_ms = c->encode_ms;
  rep.batch = c->batch;
  c->promise.deliver(std::move(rep));  // unnamed: a streamed clip is not cached
  self->state.streams.erase({c->request, c->index});
}

void stream_window_done(self_ptr self, const std::shared_ptr<stream_clip>& c, std::size_t window,
                        const caf::error& e, double encode_ms, std::size_t batch) {
  if (c->failed) return;
  if (e) return fail_stream(self, c, e);
  c->encode_ms += encode_ms;
  c->batch = std::max<std::int64_t>(c->batch, static_cast<std::int64_t>(batch));
  c->encoded[window] = true;
  // The leading windows encoded join the held rows (the first stage takes
  // them from there, in order).
  auto& h = self->state.held[c->request];
  h.owner = c->owner;
  auto& mine = h.rows[c->index];
  while (c->ready < c->parts.size() && c->encoded[c->ready]) {
    mine.push_back(c->parts[c->ready]);
    c->ready_rows += c->parts[c->ready].dim(0);
    ++c->ready;
  }
  answer_stream(self, c);
}

/// A chunk of a streamed clip: its samples cut into whole windows (and,
/// with the last chunk, the shorter last one), batched as any clip's. The
/// answer comes once those windows are encoded.
caf::result<stream_progress> take_chunk(self_ptr self, encoder_resources& res,
                                        const encoder_options& o, const audio_chunk& ch) {
  auto& st = self->state;
  auto it = st.streams.find({ch.id, ch.index});
  if (it == st.streams.end())
    return make_error(error_code::not_found, "no streamed audio clip " + std::to_string(ch.index) +
                                                 " of request " + std::to_string(ch.id) +
                                                 " is here");
  const auto c = it->second;
  if (c->closed) return make_error(error_code::invalid_request, c->name + ": it already ended");
  if (ch.pcm.size() % 2 != 0)
    return make_error(error_code::invalid_request,
                      c->name + ": a chunk of 16-bit samples with an odd byte count");
  const auto t0 = clock::now();
  const auto& m = *res.model;
  const auto& cfg = *m.config().audio;
  const auto n = static_cast<std::int64_t>(ch.pcm.size() / 2);
  const double rate = cfg.features.sample_rate;
  if (static_cast<double>(c->samples + n) > res.audio_limits.max_seconds * rate) {
    auto e =
        make_error(error_code::invalid_request,
                   c->name + ": longer than the limit of " +
                       std::to_string(static_cast<long long>(res.audio_limits.max_seconds)) + " s");
    fail_stream(self, c, e);
    return e;
  }
  if (auto full = audio_room(self, res, c->name, n)) {
    fail_stream(self, c, full);
    return full;
  }
  c->pending.reserve(c->pending.size() + static_cast<std::size_t>(n));
  for (std::size_t i = 0; i + 1 < ch.pcm.size(); i += 2) {
    const auto v = static_cast<std::int16_t>(static_cast<std::uint16_t>(ch.pcm[i]) |
                                             static_cast<std::uint16_t>(ch.pcm[i + 1]) << 8);
    c->pending.push_back(static_cast<float>(v) / 32768.0f);
  }
  c->samples += n;
  // Whole windows now, and with the last chunk the rest (a tail under one
  // hop gives none, as audio_windows cuts a whole clip).
  const auto W = static_cast<std::size_t>(cfg.window_samples());
  std::vector<pending_window> ws;
  std::size_t at = 0;
  auto cut = [&](std::size_t len) {
    const auto piece = std::span<const float>(c->pending).subspan(at, len);
    at += len;
    if (m.audio_frames(static_cast<std::int64_t>(len)) < 1) return;
    pending_window w;
    w.stream = c;
    w.window = c->parts.size();
    w.samples = static_cast<std::int64_t>(len);
    w.features = m.audio_features(piece);
    c->parts.emplace_back();
    c->encoded.push_back(false);
    ws.push_back(std::move(w));
  };
  while (c->pending.size() - at >= W) cut(W);
  if (ch.last) {
    if (at < c->pending.size()) cut(c->pending.size() - at);
    c->closed = true;
  }
  c->pending.erase(c->pending.begin(), c->pending.begin() + static_cast<std::ptrdiff_t>(at));
  c->preprocess_ms += ms_between(t0, clock::now());
  auto rp = self->make_response_promise<stream_progress>();
  c->waiting.emplace_back(c->parts.size(), rp);
  if (!ws.empty()) queue_windows(self, res, o, std::move(ws));
  answer_stream(self, c);  // at once when no window is new and none waits
  return rp;
}

/// Closes what is due in image `bucket`; re-arms the timer for the rest.
void flush(self_ptr self, encoder_resources& res, const encoder_options& o, std::int64_t bucket) {
  close_due(self, o, bucket, self->state.buckets[bucket],
            [&](std::size_t n) { run_batch(self, res, bucket, n); });
}

/// Takes a video: its sampled frames decoded and preprocessed as images
/// are, each waiting in the images' bucket (or its rows from the cache).
caf::result<encode_reply> take_video(self_ptr self, encoder_resources& res,
                                     const encoder_options& o, encode_request& req,
                                     const caf::actor_addr& owner, clock::time_point t0) {
  const std::string name =
      req.item.name.empty() ? "video of request " + std::to_string(req.request) : req.item.name;
  const auto& m = *res.model;
  if (!m.has_video())
    return make_error(error_code::invalid_request, name + ": this model takes no video");
  if (req.item.audio && !m.has_audio())
    return make_error(error_code::invalid_request,
                      name + ": its audio track was asked for, but this model has no audio tower");
  models::video_sampling sampling;
  if (req.item.num_frames > 0) sampling.num_frames = req.item.num_frames;
  sampling.fps = req.item.fps;
  sampling.audio = req.item.audio;
  auto v = models::decode_video(req.item.bytes, sampling, res.video_limits);
  if (!v) return make_error(error_code::invalid_request, name + ": " + v.error().message);
  // The frames the headers promised (the prompt worker counted them).
  const auto wanted = models::sample_frames(v->frames_in_file, v->seconds, sampling).size();
  if (v->frames.size() != wanted)
    return make_error(error_code::invalid_request, name + ": " + std::to_string(v->frames.size()) +
                                                       " of its " + std::to_string(wanted) +
                                                       " sampled frames could be decoded");
  const std::int64_t side = m.image_size(), R = m.tokens_per_frame();
  std::vector<std::vector<float>> pixels;
  for (std::size_t f = 0; f < v->frames.size(); ++f) {
    auto pv = models::preprocess_image(v->frames[f], res.preprocessor);
    if (!pv)
      return make_error(
          error_code::invalid_request,
          name + ": frame " + std::to_string(v->index[f]) + ": " + pv.error().message);
    if (pv->height != side || pv->width != side)
      return make_error(error_code::invalid_request,
                        name + ": the preprocessor makes " + std::to_string(pv->height) + "x" +
                            std::to_string(pv->width) + " frames but the vision tower takes " +
                            std::to_string(side) + "x" + std::to_string(side));
    pixels.push_back(std::move(pv->data));
  }
  // Its audio track, when asked for: its rows follow the frames'.
  const auto& sound = v->sound.samples;
  const std::int64_t sound_rows =
      req.item.audio ? m.audio_tokens(static_cast<std::int64_t>(sound.size())) : 0;
  if (req.item.audio && sound_rows < 1)
    return make_error(error_code::invalid_request,
                      name + ": its audio track was asked for, but it has " +
                          (sound.empty() ? std::string("none") : "under one hop of sound"));
  // The video's name: the tower, its pooling and the frames' pixels (and
  // the track's samples). (SHA-256 of the identity and of each part's own
  // SHA-256, in order.)
  std::vector<std::uint8_t> names;
  for (const auto& p : pixels) {
    const auto f = core::sha256({}, std::as_bytes(std::span(p)));
    names.insert(names.end(), f.begin(), f.end());
  }
  if (req.item.audio) {
    const auto a = core::sha256({}, std::as_bytes(std::span(sound)));
    names.insert(names.end(), a.begin(), a.end());
  }
  const std::string id =
      res.weights_id + ";video;" + std::to_string(R) + (req.item.audio ? ";audio" : "");
  const auto key =
      core::sha256(std::span(reinterpret_cast<const std::uint8_t*>(id.data()), id.size()),
                   std::as_bytes(std::span(names)));
  auto& st = self->state;
  if (auto hit = st.cache ? st.cache->take(key) : std::nullopt)
    return hold_shared(self, req.request, req.index, owner, *hit, key,
                       ms_between(t0, clock::now()));
  if (req.item.audio && !st.clips.contains(key))
    if (auto full = audio_room(self, res, name, static_cast<std::int64_t>(sound.size())))
      return full;
  auto promise = self->make_response_promise<encode_reply>();
  if (follows(self, key, promise, req, owner, t0)) return promise;
  const auto frames = static_cast<std::int64_t>(pixels.size());
  auto rows = tensor::empty(res.dev->memory(), kernels::dtype::f32,
                            {frames * R + sound_rows, m.config().text.hidden_size});
  if (!rows) return make_error(error_code::internal, name + ": " + rows.error().message);
  auto c = std::make_shared<pending_clip>();
  c->rows = std::move(*rows);
  c->promise = promise;
  c->request = req.request;
  c->index = req.index;
  c->owner = owner;
  c->key = key;
  std::vector<pending_window> ws;
  if (req.item.audio) {
    std::int64_t covered = 0;
    ws = make_windows(m, c, sound, frames * R, covered);
    if (covered != sound_rows || ws.empty())
      return make_error(error_code::internal, name + ": its windows' rows do not add up");
  }
  c->left = pixels.size() + ws.size();
  c->preprocess_ms = ms_between(t0, clock::now());
  st.clips.emplace(key, c);
  if (!ws.empty()) queue_windows(self, res, o, std::move(ws));
  const std::int64_t bucket = m.tokens_per_image();
  auto& q = st.buckets[bucket];
  for (std::int64_t f = 0; f < frames; ++f) {
    pending_input in;
    in.pixels = std::move(pixels[static_cast<std::size_t>(f)]);
    in.arrived = clock::now();
    in.request = req.request;
    in.index = req.index;
    in.owner = owner;
    in.key = key;
    in.video = c;
    in.first_row = f * R;
    q.push_back(std::move(in));
    if (q.size() == 1)
      self->delayed_send(self, std::chrono::milliseconds(o.max_wait_ms), flush_atom::value, bucket);
  }
  if (q.size() >= static_cast<std::size_t>(o.max_batch)) flush(self, res, o, bucket);
  return promise;
}

/// Rows [first_row, first_row + rows) of request `q.request`'s held items,
/// taken in index order (item k's rows follow items 0..k-1's: an image's
/// tokens_per_image rows, or a clip's own count), sent to the process
/// `q.dest`: a view of one item's rows, or a gather across items.
caf::result<tensor_ref> send_rows(self_ptr self, encoder_resources& res,
                                  const media_rows_request& q) {
  const auto it = self->state.held.find(q.request);
  if (it == self->state.held.end())
    return make_error(error_code::not_found,
                      "no image rows of request " + std::to_string(q.request) + " are held here");
  if (q.rows < 1 || q.first_row < 0 ||
      q.first_row > std::numeric_limits<std::int64_t>::max() - q.rows)
    return make_error(error_code::invalid_request, "image rows: a bad row range");
  const std::int64_t end = q.first_row + q.rows;
  // The held items overlapping the range, each with the row it starts at.
  struct span_of {
    const tensor* rows;
    std::int64_t start;
  };
  std::vector<span_of> spans;
  std::int64_t offset = 0;
  std::int32_t next = 0;
  for (const auto& [index, parts] : it->second.rows) {
    if (index != next || offset >= end) break;  // a gap: the offsets past it are unknown
    for (const auto& rows : parts) {
      const auto n = rows.dim(0);
      if (offset + n > q.first_row && offset < end) spans.push_back({&rows, offset});
      offset += n;
    }
    ++next;
  }
  if (offset < end)
    return make_error(error_code::not_found, "image " + std::to_string(next) + " of request " +
                                                 std::to_string(q.request) + " is not held here");
  kernels::result<tensor> t = kernels::make_error(kernels::errc::internal, "no rows");
  if (spans.size() == 1) {
    t = spans.front().rows->slice_rows(q.first_row - spans.front().start, q.rows);
  } else {
    const std::int64_t H = spans.front().rows->dim(1);
    t = tensor::empty(res.dev->memory(), kernels::dtype::f32, {q.rows, H});
    // Row by row through the device (its memory need not be the host's).
    std::size_t s = 0;
    for (std::int64_t r = 0; t && r < q.rows; ++r) {
      const auto row = q.first_row + r;
      while (row >= spans[s].start + spans[s].rows->dim(0)) ++s;
      auto src = spans[s].rows->slice_rows(row - spans[s].start, 1);
      auto dst = t->slice_rows(r, 1);
      if (!src || !dst) {
        t = std::unexpected(!src ? src.error() : dst.error());
        break;
      }
      if (auto c = res.dev->copy(*src, *dst); !c) t = std::unexpected(c.error());
    }
  }
  if (!t) return make_error(error_code::internal, "image rows: " + t.error().message);
  auto ref = data_plane::local().send(q.dest == to_string(self->node()) ? std::string{} : q.dest,
                                      res.device.name, std::move(*t));
  if (!ref)
    return make_error(error_code::peer_lost,
                      "image rows to the first stage: " + ref.error().message);
  return std::move(*ref);
}

}  // namespace

kernels::result<std::shared_ptr<encoder_resources>> make_media_encoder(
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
  res->weights_id = cache_namespace(path, plan, {}) + ";vision";
  return res;
}

encoder_actor spawn_encoder(caf::actor_system& sys, std::shared_ptr<encoder_resources> res,
                            encoder_options opts) {
  opts = core::sanitized(opts);
  auto impl = [](self_ptr self, std::shared_ptr<encoder_resources> res,
                 encoder_options o) -> encoder_actor::behavior_type {
    pin_current_thread(res->device.cores);
    if (res->cache_bytes > 0) self->state.cache.emplace(res->cache_bytes);
    // A requester that goes away forgets nothing: its requests' rows go
    // with it.
    self->set_down_handler([=](caf::down_msg& dm) {
      auto& st = self->state;
      st.watched.erase(dm.source);
      for (auto it = st.held.begin(); it != st.held.end();)
        it = it->second.owner == dm.source ? st.held.erase(it) : std::next(it);
      std::vector<std::shared_ptr<stream_clip>> gone;
      for (const auto& [key, c] : st.streams)
        if (c->owner == dm.source) gone.push_back(c);
      for (auto& c : gone)
        fail_stream(self, c,
                    make_error(error_code::cancelled, c->name + ": its requester is gone"));
    });
    return {
        [=](encode_atom, encode_request& req) -> caf::result<encode_reply> {
          const auto t0 = clock::now();
          // The requester (before make_response_promise takes the sender
          // out of the current message): its requests' rows are held here.
          const auto& sender = self->current_sender();
          const auto owner = caf::actor_cast<caf::actor_addr>(sender);
          if (sender && self->state.watched.insert(owner).second) self->monitor(sender);
          if (req.item.kind == media_kind::audio && req.item.stream)
            return take_stream(self, *res, req, owner);
          if (req.item.kind == media_kind::audio) return take_clip(self, *res, o, req, owner, t0);
          if (req.item.kind == media_kind::video) return take_video(self, *res, o, req, owner, t0);
          if (req.item.kind != media_kind::image)
            return make_error(error_code::invalid_request, "a media item of an unknown kind");
          const std::string name = req.item.name.empty()
                                       ? "image of request " + std::to_string(req.request)
                                       : req.item.name;
          auto img = models::decode_image(req.item.bytes, res->limits);
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
          // The image's name: the tower and the pixels it sees (which the
          // preprocessor's settings made).
          const auto key =
              core::sha256(std::span(reinterpret_cast<const std::uint8_t*>(res->weights_id.data()),
                                     res->weights_id.size()),
                           std::as_bytes(std::span(pv->data)));
          if (auto hit = self->state.cache ? self->state.cache->take(key) : std::nullopt)
            return hold_shared(self, req.request, req.index, owner, *hit, key,
                               ms_between(t0, clock::now()));
          // Bucket by the token count the input encodes to (fixed for a CLIP
          // tower; audio clips will differ).
          const std::int64_t bucket = res->model->tokens_per_image();
          auto promise = self->make_response_promise<encode_reply>();
          auto& q = self->state.buckets[bucket];
          // The same image already waits (two requests sent it at once):
          // this one takes its rows when that batch runs.
          for (auto& p : q)
            if (p.key == key && !p.video) {
              p.followers.push_back(
                  {promise, ms_between(t0, clock::now()), req.request, req.index, owner});
              return promise;
            }
          q.push_back({std::move(pv->data),
                       promise,
                       clock::now(),
                       ms_between(t0, clock::now()),
                       req.request,
                       req.index,
                       owner,
                       key,
                       {},
                       nullptr,
                       0});
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
          if (bucket <= -2) return flush_audio(self, *res, o, bucket);
          // -1: encode everything waiting now (the encoder is being replaced).
          for (auto& [b, q] : self->state.buckets)
            while (!q.empty()) run_batch(self, *res, b, static_cast<std::size_t>(o.max_batch));
          for (auto& [b, q] : self->state.windows)
            while (!q.empty())
              run_audio_batch(self, *res, b, static_cast<std::size_t>(o.max_batch));
        },
        [=](chunk_atom, const audio_chunk& ch) { return take_chunk(self, *res, o, ch); },
        [=](rows_atom, const media_rows_request& q) { return send_rows(self, *res, q); },
        [=](forget_atom, std::uint64_t request) {
          auto& st = self->state;
          st.held.erase(request);
          // Its streamed clip too (its windows still queued are encoded
          // and dropped).
          std::vector<std::shared_ptr<stream_clip>> gone;
          for (const auto& [key, c] : st.streams)
            if (key.first == request) gone.push_back(c);
          for (auto& c : gone)
            fail_stream(self, c, make_error(error_code::cancelled, c->name + ": forgotten"));
        },
        [](version_atom) { return protocol_version; },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(res), opts);
}

}  // namespace troupe::actors
