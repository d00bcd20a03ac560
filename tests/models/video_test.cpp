// Video input: frames sampled from MP4 (H.264), WebM (VP9) and AVI (MJPEG)
// files, checked against the drawing they were encoded from
// (tools/make_video_fixtures.py, encoded by PyAV's own FFmpeg build), the
// audio track, and the refusals of bad and hostile input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/video.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/video";

nlohmann::json meta() {
  std::ifstream f(dir + "/frames.json");
  return nlohmann::json::parse(f, nullptr, false);
}

int pixel_error(const image& img, int x, int y, const nlohmann::json& rgb) {
  int worst = 0;
  for (int c = 0; c < 3; ++c)
    worst = std::max(worst,
                     std::abs(int(img.rgb[static_cast<std::size_t>((y * img.width + x) * 3 + c)]) -
                              rgb[c].get<int>()));
  return worst;
}

// Frame `k` against the drawing: inside its square (away from the edges a
// JPEG rings at) and on the background across the frame from it.
int frame_error(const image& img, std::int64_t k, const nlohmann::json& m) {
  const auto& sq = m["squares"][static_cast<std::size_t>(k)];
  const int x = sq["x"], y = sq["y"];
  int worst = 0;
  for (int dy : {4, 8, 11})
    for (int dx : {4, 8, 11}) worst = std::max(worst, pixel_error(img, x + dx, y + dy, sq["rgb"]));
  const int bx = x < 24 ? 56 : 4, by = y < 16 ? 40 : 4;
  worst = std::max(worst, pixel_error(img, bx, by, m["background"]));
  return worst;
}

}  // namespace

TEST(Video, SamplingIsUniformAsVllmDoes) {
  video_sampling s;
  s.num_frames = 5;
  EXPECT_EQ(sample_frames(30, 3.0, s), (std::vector<std::int64_t>{0, 7, 14, 21, 29}));
  s.num_frames = 8;
  s.fps = 2;  // 3 s at 2 fps: 6 frames
  EXPECT_EQ(sample_frames(30, 3.0, s), (std::vector<std::int64_t>{0, 5, 11, 17, 23, 29}));
  s.fps = 0.1;  // fewer than one: one
  EXPECT_EQ(sample_frames(30, 3.0, s), (std::vector<std::int64_t>{0}));
  s.fps = 0;
  EXPECT_EQ(sample_frames(3, 3.0, s), (std::vector<std::int64_t>{0, 1, 2}));  // at most every frame
}

TEST(Video, FramesMatchTheDrawingInEveryContainer) {
  const auto m = meta();
  ASSERT_FALSE(m.is_discarded());
  struct tcase {
    const char* file;
    const char* codec;
    // Levels: lossless H.264 / VP9 (RGB <-> YUV rounding); JPEG at q 2 with
    // the square off the 8 x 8 blocks, where PyAV's own decoder of the same
    // file is 33 levels off at these points.
    int tolerance;
  };
  for (const auto& c : {tcase{"square.mp4", "h264", 3}, tcase{"square.webm", "vp9", 3},
                        tcase{"square.avi", "mjpeg", 36}}) {
    video_sampling s;
    s.num_frames = 5;
    auto v = load_video(dir + "/" + c.file, s);
    ASSERT_TRUE(v) << c.file << ": " << v.error().message;
    EXPECT_EQ(v->codec, c.codec);
    EXPECT_EQ(v->frames_in_file, 30) << c.file;
    EXPECT_EQ(v->width, 64);
    EXPECT_EQ(v->height, 48);
    EXPECT_NEAR(v->fps, 10.0, 1e-6) << c.file;
    EXPECT_NEAR(v->seconds, 3.0, 0.11) << c.file;
    ASSERT_EQ(v->index, (std::vector<std::int64_t>{0, 7, 14, 21, 29})) << c.file;
    int worst = 0;
    for (std::size_t i = 0; i < v->frames.size(); ++i) {
      ASSERT_EQ(v->frames[i].width, 64);
      ASSERT_EQ(v->frames[i].height, 48);
      worst = std::max(worst, frame_error(v->frames[i], v->index[i], m));
      EXPECT_NEAR(v->times[i], static_cast<double>(v->index[i]) / 10.0, 1e-3) << c.file;
    }
    std::printf("%-12s %-6s 5 of %lld frames, max |diff| from the drawing %d levels\n", c.file,
                v->codec.c_str(), static_cast<long long>(v->frames_in_file), worst);
    EXPECT_LE(worst, c.tolerance) << c.file;
    // A frame sampled is the frame it says: the square of another frame
    // is elsewhere or another color.
    EXPECT_GT(frame_error(v->frames[1], 8, m), 40) << c.file;
  }
}

TEST(Video, TheAudioTrackComesOutAt16kHz) {
  video_sampling s;
  s.num_frames = 2;
  s.audio = true;
  auto v = load_video(dir + "/square_aac.mp4", s);
  ASSERT_TRUE(v) << v.error().message;
  EXPECT_EQ(v->frames.size(), 2u);
  EXPECT_EQ(v->sound.format, "aac");
  EXPECT_EQ(v->sound.sample_rate, 16000);
  const auto& a = v->sound.samples;
  EXPECT_NEAR(v->sound.seconds(), 2.0, 0.15);
  // A 440 Hz tone at 0.3: its zero crossings and its RMS, away from the
  // encoder's priming and tail.
  ASSERT_GT(a.size(), 16000u);
  int crossings = 0;
  double sq = 0;
  const std::size_t from = 4000, to = 20000;
  for (std::size_t i = from; i < std::min(to, a.size()); ++i) {
    crossings += (a[i - 1] < 0) != (a[i] < 0);
    sq += double(a[i]) * a[i];
  }
  const double secs = static_cast<double>(std::min(to, a.size()) - from) / 16000;
  const double hz = crossings / 2.0 / secs, rms = std::sqrt(sq / (secs * 16000));
  std::printf("audio track: %.2f s, %.1f Hz, RMS %.3f\n", v->sound.seconds(), hz, rms);
  EXPECT_NEAR(hz, 440.0, 5.0);
  EXPECT_NEAR(rms, 0.3 / std::sqrt(2.0), 0.03);
  // Without asking, no audio is decoded.
  s.audio = false;
  auto quiet = load_video(dir + "/square_aac.mp4", s);
  ASSERT_TRUE(quiet);
  EXPECT_TRUE(quiet->sound.samples.empty());
  // The track alone (what the prompt worker counts): the same samples, no
  // frame decoded, the frames that would be sampled named.
  std::ifstream f(dir + "/square_aac.mp4", std::ios::binary);
  const std::vector<std::uint8_t> bytes{std::istreambuf_iterator<char>(f), {}};
  auto sound = probe_video_sound(bytes, s);
  ASSERT_TRUE(sound) << sound.error().message;
  EXPECT_TRUE(sound->frames.empty());
  EXPECT_EQ(sound->index, v->index);
  EXPECT_EQ(sound->sound.samples, a);
  // A file without a track gives no sound, and no error.
  std::ifstream g(dir + "/square.mp4", std::ios::binary);
  const std::vector<std::uint8_t> silent{std::istreambuf_iterator<char>(g), {}};
  auto none = probe_video_sound(silent, s);
  ASSERT_TRUE(none) << none.error().message;
  EXPECT_TRUE(none->sound.samples.empty());
  EXPECT_EQ(none->index.size(), 2u);
}
