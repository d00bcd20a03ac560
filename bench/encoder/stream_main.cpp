// bench_audio_stream: the time to the first token after the end of a clip,
// for a short clip and a long one, with the clip streamed while it is
// spoken (its windows encoded and prefilled as they come) and with the
// whole clip sent at its end, in the same run, rounds interleaved (issue
// 29's streaming target: long / short at most 1.5x streamed, and above 3x
// sent whole, or the benchmark does not show what streaming buys).
//
// A whole clip is a WAV file sent with the request when the clip ends; a
// streamed one is its samples as 16-bit PCM in pieces of --piece-ms, sent
// --speed times faster than real time, each piece once the one before was
// answered or its time came, whichever is later. The time counts from the
// request (whole) or the last piece (streamed) to the first token.
//
//   bench_audio_stream --model DIR [--short 2] [--long 20] [--piece-ms 500]
//                      [--speed 2] [--threads 2] [--rounds 3]
#include <sndfile.h>
#include <spdlog/spdlog.h>

#include <unistd.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "actors/client.hpp"
#include "actors/device.hpp"
#include "actors/prompt.hpp"
#include "actors/prompt_worker.hpp"
#include "actors/protocol.hpp"
#include "actors/runtime.hpp"

using namespace troupe;
using namespace troupe::actors;
using steady = std::chrono::steady_clock;

namespace {

/// `seconds` of noise shaped like speech's loudness (seeded), 16 kHz.
std::vector<std::int16_t> samples_of(double seconds, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.f, 0.1f);
  std::vector<std::int16_t> x(static_cast<std::size_t>(seconds * 16000));
  for (std::size_t i = 0; i < x.size(); ++i) {
    const float v = noise(rng) * (0.5f + 0.5f * std::sin(static_cast<float>(i) * 0.0005f));
    x[i] = static_cast<std::int16_t>(std::clamp(v, -1.f, 1.f) * 32767.f);
  }
  return x;
}

/// The samples as a 16 kHz PCM16 WAV file's bytes, written by libsndfile.
std::vector<std::uint8_t> wav_of(const std::vector<std::int16_t>& x) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("troupe-bench-stream-" + std::to_string(::getpid()) + ".wav");
  SF_INFO info{};
  info.samplerate = 16000;
  info.channels = 1;
  info.format = SF_FORMAT_WAV | SF_FORMAT_PCM_16;
  SNDFILE* f = sf_open(path.c_str(), SFM_WRITE, &info);
  if (!f) return {};
  sf_write_short(f, x.data(), static_cast<sf_count_t>(x.size()));
  sf_close(f);
  std::ifstream in(path, std::ios::binary);
  std::vector<std::uint8_t> bytes{std::istreambuf_iterator<char>(in), {}};
  std::filesystem::remove(path);
  return bytes;
}

std::vector<std::uint8_t> pcm_of(const std::vector<std::int16_t>& x, std::size_t from,
                                 std::size_t n) {
  std::vector<std::uint8_t> out;
  out.reserve(2 * n);
  for (std::size_t i = from; i < from + n; ++i) {
    const auto v = static_cast<std::uint16_t>(x[i]);
    out.push_back(static_cast<std::uint8_t>(v & 0xff));
    out.push_back(static_cast<std::uint8_t>(v >> 8));
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

/// A request's first token, waited for.
struct first_token {
  std::mutex m;
  std::condition_variable cv;
  std::optional<steady::time_point> at;
  std::optional<finish_event> end;
  client::callbacks callbacks() {
    client::callbacks cb;
    cb.on_token = [this](const token_event& e) {
      std::lock_guard lock(m);
      if (!at && !e.tokens.empty()) at = steady::now();
      cv.notify_all();
    };
    cb.on_finish = [this](const finish_event& f) {
      std::lock_guard lock(m);
      if (!at && !f.tokens.empty()) at = steady::now();
      end = f;
      cv.notify_all();
    };
    return cb;
  }
  bool wait() {
    std::unique_lock lock(m);
    cv.wait_for(lock, std::chrono::minutes(5), [&] { return end.has_value(); });
    return end && end->reason != finish_reason::error && at;
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Time to first token after a clip's end: streamed against sent whole"};
  std::string model;
  double short_s = 2, long_s = 20, speed = 2;
  int piece_ms = 500, threads = 2, rounds = 3;
  app.add_option("--model", model, "A LLaVA folder with an audio tower")->required();
  app.add_option("--short", short_s, "The short clip's seconds")->check(CLI::Range(0.1, 600.0));
  app.add_option("--long", long_s, "The long clip's seconds")->check(CLI::Range(0.1, 600.0));
  app.add_option("--piece-ms", piece_ms, "A streamed piece's milliseconds")
      ->check(CLI::Range(10, 60000));
  app.add_option("--speed", speed, "How much faster than real time pieces are sent")
      ->check(CLI::Range(0.1, 1000.0));
  app.add_option("--threads", threads, "Threads of the one device")->check(CLI::Range(1, 256));
  app.add_option("--rounds", rounds, "Rounds (each: both clips, both ways)")
      ->check(CLI::Range(1, 100));
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);

  caf::actor_system_config cfg;
  register_protocol(cfg);
  caf::actor_system sys{cfg};
  runtime_config rc;
  rc.model = model;
  rc.stages = 1;
  rc.encoder.max_wait_ms = 1;
  auto spec = parse_devices("cpu:0-" + std::to_string(threads - 1));
  if (!spec) {
    std::fprintf(stderr, "%s\n", spec.error().message.c_str());
    return 2;
  }
  rc.devices = *spec;
  auto rt = local_runtime::start(sys, rc);
  if (!rt) {
    std::fprintf(stderr, "%s\n", rt.error().message.c_str());
    return 1;
  }
  auto setup = load_prompt_setup(model);
  if (!setup) {
    std::fprintf(stderr, "%s\n", setup.error().message.c_str());
    return 1;
  }
  if (!setup->llava || !setup->llava->audio) {
    std::fprintf(stderr, "%s has no audio tower\n", model.c_str());
    return 2;
  }
  client cl(sys, (*rt)->scheduler());
  std::uint32_t seed = 1;
  bool failed = false;
  // The request a job with this clip becomes (the prompt worker's way).
  auto request = [&](media_data clip) {
    job_request job;
    job.id = client::next_id();
    job.prompt = "<audio>\nWhat is said?";
    job.max_tokens = 1;
    job.ignore_eos = true;
    job.audios.push_back(std::move(clip));
    auto r = request_of(*setup, {}, std::move(job));
    if (!r) {
      std::fprintf(stderr, "%s\n", describe(sys, r.error()).c_str());
      failed = true;
    }
    return r ? std::move(*r) : generate_request{};
  };
  // Seconds from the clip's end to its first token, sent whole.
  auto whole = [&](double seconds) {
    const auto x = samples_of(seconds, seed++);
    auto req = request({"clip.wav", wav_of(x), media_kind::audio});
    if (failed) return 0.0;
    first_token ft;
    const auto t0 = steady::now();
    auto ack = cl.submit(std::move(req), ft.callbacks());
    if (!ack || !ft.wait()) {
      std::fprintf(stderr, "whole %.1f s: %s\n", seconds,
                   !ack     ? ack.error().message.c_str()
                   : ft.end ? ft.end->error.c_str()
                            : "no end");
      failed = true;
      return 0.0;
    }
    return std::chrono::duration<double, std::milli>(*ft.at - t0).count();
  };
  // ... streamed in pieces while it is spoken.
  auto streamed = [&](double seconds) {
    const auto x = samples_of(seconds, seed++);
    media_data m{"clip", {}, media_kind::audio};
    m.stream = true;
    auto req = request(m);
    if (failed) return 0.0;
    first_token ft;
    const auto id = req.id;
    auto ack = cl.submit(std::move(req), ft.callbacks());
    if (!ack) {
      std::fprintf(stderr, "streamed %.1f s: %s\n", seconds, ack.error().message.c_str());
      failed = true;
      return 0.0;
    }
    const auto piece = static_cast<std::size_t>(16000 * piece_ms / 1000);
    const auto start = steady::now();
    steady::time_point last_sent{};
    for (std::size_t at = 0; at < x.size() && !failed; at += piece) {
      const auto n = std::min(piece, x.size() - at);
      // Its samples are all spoken (at --speed) only now.
      const auto due =
          start + std::chrono::duration_cast<steady::duration>(
                      std::chrono::duration<double>(static_cast<double>(at + n) / 16000.0 / speed));
      std::this_thread::sleep_until(due);
      const bool last = at + n == x.size();
      if (last) last_sent = steady::now();
      auto p = cl.send_audio(id, pcm_of(x, at, n), last);
      if (!p) {
        std::fprintf(stderr, "streamed %.1f s: %s\n", seconds, p.error().message.c_str());
        failed = true;
      }
    }
    if (failed || !ft.wait()) {
      if (!failed)
        std::fprintf(stderr, "streamed %.1f s: %s\n", seconds,
                     ft.end ? ft.end->error.c_str() : "no end");
      failed = true;
      return 0.0;
    }
    return std::chrono::duration<double, std::milli>(*ft.at - last_sent).count();
  };
  whole(short_s);  // warm-up
  streamed(short_s);
  std::vector<double> ws, wl, ss, sl;
  for (int r = 0; r < rounds && !failed; ++r) {
    ws.push_back(whole(short_s));
    wl.push_back(whole(long_s));
    ss.push_back(streamed(short_s));
    sl.push_back(streamed(long_s));
  }
  if (failed) return 1;
  const auto& a = *setup->llava->audio;
  std::printf(
      "time to first token after the clip's end, %s, %d threads, median of %d rounds\n"
      "  (%.1f s clip: %lld audio tokens; %.1f s clip: %lld; windows of %.2f s; pieces of %d ms "
      "at %.1fx real time)\n",
      model.c_str(), threads, rounds, short_s,
      static_cast<long long>(a.tokens_for_samples(static_cast<std::int64_t>(short_s * 16000))),
      long_s,
      static_cast<long long>(a.tokens_for_samples(static_cast<std::int64_t>(long_s * 16000))),
      static_cast<double>(a.window_samples()) / 16000.0, piece_ms, speed);
  std::printf("  sent whole: %8.1f ms (%.1f s)  %8.1f ms (%.1f s)  long / short %.2fx\n",
              median(ws), short_s, median(wl), long_s, median(wl) / median(ws));
  std::printf("  streamed:   %8.1f ms (%.1f s)  %8.1f ms (%.1f s)  long / short %.2fx\n",
              median(ss), short_s, median(sl), long_s, median(sl) / median(ss));
  return 0;
}
