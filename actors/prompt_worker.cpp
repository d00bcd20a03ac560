#include "actors/prompt_worker.hpp"

#include <algorithm>

#include "models/grammar.hpp"

namespace troupe::actors {

models::video_sampling video_sampling_of(const media_data& v) {
  models::video_sampling s;
  if (v.num_frames > 0) s.num_frames = v.num_frames;
  s.fps = v.fps;
  return s;
}

std::expected<void, caf::error> place_media(const prompt_setup& setup,
                                            std::vector<media_data> images,
                                            std::vector<media_data> audios, generate_request& req,
                                            std::vector<media_data> videos) {
  auto bad = [](std::string why) {
    return std::unexpected(make_error(error_code::invalid_request, std::move(why)));
  };
  if (images.empty() && audios.empty() && videos.empty()) return {};
  struct limit {
    const char *what, *key;
    std::size_t n;
    std::int64_t most;
  };
  for (const auto& l : {limit{"images", "max_images", images.size(), setup.max_images},
                        limit{"audio clips", "max_audios", audios.size(), setup.max_audios},
                        limit{"videos", "max_videos", videos.size(), setup.max_videos}})
    if (static_cast<std::int64_t>(l.n) > l.most)
      return bad("the request holds " + std::to_string(l.n) + " " + l.what + "; at most " +
                 std::to_string(l.most) + " are allowed ([media] " + l.key + ")");
  const auto image_token =
      setup.llava ? static_cast<std::int32_t>(setup.llava->image_token_index) : -1;
  const auto audio_token = setup.llava && setup.llava->audio
                               ? static_cast<std::int32_t>(setup.llava->audio->token_index)
                               : -1;
  if (!audios.empty()) {
    if (audio_token < 0)
      return bad("audio clips need a model that hears; this model has no audio tower");
    const auto& a = *setup.llava->audio;
    for (std::size_t k = 0; k < audios.size(); ++k) {
      auto& clip = audios[k];
      const std::string name =
          clip.name.empty() ? "audio clip " + std::to_string(k + 1) : clip.name;
      if (clip.stream) {
        // It comes in chunks while the request runs: its tokens are
        // counted as it comes (the scheduler checks its place: the last).
        if (!clip.bytes.empty())
          return bad(name + ": a streamed clip comes in chunks, not with the request");
        if (k + 1 != audios.size()) return bad(name + ": only the last audio clip can be streamed");
        req.audio_tokens.push_back(0);
        clip.kind = media_kind::audio;
        continue;
      }
      auto decoded =
          models::decode_audio_at(clip.bytes, a.features.sample_rate, setup.audio_limits);
      if (!decoded) return bad(name + ": " + decoded.error().message);
      const auto tokens = a.tokens_for_samples(static_cast<std::int64_t>(decoded->samples.size()));
      if (tokens < 1)
        return bad(name + ": " + std::to_string(decoded->samples.size()) +
                   " samples are shorter than one hop of the audio features");
      req.audio_tokens.push_back(tokens);
      clip.kind = media_kind::audio;
    }
  }
  const auto video_token = setup.llava && setup.llava->video
                               ? static_cast<std::int32_t>(setup.llava->video->token_index)
                               : -1;
  if (!videos.empty()) {
    if (video_token < 0) return bad("videos need a model that sees video; this model takes none");
    const auto per_frame = setup.llava->tokens_per_frame();
    for (std::size_t k = 0; k < videos.size(); ++k) {
      auto& v = videos[k];
      const std::string name = v.name.empty() ? "video " + std::to_string(k + 1) : v.name;
      // The server's default when the request names no frame count: the
      // encoder then samples what was counted here.
      if (v.num_frames <= 0) v.num_frames = setup.video_frames;
      if (v.audio && !setup.llava->audio)
        return bad(name + ": its audio track was asked for, but this model has no audio tower");
      // The headers and packets only (and the audio track when asked
      // for): the frames it will give.
      auto probed =
          v.audio ? models::probe_video_sound(v.bytes, video_sampling_of(v), setup.video_limits)
                  : models::probe_video(v.bytes, video_sampling_of(v), setup.video_limits);
      if (!probed) return bad(name + ": " + probed.error().message);
      std::int64_t tokens = static_cast<std::int64_t>(probed->index.size()) * per_frame;
      if (v.audio) {
        const auto n = static_cast<std::int64_t>(probed->sound.samples.size());
        const auto sound = setup.llava->audio->tokens_for_samples(n);
        if (sound < 1)
          return bad(name + ": its audio track was asked for, but it has " +
                     (n == 0 ? std::string("none") : "under one hop of sound"));
        tokens += sound;
      }
      req.video_tokens.push_back(tokens);
      v.kind = media_kind::video;
    }
  }
  std::size_t image = 0, clip = 0, video = 0;
  for (auto t : req.prompt_tokens) {
    if (t == image_token && image_token >= 0) {
      if (image == images.size())
        return bad("the prompt has more image placeholders than the " +
                   std::to_string(images.size()) + " images given");
      req.media.push_back(std::move(images[image++]));
      req.media.back().kind = media_kind::image;
    } else if (t == audio_token && audio_token >= 0) {
      if (clip == audios.size())
        return bad("the prompt has more audio placeholders than the " +
                   std::to_string(audios.size()) + " clips given");
      req.media.push_back(std::move(audios[clip++]));
    } else if (t == video_token && video_token >= 0) {
      if (video == videos.size())
        return bad("the prompt has more video placeholders than the " +
                   std::to_string(videos.size()) + " videos given");
      req.media.push_back(std::move(videos[video++]));
    }
  }
  if (image != images.size() || clip != audios.size() || video != videos.size())
    return bad("the prompt places " + std::to_string(image) + " of " +
               std::to_string(images.size()) + " images, " + std::to_string(clip) + " of " +
               std::to_string(audios.size()) + " audio clips and " + std::to_string(video) +
               " of " + std::to_string(videos.size()) + " videos");
  return {};
}

std::expected<generate_request, caf::error> request_of(const prompt_setup& setup,
                                                       const prompt_renderer& render,
                                                       job_request job) {
  generate_request req;
  if (!job.prompt_ids.empty()) {
    if (!job.images.empty() || !job.audios.empty() || !job.videos.empty() || job.chat ||
        !job.turns.empty() || !job.prompt.empty())
      return std::unexpected(make_error(error_code::invalid_request,
                                        "a prompt of token ids comes alone: no text, chat, "
                                        "images, audio or video with it"));
    req.prompt_tokens = std::move(job.prompt_ids);
  }
  prompt_input in;
  in.prompt = job.prompt;
  in.system = job.system;
  in.images = static_cast<int>(job.images.size());
  in.audios = static_cast<int>(job.audios.size());
  in.videos = static_cast<int>(job.videos.size());
  in.chat = job.chat;
  for (const auto& t : job.turns)
    in.messages.push_back({t.role, t.content, t.images, t.audios, t.videos});
  if (req.prompt_tokens.empty()) {
    auto ids = render ? render(setup, in) : render_prompt(setup, in);
    if (!ids) return std::unexpected(make_error(error_code::invalid_request, ids.error().message));
    req.prompt_tokens = std::move(*ids);
  }
  req.id = job.id;
  if (auto r = place_media(setup, std::move(job.images), std::move(job.audios), req,
                           std::move(job.videos));
      !r)
    return std::unexpected(std::move(r.error()));
  req.params = default_sampling(setup, job.max_tokens);
  if (job.has_temperature) req.params.temperature = job.temperature;
  if (job.has_top_p) req.params.top_p = job.top_p;
  req.params.seed = job.seed;
  req.params.stop_strings = std::move(job.stop_strings);
  if (job.has_repetition_penalty) req.params.repetition_penalty = job.repetition_penalty;
  req.params.presence_penalty = job.presence_penalty;
  req.params.frequency_penalty = job.frequency_penalty;
  req.params.bias_ids = std::move(job.logit_bias_ids);
  req.params.bias_values = std::move(job.logit_bias_values);
  req.params.min_tokens = job.min_tokens;
  req.params.logprobs = job.logprobs;
  if (job.ignore_eos) req.params.stop_token_ids.clear();
  for (auto id : job.stop_token_ids)  // the request's own end too (ignore_eos drops the model's)
    if (std::find(req.params.stop_token_ids.begin(), req.params.stop_token_ids.end(), id) ==
        req.params.stop_token_ids.end())
      req.params.stop_token_ids.push_back(id);
  // max_tokens 0 (the rest of the context) is resolved by the scheduler,
  // which knows the context length.
  auto check = req.params;
  if (check.max_tokens == 0) check.max_tokens = std::max<std::int64_t>(1, check.min_tokens);
  if (auto v = check.validate(); !v)
    return std::unexpected(make_error(error_code::invalid_request, v.error().message));
  req.deadline_ms = job.deadline_ms;
  req.cache_salt = job.cache_salt;
  req.priority = job.priority;
  if (!job.grammar.empty()) {
    // The grammar ends on the model's stop tokens, which it needs; and it
    // may be complete before min_tokens.
    if (job.ignore_eos)
      return std::unexpected(make_error(error_code::invalid_request,
                                        "ignore_eos cannot be combined with structured output"));
    if (job.min_tokens > 0)
      return std::unexpected(make_error(error_code::invalid_request,
                                        "min_tokens cannot be combined with structured output"));
    if (req.params.stop_token_ids.empty())
      return std::unexpected(make_error(error_code::invalid_request,
                                        "structured output needs the model's end-of-text token"));
    if (job.grammar.size() > models::grammar_limits{}.max_bytes)
      return std::unexpected(make_error(error_code::invalid_request, "the grammar is too large"));
    req.grammar = std::move(job.grammar);
  }
  return req;
}

prompt_worker_actor spawn_prompt_worker(caf::actor_system& sys,
                                        std::shared_ptr<const prompt_setup> setup,
                                        prompt_renderer render) {
  auto impl = [](prompt_worker_actor::pointer self, std::shared_ptr<const prompt_setup> setup,
                 prompt_renderer render) -> prompt_worker_actor::behavior_type {
    return {
        [=](render_atom, job_request& job) -> caf::result<generate_request> {
          self->quit();
          auto req = request_of(*setup, render, std::move(job));
          if (!req) return std::move(req.error());
          return std::move(*req);
        },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(setup), std::move(render));
}

}  // namespace troupe::actors
