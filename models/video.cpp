#include "models/video.hpp"

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/avutil.h>
#include <libavutil/pixdesc.h>
#include <libswscale/swscale.h>
}

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <string_view>

namespace troupe::models {

namespace {

// The encoded bytes behind a custom AVIOContext: read and seek only.
struct memory_source {
  std::span<const std::uint8_t> bytes;
  std::int64_t pos = 0;
};

int io_read(void* opaque, std::uint8_t* buf, int size) {
  auto* m = static_cast<memory_source*>(opaque);
  const auto total = static_cast<std::int64_t>(m->bytes.size());
  if (m->pos >= total) return AVERROR_EOF;
  const auto n = std::min<std::int64_t>(size, total - m->pos);
  std::memcpy(buf, m->bytes.data() + m->pos, static_cast<std::size_t>(n));
  m->pos += n;
  return static_cast<int>(n);
}

std::int64_t io_seek(void* opaque, std::int64_t offset, int whence) {
  auto* m = static_cast<memory_source*>(opaque);
  const auto total = static_cast<std::int64_t>(m->bytes.size());
  if (whence & AVSEEK_SIZE) return total;
  const auto to = seek_within(m->pos, total, offset, whence & ~AVSEEK_FORCE);
  if (to < 0) return AVERROR(EINVAL);
  m->pos = to;
  return to;
}

// Whatever a container names (a MOV data reference, a playlist entry) is
// never opened.
int refuse_open(AVFormatContext*, AVIOContext**, const char*, int, AVDictionary**) {
  return AVERROR(EPERM);
}

std::string av_text(int err) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {};
  av_strerror(err, buf, sizeof buf);
  return buf;
}

bool starts(std::span<const std::uint8_t> b, std::string_view magic, std::size_t at = 0) {
  return b.size() >= at + magic.size() &&
         std::memcmp(b.data() + at, magic.data(), magic.size()) == 0;
}

// The demuxer for the file's first bytes (none: refused before demuxing).
const char* demuxer_of(std::span<const std::uint8_t> b) {
  for (std::string_view box : {"ftyp", "moov", "mdat", "free", "wide", "skip"})
    if (starts(b, box, 4)) return "mov";
  if (starts(b, "\x1a\x45\xdf\xa3")) return "matroska";
  if (starts(b, "RIFF") && starts(b, "AVI ", 8)) return "avi";
  return nullptr;
}

std::string describe_other(std::span<const std::uint8_t> b) {
  if (starts(b, "#EXTM3U")) return "an HLS playlist";
  if (starts(b, "ffconcat")) return "an ffconcat playlist";
  if (starts(b, "OggS")) return "Ogg";
  if (starts(b, "FLV")) return "FLV";
  if (starts(b, std::string_view("\x00\x00\x01\xba", 4))) return "MPEG program stream";
  if (b.size() > 188 && b[0] == 0x47 && b[188] == 0x47) return "MPEG transport stream";
  if (starts(b, "RIFF")) return "RIFF but not AVI";
  return "unrecognized";
}

bool video_codec_allowed(AVCodecID id) {
  switch (id) {
    case AV_CODEC_ID_H264:
    case AV_CODEC_ID_HEVC:
    case AV_CODEC_ID_VP8:
    case AV_CODEC_ID_VP9:
    case AV_CODEC_ID_AV1:
    case AV_CODEC_ID_MPEG4:
    case AV_CODEC_ID_MJPEG:
      return true;
    default:
      return false;
  }
}

bool audio_codec_allowed(AVCodecID id) {
  switch (id) {
    case AV_CODEC_ID_AAC:
    case AV_CODEC_ID_MP3:
    case AV_CODEC_ID_OPUS:
    case AV_CODEC_ID_VORBIS:
    case AV_CODEC_ID_FLAC:
    case AV_CODEC_ID_PCM_S16LE:
    case AV_CODEC_ID_PCM_S24LE:
    case AV_CODEC_ID_PCM_S32LE:
    case AV_CODEC_ID_PCM_F32LE:
    case AV_CODEC_ID_PCM_U8:
      return true;
    default:
      return false;
  }
}

// The decoders the demuxer itself may open while probing streams.
constexpr const char* codec_whitelist =
    "h264,hevc,vp8,vp9,av1,libdav1d,libaom-av1,mpeg4,mjpeg,aac,mp3,mp3float,opus,libopus,vorbis,"
    "libvorbis,flac,pcm_s16le,pcm_s24le,pcm_s32le,pcm_f32le,pcm_u8";

struct format_closer {
  void operator()(AVFormatContext* f) const { avformat_close_input(&f); }
};
struct io_closer {
  void operator()(AVIOContext* io) const {
    if (!io) return;
    av_freep(&io->buffer);
    avio_context_free(&io);
  }
};
struct codec_closer {
  void operator()(AVCodecContext* c) const { avcodec_free_context(&c); }
};
struct packet_closer {
  void operator()(AVPacket* p) const { av_packet_free(&p); }
};
struct frame_closer {
  void operator()(AVFrame* f) const { av_frame_free(&f); }
};
struct sws_closer {
  void operator()(SwsContext* s) const { sws_freeContext(s); }
};

// One demuxer over the bytes (the AVIO context must outlive it: declared first).
struct input {
  memory_source src;
  std::unique_ptr<AVIOContext, io_closer> io;
  std::unique_ptr<AVFormatContext, format_closer> fmt;
};

result<std::unique_ptr<input>> open_input(std::span<const std::uint8_t> bytes,
                                          const char* demuxer) {
  static std::once_flag quiet;
  std::call_once(quiet, [] { av_log_set_level(AV_LOG_QUIET); });  // errors come back as codes
  auto in = std::make_unique<input>();
  in->src.bytes = bytes;
  constexpr int io_size = 1 << 16;
  auto* buf = static_cast<unsigned char*>(av_malloc(io_size));
  if (!buf) return make_error(errc::out_of_memory, "video: no memory for the input buffer");
  in->io.reset(avio_alloc_context(buf, io_size, 0, &in->src, io_read, nullptr, io_seek));
  if (!in->io) {
    av_free(buf);
    return make_error(errc::out_of_memory, "video: no memory for the input context");
  }
  AVFormatContext* fmt = avformat_alloc_context();
  if (!fmt) return make_error(errc::out_of_memory, "video: no memory for the demuxer");
  fmt->pb = in->io.get();
  fmt->flags |= AVFMT_FLAG_CUSTOM_IO;
  fmt->io_open = refuse_open;
  fmt->format_whitelist = av_strdup("mov,matroska,avi");
  fmt->codec_whitelist = av_strdup(codec_whitelist);
  fmt->protocol_whitelist = av_strdup("none");
  fmt->probesize = 8 << 20;
  fmt->max_analyze_duration = 10 * AV_TIME_BASE;
  const AVInputFormat* iformat = av_find_input_format(demuxer);
  if (const int e = avformat_open_input(&fmt, nullptr, iformat, nullptr); e < 0)
    // avformat_open_input frees the context on failure.
    return make_error(errc::corrupt_data, "video: not a readable " + std::string(demuxer) +
                                              " file (" + av_text(e) + ")");
  in->fmt.reset(fmt);
  if (const int e = avformat_find_stream_info(fmt, nullptr); e < 0)
    return make_error(errc::corrupt_data, "video: its streams cannot be read (" + av_text(e) + ")");
  return in;
}

std::string seconds_text(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", s);
  return buf;
}

result<std::unique_ptr<AVCodecContext, codec_closer>> open_decoder(const AVStream* s) {
  const AVCodec* dec = avcodec_find_decoder(s->codecpar->codec_id);
  if (!dec)
    return make_error(errc::invalid_argument, std::string("video: no decoder for ") +
                                                  avcodec_get_name(s->codecpar->codec_id));
  std::unique_ptr<AVCodecContext, codec_closer> ctx(avcodec_alloc_context3(dec));
  if (!ctx) return make_error(errc::out_of_memory, "video: no memory for a decoder");
  if (const int e = avcodec_parameters_to_context(ctx.get(), s->codecpar); e < 0)
    return make_error(errc::corrupt_data, "video: bad codec parameters (" + av_text(e) + ")");
  ctx->thread_count = 1;
  ctx->codec_whitelist = av_strdup(codec_whitelist);
  if (const int e = avcodec_open2(ctx.get(), dec, nullptr); e < 0)
    return make_error(errc::corrupt_data, std::string("video: the ") + dec->name +
                                              " decoder cannot start (" + av_text(e) + ")");
  return ctx;
}

// A decoded audio frame, channels averaged, appended as floats.
bool append_mono(const AVFrame* f, std::vector<float>& out) {
  const int ch = f->ch_layout.nb_channels;
  if (ch < 1 || f->nb_samples < 0) return false;
  const auto fmt = static_cast<AVSampleFormat>(f->format);
  const bool planar = av_sample_fmt_is_planar(fmt);
  auto sample = [&](int c, int i) -> double {
    const int plane = planar ? c : 0, at = planar ? i : i * ch + c;
    const std::uint8_t* p = f->extended_data[plane];
    switch (av_get_packed_sample_fmt(fmt)) {
      case AV_SAMPLE_FMT_U8:
        return (p[at] - 128) / 128.0;
      case AV_SAMPLE_FMT_S16:
        return reinterpret_cast<const std::int16_t*>(p)[at] / 32768.0;
      case AV_SAMPLE_FMT_S32:
        return reinterpret_cast<const std::int32_t*>(p)[at] / 2147483648.0;
      case AV_SAMPLE_FMT_FLT:
        return reinterpret_cast<const float*>(p)[at];
      case AV_SAMPLE_FMT_DBL:
        return reinterpret_cast<const double*>(p)[at];
      default:
        return std::nan("");
    }
  };
  for (int i = 0; i < f->nb_samples; ++i) {
    double s = 0;
    for (int c = 0; c < ch; ++c) s += sample(c, i);
    const auto v = static_cast<float>(s / ch);
    if (!std::isfinite(v)) return false;
    out.push_back(v);
  }
  return true;
}

}  // namespace

std::vector<std::int64_t> sample_frames(std::int64_t frames, double seconds,
                                        const video_sampling& s) {
  if (frames <= 0 || s.num_frames <= 0) return {};
  std::int64_t n = s.num_frames;
  if (s.fps > 0)
    n = std::clamp<std::int64_t>(static_cast<std::int64_t>(std::floor(seconds * s.fps)), 1,
                                 s.num_frames);
  n = std::min(n, frames);
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = n == 1 ? 0.0
                            : static_cast<double>(i) * static_cast<double>(frames - 1) /
                                  static_cast<double>(n - 1);
    out.push_back(static_cast<std::int64_t>(v));  // truncation, as astype(int)
  }
  return out;
}

namespace {

/// What read_video does: decode_video's whole work, its first pass alone,
/// or the first pass and the audio track (no frame decoded).
enum class reading { whole, probe, sound };

result<video> read_video(std::span<const std::uint8_t> bytes, const video_sampling& sampling,
                         const video_limits& limits, reading what) {
  if (bytes.empty()) return make_error(errc::corrupt_data, "video: the file is empty");
  if (bytes.size() > limits.max_bytes)
    return make_error(errc::invalid_argument, "video: " + std::to_string(bytes.size()) +
                                                  " bytes is larger than the limit of " +
                                                  std::to_string(limits.max_bytes));
  if (sampling.num_frames < 1 || sampling.num_frames > limits.max_sampled_frames)
    return make_error(errc::invalid_argument,
                      "video: num_frames " + std::to_string(sampling.num_frames) +
                          " is outside 1-" + std::to_string(limits.max_sampled_frames));
  if (!(sampling.fps >= 0) || sampling.fps > 240)
    return make_error(errc::invalid_argument, "video: fps must be within 0-240");
  const char* demuxer = demuxer_of(bytes);
  if (!demuxer)
    return make_error(errc::invalid_argument,
                      "video: format " + describe_other(bytes) +
                          " is not supported (MP4/MOV, WebM/Matroska, AVI)");
  // Pass 1: the headers and every packet, nothing decoded: the limits,
  // and the number of frames to sample from.
  auto first = open_input(bytes, demuxer);
  if (!first) return std::unexpected(first.error());
  AVFormatContext* fmt = (*first)->fmt.get();
  const int vi = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, nullptr, 0);
  if (vi < 0) return make_error(errc::invalid_argument, "video: the file has no video stream");
  const AVStream* vs = fmt->streams[vi];
  video out;
  out.container = std::string_view(demuxer) == "mov"   ? "mp4"
                  : std::string_view(demuxer) == "avi" ? "avi"
                                                       : "matroska/webm";
  out.codec = avcodec_get_name(vs->codecpar->codec_id);
  if (!video_codec_allowed(vs->codecpar->codec_id))
    return make_error(errc::invalid_argument, "video: codec " + out.codec +
                                                  " is not supported (h264, hevc, vp8, vp9, av1, "
                                                  "mpeg4, mjpeg)");
  out.width = vs->codecpar->width;
  out.height = vs->codecpar->height;
  if (out.width < 1 || out.height < 1)
    return make_error(errc::corrupt_data, "video: the stream declares no frame size");
  if (out.width > limits.max_side || out.height > limits.max_side ||
      std::int64_t{out.width} * out.height > limits.max_pixels)
    return make_error(errc::invalid_argument,
                      "video: " + std::to_string(out.width) + "x" + std::to_string(out.height) +
                          " is larger than the limit (" + std::to_string(limits.max_side) +
                          " per side, " + std::to_string(limits.max_pixels) + " pixels)");
  const double tb = av_q2d(vs->time_base);
  double declared = vs->duration > 0    ? static_cast<double>(vs->duration) * tb
                    : fmt->duration > 0 ? static_cast<double>(fmt->duration) / AV_TIME_BASE
                                        : 0.0;
  if (declared > limits.max_seconds)
    return make_error(errc::invalid_argument, "video: " + seconds_text(declared) +
                                                  " s is longer than the limit of " +
                                                  seconds_text(limits.max_seconds) + " s");
  const std::int64_t start = vs->start_time != AV_NOPTS_VALUE ? vs->start_time : 0;
  const int ai =
      sampling.audio ? av_find_best_stream(fmt, AVMEDIA_TYPE_AUDIO, -1, vi, nullptr, 0) : -1;
  if (ai >= 0 && !audio_codec_allowed(fmt->streams[ai]->codecpar->codec_id))
    return make_error(errc::invalid_argument,
                      std::string("video: audio codec ") +
                          avcodec_get_name(fmt->streams[ai]->codecpar->codec_id) +
                          " is not supported (aac, mp3, opus, vorbis, flac, pcm)");
  std::unique_ptr<AVPacket, packet_closer> pkt(av_packet_alloc());
  if (!pkt) return make_error(errc::out_of_memory, "video: no memory for a packet");
  std::int64_t packets = 0, last_end = 0;
  for (int e; (e = av_read_frame(fmt, pkt.get())) != AVERROR_EOF; av_packet_unref(pkt.get())) {
    if (e < 0) {
      if (packets > 0) break;  // a file cut short: the packets before the cut
      return make_error(errc::corrupt_data, "video: demuxing failed (" + av_text(e) + ")");
    }
    if (pkt->stream_index != vi) continue;
    if (++packets > limits.max_frames_in_file)
      return make_error(
          errc::invalid_argument,
          "video: more than " + std::to_string(limits.max_frames_in_file) + " frames");
    if (pkt->pts != AV_NOPTS_VALUE) last_end = std::max(last_end, pkt->pts + pkt->duration - start);
  }
  pkt.reset(av_packet_alloc());
  if (!pkt) return make_error(errc::out_of_memory, "video: no memory for a packet");
  if (packets == 0) return make_error(errc::corrupt_data, "video: the video stream holds no frame");
  const double measured = static_cast<double>(last_end) * tb;
  out.seconds = declared > 0 ? declared : measured;
  if (measured > limits.max_seconds)
    return make_error(errc::invalid_argument, "video: " + seconds_text(measured) +
                                                  " s is longer than the limit of " +
                                                  seconds_text(limits.max_seconds) + " s");
  out.frames_in_file = packets;
  out.fps = vs->avg_frame_rate.den > 0 ? av_q2d(vs->avg_frame_rate)
                                       : (out.seconds > 0 ? packets / out.seconds : 0.0);
  const auto wanted = sample_frames(packets, out.seconds, sampling);
  first->reset();
  if (what != reading::whole) out.index = wanted;
  if (what == reading::probe) return out;
  const bool frames_too = what == reading::whole;

  // Pass 2: decode in order, keeping the wanted frames (and the audio).
  auto second = open_input(bytes, demuxer);
  if (!second) return std::unexpected(second.error());
  fmt = (*second)->fmt.get();
  if (vi >= static_cast<int>(fmt->nb_streams) ||
      (ai >= 0 && ai >= static_cast<int>(fmt->nb_streams)))
    return make_error(errc::corrupt_data, "video: the streams changed between two reads");
  auto vdec = open_decoder(fmt->streams[vi]);
  if (!vdec) return std::unexpected(vdec.error());
  std::unique_ptr<AVCodecContext, codec_closer> adec;
  if (ai >= 0) {
    auto a = open_decoder(fmt->streams[ai]);
    if (!a) return std::unexpected(a.error());
    adec = std::move(*a);
  }
  std::unique_ptr<AVFrame, frame_closer> frame(av_frame_alloc());
  if (!frame) return make_error(errc::out_of_memory, "video: no memory for a frame");
  std::unique_ptr<SwsContext, sws_closer> sws;
  std::int64_t decoded = 0;
  std::size_t next = 0;
  std::vector<float> sound;
  int sound_rate = 0;
  // The track may not outlast the duration limit (one second of slack).
  auto sound_limit = [&] {
    return static_cast<std::size_t>((limits.max_seconds + 1) * sound_rate);
  };
  auto take_video = [&]() -> result<void> {
    for (;;) {
      const int e = avcodec_receive_frame(vdec->get(), frame.get());
      if (e == AVERROR(EAGAIN) || e == AVERROR_EOF) return {};
      if (e < 0)
        return make_error(errc::corrupt_data, "video: decoding failed (" + av_text(e) + ")");
      const std::int64_t k = decoded++;
      if (next < wanted.size() && k == wanted[next]) {
        const int w = frame->width, h = frame->height;
        if (w < 1 || h < 1 || w > limits.max_side || h > limits.max_side ||
            std::int64_t{w} * h > limits.max_pixels)
          return make_error(errc::invalid_argument, "video: frame " + std::to_string(k) + " is " +
                                                        std::to_string(w) + "x" +
                                                        std::to_string(h) + ", beyond the limit");
        sws.reset(sws_getCachedContext(
            sws.release(), w, h, static_cast<AVPixelFormat>(frame->format), w, h, AV_PIX_FMT_RGB24,
            SWS_BICUBIC | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT, nullptr, nullptr, nullptr));
        if (!sws)
          return make_error(errc::invalid_argument,
                            std::string("video: pixel format ") +
                                av_get_pix_fmt_name(static_cast<AVPixelFormat>(frame->format)) +
                                " cannot be converted");
        image img;
        img.width = w;
        img.height = h;
        img.rgb.resize(static_cast<std::size_t>(w) * static_cast<std::size_t>(h) * 3);
        std::uint8_t* dst[4] = {img.rgb.data(), nullptr, nullptr, nullptr};
        int stride[4] = {w * 3, 0, 0, 0};
        sws_scale(sws.get(), frame->data, frame->linesize, 0, h, dst, stride);
        const std::int64_t pts =
            frame->best_effort_timestamp != AV_NOPTS_VALUE ? frame->best_effort_timestamp : start;
        out.frames.push_back(std::move(img));
        out.times.push_back(static_cast<double>(pts - start) * tb);
        out.index.push_back(k);
        ++next;
      }
      av_frame_unref(frame.get());
    }
  };
  auto take_audio = [&]() -> result<void> {
    for (;;) {
      const int e = avcodec_receive_frame(adec.get(), frame.get());
      if (e == AVERROR(EAGAIN) || e == AVERROR_EOF) return {};
      if (e < 0)
        return make_error(errc::corrupt_data, "video: audio decoding failed (" + av_text(e) + ")");
      if (sound_rate == 0) sound_rate = frame->sample_rate;
      if (frame->sample_rate != sound_rate || sound_rate < 1000 || sound_rate > 192000)
        return make_error(errc::corrupt_data, "video: the audio track's sample rate is not usable");
      if (!append_mono(frame.get(), sound))
        return make_error(errc::corrupt_data, "video: the audio track holds unusable samples");
      if (sound.size() > sound_limit())
        return make_error(errc::invalid_argument,
                          "video: the audio track is longer than the limit");
      av_frame_unref(frame.get());
    }
  };
  for (int e; (e = av_read_frame(fmt, pkt.get())) != AVERROR_EOF; av_packet_unref(pkt.get())) {
    if (e < 0) break;  // cut short: what came before
    if (pkt->stream_index == vi && frames_too && next < wanted.size()) {
      if (avcodec_send_packet(vdec->get(), pkt.get()) < 0) continue;  // a damaged packet is skipped
      if (auto r = take_video(); !r) return std::unexpected(r.error());
    } else if (adec && pkt->stream_index == ai) {
      if (avcodec_send_packet(adec.get(), pkt.get()) < 0) continue;
      if (auto r = take_audio(); !r) return std::unexpected(r.error());
    }
    if ((next >= wanted.size() || !frames_too) && !adec) break;
  }
  if (frames_too && next < wanted.size()) {
    avcodec_send_packet(vdec->get(), nullptr);  // the frames the decoder still holds
    if (auto r = take_video(); !r) return std::unexpected(r.error());
  }
  if (adec) {
    avcodec_send_packet(adec.get(), nullptr);
    if (auto r = take_audio(); !r) return std::unexpected(r.error());
  }
  if (frames_too && out.frames.empty())
    return make_error(errc::corrupt_data,
                      "video: no frame could be decoded (" + std::to_string(decoded) + " tried)");
  if (adec && !sound.empty()) {
    auto r = resample(sound, sound_rate, 16000);
    if (!r) return std::unexpected(r.error());
    out.sound.samples = std::move(*r);
    out.sound.sample_rate = 16000;
    out.sound.source_rate = sound_rate;
    out.sound.source_channels = fmt->streams[ai]->codecpar->ch_layout.nb_channels;
    out.sound.format = avcodec_get_name(fmt->streams[ai]->codecpar->codec_id);
  }
  return out;
}

}  // namespace

result<video> decode_video(std::span<const std::uint8_t> bytes, const video_sampling& sampling,
                           const video_limits& limits) {
  return read_video(bytes, sampling, limits, reading::whole);
}

result<video> probe_video_sound(std::span<const std::uint8_t> bytes, const video_sampling& sampling,
                                const video_limits& limits) {
  auto s = sampling;
  s.audio = true;
  return read_video(bytes, s, limits, reading::sound);
}

result<video> probe_video(std::span<const std::uint8_t> bytes, const video_sampling& sampling,
                          const video_limits& limits) {
  return read_video(bytes, sampling, limits, reading::probe);
}

result<video> load_video(const std::string& path, const video_sampling& sampling,
                         const video_limits& limits) {
  auto bytes = read_file_bytes(path, limits.max_bytes);
  if (!bytes) return std::unexpected(bytes.error());
  auto v = decode_video(*bytes, sampling, limits);
  if (!v) return make_error(v.error().code, path + ": " + v.error().message);
  return v;
}

}  // namespace troupe::models
