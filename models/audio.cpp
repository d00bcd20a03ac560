#include "models/audio.hpp"

#include <sndfile.h>
#include <soxr.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string_view>

namespace troupe::models {

namespace {

// The encoded bytes behind libsndfile's virtual I/O: reads, seeks and
// tells within the span; nothing is written.
struct memory_source {
  std::span<const std::uint8_t> bytes;
  sf_count_t pos = 0;
};

sf_count_t vio_length(void* user) {
  return static_cast<sf_count_t>(static_cast<memory_source*>(user)->bytes.size());
}

sf_count_t vio_seek(sf_count_t offset, int whence, void* user) {
  // A hostile header's offsets: no overflow, nothing outside [0, size].
  auto* m = static_cast<memory_source*>(user);
  const auto to = seek_within(m->pos, static_cast<sf_count_t>(m->bytes.size()), offset, whence);
  if (to >= 0) m->pos = to;
  return to;
}

sf_count_t vio_read(void* ptr, sf_count_t count, void* user) {
  auto* m = static_cast<memory_source*>(user);
  const auto size = static_cast<sf_count_t>(m->bytes.size());
  if (count <= 0 || m->pos >= size) return 0;
  const auto n = std::min(count, size - m->pos);
  std::memcpy(ptr, m->bytes.data() + m->pos, static_cast<std::size_t>(n));
  m->pos += n;
  return n;
}

sf_count_t vio_write(const void*, sf_count_t, void*) {
  return 0;
}

sf_count_t vio_tell(void* user) {
  return static_cast<memory_source*>(user)->pos;
}

struct sndfile_closer {
  void operator()(SNDFILE* f) const { sf_close(f); }
};

bool starts(std::span<const std::uint8_t> b, std::string_view magic, std::size_t at = 0) {
  return b.size() >= at + magic.size() &&
         std::memcmp(b.data() + at, magic.data(), magic.size()) == 0;
}

// An MPEG audio frame header: 11 sync bits, a layer that is not "reserved",
// a bitrate index that is neither "free" nor "bad", a valid sample rate.
bool mpeg_frame_at(std::span<const std::uint8_t> b) {
  if (b.size() < 4 || b[0] != 0xff || (b[1] & 0xe0) != 0xe0) return false;
  const int version = (b[1] >> 3) & 3, layer = (b[1] >> 1) & 3;
  const int bitrate = (b[2] >> 4) & 15, rate = (b[2] >> 2) & 3;
  return version != 1 && layer != 0 && bitrate != 0 && bitrate != 15 && rate != 3;
}

// The container by its first bytes, or empty (refused).
std::string_view container_of(std::span<const std::uint8_t> b) {
  if ((starts(b, "RIFF") || starts(b, "RF64")) && starts(b, "WAVE", 8)) return "WAV";
  if (starts(b, "fLaC")) return "FLAC";
  if (starts(b, "ID3") || mpeg_frame_at(b)) return "MP3";
  return {};
}

std::string describe_other(std::span<const std::uint8_t> b) {
  if (starts(b, "OggS")) return "Ogg";
  if (starts(b, "FORM") && (starts(b, "AIFF", 8) || starts(b, "AIFC", 8))) return "AIFF";
  if (starts(b, ".snd")) return "AU";
  if (starts(b, "ftyp", 4)) return "MP4/M4A";
  if (starts(b, "\x1a\x45\xdf\xa3")) return "Matroska/WebM";
  if (starts(b, "RIFF")) return "RIFF but not WAVE";
  std::string hex;
  static const char* digits = "0123456789abcdef";
  for (std::size_t i = 0; i < std::min<std::size_t>(b.size(), 8); ++i) {
    if (i) hex += ' ';
    hex += digits[b[i] >> 4];
    hex += digits[b[i] & 15];
  }
  return "unrecognized (first bytes " + (hex.empty() ? std::string("none") : hex) + ")";
}

std::string subtype_name(int format) {
  switch (format & SF_FORMAT_SUBMASK) {
    case SF_FORMAT_PCM_U8:
    case SF_FORMAT_PCM_S8:
      return "PCM 8-bit";
    case SF_FORMAT_PCM_16:
      return "PCM 16-bit";
    case SF_FORMAT_PCM_24:
      return "PCM 24-bit";
    case SF_FORMAT_PCM_32:
      return "PCM 32-bit";
    case SF_FORMAT_FLOAT:
      return "float 32-bit";
    case SF_FORMAT_DOUBLE:
      return "float 64-bit";
    case SF_FORMAT_ULAW:
      return "mu-law";
    case SF_FORMAT_ALAW:
      return "A-law";
    default:
      return {};
  }
}

// The file's format as libsndfile read it, checked against what the
// container promised; empty: refused.
std::string format_name(std::string_view container, int format) {
  const int major = format & SF_FORMAT_TYPEMASK;
  if (container == "WAV") {
    if (major != SF_FORMAT_WAV && major != SF_FORMAT_WAVEX && major != SF_FORMAT_RF64) return {};
    const auto sub = subtype_name(format);
    return sub.empty() ? std::string{} : "WAV " + sub;
  }
  if (container == "FLAC") return major == SF_FORMAT_FLAC ? "FLAC" : std::string{};
  if (container == "MP3") return major == SF_FORMAT_MPEG ? "MP3" : std::string{};
  return {};
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", s);
  return buf;
}

}  // namespace

result<audio> decode_audio(std::span<const std::uint8_t> bytes, const audio_limits& limits) {
  if (bytes.empty()) return make_error(errc::corrupt_data, "audio: the file is empty");
  if (bytes.size() > limits.max_bytes)
    return make_error(errc::invalid_argument, "audio: " + std::to_string(bytes.size()) +
                                                  " bytes is larger than the limit of " +
                                                  std::to_string(limits.max_bytes));
  const auto container = container_of(bytes);
  if (container.empty())
    return make_error(errc::invalid_argument, "audio: format " + describe_other(bytes) +
                                                  " is not supported (WAV, FLAC or MP3)");
  memory_source src{bytes, 0};
  SF_VIRTUAL_IO io{vio_length, vio_seek, vio_read, vio_write, vio_tell};
  SF_INFO info{};
  std::unique_ptr<SNDFILE, sndfile_closer> file(sf_open_virtual(&io, SFM_READ, &info, &src));
  if (!file)
    return make_error(errc::corrupt_data, "audio: not a readable " + std::string(container) +
                                              " file (" + sf_strerror(nullptr) + ")");
  const auto name = format_name(container, info.format);
  if (name.empty())
    return make_error(
        errc::invalid_argument, "audio: this " + std::string(container) +
                                    " encoding (libsndfile format 0x" +
                                    [&] {
                                      char b[16];
                                      std::snprintf(b, sizeof b, "%x", info.format);
                                      return std::string(b);
                                    }() +
                                    ") is not supported");
  if (info.channels < 1)
    return make_error(errc::corrupt_data, "audio: the file declares no channel");
  if (info.channels > limits.max_channels)
    return make_error(errc::invalid_argument, "audio: " + std::to_string(info.channels) +
                                                  " channels, the limit is " +
                                                  std::to_string(limits.max_channels));
  if (info.samplerate < limits.min_sample_rate || info.samplerate > limits.max_sample_rate)
    return make_error(errc::invalid_argument,
                      "audio: sample rate " + std::to_string(info.samplerate) +
                          " Hz is outside the accepted " + std::to_string(limits.min_sample_rate) +
                          "-" + std::to_string(limits.max_sample_rate) + " Hz");
  const auto max_frames = static_cast<sf_count_t>(std::floor(limits.max_seconds * info.samplerate));
  if (info.frames > max_frames)
    return make_error(errc::invalid_argument,
                      "audio: " + seconds_text(static_cast<double>(info.frames) / info.samplerate) +
                          " s is longer than the limit of " + seconds_text(limits.max_seconds) +
                          " s");
  audio out;
  out.sample_rate = out.source_rate = info.samplerate;
  out.source_channels = info.channels;
  out.format = name;
  // Integer PCM scaled to [-1, 1) (x / 2^(bits-1)), as soundfile and
  // ffmpeg's s16le / 32768 give it.
  sf_command(file.get(), SFC_SET_NORM_FLOAT, nullptr, SF_TRUE);
  const auto channels = static_cast<std::size_t>(info.channels);
  constexpr sf_count_t block = 4096;
  std::vector<float> buf(static_cast<std::size_t>(block) * channels);
  // Reserved from the header, but no more than twice the file's bytes: a
  // header that lies about its length costs nothing up front.
  out.samples.reserve(static_cast<std::size_t>(std::clamp<sf_count_t>(
      info.frames, 0,
      std::min<sf_count_t>(max_frames, 2 * static_cast<sf_count_t>(bytes.size())))));
  for (;;) {
    const auto got = sf_readf_float(file.get(), buf.data(), block);
    if (got <= 0) break;
    if (static_cast<sf_count_t>(out.samples.size()) + got > max_frames)
      return make_error(errc::invalid_argument,
                        "audio: longer than the limit of " + seconds_text(limits.max_seconds) +
                            " s (its header said " +
                            seconds_text(static_cast<double>(info.frames) / info.samplerate) +
                            " s)");
    for (sf_count_t f = 0; f < got; ++f) {
      const float* frame = buf.data() + static_cast<std::size_t>(f) * channels;
      double sum = 0;
      for (std::size_t c = 0; c < channels; ++c) sum += frame[c];
      const auto v = static_cast<float>(sum / static_cast<double>(channels));
      if (!std::isfinite(v))
        return make_error(
            errc::corrupt_data,
            "audio: sample " + std::to_string(out.samples.size()) + " is not a finite number");
      out.samples.push_back(v);
    }
  }
  if (const int e = sf_error(file.get()); e != SF_ERR_NO_ERROR)
    return make_error(errc::corrupt_data, "audio: decoding failed after " +
                                              std::to_string(out.samples.size()) + " samples (" +
                                              sf_error_number(e) + ")");
  if (out.samples.empty())
    return make_error(errc::corrupt_data, "audio: the " + name + " file holds no sample");
  return out;
}

result<audio> load_audio(const std::string& path, const audio_limits& limits) {
  auto bytes = read_file_bytes(path, limits.max_bytes);
  if (!bytes) return std::unexpected(bytes.error());
  auto a = decode_audio(*bytes, limits);
  if (!a) return make_error(a.error().code, path + ": " + a.error().message);
  return a;
}

result<std::vector<float>> resample(std::span<const float> samples, int from, int to) {
  if (from <= 0 || to <= 0)
    return make_error(errc::invalid_argument, "resample: rates must be positive (" +
                                                  std::to_string(from) + " -> " +
                                                  std::to_string(to) + ")");
  if (from == to) return std::vector<float>(samples.begin(), samples.end());
  const auto want = static_cast<std::size_t>(
      std::ceil(static_cast<double>(samples.size()) * to / static_cast<double>(from)));
  std::vector<float> out(want + 16);
  const soxr_io_spec_t io = soxr_io_spec(SOXR_FLOAT32_I, SOXR_FLOAT32_I);
  const soxr_quality_spec_t q = soxr_quality_spec(SOXR_HQ, 0);
  const soxr_runtime_spec_t rt = soxr_runtime_spec(1);  // one thread: the caller's
  std::size_t done = 0;
  if (const soxr_error_t e = soxr_oneshot(from, to, 1, samples.data(), samples.size(), nullptr,
                                          out.data(), out.size(), &done, &io, &q, &rt))
    return make_error(errc::internal, std::string("resample: ") + e);
  out.resize(std::min(done, want));
  return out;
}

result<audio> decode_audio_at(std::span<const std::uint8_t> bytes, int rate,
                              const audio_limits& limits) {
  auto a = decode_audio(bytes, limits);
  if (!a || a->sample_rate == rate) return a;
  auto r = resample(a->samples, a->sample_rate, rate);
  if (!r) return std::unexpected(r.error());
  a->samples = std::move(*r);
  a->sample_rate = rate;
  return a;
}

}  // namespace troupe::models
