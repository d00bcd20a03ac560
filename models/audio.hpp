#pragma once

// Audio input: decoding (libsndfile) and resampling (libsoxr) to the mono
// 16 kHz float samples a Whisper-style encoder's features are computed
// from (models/log_mel.hpp).

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "models/mapped_file.hpp"

namespace troupe::models {

/// Decoded audio: mono samples (the channels averaged, as `ffmpeg -ac 1`
/// does), nominally in [-1, 1], at `sample_rate`.
struct audio {
  int sample_rate = 0;
  std::vector<float> samples;
  int source_channels = 0;  ///< channels in the file
  int source_rate = 0;      ///< the file's sample rate (before any resampling)
  std::string format;       ///< "WAV PCM 16-bit", "FLAC", "MP3", ...
  double seconds() const {
    return sample_rate > 0 ? static_cast<double>(samples.size()) / sample_rate : 0.0;
  }
};

/// Limits checked against the file's header before any sample is decoded,
/// and again while decoding (a header may understate its length).
struct audio_limits {
  std::uint64_t max_bytes = std::uint64_t{64} << 20;  ///< the encoded file (64 MiB)
  double max_seconds = 600;                           ///< duration (10 minutes)
  int max_channels = 8;
  int min_sample_rate = 4000;
  int max_sample_rate = 192000;
};

/// Decodes WAV (PCM 8/16/24/32-bit, 32/64-bit float, A-law, mu-law; RIFF,
/// WAVE_FORMAT_EXTENSIBLE and RF64), FLAC or MP3 from memory, recognized by
/// their first bytes (other formats are refused before libsndfile sees
/// them), to mono float at the file's rate. Corrupt, truncated, empty,
/// non-finite (a float WAV's NaN) or over-limit input is an error; no input
/// aborts. Decoding reads from `bytes` only (libsndfile's virtual I/O).
result<audio> decode_audio(std::span<const std::uint8_t> bytes, const audio_limits& limits = {});

/// Reads and decodes an audio file (a regular file of at most
/// limits.max_bytes); messages start with `path`.
result<audio> load_audio(const std::string& path, const audio_limits& limits = {});

/// Resamples mono `samples` from `from` Hz to `to` Hz with libsoxr (its
/// high quality setting: a linear-phase filter passing 91 % of the band,
/// -100 dB of stop band). The same rate returns the input.
result<std::vector<float>> resample(std::span<const float> samples, int from, int to);

/// decode_audio, then resample to `rate` (Whisper's features want 16 kHz).
result<audio> decode_audio_at(std::span<const std::uint8_t> bytes, int rate,
                              const audio_limits& limits = {});

}  // namespace troupe::models
