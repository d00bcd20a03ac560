#include "models/llava.hpp"

#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <span>

namespace troupe::models {

using kernels::dtype;
using kernels::tensor;

result<std::vector<std::int32_t>> expand_media_tokens(
    std::span<const std::int32_t> ids, std::int32_t image_token, std::int64_t tokens_per_image,
    std::int64_t n_images, std::int32_t audio_token, std::span<const std::int64_t> audio_tokens) {
  return expand_media_tokens(ids, image_token, tokens_per_image, n_images, audio_token,
                             audio_tokens, -1, {});
}

result<std::vector<std::int32_t>> expand_media_tokens(
    std::span<const std::int32_t> ids, std::int32_t image_token, std::int64_t tokens_per_image,
    std::int64_t n_images, std::int32_t audio_token, std::span<const std::int64_t> audio_tokens,
    std::int32_t video_token, std::span<const std::int64_t> video_tokens) {
  if (tokens_per_image < 1)
    return make_error(errc::invalid_argument, "tokens per image must be >= 1");
  const auto images = std::count(ids.begin(), ids.end(), image_token);
  if (images != n_images)
    return make_error(errc::invalid_argument,
                      "the prompt holds " + std::to_string(images) + " image token(s) (id " +
                          std::to_string(image_token) + ") but " + std::to_string(n_images) +
                          " image(s) were given: one image token per image");
  const auto clips = audio_token >= 0 ? std::count(ids.begin(), ids.end(), audio_token) : 0;
  if (clips != static_cast<std::int64_t>(audio_tokens.size()))
    return make_error(errc::invalid_argument,
                      "the prompt holds " + std::to_string(clips) + " audio token(s) (id " +
                          std::to_string(audio_token) + ") but " +
                          std::to_string(audio_tokens.size()) +
                          " audio clip(s) were given: one audio token per clip");
  const auto videos = video_token >= 0 ? std::count(ids.begin(), ids.end(), video_token) : 0;
  if (videos != static_cast<std::int64_t>(video_tokens.size()))
    return make_error(errc::invalid_argument,
                      "the prompt holds " + std::to_string(videos) + " video token(s) (id " +
                          std::to_string(video_token) + ") but " +
                          std::to_string(video_tokens.size()) +
                          " video(s) were given: one video token per video");
  constexpr std::int64_t limit = std::int64_t{1} << 30;
  std::int64_t total = static_cast<std::int64_t>(ids.size()) - images - clips - videos;
  if (images > 0 && tokens_per_image > limit / images)
    return make_error(errc::invalid_argument, "the expanded prompt would be too long");
  total += images * tokens_per_image;
  for (auto n : audio_tokens) {
    if (n < 1 || n > limit || total > limit - n)
      return make_error(errc::invalid_argument,
                        n < 1 ? "an audio clip gives no token (shorter than 10 ms)"
                              : "the expanded prompt would be too long");
    total += n;
  }
  for (auto n : video_tokens) {
    if (n < 1 || n > limit || total > limit - n)
      return make_error(errc::invalid_argument, n < 1 ? "a video gives no token (no frame)"
                                                      : "the expanded prompt would be too long");
    total += n;
  }
  if (total > limit)
    return make_error(errc::invalid_argument, "the expanded prompt would be too long");
  std::vector<std::int32_t> out;
  out.reserve(static_cast<std::size_t>(total));
  std::size_t clip = 0, video = 0;
  for (auto t : ids) {
    if (t == image_token) {
      out.insert(out.end(), static_cast<std::size_t>(tokens_per_image), image_token);
    } else if (t == audio_token && audio_token >= 0) {
      out.insert(out.end(), static_cast<std::size_t>(audio_tokens[clip++]), image_token);
    } else if (t == video_token && video_token >= 0) {
      out.insert(out.end(), static_cast<std::size_t>(video_tokens[video++]), image_token);
    } else {
      out.push_back(t);
    }
  }
  return out;
}

result<std::vector<std::int32_t>> expand_image_tokens(std::span<const std::int32_t> ids,
                                                      std::int32_t image_token,
                                                      std::int64_t tokens_per_image,
                                                      std::int64_t n_images) {
  return expand_media_tokens(ids, image_token, tokens_per_image, n_images, -1, {});
}

result<std::unique_ptr<llava_model>> llava_model::load(const std::string& path,
                                                       kernels::device& dev,
                                                       const quant_plan& plan) {
  std::string dir = path;
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
    const auto slash = dir.rfind('/');
    dir = slash == std::string::npos ? "." : dir.substr(0, slash);
  }
  auto cfg = load_llava_config(dir + "/config.json");
  if (!cfg) return std::unexpected(cfg.error());
  auto src = weight_source::open(path);
  if (!src) return std::unexpected(src.error());
  if ((*src)->is_gguf())
    return make_error(errc::unsupported_op,
                      path + ": LLaVA loads from a Hugging Face folder, not GGUF");
  return build(**src, *cfg, dev, plan);
}

result<std::unique_ptr<llava_model>> llava_model::build(const weight_source& src,
                                                        const llava_config& cfg,
                                                        kernels::device& dev,
                                                        const quant_plan& plan) {
  if (auto r = cfg.validate(src.path()); !r) return std::unexpected(r.error());
  std::unique_ptr<llava_model> m(new llava_model());
  m->cfg_ = cfg;
  auto vision = clip_vision_tower::build(src, cfg.vision, cfg.vision_layers_used(), dev, plan);
  if (!vision) return std::unexpected(vision.error());
  m->vision_ = std::move(*vision);
  const std::int64_t Dv = cfg.vision.hidden_size, Dt = cfg.text.hidden_size;
  auto p1 = load_linear(dev, src, plan, "projector.linear_1", Dt, Dv, cfg.projector_bias);
  if (!p1) return std::unexpected(p1.error());
  auto p2 = load_linear(dev, src, plan, "projector.linear_2", Dt, Dt, cfg.projector_bias);
  if (!p2) return std::unexpected(p2.error());
  m->proj1_ = std::move(*p1);
  m->proj2_ = std::move(*p2);
  auto text = llama_model::build(src, cfg.text, dev, plan);
  if (!text) return std::unexpected(text.error());
  m->text_ = std::move(*text);
  if (cfg.audio) {
    auto enc = whisper_encoder::build(src, cfg.audio->encoder, dev, plan);
    if (!enc) return std::unexpected(enc.error());
    m->audio_ = std::move(*enc);
    auto proj =
        audio_projector::build(src, cfg.audio->projector, cfg.audio->encoder.d_model, dev, plan);
    if (!proj) return std::unexpected(proj.error());
    m->audio_proj_ = std::move(*proj);
    m->mel_ = std::make_unique<log_mel>(cfg.audio->features);
  }
  if (cfg.video && cfg.video->frame_newline) {
    auto stored = src.get("video.image_newline");
    if (!stored) return std::unexpected(stored.error());
    if (stored->numel() != Dt)
      return make_error(errc::shape_mismatch, src.path() + ": image_newline has " +
                                                  std::to_string(stored->numel()) +
                                                  " values but the text hidden size is " +
                                                  std::to_string(Dt) + " (video_frame_newline)");
    auto row = to_f32(dev, *stored);
    if (!row) return std::unexpected(row.error());
    auto shaped = row->reshape({1, Dt});
    if (!shaped) return std::unexpected(shaped.error());
    m->newline_ = std::move(*shaped);
  }
  spdlog::debug("loaded {}: {}", src.path(), m->describe());
  return m;
}

result<tensor> llava_model::pool_frames(kernels::device& dev, const tensor& features) const {
  if (!cfg_.video) return make_error(errc::unsupported_op, "this model takes no video");
  const std::int64_t T = tokens_per_image(), Dv = cfg_.vision.hidden_size, g = cfg_.patch_grid(),
                     s = cfg_.video->pool_stride, p = g / s;
  if (features.type() != dtype::f32 || features.ndim() != 2 || features.dim(1) != Dv ||
      features.dim(0) < T || features.dim(0) % T != 0 || g * g != T)
    return make_error(errc::shape_mismatch, "frame features must be f32 [F * " + std::to_string(T) +
                                                ", " + std::to_string(Dv) + "], got " +
                                                features.shape().to_string());
  const std::int64_t F = features.dim(0) / T;
  // On the host (a few rows per frame; the device's memory need not be the host's).
  std::vector<float> in(static_cast<std::size_t>(features.numel()));
  if (auto r = kernels::copy_to_host(features, std::as_writable_bytes(std::span<float>(in))); !r)
    return std::unexpected(r.error());
  auto& staging = dev.memory().host_accessible() ? dev.memory() : host_staging_pool();
  auto host = tensor::empty(staging, dtype::f32, {F * p * p, Dv});
  if (!host) return std::unexpected(host.error());
  float* out = host->data_as<float>();
  const bool avg = cfg_.video->pool == video_pool::average;
  const float inv = 1.0f / static_cast<float>(s * s);
  // torch's AvgPool2d / MaxPool2d (kernel = stride, floor): window rows
  // summed in row-major order, then divided by the window's size.
  for (std::int64_t f = 0; f < F; ++f)
    for (std::int64_t py = 0; py < p; ++py)
      for (std::int64_t px = 0; px < p; ++px) {
        float* o = out + ((f * p + py) * p + px) * Dv;
        for (std::int64_t d = 0; d < Dv; ++d) {
          float acc = avg ? 0.0f : -std::numeric_limits<float>::infinity();
          for (std::int64_t y = py * s; y < py * s + s; ++y)
            for (std::int64_t x = px * s; x < px * s + s; ++x) {
              const float v = in[static_cast<std::size_t>(((f * T) + y * g + x) * Dv + d)];
              acc = avg ? acc + v : std::max(acc, v);
            }
          o[d] = avg ? acc * inv : acc;
        }
      }
  if (&staging == &dev.memory()) return std::move(*host);
  auto on_dev = tensor::empty(dev.memory(), dtype::f32, {F * p * p, Dv});
  if (!on_dev) return std::unexpected(on_dev.error());
  if (auto r = dev.copy(*host, *on_dev); !r) return std::unexpected(r.error());
  return std::move(*on_dev);
}

result<tensor> llava_model::frame_rows(kernels::device& dev, const tensor& features) const {
  auto pooled = pool_frames(dev, features);
  if (!pooled) return std::unexpected(pooled.error());
  auto rows = project(dev, *pooled);
  if (!rows || !cfg_.video->frame_newline) return rows;
  const std::int64_t Dt = cfg_.text.hidden_size, P = tokens_per_frame() - 1, F = rows->dim(0) / P;
  auto out = tensor::empty(dev.memory(), dtype::f32, {F * (P + 1), Dt});
  if (!out) return std::unexpected(out.error());
  for (std::int64_t f = 0; f < F; ++f) {
    auto from = rows->slice_rows(f * P, P);
    auto to = out->slice_rows(f * (P + 1), P);
    auto nl = out->slice_rows(f * (P + 1) + P, 1);
    if (!from || !to || !nl)
      return std::unexpected(!from ? from.error() : !to ? to.error() : nl.error());
    if (auto r = dev.copy(*from, *to); !r) return std::unexpected(r.error());
    if (auto r = dev.copy(newline_, *nl); !r) return std::unexpected(r.error());
  }
  return std::move(*out);
}

result<tensor> llava_model::encode_frames(kernels::device& dev, const tensor& pixels,
                                          const clip_options& opts) const {
  if (!cfg_.video) return make_error(errc::unsupported_op, "this model takes no video");
  auto f = vision_features(dev, pixels, opts);
  if (!f) return std::unexpected(f.error());
  return frame_rows(dev, *f);
}

result<llava_prompt> llava_model::prepare(kernels::device& dev, std::span<const std::int32_t> ids,
                                          const tensor& pixels,
                                          const std::vector<std::span<const float>>& clips,
                                          const std::vector<tensor>& videos,
                                          const clip_options& opts,
                                          const std::vector<std::span<const float>>& sounds) const {
  if (videos.empty()) return prepare(dev, ids, pixels, clips, opts);
  if (!cfg_.video) return make_error(errc::unsupported_op, "this model takes no video");
  const bool heard = std::any_of(sounds.begin(), sounds.end(), [](auto s) { return !s.empty(); });
  if ((!clips.empty() || heard) && !audio_)
    return make_error(errc::unsupported_op, "this model has no audio encoder");
  if (!sounds.empty() && sounds.size() != videos.size())
    return make_error(errc::invalid_argument, std::to_string(sounds.size()) + " audio tracks for " +
                                                  std::to_string(videos.size()) + " videos");
  const auto sound_of = [&](std::size_t k) {
    return k < sounds.size() ? sounds[k] : std::span<const float>{};
  };
  auto n_images = count_images(pixels);
  if (!n_images) return std::unexpected(n_images.error());
  std::vector<std::int64_t> counts, frames;
  for (const auto& c : clips) counts.push_back(audio_tokens(static_cast<std::int64_t>(c.size())));
  for (std::size_t k = 0; k < videos.size(); ++k) {
    const auto& v = videos[k];
    const auto sound = static_cast<std::int64_t>(sound_of(k).size());
    frames.push_back((v.ndim() == 4 ? v.dim(0) : 0) * tokens_per_frame() +
                     (sound > 0 ? audio_tokens(sound) : 0));
  }
  llava_prompt p;
  p.image_token = image_token();
  auto tokens = expand_media_tokens(ids, image_token(), tokens_per_image(), *n_images,
                                    audio_token(), counts, video_token(), frames);
  if (!tokens) return std::unexpected(tokens.error());
  p.tokens = std::move(*tokens);
  auto to_host = [](const tensor& t) -> result<std::vector<float>> {
    std::vector<float> rows(static_cast<std::size_t>(t.numel()));
    if (auto r = kernels::copy_to_host(t, std::as_writable_bytes(std::span<float>(rows))); !r)
      return std::unexpected(r.error());
    return rows;
  };
  std::vector<float> image_rows;
  if (*n_images > 0) {
    auto emb = encode_images(dev, pixels, opts);
    if (!emb) return std::unexpected(emb.error());
    auto h = to_host(*emb);
    if (!h) return std::unexpected(h.error());
    image_rows = std::move(*h);
  }
  const auto per_image = static_cast<std::size_t>(tokens_per_image()) *
                         static_cast<std::size_t>(cfg_.text.hidden_size);
  std::size_t image = 0, clip = 0, video = 0;
  for (auto t : ids) {
    if (t == image_token()) {
      const auto* from = image_rows.data() + image++ * per_image;
      p.image_embeds.insert(p.image_embeds.end(), from, from + per_image);
      continue;
    }
    kernels::result<tensor> emb = make_error(errc::internal, "no rows");
    if (t == audio_token() && audio_token() >= 0) {
      emb = encode_audio(dev, clips[clip++]);
    } else if (t == video_token()) {
      const auto k = video++;
      emb = encode_frames(dev, videos[k], opts);
      if (emb && !sound_of(k).empty()) {  // the track's rows after the frames'
        auto h = to_host(*emb);
        auto a = encode_audio(dev, sound_of(k));
        if (!h || !a) return std::unexpected(!h ? h.error() : a.error());
        auto ah = to_host(*a);
        if (!ah) return std::unexpected(ah.error());
        p.image_embeds.insert(p.image_embeds.end(), h->begin(), h->end());
        p.image_embeds.insert(p.image_embeds.end(), ah->begin(), ah->end());
        continue;
      }
    } else {
      continue;
    }
    if (!emb) return std::unexpected(emb.error());
    auto h = to_host(*emb);
    if (!h) return std::unexpected(h.error());
    p.image_embeds.insert(p.image_embeds.end(), h->begin(), h->end());
  }
  return p;
}

std::string llava_model::describe() const {
  return vision_->describe() + "; projector " +
         std::string(kernels::to_string(proj1_.weight.format())) + "/" +
         std::string(kernels::to_string(proj2_.weight.format())) + "; text " + text_->describe() +
         (audio_ ? "; " + audio_->describe() : std::string{});
}

std::vector<std::span<const float>> llava_model::audio_windows(
    std::span<const float> samples) const {
  std::vector<std::span<const float>> out;
  if (!audio_) return out;
  const auto window = static_cast<std::size_t>(cfg_.audio->window_samples());
  for (std::size_t at = 0; at < samples.size(); at += window) {
    const auto piece = samples.subspan(at, std::min(window, samples.size() - at));
    // A tail under one hop: no frame, no token (tokens_for_samples agrees).
    if (mel_->frames_for(static_cast<std::int64_t>(piece.size())) < 1) break;
    out.push_back(piece);
  }
  return out;
}

std::int64_t llava_model::audio_frames(std::int64_t window_samples) const {
  return mel_ ? mel_->frames_for(window_samples) : 0;
}

std::vector<float> llava_model::audio_features(std::span<const float> window) const {
  return mel_ ? (*mel_)(window) : std::vector<float>{};
}

result<tensor> llava_model::encode_audio_windows(kernels::device& dev,
                                                 const tensor& features) const {
  if (!audio_) return make_error(errc::unsupported_op, "this model has no audio encoder");
  auto rows = audio_->forward(dev, features);
  if (!rows) return std::unexpected(rows.error());
  return audio_proj_->forward(dev, *rows);
}

result<tensor> llava_model::encode_audio(kernels::device& dev,
                                         std::span<const float> samples) const {
  if (!audio_) return make_error(errc::unsupported_op, "this model has no audio encoder");
  const auto& a = *cfg_.audio;
  const std::int64_t total = audio_tokens(static_cast<std::int64_t>(samples.size()));
  if (total < 1)
    return make_error(errc::invalid_argument,
                      "an audio clip of " + std::to_string(samples.size()) +
                          " samples is shorter than one hop of the features (" +
                          std::to_string(a.features.hop_length) + ")");
  const std::int64_t Dt = cfg_.text.hidden_size, M = a.encoder.num_mel_bins;
  auto out = tensor::empty(dev.memory(), dtype::f32, {total, Dt});
  if (!out) return std::unexpected(out.error());
  auto& staging = dev.memory().host_accessible() ? dev.memory() : host_staging_pool();
  std::int64_t row = 0;
  for (const auto piece : audio_windows(samples)) {
    const std::int64_t frames = audio_frames(static_cast<std::int64_t>(piece.size()));
    auto feats = audio_features(piece);
    auto f = tensor::empty(staging, dtype::f32, {1, M, frames});
    if (!f) return std::unexpected(f.error());
    std::copy(feats.begin(), feats.end(), f->data_as<float>());
    auto emb = encode_audio_windows(dev, *f);
    if (!emb) return std::unexpected(emb.error());
    const std::int64_t n = emb->dim(1);
    auto flat = emb->reshape({n, Dt});
    auto dst = out->slice_rows(row, n);
    if (!flat || !dst || row + n > total)
      return make_error(errc::internal, "audio rows do not add up to the clip's token count");
    if (auto r = dev.copy(*flat, *dst); !r) return std::unexpected(r.error());
    row += n;
  }
  if (row != total)
    return make_error(errc::internal, "audio rows do not add up to the clip's token count");
  return out;
}

result<llava_prompt> llava_model::prepare(kernels::device& dev, std::span<const std::int32_t> ids,
                                          const tensor& pixels,
                                          const std::vector<std::span<const float>>& clips,
                                          const clip_options& opts) const {
  if (clips.empty()) return prepare(dev, ids, pixels, opts);
  if (!audio_) return make_error(errc::unsupported_op, "this model has no audio encoder");
  auto n_images = count_images(pixels);
  if (!n_images) return std::unexpected(n_images.error());
  std::vector<std::int64_t> counts;
  for (const auto& c : clips) counts.push_back(audio_tokens(static_cast<std::int64_t>(c.size())));
  llava_prompt p;
  p.image_token = image_token();
  auto tokens =
      expand_media_tokens(ids, image_token(), tokens_per_image(), *n_images, audio_token(), counts);
  if (!tokens) return std::unexpected(tokens.error());
  p.tokens = std::move(*tokens);
  // Every image's rows and every clip's, then laid out in prompt order.
  std::vector<float> image_rows;
  if (*n_images > 0) {
    auto emb = encode_images(dev, pixels, opts);
    if (!emb) return std::unexpected(emb.error());
    image_rows.resize(static_cast<std::size_t>(emb->numel()));
    if (auto r = kernels::copy_to_host(*emb, std::as_writable_bytes(std::span<float>(image_rows)));
        !r)
      return std::unexpected(r.error());
  }
  const auto Dt = static_cast<std::size_t>(cfg_.text.hidden_size);
  const auto per_image = static_cast<std::size_t>(tokens_per_image()) * Dt;
  std::size_t image = 0, clip = 0;
  for (auto t : ids) {
    if (t == image_token()) {
      const auto* from = image_rows.data() + image++ * per_image;
      p.image_embeds.insert(p.image_embeds.end(), from, from + per_image);
    } else if (t == audio_token()) {
      auto emb = encode_audio(dev, clips[clip++]);
      if (!emb) return std::unexpected(emb.error());
      std::vector<float> rows(static_cast<std::size_t>(emb->numel()));
      if (auto r = kernels::copy_to_host(*emb, std::as_writable_bytes(std::span<float>(rows))); !r)
        return std::unexpected(r.error());
      p.image_embeds.insert(p.image_embeds.end(), rows.begin(), rows.end());
    }
  }
  return p;
}

result<tensor> llava_model::vision_features(kernels::device& dev, const tensor& pixels,
                                            const clip_options& opts) const {
  auto hidden = vision_->forward(dev, pixels, opts);
  if (!hidden) return std::unexpected(hidden.error());
  const std::int64_t N = hidden->dim(0), T = hidden->dim(1), D = hidden->dim(2);
  if (cfg_.select == vision_select::full) return hidden->reshape({N * T, D});
  auto out = tensor::empty(dev.memory(), dtype::f32, {N * (T - 1), D});
  if (!out) return std::unexpected(out.error());
  auto flat = hidden->reshape({N * T, D});
  if (!flat) return std::unexpected(flat.error());
  for (std::int64_t n = 0; n < N; ++n) {  // through the device: its memory need not be the host's
    auto from = flat->slice_rows(n * T + 1, T - 1);
    auto to = out->slice_rows(n * (T - 1), T - 1);
    if (!from || !to) return std::unexpected(!from ? from.error() : to.error());
    if (auto r = dev.copy(*from, *to); !r) return std::unexpected(r.error());
  }
  return out;
}

result<tensor> llava_model::project(kernels::device& dev, const tensor& features) const {
  const std::int64_t Dv = cfg_.vision.hidden_size, Dt = cfg_.text.hidden_size;
  if (features.type() != dtype::f32 || features.ndim() != 2 || !features.is_contiguous() ||
      features.dim(1) != Dv || features.dim(0) < 1)
    return make_error(errc::shape_mismatch, "projector input must be f32 [rows >= 1, " +
                                                std::to_string(Dv) + "], got " +
                                                features.shape().to_string());
  auto h = tensor::empty(dev.memory(), dtype::f32, {features.dim(0), Dt});
  auto out = tensor::empty(dev.memory(), dtype::f32, {features.dim(0), Dt});
  if (!h) return std::unexpected(h.error());
  if (!out) return std::unexpected(out.error());
  if (auto r = proj1_.run(dev, features, *h); !r) return std::unexpected(r.error());
  if (auto r = dev.gelu(*h, cfg_.projector_activation, *h); !r) return std::unexpected(r.error());
  if (auto r = proj2_.run(dev, *h, *out); !r) return std::unexpected(r.error());
  return out;
}

result<tensor> llava_model::encode_images(kernels::device& dev, const tensor& pixels,
                                          const clip_options& opts) const {
  auto f = vision_features(dev, pixels, opts);
  if (!f) return std::unexpected(f.error());
  return project(dev, *f);
}

result<std::vector<std::int32_t>> llava_model::expand_image_tokens(
    std::span<const std::int32_t> ids, std::int64_t n_images) const {
  return models::expand_image_tokens(ids, image_token(), tokens_per_image(), n_images);
}

result<std::int64_t> llava_model::count_images(const tensor& pixels) const {
  const std::int64_t n = pixels.empty_view() ? 0 : (pixels.ndim() == 4 ? pixels.dim(0) : -1);
  if (n < 0)
    return make_error(errc::shape_mismatch,
                      "pixel_values must be [N, " + std::to_string(channels()) + ", " +
                          std::to_string(image_size()) + ", " + std::to_string(image_size()) +
                          "], got " + pixels.shape().to_string());
  return n;
}

result<llava_prompt> llava_model::prepare(kernels::device& dev, std::span<const std::int32_t> ids,
                                          const tensor& pixels, const clip_options& opts) const {
  auto n_images = count_images(pixels);
  if (!n_images) return std::unexpected(n_images.error());
  llava_prompt p;
  p.image_token = image_token();
  auto tokens = expand_image_tokens(ids, *n_images);
  if (!tokens) return std::unexpected(tokens.error());
  p.tokens = std::move(*tokens);
  if (*n_images > 0) {
    auto emb = encode_images(dev, pixels, opts);
    if (!emb) return std::unexpected(emb.error());
    p.image_embeds.resize(static_cast<std::size_t>(emb->numel()));
    if (auto r =
            kernels::copy_to_host(*emb, std::as_writable_bytes(std::span<float>(p.image_embeds)));
        !r)
      return std::unexpected(r.error());
  }
  return p;
}

}  // namespace troupe::models
