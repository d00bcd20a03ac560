#pragma once

// Whisper's log-mel spectrogram, computed as transformers'
// WhisperFeatureExtractor does (its NumPy path): a centred STFT (reflect
// padding, periodic Hann window, FFTW for the transforms), the power
// spectrum through a Slaney-normalized mel filter bank, log10 with a floor,
// the last frame dropped, everything below (maximum - 8) raised to it, and
// (x + 4) / 4.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "models/mapped_file.hpp"

namespace troupe::models {

/// The feature extractor's settings (a Whisper `preprocessor_config.json`).
struct mel_options {
  int sample_rate = 16000;
  int n_fft = 400;
  int hop_length = 160;
  int n_mels = 80;  ///< `feature_size`: 80 (Whisper up to large-v2) or 128 (large-v3)
  /// Samples per window (`n_samples` = chunk_length x sample_rate): the
  /// input is padded with zeros, or cut, to this many; 0: neither (the
  /// frames follow the input's length).
  std::int64_t n_samples = 480000;
  /// The mel filters' highest frequency (transformers fixes 8 kHz).
  double max_frequency = 8000.0;
};

/// Reads a Whisper `preprocessor_config.json` (feature_size, sampling_rate,
/// hop_length, n_fft, n_samples or chunk_length). Settings the extractor
/// would apply and this one does not (dither, normalization) are refused.
result<mel_options> load_mel_options(const std::string& path);

/// Checks ranges: an error names the setting.
result<void> validate(const mel_options& o);

/// A log-mel feature extractor; computing is thread-safe.
class log_mel {
 public:
  /// The options must pass validate() (else the constructor throws
  /// std::invalid_argument).
  explicit log_mel(const mel_options& o);
  ~log_mel();
  log_mel(const log_mel&) = delete;
  log_mel& operator=(const log_mel&) = delete;

  const mel_options& options() const { return o_; }

  /// Frames for `samples` input samples: n_samples / hop_length with
  /// padding, else samples / hop_length.
  std::int64_t frames_for(std::int64_t samples) const;

  /// The features of mono samples at options().sample_rate: [n_mels, frames]
  /// row-major (frame t of mel bin m at m * frames + t).
  std::vector<float> operator()(std::span<const float> samples) const;

  /// The mel filter bank, [bins = n_fft / 2 + 1, n_mels] row-major, as
  /// transformers' mel_filter_bank(norm="slaney", mel_scale="slaney").
  const std::vector<double>& filters() const { return filters_; }

 private:
  mel_options o_;
  std::vector<double> window_;   // periodic Hann, n_fft
  std::vector<double> filters_;  // [bins, n_mels]
  // Per mel bin, the range of FFT bins its triangle covers (the rest are 0).
  std::vector<std::pair<int, int>> spans_;
  void* plan_ = nullptr;  // fftw_plan
};

}  // namespace troupe::models
