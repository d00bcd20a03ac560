#pragma once

// Video input: frames sampled from an MP4, WebM/Matroska or AVI file with
// FFmpeg's libavformat and libavcodec, decoded from memory.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "models/audio.hpp"
#include "models/image.hpp"
#include "models/mapped_file.hpp"

namespace troupe::models {

/// Limits checked against the container's headers before any frame is
/// decoded, and again while demuxing (headers can lie).
struct video_limits {
  std::uint64_t max_bytes = std::uint64_t{256} << 20;  ///< the file (256 MiB)
  double max_seconds = 600;                            ///< duration
  int max_side = 4096;                                 ///< width and height
  std::int64_t max_pixels = 4096 * 2304;               ///< width x height
  std::int64_t max_frames_in_file = 36000;             ///< video frames (10 min at 60 fps)
  int max_sampled_frames = 64;                         ///< frames a request may ask for
};

/// Which frames to keep.
struct video_sampling {
  int num_frames = 8;  ///< frames, spread uniformly over the clip
  /// > 0: one frame per 1 / fps seconds of the clip instead, at most
  /// num_frames (then spread uniformly), at least one.
  double fps = 0;
  bool audio = false;  ///< also decode the first audio track (mono, 16 kHz)
};

struct video {
  std::vector<image> frames;        ///< RGB8, in order
  std::vector<double> times;        ///< each frame's presentation time, seconds from the start
  std::vector<std::int64_t> index;  ///< each frame's number in the stream (0-based)
  std::int64_t frames_in_file = 0;
  double seconds = 0;  ///< the video stream's duration
  double fps = 0;      ///< its average frame rate
  int width = 0, height = 0;
  std::string container;  ///< "mp4", "webm", "matroska", "avi"
  std::string codec;      ///< "h264", "vp9", ...
  /// With video_sampling::audio and an audio track: its samples, mono,
  /// 16 kHz (empty without one).
  audio sound;
};

/// Decodes the frames `sampling` asks for. Containers: MP4/MOV, Matroska/
/// WebM, AVI; video codecs: H.264, HEVC, VP8, VP9, AV1, MPEG-4 part 2,
/// MJPEG; audio codecs (for `sampling.audio`): AAC, MP3, Opus, Vorbis, FLAC,
/// PCM. Anything else (playlists such as HLS or ffconcat included) is
/// refused before it is demuxed. The input is read from `bytes` only: no
/// protocol, file or URL is ever opened, whatever the container names.
/// Decoding runs single-threaded in the caller's thread.
result<video> decode_video(std::span<const std::uint8_t> bytes, const video_sampling& sampling = {},
                           const video_limits& limits = {});

/// decode_video's first pass alone (headers and packets, nothing decoded):
/// the limits checked, `index` the frame numbers `sampling` would keep,
/// `frames` and `times` empty, no sound.
result<video> probe_video(std::span<const std::uint8_t> bytes, const video_sampling& sampling = {},
                          const video_limits& limits = {});

/// probe_video, and the first audio track decoded (mono, 16 kHz, in
/// `sound`; empty without one), no frame decoded: what a request that also
/// wants the video's audio needs to count its tokens.
result<video> probe_video_sound(std::span<const std::uint8_t> bytes,
                                const video_sampling& sampling = {},
                                const video_limits& limits = {});

/// Reads and decodes a video file (a regular file of at most
/// limits.max_bytes); messages start with `path`.
result<video> load_video(const std::string& path, const video_sampling& sampling = {},
                         const video_limits& limits = {});

/// The frame numbers `sampling` keeps of `frames` frames lasting `seconds`:
/// numpy.linspace(0, frames - 1, n).astype(int), as vLLM samples.
std::vector<std::int64_t> sample_frames(std::int64_t frames, double seconds,
                                        const video_sampling& sampling);

}  // namespace troupe::models
