#include "models/log_mel.hpp"

#include <fftw3.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <numbers>
#include <stdexcept>

#include <nlohmann/json.hpp>

namespace troupe::models {

namespace {

// FFTW's planner is not thread-safe (executing a plan is).
std::mutex& planner_mutex() {
  static std::mutex m;
  return m;
}

// Slaney's mel scale: linear below 1 kHz, logarithmic above (librosa's
// and transformers' "slaney").
double hz_to_mel(double f) {
  constexpr double min_log_hz = 1000.0, min_log_mel = 15.0;
  const double logstep = 27.0 / std::log(6.4);
  return f >= min_log_hz ? min_log_mel + std::log(f / min_log_hz) * logstep : 3.0 * f / 200.0;
}

double mel_to_hz(double m) {
  constexpr double min_log_hz = 1000.0, min_log_mel = 15.0;
  const double logstep = std::log(6.4) / 27.0;
  return m >= min_log_mel ? min_log_hz * std::exp(logstep * (m - min_log_mel)) : 200.0 * m / 3.0;
}

// numpy.linspace(start, stop, n)[i].
double linspace(double start, double stop, int n, int i) {
  if (n == 1) return start;
  const double step = (stop - start) / (n - 1);
  return i == n - 1 ? stop : start + i * step;
}

struct fftw_buffer_free {
  void operator()(void* p) const { fftw_free(p); }
};

}  // namespace

result<void> validate(const mel_options& o) {
  auto bad = [](std::string why) { return make_error(errc::invalid_argument, "log-mel: " + why); };
  if (o.sample_rate < 1000 || o.sample_rate > 192000)
    return bad("sampling_rate " + std::to_string(o.sample_rate) + " is outside 1000-192000");
  if (o.n_fft < 16 || o.n_fft > 8192 || o.n_fft % 2 != 0)
    return bad("n_fft " + std::to_string(o.n_fft) + " must be even and within 16-8192");
  if (o.hop_length < 1 || o.hop_length > o.n_fft)
    return bad("hop_length " + std::to_string(o.hop_length) + " must be within 1-n_fft");
  if (o.n_mels < 1 || o.n_mels > 512)
    return bad("feature_size " + std::to_string(o.n_mels) + " is outside 1-512");
  if (o.n_samples != 0 && (o.n_samples < o.n_fft || o.n_samples > std::int64_t{192000} * 3600))
    return bad("n_samples " + std::to_string(o.n_samples) + " must be 0 or within n_fft-1 hour");
  if (!(o.max_frequency > 0) || o.max_frequency > o.sample_rate / 2.0)
    return bad("the highest mel frequency must be within (0, sampling_rate / 2]");
  return {};
}

result<mel_options> load_mel_options(const std::string& path) {
  auto bytes = read_file_bytes(path, 1 << 20);
  if (!bytes) return std::unexpected(bytes.error());
  auto j = nlohmann::json::parse(bytes->begin(), bytes->end(), nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return make_error(errc::corrupt_data, path + ": not a JSON object");
  mel_options o;
  auto bad = [&](std::string why) { return make_error(errc::invalid_argument, path + ": " + why); };
  auto get_int = [&](const char* key, auto& out) -> bool {
    if (!j.contains(key)) return true;
    const auto& v = j[key];
    if (!v.is_number_integer()) return false;
    out = v.get<std::int64_t>();
    return true;
  };
  std::int64_t n_mels = o.n_mels, rate = o.sample_rate, hop = o.hop_length, n_fft = o.n_fft,
               chunk = -1, n_samples = -1;
  if (!get_int("feature_size", n_mels) || !get_int("sampling_rate", rate) ||
      !get_int("hop_length", hop) || !get_int("n_fft", n_fft) || !get_int("chunk_length", chunk) ||
      !get_int("n_samples", n_samples))
    return bad(
        "feature_size, sampling_rate, hop_length, n_fft, chunk_length and n_samples must be "
        "integers");
  if (j.contains("feature_extractor_type") &&
      j["feature_extractor_type"] != nlohmann::json("WhisperFeatureExtractor"))
    return bad("feature_extractor_type " + j["feature_extractor_type"].dump() +
               " is not supported (WhisperFeatureExtractor)");
  if (j.contains("dither") && !(j["dither"].is_number() && j["dither"].get<double>() == 0.0))
    return bad("dither " + j["dither"].dump() + " is not supported (0 only)");
  if (j.contains("padding_value") &&
      !(j["padding_value"].is_number() && j["padding_value"].get<double>() == 0.0))
    return bad("padding_value " + j["padding_value"].dump() + " is not supported (0 only)");
  if (j.contains("do_normalize") && j["do_normalize"] != nlohmann::json(false))
    return bad("do_normalize " + j["do_normalize"].dump() + " is not supported");
  auto fits = [](std::int64_t v) { return v >= 0 && v <= (std::int64_t{1} << 30); };
  if (!fits(n_mels) || !fits(rate) || !fits(hop) || !fits(n_fft) || chunk > (1 << 20) ||
      n_samples > (std::int64_t{1} << 40))
    return bad("a setting is out of range");
  o.n_mels = static_cast<int>(n_mels);
  o.sample_rate = static_cast<int>(rate);
  o.hop_length = static_cast<int>(hop);
  o.n_fft = static_cast<int>(n_fft);
  if (n_samples >= 0)
    o.n_samples = n_samples;
  else if (chunk >= 0)
    o.n_samples = chunk * o.sample_rate;
  if (auto v = validate(o); !v) return make_error(v.error().code, path + ": " + v.error().message);
  return o;
}

log_mel::log_mel(const mel_options& o) : o_(o) {
  if (auto v = validate(o); !v) throw std::invalid_argument(v.error().message);
  const int n = o.n_fft, bins = n / 2 + 1, mels = o.n_mels;
  window_.resize(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    window_[static_cast<std::size_t>(i)] = 0.5 - 0.5 * std::cos(2.0 * std::numbers::pi * i / n);
  // The triangles between mel points evenly spaced from 0 Hz to
  // max_frequency, scaled by 2 / their width in Hz (Slaney's norm).
  std::vector<double> fpts(static_cast<std::size_t>(mels + 2));
  const double mel_lo = hz_to_mel(0.0), mel_hi = hz_to_mel(o.max_frequency);
  for (int i = 0; i < mels + 2; ++i)
    fpts[static_cast<std::size_t>(i)] = mel_to_hz(linspace(mel_lo, mel_hi, mels + 2, i));
  filters_.assign(static_cast<std::size_t>(bins) * mels, 0.0);
  spans_.assign(static_cast<std::size_t>(mels), {bins, 0});
  const double nyquist =
      static_cast<double>(o.sample_rate / 2);  // integer division, as transformers
  for (int k = 0; k < bins; ++k) {
    const double f = linspace(0.0, nyquist, bins, k);
    for (int m = 0; m < mels; ++m) {
      const auto mi = static_cast<std::size_t>(m);
      const double down = -(fpts[mi] - f) / (fpts[mi + 1] - fpts[mi]);
      const double up = (fpts[mi + 2] - f) / (fpts[mi + 2] - fpts[mi + 1]);
      const double w = std::max(0.0, std::min(down, up)) * (2.0 / (fpts[mi + 2] - fpts[mi]));
      filters_[static_cast<std::size_t>(k) * mels + mi] = w;
      if (w != 0.0) {
        spans_[mi].first = std::min(spans_[mi].first, k);
        spans_[mi].second = std::max(spans_[mi].second, k + 1);
      }
    }
  }
  // Planned once, without SIMD codelets and by estimate (no timing): the
  // same plan, so the same bits, on every x86-64 machine.
  std::unique_ptr<double, fftw_buffer_free> in(fftw_alloc_real(static_cast<std::size_t>(n)));
  std::unique_ptr<fftw_complex, fftw_buffer_free> out(
      fftw_alloc_complex(static_cast<std::size_t>(bins)));
  std::lock_guard lock(planner_mutex());
  plan_ = fftw_plan_dft_r2c_1d(n, in.get(), out.get(),
                               FFTW_ESTIMATE | FFTW_NO_SIMD | FFTW_UNALIGNED | FFTW_PRESERVE_INPUT);
  if (!plan_)
    throw std::runtime_error("log-mel: FFTW could not plan a transform of " + std::to_string(n));
}

log_mel::~log_mel() {
  std::lock_guard lock(planner_mutex());
  fftw_destroy_plan(static_cast<fftw_plan>(plan_));
}

std::int64_t log_mel::frames_for(std::int64_t samples) const {
  return (o_.n_samples > 0 ? o_.n_samples : samples) / o_.hop_length;
}

std::vector<float> log_mel::operator()(std::span<const float> samples) const {
  const int n = o_.n_fft, half = n / 2, bins = half + 1, mels = o_.n_mels;
  // The window's samples: padded with zeros or cut to n_samples, and at
  // least half + 1 long (reflection needs one sample past the padding).
  std::vector<double> x(samples.begin(), samples.end());
  if (o_.n_samples > 0) x.resize(static_cast<std::size_t>(o_.n_samples), 0.0);
  if (static_cast<int>(x.size()) < half + 1) x.resize(static_cast<std::size_t>(half + 1), 0.0);
  const auto len = static_cast<std::int64_t>(x.size());
  // Centred frames: `half` reflected samples before and after.
  std::vector<double> p(static_cast<std::size_t>(len + 2 * half));
  for (std::int64_t i = 0; i < len; ++i)
    p[static_cast<std::size_t>(i + half)] = x[static_cast<std::size_t>(i)];
  for (int k = 1; k <= half; ++k) {
    p[static_cast<std::size_t>(half - k)] = x[static_cast<std::size_t>(k)];
    p[static_cast<std::size_t>(half + len - 1 + k)] = x[static_cast<std::size_t>(len - 1 - k)];
  }
  // 1 + len / hop frames; the last is dropped, as Whisper's extractor does.
  const std::int64_t frames = len / o_.hop_length;
  std::vector<float> out(static_cast<std::size_t>(mels * frames));
  std::unique_ptr<double, fftw_buffer_free> buf(fftw_alloc_real(static_cast<std::size_t>(n)));
  std::unique_ptr<fftw_complex, fftw_buffer_free> spec(
      fftw_alloc_complex(static_cast<std::size_t>(bins)));
  std::vector<double> power(static_cast<std::size_t>(bins));
  auto plan = static_cast<fftw_plan>(plan_);
  for (std::int64_t t = 0; t < frames; ++t) {
    const double* frame = p.data() + t * o_.hop_length;
    for (int i = 0; i < n; ++i) buf.get()[i] = frame[i] * window_[static_cast<std::size_t>(i)];
    fftw_execute_dft_r2c(plan, buf.get(), spec.get());
    for (int k = 0; k < bins; ++k) {
      // transformers keeps the spectrum as complex64: each part rounded to
      // float before the power is taken in double.
      const double re = static_cast<float>(spec.get()[k][0]);
      const double im = static_cast<float>(spec.get()[k][1]);
      power[static_cast<std::size_t>(k)] = re * re + im * im;
    }
    for (int m = 0; m < mels; ++m) {
      const auto [lo, hi] = spans_[static_cast<std::size_t>(m)];
      double s = 0;
      for (int k = lo; k < hi; ++k)
        s += filters_[static_cast<std::size_t>(k) * mels + static_cast<std::size_t>(m)] *
             power[static_cast<std::size_t>(k)];
      out[static_cast<std::size_t>(m * frames + t)] =
          static_cast<float>(std::log10(std::max(1e-10, s)));
    }
  }
  if (out.empty()) return out;
  const float floor = *std::max_element(out.begin(), out.end()) - 8.0f;
  for (auto& v : out) v = (std::max(v, floor) + 4.0f) / 4.0f;
  return out;
}

}  // namespace troupe::models
