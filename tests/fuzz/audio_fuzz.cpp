// libFuzzer target: audio decoding (WAV, FLAC, MP3 through libsndfile;
// small limits, so no input can ask for much memory or time), resampling
// to 16 kHz, then Whisper's log-mel features of whatever decoded.
#include <cstddef>
#include <cstdint>
#include <span>

#include "models/audio.hpp"
#include "models/log_mel.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::models;
  audio_limits limits;
  limits.max_seconds = 4;
  limits.max_bytes = 1 << 20;
  auto a = decode_audio_at(std::span<const std::uint8_t>(data, size), 16000, limits);
  if (!a) return 0;
  static const log_mel features([] {
    mel_options o;
    o.n_samples = 0;  // the clip's own frames
    return o;
  }());
  (void)features(a->samples);
  return 0;
}
