// troupe generate: one process, one prompt, tokens streamed as produced.
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "actors/prompt.hpp"
#include "actors/prompt_worker.hpp"
#include "actors/runtime.hpp"
#include "cli/commands.hpp"
#include "cli/model_setup.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/chat_template.hpp"
#include "models/generate.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"
#include "models/llama.hpp"
#include "models/llava.hpp"
#include "models/mapped_file.hpp"
#include "models/tokenizer.hpp"
#include "models/video.hpp"

namespace troupe::cli {

namespace {

struct generate_args {
  std::string model, prompt, quant, kv_type = "f32", chat_template, system;
  std::vector<std::string> overrides, stops, images, audios, videos;
  std::int32_t num_frames = 0;  ///< each video's frames (0: the default, 8)
  double fps = 0;               ///< > 0: one frame per 1 / fps seconds, at most num_frames
  bool video_audio = false;     ///< each video's audio track too
  std::int64_t max_tokens = 128, top_k = 0, ctx_tokens = 4096;
  double temperature = 0.0, top_p = 1.0, min_p = 0.0, repeat_penalty = 1.0;
  std::uint64_t seed = 0;
  int threads = 0;
  bool json = false, no_bos = false, chat = false;
  // Execution: the actor pipeline (devices, stages) or the plain loop.
  bool direct = false;
  std::string devices;
  pipeline_flags pipeline;
  // Which sampling flags the user gave (the rest come from generation_config.json).
  bool set_temperature = false, set_top_k = false, set_top_p = false, set_min_p = false,
       set_repeat = false;
};

std::string dir_of(const std::string& path) {
  const auto s = path.rfind('/');
  return s == std::string::npos ? "." : path.substr(0, s);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Images decoded and preprocessed for the model: pixel_values [N, 3, H, W].
struct prepared_images {
  std::vector<float> data;
  std::int64_t n = 0, side = 0;
  double preprocess_seconds = 0;
};

/// `n` images, image i from `load(i)` (named `name(i)` in errors).
template <class Load, class Name>
kernels::result<prepared_images> prepare_pixels(std::int64_t n, Load load, Name name,
                                                const std::string& model_dir,
                                                const models::llava_model& model) {
  using namespace troupe::models;
  auto cfg = load_image_processor_config(model_dir);
  if (!cfg) return std::unexpected(cfg.error());
  const auto t0 = std::chrono::steady_clock::now();
  const std::int64_t side = model.image_size();
  std::vector<float> pixels(static_cast<std::size_t>(n * 3 * side * side));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::string file = name(i);
    kernels::result<image> img = load(i);
    if (!img) return std::unexpected(img.error());
    auto pv = preprocess_image(*img, *cfg);
    if (!pv) return make_error(pv.error().code, file + ": " + pv.error().message);
    if (pv->height != side || pv->width != side || model.channels() != 3)
      return make_error(errc::invalid_argument,
                        file + ": the preprocessor makes " + std::to_string(pv->height) + "x" +
                            std::to_string(pv->width) + " images but the vision tower takes " +
                            std::to_string(side) + "x" + std::to_string(side) +
                            " (preprocessor_config.json and config.json disagree)");
    std::copy(pv->data.begin(), pv->data.end(), pixels.begin() + i * 3 * side * side);
  }
  return prepared_images{std::move(pixels), n, side, seconds_since(t0)};
}

kernels::result<prepared_images> prepare_images(const std::vector<std::string>& files,
                                                const std::string& model_dir,
                                                const models::llava_model& model) {
  const auto at = [&](std::int64_t i) { return files[static_cast<std::size_t>(i)]; };
  return prepare_pixels(
      static_cast<std::int64_t>(files.size()),
      [&](std::int64_t i) { return models::load_image(at(i)); }, at, model_dir, model);
}

/// A video's sampled frames as pixel_values [F, 3, H, W].
kernels::result<prepared_images> prepare_frames(const models::video& v, const std::string& file,
                                                const std::string& model_dir,
                                                const models::llava_model& model) {
  return prepare_pixels(
      static_cast<std::int64_t>(v.frames.size()),
      [&](std::int64_t i) -> kernels::result<models::image> {
        return v.frames[static_cast<std::size_t>(i)];
      },
      [&](std::int64_t i) {
        return file + " frame " + std::to_string(v.index[static_cast<std::size_t>(i)]);
      },
      model_dir, model);
}

void print_text(const generate_args& a, const std::string& text) {
  if (a.json) return;
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

const char* reason_text(models::stop_reason r) {
  return r == models::stop_reason::stop_token    ? "stop token"
         : r == models::stop_reason::stop_string ? "stop string"
                                                 : "max tokens";
}

/// Prints the result: one JSON object with --json, else llama.cpp-style timings.
void print_result(const generate_args& a, const std::string& text,
                  const std::vector<std::int32_t>& prompt_ids, std::int64_t prompt_length,
                  const std::vector<std::int32_t>& tokens, const char* why, int images,
                  double prompt_s, double decode_s, double preprocess_s, double encode_s,
                  const std::string& pipeline) {
  const double pp = prompt_s > 0 ? static_cast<double>(prompt_length) / prompt_s : 0;
  const auto gen_n = static_cast<double>(tokens.size() > 0 ? tokens.size() - 1 : 0);
  const double tg = decode_s > 0 ? gen_n / decode_s : 0;
  if (a.json) {
    nlohmann::json j;
    j["text"] = text;
    j["prompt_tokens"] = prompt_ids;
    j["prompt_length"] = prompt_length;
    j["images"] = images;
    j["tokens"] = tokens;
    j["finish_reason"] = why;
    j["pipeline"] = pipeline;
    j["timings"] = {{"prompt_ms", prompt_s * 1e3},
                    {"prompt_tokens_per_s", pp},
                    {"decode_ms", decode_s * 1e3},
                    {"decode_tokens_per_s", tg},
                    {"image_preprocess_ms", preprocess_s * 1e3},
                    {"image_encode_ms", encode_s * 1e3}};
    std::puts(j.dump().c_str());
    return;
  }
  if (images > 0)
    std::printf("\n\nimages: %d, preprocess %.1f ms, encode %.1f ms (%.1f ms per image)", images,
                preprocess_s * 1e3, encode_s * 1e3, encode_s * 1e3 / images);
  std::printf(
      "\n\n[%s] prompt eval: %lld tokens, %.1f ms, %.2f tokens/s | eval: %.0f tokens, %.1f ms, "
      "%.2f tokens/s\n",
      why, static_cast<long long>(prompt_length), prompt_s * 1e3, pp, gen_n, decode_s * 1e3, tg);
  if (!pipeline.empty()) std::printf("pipeline: %s\n", pipeline.c_str());
}

int run_generate(const generate_args& a) {
  using namespace troupe::models;
  const int threads = a.threads > 0
                          ? a.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  auto precision = parse_precision_flags(a.quant, a.overrides, a.kv_type);
  if (!precision) {
    spdlog::error("{}", precision.error().message);
    return 2;
  }
  const quant_plan& plan = precision->plan;
  std::vector<actors::device_spec> devices;
  if (!a.direct) {
    std::string list = a.devices;
    if (list.empty()) list = a.threads > 0 ? "cpu:0-" + std::to_string(threads - 1) : "cpu";
    auto d = actors::parse_devices(list);
    if (!d) {
      spdlog::error("--devices: {}", d.error().message);
      return 2;
    }
    devices = std::move(*d);
  }
  auto src = weight_source::open(a.model);
  if (!src) {
    spdlog::error("{}", src.error().message);
    return 1;
  }
  const std::string model_dir = std::filesystem::is_directory(a.model) ? a.model : dir_of(a.model);
  // The tokenizer, configs (a LLaVA folder: the vision tower and projector
  // come with the decoder) and generation defaults.
  auto setup = actors::load_prompt_setup(a.model);
  if (!setup) {
    spdlog::error("{}", setup.error().message);
    return 1;
  }
  const std::optional<llava_config> lcfg = setup->llava;
  const std::optional<llama_config> text_cfg = setup->text;
  const auto tok = setup->tok;
  if (!a.images.empty() && !lcfg) {
    spdlog::error("--image needs a vision model (a LLaVA folder); {} has no vision tower", a.model);
    return 2;
  }
  if (!a.audios.empty() && !(lcfg && lcfg->audio)) {
    spdlog::error(
        "--audio needs a model that hears (a LLaVA folder with audio_config); {} has no "
        "audio tower",
        a.model);
    return 2;
  }
  // The clips, decoded at the tower's rate: their token counts (and, for
  // --direct, their samples).
  std::vector<models::audio> clips;
  std::int64_t audio_tokens = 0;
  for (const auto& f : a.audios) {
    auto c = models::load_audio(f, setup->audio_limits);
    const int rate = lcfg->audio->features.sample_rate;
    if (c && c->sample_rate != rate) {
      auto r = models::resample(c->samples, c->sample_rate, rate);
      if (!r)
        c = std::unexpected(r.error());
      else {
        c->samples = std::move(*r);
        c->sample_rate = rate;
      }
    }
    if (!c) {
      spdlog::error("--audio {}", c.error().message);
      return 2;
    }
    const auto n = lcfg->audio->tokens_for_samples(static_cast<std::int64_t>(c->samples.size()));
    if (n < 1) {
      spdlog::error("--audio {}: shorter than one hop of the audio features", f);
      return 2;
    }
    audio_tokens += n;
    clips.push_back(std::move(*c));
  }
  if (!a.videos.empty() && !(lcfg && lcfg->video)) {
    spdlog::error(
        "--video needs a model that sees video (a LLaVA folder with video_token_index); {} "
        "takes none",
        a.model);
    return 2;
  }
  if (a.videos.empty() && (a.num_frames > 0 || a.fps > 0 || a.video_audio)) {
    spdlog::error("--num-frames, --fps and --video-audio apply to videos: give --video");
    return 2;
  }
  if (a.video_audio && !(lcfg && lcfg->audio)) {
    spdlog::error(
        "--video-audio needs a model that hears (a LLaVA folder with audio_config); {} has no "
        "audio tower",
        a.model);
    return 2;
  }
  // The videos' frames: their token counts from the headers (and, for
  // --direct, the frames, decoded below).
  models::video_sampling frames_wanted;
  if (a.num_frames > 0) frames_wanted.num_frames = a.num_frames;
  frames_wanted.fps = a.fps;
  std::vector<std::vector<std::uint8_t>> video_bytes;
  std::int64_t video_tokens = 0;
  for (const auto& f : a.videos) {
    auto bytes = models::read_file_bytes(f, setup->video_limits.max_bytes);
    auto probed = !bytes ? kernels::result<models::video>(std::unexpected(bytes.error()))
                  : a.video_audio
                      ? models::probe_video_sound(*bytes, frames_wanted, setup->video_limits)
                      : models::probe_video(*bytes, frames_wanted, setup->video_limits);
    if (!probed) {
      spdlog::error("--video {}: {}", f, probed.error().message);
      return 2;
    }
    video_tokens += static_cast<std::int64_t>(probed->index.size()) * lcfg->tokens_per_frame();
    if (a.video_audio) {
      const auto n =
          lcfg->audio->tokens_for_samples(static_cast<std::int64_t>(probed->sound.samples.size()));
      if (n < 1) {
        spdlog::error("--video {}: --video-audio, but it has no audio track", f);
        return 2;
      }
      video_tokens += n;
    }
    video_bytes.push_back(std::move(*bytes));
  }
  // With images the prompt is a chat turn whose placeholders the template
  // writes, unless the prompt already holds one "<image>" per image.
  const int images = static_cast<int>(a.images.size());
  actors::prompt_input in;
  in.prompt = a.prompt;
  in.system = a.system;
  in.chat_template = a.chat_template;
  in.images = images;
  in.audios = static_cast<int>(a.audios.size());
  in.videos = static_cast<int>(a.videos.size());
  in.chat = a.chat;
  in.no_bos = a.no_bos;
  std::string text;
  auto ids = actors::render_prompt(*setup, in, &text);
  if (!ids) {
    spdlog::error("{}", ids.error().message);
    return ids.error().code == errc::invalid_argument ? 2 : 1;
  }
  // generation_config.json (HF folders) supplies defaults for flags not given,
  // as transformers and vLLM do.
  const generation_defaults& defaults = setup->defaults;
  sampling_params params;
  params.max_tokens = a.max_tokens;
  const bool sampling = defaults.do_sample.value_or(true);
  params.temperature = a.set_temperature ? a.temperature
                       : sampling        ? defaults.temperature.value_or(a.temperature)
                                         : 0.0;
  params.top_k = a.set_top_k ? a.top_k : defaults.top_k.value_or(a.top_k);
  params.top_p = a.set_top_p ? a.top_p : defaults.top_p.value_or(a.top_p);
  params.min_p = a.set_min_p ? a.min_p : defaults.min_p.value_or(a.min_p);
  params.repetition_penalty =
      a.set_repeat ? a.repeat_penalty : defaults.repetition_penalty.value_or(a.repeat_penalty);
  params.stop_token_ids = setup->stop_ids;
  params.seed = a.seed;
  params.stop_strings = a.stops;
  if (auto r = params.validate(); !r) {
    spdlog::error("{}", r.error().message);
    return 2;
  }
  // The context length, checked here for both paths (the direct loop has
  // no scheduler to refuse it).
  auto context = models::serving_context_length(text_cfg->max_position_embeddings,
                                                a.pipeline.context, "--max-model-len");
  if (!context) {
    spdlog::error("{}", context.error().message);
    return 2;
  }
  if (auto over = models::context_overflow(*context,
                                           static_cast<std::int64_t>(ids->size()) +
                                               (lcfg ? images * lcfg->tokens_per_image() : 0) +
                                               audio_tokens + video_tokens,
                                           a.max_tokens)) {
    spdlog::error("{}", *over);
    return 2;
  }
  kv_options kv;
  kv.type = precision->kv_type;
  kv.capacity_tokens = a.ctx_tokens;

  if (!a.direct) {
    // The actor pipeline: encoder, shards and KV stores pinned to devices,
    // the scheduler in front, one client request.
    src->reset();
    caf::actor_system_config cfg;
    configure_pipeline_system(cfg, a.pipeline);
    caf::actor_system sys{cfg};
    auto rc = pipeline_config(a.pipeline, a.model, devices, plan, kv);
    // A single request may use the whole cache, as the direct loop does.
    rc.kv.capacity_tokens = std::max<std::int64_t>(
        kv.capacity_tokens, static_cast<std::int64_t>(ids->size()) +
                                (lcfg ? images * lcfg->tokens_per_image() : 0) + audio_tokens +
                                video_tokens + a.max_tokens + 16);
    auto rt = actors::local_runtime::start(sys, rc);
    if (!rt) {
      spdlog::error("{}", rt.error().message);
      return 1;
    }
    actors::generate_request req;
    req.id = actors::client::next_id();
    req.prompt_tokens = *ids;
    req.params = params;
    std::vector<actors::media_data> image_files, audio_files;
    for (const auto& f : a.images) {
      auto bytes = models::read_file_bytes(f, std::uint64_t{256} << 20);
      if (!bytes) {
        spdlog::error("--image {}", bytes.error().message);
        return 1;
      }
      image_files.push_back({f, std::move(*bytes), actors::media_kind::image});
    }
    for (const auto& f : a.audios) {
      auto bytes = models::read_file_bytes(f, setup->audio_limits.max_bytes);
      if (!bytes) {
        spdlog::error("--audio {}", bytes.error().message);
        return 1;
      }
      audio_files.push_back({f, std::move(*bytes), actors::media_kind::audio});
    }
    std::vector<actors::media_data> video_files;
    for (std::size_t k = 0; k < a.videos.size(); ++k) {
      actors::media_data v{a.videos[k], std::move(video_bytes[k]), actors::media_kind::video};
      v.num_frames = a.num_frames;
      v.fps = a.fps;
      v.audio = a.video_audio;
      video_files.push_back(std::move(v));
    }
    if (auto r = actors::place_media(*setup, std::move(image_files), std::move(audio_files), req,
                                     std::move(video_files));
        !r) {
      spdlog::error("{}", actors::describe(sys, r.error()));
      return 2;
    }
    // The prompt is echoed with the first token, not before: a request
    // that fails prints its error alone.
    bool echoed = false;
    auto echo = [&] {
      if (!std::exchange(echoed, true)) print_text(a, text);
    };
    actors::client client(sys, (*rt)->scheduler());
    auto fin = client.run(std::move(req), [&](const actors::token_event& e) {
      echo();
      print_text(a, e.text);
    });
    if (fin && fin->reason != actors::finish_reason::error) echo();
    if (!fin) {
      spdlog::error("{}", fin.error().message);
      return 2;
    }
    if (fin->reason == actors::finish_reason::error) {
      spdlog::error("{}", fin->error);
      return 1;
    }
    const char* why = fin->reason == actors::finish_reason::length ? "max tokens"
                      : fin->stop_string                           ? "stop string"
                                                                   : "stop token";
    const double prompt_s = (fin->ttft_ms - fin->encode_ms - fin->preprocess_ms) / 1e3;
    print_result(a, fin->text, *ids, fin->prompt_tokens, fin->tokens, why, images,
                 std::max(0.0, prompt_s), (fin->total_ms - fin->ttft_ms) / 1e3,
                 fin->preprocess_ms / 1e3, fin->encode_ms / 1e3, (*rt)->describe());
    return 0;
  }

  // --direct: the plain generation loop in this thread (the reference the
  // actor path is checked against).
  auto ctx = kernels::cpu::cpu_device::with_threads(threads);
  auto loaded = load_direct_model(**src, lcfg, *text_cfg, *ctx, plan);
  if (!loaded) {
    spdlog::error("{}", loaded.error().message);
    return 1;
  }
  const llava_model* llava = loaded->llava.get();
  const llama_model& model = loaded->text();
  // Images: decode, preprocess, encode (vision tower + projector).
  generation_request req;
  req.prompt = *ids;
  req.params = params;
  double preprocess_s = 0, encode_s = 0;
  if (llava) {
    prepared_images imgs;
    kernels::tensor pixels;
    if (images > 0) {
      auto p = prepare_images(a.images, model_dir, *llava);
      if (!p) {
        spdlog::error("{}", p.error().message);
        return 1;
      }
      imgs = std::move(*p);
      auto v = kernels::tensor::view(imgs.data.data(), kernels::dtype::f32,
                                     {imgs.n, 3, imgs.side, imgs.side});
      if (!v) {
        spdlog::error("{}", v.error().message);
        return 1;
      }
      pixels = *v;
      preprocess_s = imgs.preprocess_seconds;
    }
    // Each video's frames, decoded and preprocessed.
    std::vector<prepared_images> frame_data;
    std::vector<kernels::tensor> videos;
    std::vector<std::vector<float>> sounds;
    auto sampling = frames_wanted;
    sampling.audio = a.video_audio;
    for (std::size_t k = 0; k < a.videos.size(); ++k) {
      auto v = models::decode_video(video_bytes[k], sampling, setup->video_limits);
      if (v) sounds.push_back(std::move(v->sound.samples));
      auto p = v ? prepare_frames(*v, a.videos[k], model_dir, *llava)
                 : kernels::result<prepared_images>(std::unexpected(v.error()));
      if (!p) {
        spdlog::error("--video {}: {}", a.videos[k], p.error().message);
        return 2;
      }
      preprocess_s += p->preprocess_seconds;
      frame_data.push_back(std::move(*p));
    }
    for (auto& f : frame_data) {
      auto t = kernels::tensor::view(f.data.data(), kernels::dtype::f32, {f.n, 3, f.side, f.side});
      if (!t) {
        spdlog::error("{}", t.error().message);
        return 1;
      }
      videos.push_back(*t);
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::span<const float>> spans;
    for (const auto& c : clips) spans.emplace_back(c.samples);
    const std::vector<std::span<const float>> heard(sounds.begin(), sounds.end());
    auto vp = llava->prepare(*ctx, *ids, pixels, spans, videos, {}, heard);
    if (!vp) {
      spdlog::error("{}", vp.error().message);
      return 2;
    }
    encode_s = seconds_since(t0);
    req.prompt = std::move(vp->tokens);
    req.image_token = vp->image_token;
    req.image_embeds = std::move(vp->image_embeds);
  }
  auto dec = std::make_shared<stream_decoder>(*tok, true);
  piece_fn piece = [dec](std::int32_t id) { return dec->push(id); };
  generate_options opts;
  opts.kv = kv;
  bool echoed = false;  // the prompt goes out with the first token (see above)
  auto echo = [&] {
    if (!std::exchange(echoed, true)) print_text(a, text);
  };
  auto out = generate_batch(
      *ctx, model, {req}, {piece},
      [&](std::size_t, const std::string& t) {
        echo();
        print_text(a, t);
      },
      opts);
  if (out) echo();
  if (!out) {
    spdlog::error("generation failed: {}", out.error().message);
    return 1;
  }
  const auto& r = (*out)[0];
  print_result(a, r.text, *ids, r.prompt_tokens, r.tokens, reason_text(r.reason), images,
               r.prompt_seconds, r.decode_seconds, preprocess_s, encode_s, "");
  return 0;
}

}  // namespace

command_runner add_generate(CLI::App& app, bool run) {
  auto a = std::make_shared<generate_args>();
  auto* cmd =
      run ? app.add_subcommand(
                "run", "Generate through the actor pipeline over several devices of this process")
          : app.add_subcommand("generate", "Generate text from a prompt in this process");
  cmd->add_option("--devices", a->devices,
                  "Devices of the stages: cpu, cpu:N or cpu:A-B, comma-separated (stage i on "
                  "device i mod count)");
  cmd->add_option("--stages", a->pipeline.stages, "Pipeline stages (contiguous layer ranges)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option(
      "--remote-stage", a->pipeline.remote_stage,
      "HOST:PORT of a `troupe worker` serving the last layers (pipeline across processes)");
  cmd->add_option("--tp-peer", a->pipeline.tp_peers,
                  "HOST:PORT of a `troupe worker --tp-rank R --tp-size K` (repeat for each of "
                  "ranks 1..K-1): tensor "
                  "parallelism across processes, this process being rank 0");
  cmd->add_option("--micro-batches", a->pipeline.micro_batches,
                  "Micro-batches in flight (default: the number of stages)")
      ->check(CLI::Range(0, 64));
  cmd->add_option("--decode-steps", a->pipeline.decode_steps,
                  "Multi-step decode on one stage: decode passes per scheduler step at most (sized "
                  "to ~2 ms; 1 = off)")
      ->check(CLI::Range(1, 64));
  add_context_flags(*cmd, a->pipeline.context);
  add_cache_flags(*cmd, a->pipeline);
  if (!run)
    cmd->add_flag("--direct", a->direct,
                  "Run the plain generation loop in this thread instead of the actor pipeline");
  cmd->add_option("--model,-m", a->model,
                  "GGUF file or Hugging Face folder (default: the bundled tiny LLaVA)");
  cmd->add_option("--image,-i", a->images,
                  "PNG or JPEG for a vision model (repeatable; one <image> each)");
  cmd->add_option("--audio", a->audios,
                  "WAV, FLAC or MP3 for a model that hears (repeatable; one <audio> each)");
  cmd->add_option("--video", a->videos,
                  "MP4, WebM or AVI for a model that sees video (repeatable; one <video> each)");
  cmd->add_option("--num-frames", a->num_frames,
                  "Frames sampled from each video, uniformly (default 8, at most 64)")
      ->check(CLI::Range(1, 64));
  cmd->add_option("--fps", a->fps,
                  "Sample one frame per 1/FPS seconds of each video instead (at most --num-frames)")
      ->check(CLI::Range(0.0, 240.0));
  cmd->add_flag("--video-audio", a->video_audio,
                "Also hear each video's audio track (a model that hears): its tokens follow the "
                "frames'");
  cmd->add_option("--prompt,-p", a->prompt, "Prompt text")->required();
  cmd->add_option("--max-tokens,-n", a->max_tokens, "Tokens to generate")
      ->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--temperature", a->temperature, "0 = greedy");
  cmd->add_option("--top-k", a->top_k);
  cmd->add_option("--top-p", a->top_p);
  cmd->add_option("--min-p", a->min_p);
  cmd->add_option("--repeat-penalty", a->repeat_penalty);
  cmd->add_option("--seed", a->seed);
  cmd->add_option("--stop", a->stops, "Stop string (repeatable)");
  cmd->add_option("--threads,-t", a->threads, "Worker threads (default: all cores)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--quant", a->quant,
                  "Weight format for every matrix (f32 f16 bf16 int8 int8_asym int4 int4_asym "
                  "q8_0 q4_0 q4_1 q5_0 q5_1 q2_k q3_k q4_k q5_k q6_k iq4_nl iq4_xs) or a "
                  "llama.cpp file type, a per-tensor mix (q2_k q3_k_s q3_k_m q3_k_l q4_k_s "
                  "q4_k_m q5_k_s q5_k_m q6_k iq4_nl iq4_xs)");
  cmd->add_option("--quant-override", a->overrides,
                  "PATTERN=FORMAT on tensor names, e.g. 'layers.0.*=f16'");
  cmd->add_option("--kv-type", a->kv_type, "KV cache type: f32, f16, int8");
  cmd->add_option("--ctx", a->ctx_tokens, "KV cache capacity in tokens")
      ->check(CLI::Range(16, 1 << 24));
  cmd->add_flag("--no-bos", a->no_bos, "Do not add the tokenizer's special prefix");
  cmd->add_flag("--chat", a->chat, "Wrap the prompt as a user turn in the model's chat template");
  cmd->add_option("--chat-template", a->chat_template,
                  "Template by name: llama2, llama3, chatml, qwen2, llava (implies --chat)");
  cmd->add_option("--system", a->system, "System prompt (with --chat)");
  cmd->add_flag("--json", a->json, "Print one JSON object (text, token ids, timings)");
  return [a, cmd] {
    a->set_temperature = cmd->count("--temperature") > 0;
    a->set_top_k = cmd->count("--top-k") > 0;
    a->set_top_p = cmd->count("--top-p") > 0;
    a->set_min_p = cmd->count("--min-p") > 0;
    a->set_repeat = cmd->count("--repeat-penalty") > 0;
    if (a->model.empty()) a->model = bundled_model_path();
    return run_generate(*a);
  };
}

}  // namespace troupe::cli
