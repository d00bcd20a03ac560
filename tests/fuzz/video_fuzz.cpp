// libFuzzer target: video demuxing and decoding (MP4, WebM, AVI through
// FFmpeg's libraries; small limits), frames and the audio track, as a
// request would ask for them.
#include <cstddef>
#include <cstdint>
#include <span>

#include "models/video.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::models;
  video_limits limits;
  limits.max_bytes = 1 << 20;
  limits.max_seconds = 20;
  limits.max_side = 512;
  limits.max_pixels = 256 * 256;
  limits.max_frames_in_file = 600;
  video_sampling s;
  s.num_frames = 1 + static_cast<int>(size % 4);
  s.audio = (size & 1) != 0;
  (void)decode_video(std::span<const std::uint8_t>(data, size), s, limits);
  return 0;
}
