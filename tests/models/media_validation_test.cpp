// Bad and hostile audio and video input, and bad feature-extractor
// configs: a clear error, the samples or frames that are there, never a
// crash (this file runs under ASan+UBSan too: label `sanitize`).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "models/audio.hpp"
#include "models/log_mel.hpp"
#include "models/video.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

const std::string audio_dir = std::string(TROUPE_FIXTURES_DIR) + "/audio";
const std::string video_dir = std::string(TROUPE_FIXTURES_DIR) + "/video";

std::vector<std::uint8_t> read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}
std::vector<std::uint8_t> audio_bytes(const std::string& name) {
  return read_all(audio_dir + "/" + name);
}
std::vector<std::uint8_t> video_bytes(const std::string& name) {
  return read_all(video_dir + "/" + name);
}

void put_u16(std::vector<std::uint8_t>& b, std::size_t at, std::uint16_t v) {
  b[at] = static_cast<std::uint8_t>(v);
  b[at + 1] = static_cast<std::uint8_t>(v >> 8);
}

void put_u32(std::vector<std::uint8_t>& b, std::size_t at, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<std::uint8_t>(v >> (8 * i));
}

}  // namespace

TEST(AudioValidation, BadInputIsRefusedWithAReason) {
  auto refused = [](std::span<const std::uint8_t> b, const std::string& needle,
                    const audio_limits& l = {}) {
    auto a = decode_audio(b, l);
    EXPECT_FALSE(a) << "accepted; wanted an error with \"" << needle << "\"";
    if (!a) {
      EXPECT_NE(a.error().message.find(needle), std::string::npos)
          << a.error().message << " (wanted \"" << needle << "\")";
    }
  };
  refused({}, "empty");
  const std::vector<std::uint8_t> junk = {'h', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'};
  refused(junk, "unrecognized");
  std::vector<std::uint8_t> ogg = {'O', 'g', 'g', 'S', 0, 2, 0, 0, 0, 0, 0, 0};
  refused(ogg, "Ogg");
  std::vector<std::uint8_t> aiff = {'F', 'O', 'R', 'M', 0, 0, 0, 4, 'A', 'I', 'F', 'F'};
  refused(aiff, "AIFF");

  const auto wav = audio_bytes("speech16k.wav");
  ASSERT_GT(wav.size(), 44u);
  refused(std::span(wav).first(20), "not a readable WAV");
  auto many = wav;
  put_u16(many, 22, 12);  // channels
  put_u32(many, 28, 16000 * 2 * 12);
  put_u16(many, 32, 2 * 12);
  refused(many, "12 channels");
  auto slow = wav;
  put_u32(slow, 24, 500);  // sample rate
  put_u32(slow, 28, 1000);
  refused(slow, "500 Hz");
  audio_limits short_clips;
  short_clips.max_seconds = 1.0;
  refused(wav, "longer than the limit of 1.0 s", short_clips);
  audio_limits small_files;
  small_files.max_bytes = 1000;
  refused(wav, "larger than the limit", small_files);

  auto nan = audio_bytes("float16k.wav");
  const auto data = std::search(nan.begin(), nan.end(), std::begin("data"), std::end("data") - 1);
  ASSERT_NE(data, nan.end());
  const auto at = static_cast<std::size_t>(data - nan.begin()) + 8 + 4 * 1000;  // sample 1000
  const float q = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan.data() + at, &q, 4);
  refused(nan, "sample 1000 is not a finite number");
}

TEST(AudioValidation, TruncatedOrLyingFilesNeverGiveMoreThanTheyHold) {
  // A data chunk that claims 2 GB, files cut short: an error or the
  // samples that are there, never more, never a crash.
  auto lying = audio_bytes("speech16k.wav");
  put_u32(lying, 40, 0x7ffffff0u);
  for (const auto* name : {"speech16k.wav", "speech16k.flac", "speech16k.mp3"}) {
    const auto full = audio_bytes(name);
    for (double share : {0.9, 0.5, 0.1}) {
      const auto n = static_cast<std::size_t>(static_cast<double>(full.size()) * share);
      auto a = decode_audio(std::span(full).first(n));
      if (a) {
        EXPECT_LE(a->samples.size(), 52800u + 2400u) << name << " cut to " << share;
        EXPECT_GT(a->samples.size(), 0u);
      } else {
        EXPECT_FALSE(a.error().message.empty());
      }
    }
  }
  auto a = decode_audio(lying);
  if (a) {
    EXPECT_EQ(a->samples.size(), 52800u);
  }
  EXPECT_FALSE(load_audio(audio_dir));  // a directory
  EXPECT_FALSE(load_audio(audio_dir + "/no-such.wav"));
}

TEST(LogMelValidation, BadConfigsAreRefusedByName) {
  const auto path = testing::TempDir() + "/pp.json";
  auto refused = [&](const std::string& json, const std::string& needle) {
    std::ofstream(path) << json;
    auto o = load_mel_options(path);
    EXPECT_FALSE(o) << json;
    if (!o) {
      EXPECT_NE(o.error().message.find(needle), std::string::npos) << o.error().message;
    }
  };
  refused(R"({"feature_size": 80, "dither": 0.5})", "dither");
  refused(R"({"feature_extractor_type": "SeamlessM4TFeatureExtractor"})", "feature_extractor_type");
  refused(R"({"n_fft": 401})", "n_fft");
  refused(R"({"hop_length": 0})", "hop_length");
  refused(R"({"feature_size": "80"})", "integers");
  refused(R"({"do_normalize": true})", "do_normalize");
  refused("[1, 2", "not a JSON object");
  mel_options bad;
  bad.n_mels = 0;
  EXPECT_THROW(log_mel{bad}, std::invalid_argument);
}

TEST(VideoValidation, PlaylistsAndOtherFormatsAreRefusedBeforeDemuxing) {
  auto refused = [](std::span<const std::uint8_t> b, const std::string& needle,
                    const video_sampling& s = {}, const video_limits& l = {}) {
    auto v = decode_video(b, s, l);
    EXPECT_FALSE(v) << "accepted; wanted \"" << needle << "\"";
    if (!v) {
      EXPECT_NE(v.error().message.find(needle), std::string::npos)
          << v.error().message << " (wanted \"" << needle << "\")";
    }
  };
  refused(video_bytes("playlist.ffconcat"), "ffconcat playlist");
  refused(video_bytes("playlist.m3u8"), "HLS playlist");
  refused({}, "empty");
  const std::vector<std::uint8_t> junk(100, 0x41);
  refused(junk, "unrecognized");
  const auto mp4 = video_bytes("square.mp4");
  video_limits small;
  small.max_side = 32;
  refused(mp4, "larger than the limit", {}, small);
  video_limits brief;
  brief.max_seconds = 1.0;
  refused(mp4, "longer than the limit of 1.0 s", {}, brief);
  video_limits few;
  few.max_frames_in_file = 10;
  refused(mp4, "more than 10 frames", {}, few);
  video_limits tiny_file;
  tiny_file.max_bytes = 1000;
  refused(mp4, "larger than the limit of 1000", {}, tiny_file);
  video_sampling none;
  none.num_frames = 0;
  refused(mp4, "num_frames", none);
  video_sampling many;
  many.num_frames = 65;
  refused(mp4, "num_frames", many);
  // The MP4 header with its media cut off, then a third of the file: an
  // error or the frames that are there, never a crash.
  for (double share : {0.05, 0.33, 0.66}) {
    const auto n = static_cast<std::size_t>(static_cast<double>(mp4.size()) * share);
    auto v = decode_video(std::span(mp4).first(n));
    if (v) {
      EXPECT_LE(v->frames.size(), 8u);
    } else {
      EXPECT_FALSE(v.error().message.empty());
    }
  }
  EXPECT_FALSE(load_video(video_dir));
}
