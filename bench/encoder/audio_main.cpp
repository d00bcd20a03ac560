// bench_audio_encoder: the media encoder actor's audio throughput, one
// clip at a time against N clips at once (issue 29's batching target: 16
// concurrent clips at least 4x one clip), in the same run, rounds
// interleaved. Clips are distinct (seeded noise written as WAV by
// libsndfile), so the encoder cache never answers; it is off anyway.
//
//   bench_audio_encoder --model DIR [--seconds 2] [--clips 16]
//                       [--max-batch 16] [--threads 2] [--rounds 3]
#include <sndfile.h>
#include <spdlog/spdlog.h>

#include <unistd.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "actors/device.hpp"
#include "actors/encoder.hpp"
#include "actors/protocol.hpp"

using namespace troupe;
using namespace troupe::actors;

namespace {

/// `seconds` of noise shaped like speech's loudness (seeded), as a 16 kHz
/// PCM16 WAV file's bytes, written by libsndfile.
std::vector<std::uint8_t> wav_clip(double seconds, std::uint32_t seed) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("troupe-bench-clip-" + std::to_string(::getpid()) + ".wav");
  SF_INFO info{};
  info.samplerate = 16000;
  info.channels = 1;
  info.format = SF_FORMAT_WAV | SF_FORMAT_PCM_16;
  SNDFILE* f = sf_open(path.c_str(), SFM_WRITE, &info);
  if (!f) return {};
  std::mt19937 rng(seed);
  std::normal_distribution<float> noise(0.f, 0.1f);
  std::vector<float> x(static_cast<std::size_t>(seconds * 16000));
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = noise(rng) * (0.5f + 0.5f * std::sin(static_cast<float>(i) * 0.0005f));
  sf_write_float(f, x.data(), static_cast<sf_count_t>(x.size()));
  sf_close(f);
  std::ifstream in(path, std::ios::binary);
  std::vector<std::uint8_t> bytes{std::istreambuf_iterator<char>(in), {}};
  std::filesystem::remove(path);
  return bytes;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"The media encoder's audio throughput: one clip at a time vs N at once"};
  std::string model;
  double seconds = 2;
  int clips = 16, max_batch = 16, threads = 2, rounds = 3;
  app.add_option("--model", model, "A LLaVA folder with an audio tower")->required();
  app.add_option("--seconds", seconds, "Length of each clip")->check(CLI::Range(0.05, 600.0));
  app.add_option("--clips", clips, "Clips at once")->check(CLI::Range(1, 256));
  app.add_option("--max-batch", max_batch, "The encoder's max_batch")->check(CLI::Range(1, 256));
  app.add_option("--threads", threads, "The device's threads")->check(CLI::Range(1, 256));
  app.add_option("--rounds", rounds, "Rounds (each: one at a time, then all at once)")
      ->check(CLI::Range(1, 100));
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);

  caf::actor_system_config cfg;
  register_protocol(cfg);
  caf::actor_system sys{cfg};
  auto spec = parse_devices("cpu:0-" + std::to_string(threads - 1));
  if (!spec) {
    std::fprintf(stderr, "%s\n", spec.error().message.c_str());
    return 2;
  }
  auto dev = open_device(spec->front());
  if (!dev) {
    std::fprintf(stderr, "%s\n", dev.error().message.c_str());
    return 1;
  }
  auto res = make_media_encoder(spec->front(), *dev, model, {});
  if (!res) {
    std::fprintf(stderr, "%s\n", res.error().message.c_str());
    return 1;
  }
  (*res)->cache_bytes = 0;
  if (!(*res)->model->has_audio()) {
    std::fprintf(stderr, "%s has no audio tower\n", model.c_str());
    return 2;
  }
  encoder_options o;
  o.max_batch = max_batch;
  o.max_wait_ms = 5;
  auto enc = spawn_encoder(sys, *res, o);
  caf::scoped_actor self{sys};
  std::uint64_t request = 1;
  std::uint32_t seed = 1;
  // Each round's clips are new (no two encodings of one clip).
  auto make = [&](int n) {
    std::vector<std::vector<std::uint8_t>> out;
    for (int i = 0; i < n; ++i) out.push_back(wav_clip(seconds, seed++));
    return out;
  };
  std::int64_t largest_batch = 0, tokens = 0;
  bool failed = false;
  // Sends `batch` clips at once and waits for all: seconds taken.
  auto encode = [&](const std::vector<std::vector<std::uint8_t>>& batch) {
    const auto id = request++;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t k = 0; k < batch.size(); ++k)
      self->send(
          enc, encode_atom::value,
          encode_request{id, static_cast<std::int32_t>(k), {"clip", batch[k], media_kind::audio}});
    for (std::size_t k = 0; k < batch.size(); ++k)
      self->receive(
          [&](encode_reply& r) {
            largest_batch = std::max(largest_batch, r.batch);
            tokens = r.rows;
          },
          [&](caf::error& e) {
            std::fprintf(stderr, "%s\n", describe(sys, e).c_str());
            failed = true;
          });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    self->send(enc, forget_atom::value, id);
    return s;
  };
  encode(make(1));  // warm-up
  std::vector<double> alone, together;
  for (int r = 0; r < rounds && !failed; ++r) {
    auto one = make(clips);
    double s = 0;
    for (const auto& c : one) s += encode({c});
    alone.push_back(clips / s);
    together.push_back(clips / encode(make(clips)));
  }
  self->send_exit(enc, caf::exit_reason::user_shutdown);
  if (failed) return 1;
  const double a = median(alone), t = median(together);
  std::printf(
      "audio encoder, %s, %.2f s clips (%lld tokens each), %d threads, max_batch %d\n"
      "  one clip at a time: %.2f clips/s\n"
      "  %d clips at once:   %.2f clips/s (largest batch %lld windows)\n"
      "  ratio %.2fx (issue 29's target: at least 4x with 16 clips)\n",
      model.c_str(), seconds, static_cast<long long>(tokens), threads, max_batch, a, clips, t,
      static_cast<long long>(largest_batch), t / a);
  return 0;
}
