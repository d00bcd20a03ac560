#include "actors/prompt.hpp"

#include <filesystem>

#include "models/chat_template.hpp"
#include "models/weights.hpp"

namespace troupe::actors {

using kernels::errc;

kernels::result<prompt_setup> load_prompt_setup(const std::string& model) {
  auto src = models::weight_source::open(model);
  if (!src) return std::unexpected(src.error());
  const std::string dir = std::filesystem::is_directory(model)
                              ? model
                              : std::filesystem::path(model).parent_path().string();
  prompt_setup s;
  models::llama_config text;
  if ((*src)->is_gguf()) {
    auto c = models::llama_config_from_gguf(*(*src)->gguf());
    if (!c) return std::unexpected(c.error());
    text = *c;
    auto tok = models::tokenizer::from_gguf(*(*src)->gguf());
    if (!tok) return std::unexpected(tok.error());
    s.tok = std::make_shared<const models::tokenizer>(std::move(*tok));
  } else {
    auto json = models::read_text_file(dir + "/config.json");
    if (!json) return std::unexpected(json.error());
    if (models::is_llava_config(*json)) {
      auto c = models::parse_llava_config(*json, dir + "/config.json");
      if (!c) return std::unexpected(c.error());
      s.llava = *c;
      text = c->text;
    } else {
      auto c = models::load_llama_config(dir + "/config.json");
      if (!c) return std::unexpected(c.error());
      text = *c;
    }
    auto tok = models::tokenizer::load(dir);
    if (!tok) return std::unexpected(tok.error());
    s.tok = std::make_shared<const models::tokenizer>(std::move(*tok));
    // Optional, as in transformers: without it the defaults are plain greedy.
    if (std::filesystem::exists(dir + "/generation_config.json")) {
      auto g = models::load_generation_config(dir + "/generation_config.json");
      if (!g) return std::unexpected(g.error());
      s.defaults = *g;
    }
  }
  s.text = text;
  for (auto id : s.defaults.eos_token_ids) s.stop_ids.push_back(id);
  for (auto id : text.eos_token_ids) s.stop_ids.push_back(id);
  if (auto eos = s.tok->special_ids().eos) s.stop_ids.push_back(*eos);
  if (s.llava) {
    auto t = s.tok->token_text(static_cast<std::int32_t>(s.llava->image_token_index));
    s.image_text = t ? *t : "<image>";
    if (s.llava->audio) {
      auto a = s.tok->token_text(static_cast<std::int32_t>(s.llava->audio->token_index));
      if (!a)
        return kernels::make_error(errc::corrupt_data,
                                   model + ": the tokenizer has no token " +
                                       std::to_string(s.llava->audio->token_index) +
                                       " (audio_token_index)");
      s.audio_text = *a;
    }
    if (s.llava->video) {
      auto v = s.tok->token_text(static_cast<std::int32_t>(s.llava->video->token_index));
      if (!v)
        return kernels::make_error(errc::corrupt_data,
                                   model + ": the tokenizer has no token " +
                                       std::to_string(s.llava->video->token_index) +
                                       " (video_token_index)");
      s.video_text = *v;
    }
  }
  return s;
}

namespace {

// --chat-template when given; else the model's own template; else, for a
// family whose GGUF files carry none (Gemma), its built-in one.
kernels::result<models::chat_template> choose_template(const prompt_setup& s,
                                                       const std::string& override_name) {
  if (override_name.empty() && s.tok->chat_template_source().empty() &&
      s.text.family == models::decoder_family::gemma3)
    return models::chat_template::from_name("gemma");
  return models::chat_template::select(s.tok->chat_template_source(), override_name);
}

}  // namespace

namespace {

std::size_t occurrences(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  if (!needle.empty())
    for (auto at = text.find(needle); at != std::string::npos;
         at = text.find(needle, at + needle.size()))
      ++n;
  return n;
}

// Media the model cannot take, or placeholders the template cannot write.
kernels::result<void> check_media(const prompt_setup& s, int images, int audios, int videos,
                                  bool templated) {
  if (images < 0 || audios < 0 || videos < 0)
    return kernels::make_error(errc::invalid_argument,
                               "a negative image, audio clip or video count");
  if (videos > 0 && s.video_text.empty())
    return kernels::make_error(errc::invalid_argument,
                               "videos need a model that sees video (a LLaVA folder with "
                               "video_token_index); this model takes none");
  if (templated && videos > 0 && s.video_text != "<video>")
    return kernels::make_error(errc::invalid_argument,
                               "this model's video placeholder is " + s.video_text +
                                   ", which the chat template does not write; put it in the "
                                   "prompt where each video goes");
  if (images > 0 && !s.llava)
    return kernels::make_error(
        errc::invalid_argument,
        "images need a vision model (a LLaVA folder); this model has no vision tower");
  if (audios > 0 && s.audio_text.empty())
    return kernels::make_error(errc::invalid_argument,
                               "audio clips need a model that hears (a LLaVA folder with "
                               "audio_config); this model has no audio tower");
  // The llava template writes "<audio>": the model's placeholder must be it.
  if (templated && audios > 0 && s.audio_text != "<audio>")
    return kernels::make_error(errc::invalid_argument,
                               "this model's audio placeholder is " + s.audio_text +
                                   ", which the chat template does not write; put it in the "
                                   "prompt where each clip goes");
  return {};
}

}  // namespace

kernels::result<std::vector<std::int32_t>> render_prompt(const prompt_setup& s,
                                                         const prompt_input& in,
                                                         std::string* text_out) {
  auto piece = [&](std::optional<std::int32_t> id) {
    if (!id) return std::string();
    auto t = s.tok->token_text(*id);
    return t ? *t : std::string();
  };
  if (!in.messages.empty()) {
    int images = 0, audios = 0, videos = 0;
    for (const auto& m : in.messages) {
      if (m.images < 0 || m.audios < 0 || m.videos < 0)
        return kernels::make_error(errc::invalid_argument,
                                   "a message with a negative image, audio clip or video count");
      images += m.images;
      audios += m.audios;
      videos += m.videos;
      if (!s.video_text.empty() && m.content.find(s.video_text) != std::string::npos)
        return kernels::make_error(errc::invalid_argument,
                                   "a message holds the video placeholder " + s.video_text +
                                       " as text; send videos as video parts");
      if (!s.image_text.empty() && m.content.find(s.image_text) != std::string::npos)
        return kernels::make_error(errc::invalid_argument,
                                   "a message holds the image placeholder " + s.image_text +
                                       " as text; send images as image parts");
      if (!s.audio_text.empty() && m.content.find(s.audio_text) != std::string::npos)
        return kernels::make_error(errc::invalid_argument,
                                   "a message holds the audio placeholder " + s.audio_text +
                                       " as text; send audio clips as audio parts");
    }
    if (images != in.images)
      return kernels::make_error(
          errc::invalid_argument,
          std::to_string(images) + " image parts for " + std::to_string(in.images) + " images");
    if (audios != in.audios)
      return kernels::make_error(
          errc::invalid_argument,
          std::to_string(audios) + " audio parts for " + std::to_string(in.audios) + " clips");
    if (videos != in.videos)
      return kernels::make_error(
          errc::invalid_argument,
          std::to_string(videos) + " video parts for " + std::to_string(in.videos) + " videos");
    if (auto r = check_media(s, images, audios, videos, true); !r)
      return std::unexpected(r.error());
    auto tmpl = choose_template(s, in.chat_template);
    if (!tmpl)
      return kernels::make_error(errc::invalid_argument, "chat template: " + tmpl.error().message);
    auto rendered = tmpl->render(in.messages, true, piece(s.tok->special_ids().bos),
                                 piece(s.tok->special_ids().eos));
    if (!rendered)
      return kernels::make_error(errc::invalid_argument,
                                 "chat template: " + rendered.error().message);
    if (text_out) *text_out = *rendered;
    auto ids = s.tok->encode(*rendered, false, /*parse_special=*/true);
    if (!ids) return std::unexpected(ids.error());
    if (ids->empty())
      return kernels::make_error(errc::invalid_argument, "the chat encodes to no tokens");
    return std::move(*ids);
  }
  if (auto r = check_media(s, in.images, in.audios, in.videos, false); !r)
    return std::unexpected(r.error());
  // Placeholders in the prompt put each image and clip where they stand;
  // with none, the template puts the turn's images, then its clips, first.
  const auto image_marks = occurrences(in.prompt, s.image_text);
  const auto audio_marks = occurrences(in.prompt, s.audio_text);
  const auto video_marks = occurrences(in.prompt, s.video_text);
  const bool placed = image_marks + audio_marks + video_marks > 0;
  if (placed && image_marks != static_cast<std::size_t>(in.images))
    return kernels::make_error(errc::invalid_argument, "the prompt has " +
                                                           std::to_string(image_marks) + " " +
                                                           s.image_text + " placeholders for " +
                                                           std::to_string(in.images) + " images");
  if (placed && audio_marks != static_cast<std::size_t>(in.audios))
    return kernels::make_error(errc::invalid_argument,
                               "the prompt has " + std::to_string(audio_marks) + " " +
                                   s.audio_text + " placeholders for " + std::to_string(in.audios) +
                                   " audio clips");
  if (placed && video_marks != static_cast<std::size_t>(in.videos))
    return kernels::make_error(errc::invalid_argument, "the prompt has " +
                                                           std::to_string(video_marks) + " " +
                                                           s.video_text + " placeholders for " +
                                                           std::to_string(in.videos) + " videos");
  const bool chat =
      in.chat || !in.chat_template.empty() || (in.images + in.audios + in.videos > 0 && !placed);
  if (chat && !placed)
    if (auto r = check_media(s, in.images, in.audios, in.videos, true); !r)
      return std::unexpected(r.error());
  std::string text = in.prompt;
  bool add_special = !in.no_bos;
  if (chat) {
    auto tmpl = choose_template(s, in.chat_template);
    if (!tmpl)
      return kernels::make_error(errc::invalid_argument, "chat template: " + tmpl.error().message);
    std::vector<models::chat_message> msgs;
    if (!in.system.empty()) msgs.push_back({"system", in.system, 0, 0, 0});
    msgs.push_back({"user", in.prompt, placed ? 0 : in.images, placed ? 0 : in.audios,
                    placed ? 0 : in.videos});
    auto rendered =
        tmpl->render(msgs, true, piece(s.tok->special_ids().bos), piece(s.tok->special_ids().eos));
    if (!rendered)
      return kernels::make_error(errc::invalid_argument,
                                 "chat template: " + rendered.error().message);
    text = *rendered;
    add_special = false;  // the template writes its own BOS
  }
  if (text_out) *text_out = text;
  auto ids = s.tok->encode(text, add_special, /*parse_special=*/true);
  if (!ids) return std::unexpected(ids.error());
  if (ids->empty())
    return kernels::make_error(errc::invalid_argument, "the prompt encodes to no tokens");
  return std::move(*ids);
}

models::video_limits video_limits_of(const cluster::media_entry& m) {
  models::video_limits v;
  v.max_seconds = m.max_video_seconds;
  v.max_side = static_cast<int>(m.max_video_side);
  v.max_pixels = std::min<std::int64_t>(v.max_pixels, m.max_video_side * m.max_video_side);
  v.max_sampled_frames = static_cast<int>(m.max_video_frames);
  return v;
}

void apply_media_limits(prompt_setup& s, const cluster::media_entry& m) {
  s.video_limits = video_limits_of(m);
  s.video_frames = static_cast<std::int32_t>(m.video_frames);
  s.max_images = m.max_images;
  s.max_audios = m.max_audios;
  s.max_videos = m.max_videos;
}

models::sampling_params default_sampling(const prompt_setup& s, std::int64_t max_tokens) {
  models::sampling_params p;
  p.max_tokens = max_tokens;
  const auto& d = s.defaults;
  if (d.do_sample.value_or(true)) p.temperature = d.temperature.value_or(p.temperature);
  p.top_k = d.top_k.value_or(p.top_k);
  p.top_p = d.top_p.value_or(p.top_p);
  p.min_p = d.min_p.value_or(p.min_p);
  p.repetition_penalty = d.repetition_penalty.value_or(p.repetition_penalty);
  p.stop_token_ids = s.stop_ids;
  return p;
}

}  // namespace troupe::actors
