#include "models/image.hpp"

// libpng and libjpeg report errors through callbacks that must not return;
// ours longjmp back to the decode function. Every setjmp lives in a small
// function (png_run, jpeg_run) where no object with a destructor is alive
// across a library call, and all state (buffers, messages, the library
// handles) lives in a struct owned by the caller, so a longjmp never skips
// a destructor or reads a clobbered local.
#include <png.h>

#include <algorithm>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <new>
#include <optional>
#include <string_view>

#include <jerror.h>
#include <jpeglib.h>

namespace troupe::models {

namespace {

constexpr std::uint8_t png_signature[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

std::string dims(std::int64_t w, std::int64_t h) {
  return std::to_string(w) + "x" + std::to_string(h);
}

// The header check shared by both formats; `what` prefixes the message.
result<void> check_dimensions(const char* what, std::int64_t w, std::int64_t h,
                              const image_limits& limits) {
  const std::string prefix = std::string(what) + ": ";
  if (w <= 0 || h <= 0) {
    return make_error(errc::corrupt_data, prefix + "image has zero size: " + dims(w, h));
  }
  if (w < limits.min_side || h < limits.min_side) {
    return make_error(errc::invalid_argument, prefix + "image too small: " + dims(w, h) +
                                                  ", minimum " +
                                                  dims(limits.min_side, limits.min_side));
  }
  if (w > limits.max_side || h > limits.max_side) {
    return make_error(errc::invalid_argument,
                      prefix + "image too large: " + dims(w, h) + ", the limit is " +
                          std::to_string(limits.max_side) + " pixels per side");
  }
  if (w * h > limits.max_pixels) {
    return make_error(errc::invalid_argument, prefix + "image too large: " + dims(w, h) + " is " +
                                                  std::to_string(w * h) + " pixels, the limit is " +
                                                  std::to_string(limits.max_pixels));
  }
  return {};
}

std::string describe_unknown(std::span<const std::uint8_t> b) {
  auto starts = [&](std::string_view magic, std::size_t at = 0) {
    return b.size() >= at + magic.size() &&
           std::memcmp(b.data() + at, magic.data(), magic.size()) == 0;
  };
  std::string kind;
  if (starts("GIF87a") || starts("GIF89a")) {
    kind = "GIF";
  } else if (starts("BM")) {
    kind = "BMP";
  } else if (starts("RIFF") && starts("WEBP", 8)) {
    kind = "WebP";
  } else if (starts(std::string_view("II*\0", 4)) || starts(std::string_view("MM\0*", 4))) {
    kind = "TIFF";
  } else if (starts("ftyp", 4)) {
    kind = "HEIF/AVIF";
  } else if (starts("qoif")) {
    kind = "QOI";
  } else if (starts("%PDF")) {
    kind = "PDF";
  } else if (starts(std::string_view("\0\0\0\x0cjP", 6))) {
    kind = "JPEG 2000";
  }
  char hex[8 * 3 + 1] = {};
  const std::size_t n = std::min<std::size_t>(b.size(), 8);
  for (std::size_t i = 0; i < n; ++i) {
    std::snprintf(hex + i * 3, 4, i + 1 < n ? "%02x " : "%02x", b[i]);
  }
  std::string out = "unrecognized image format";
  if (!kind.empty()) {
    out += " (looks like " + kind + ")";
  }
  return out + ": first bytes " + hex + "; only PNG and JPEG are supported";
}

// ---------------------------------------------------------------- PNG

struct png_state {
  std::span<const std::uint8_t> bytes;
  std::size_t pos = 0;
  png_structp png = nullptr;
  png_infop info = nullptr;
  const image_limits* limits = nullptr;
  char message[256] = {};
  bool truncated = false;
  std::optional<error> failure;  // set by png_run for non-library errors
  int channels = 0;
  int width = 0;
  int height = 0;
  std::vector<std::uint8_t> pixels;
  std::vector<png_bytep> rows;

  ~png_state() {
    if (png != nullptr) {
      png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr);
    }
  }
};

void png_on_error(png_structp png, png_const_charp msg) {
  auto* s = static_cast<png_state*>(png_get_error_ptr(png));
  std::snprintf(s->message, sizeof s->message, "%s", msg != nullptr ? msg : "unknown error");
  png_longjmp(png, 1);
}

void png_on_warning(png_structp, png_const_charp) {}  // benign: ignored, as PIL does

void png_on_read(png_structp png, png_bytep out, std::size_t n) {
  auto* s = static_cast<png_state*>(png_get_io_ptr(png));
  if (n > s->bytes.size() - s->pos) {
    s->truncated = true;
    png_error(png, "unexpected end of data");
  }
  std::memcpy(out, s->bytes.data() + s->pos, n);
  s->pos += n;
}

// Returns false on any error (message in `s`). Only trivially destructible
// locals: a longjmp lands here.
bool png_run(png_state& s) {
  if (setjmp(png_jmpbuf(s.png))) {
    return false;
  }
  png_set_read_fn(s.png, &s, png_on_read);
  png_read_info(s.png, s.info);
  const png_uint_32 w = png_get_image_width(s.png, s.info);
  const png_uint_32 h = png_get_image_height(s.png, s.info);
  if (auto ok = check_dimensions("PNG", w, h, *s.limits); !ok) {
    s.failure = ok.error();
    return false;
  }
  const int depth = png_get_bit_depth(s.png, s.info);
  const int color = png_get_color_type(s.png, s.info);
  if (depth == 16) {
    png_set_strip_16(s.png);  // high byte, as PIL's ";16B" raw modes
  }
  if (color == PNG_COLOR_TYPE_PALETTE) {
    png_set_palette_to_rgb(s.png);
  }
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) {
    png_set_expand_gray_1_2_4_to_8(s.png);
  }
  png_set_interlace_handling(s.png);
  png_read_update_info(s.png, s.info);
  s.channels = png_get_channels(s.png, s.info);
  s.width = static_cast<int>(w);
  s.height = static_cast<int>(h);
  const std::size_t row_bytes = png_get_rowbytes(s.png, s.info);
  if (png_get_bit_depth(s.png, s.info) != 8 || s.channels < 1 || s.channels > 4 ||
      row_bytes != std::size_t{w} * static_cast<std::size_t>(s.channels)) {
    s.failure = error{errc::internal, "PNG: unexpected row layout after conversion"};
    return false;
  }
  try {
    s.pixels.resize(row_bytes * h);
    s.rows.resize(h);
  } catch (const std::bad_alloc&) {
    s.failure = error{errc::out_of_memory, "PNG: out of memory for " + dims(w, h)};
    return false;
  }
  for (png_uint_32 y = 0; y < h; ++y) {
    s.rows[y] = s.pixels.data() + row_bytes * y;
  }
  png_read_image(s.png, s.rows.data());
  png_read_end(s.png, nullptr);
  return true;
}

result<image> decode_png(std::span<const std::uint8_t> bytes, const image_limits& limits) {
  if (bytes.size() < 8) {
    return make_error(errc::corrupt_data, "PNG: truncated data (the file ends after " +
                                              std::to_string(bytes.size()) + " bytes)");
  }
  // Check the IHDR dimensions before libpng sees the file.
  if (bytes.size() >= 24 && std::memcmp(bytes.data() + 12, "IHDR", 4) == 0) {
    auto be32 = [&](std::size_t at) {
      return (std::uint32_t{bytes[at]} << 24) | (std::uint32_t{bytes[at + 1]} << 16) |
             (std::uint32_t{bytes[at + 2]} << 8) | std::uint32_t{bytes[at + 3]};
    };
    if (auto ok = check_dimensions("PNG", be32(16), be32(20), limits); !ok) {
      return std::unexpected(ok.error());
    }
  }
  png_state s;
  s.bytes = bytes;
  s.limits = &limits;
  s.png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &s, png_on_error, png_on_warning);
  if (s.png == nullptr) {
    return make_error(errc::out_of_memory, "PNG: cannot create the decoder");
  }
  s.info = png_create_info_struct(s.png);
  if (s.info == nullptr) {
    return make_error(errc::out_of_memory, "PNG: cannot create the decoder");
  }
  if (!png_run(s)) {
    if (s.failure) {
      return std::unexpected(*s.failure);
    }
    if (s.truncated) {
      return make_error(errc::corrupt_data, std::string("PNG: truncated data (") + s.message + ")");
    }
    return make_error(errc::corrupt_data, std::string("PNG: corrupt data: ") + s.message);
  }
  image out;
  out.width = s.width;
  out.height = s.height;
  const std::size_t n = static_cast<std::size_t>(s.width) * static_cast<std::size_t>(s.height);
  if (s.channels == 3) {
    out.rgb = std::move(s.pixels);
    return out;
  }
  out.rgb.resize(n * 3);
  const std::uint8_t* in = s.pixels.data();
  std::uint8_t* o = out.rgb.data();
  for (std::size_t i = 0; i < n; ++i, in += s.channels, o += 3) {
    if (s.channels <= 2) {  // gray, gray + alpha
      o[0] = o[1] = o[2] = in[0];
    } else {  // RGBA: alpha dropped, as PIL's convert("RGB")
      o[0] = in[0];
      o[1] = in[1];
      o[2] = in[2];
    }
  }
  return out;
}

// ---------------------------------------------------------------- JPEG

struct jpeg_state {
  jpeg_decompress_struct cinfo{};
  jpeg_error_mgr err{};
  jpeg_progress_mgr progress{};
  std::jmp_buf jump{};
  bool created = false;
  const image_limits* limits = nullptr;
  char message[JMSG_LENGTH_MAX + 64] = {};
  bool truncated = false;
  std::optional<error> failure;
  int components = 0;
  std::vector<std::uint8_t> pixels;

  ~jpeg_state() {
    if (created) {
      jpeg_destroy_decompress(&cinfo);
    }
  }
};

jpeg_state* state_of(j_common_ptr cinfo) {
  return static_cast<jpeg_state*>(cinfo->client_data);
}

void jpeg_on_error(j_common_ptr cinfo) {
  jpeg_state* s = state_of(cinfo);
  if (cinfo->err->msg_code == JERR_EMPTY_IMAGE) {
    std::snprintf(s->message, sizeof s->message,
                  "image has zero size (a 0 width or height in the frame header)");
  } else {
    (*cinfo->err->format_message)(cinfo, s->message);
  }
  std::longjmp(s->jump, 1);
}

// libjpeg-turbo only warns on corrupt or truncated data (and fills the
// missing pixels with gray); we refuse such images. Warnings that lose no
// pixel data (stray bytes between markers, a newer JFIF version) pass.
void jpeg_on_message(j_common_ptr cinfo, int level) {
  if (level >= 0) {
    return;  // trace messages
  }
  const int code = cinfo->err->msg_code;
  if (code == JWRN_EXTRANEOUS_DATA || code == JWRN_JFIF_MAJOR) {
    return;
  }
  jpeg_state* s = state_of(cinfo);
  s->truncated = code == JWRN_JPEG_EOF;
  (*cinfo->err->format_message)(cinfo, s->message);
  std::longjmp(s->jump, 1);
}

void jpeg_on_output(j_common_ptr) {}

void jpeg_on_progress(j_common_ptr cinfo) {
  jpeg_state* s = state_of(cinfo);
  if (s->cinfo.input_scan_number > s->limits->max_jpeg_scans) {
    std::snprintf(s->message, sizeof s->message, "more than %d scans", s->limits->max_jpeg_scans);
    std::longjmp(s->jump, 1);
  }
}

bool jpeg_run(jpeg_state& s, std::span<const std::uint8_t> bytes) {
  if (setjmp(s.jump)) {
    return false;
  }
  jpeg_create_decompress(&s.cinfo);
  s.created = true;
  s.cinfo.client_data = &s;
  s.cinfo.progress = &s.progress;
  // Progressive images keep all coefficients in memory: bound it.
  s.cinfo.mem->max_memory_to_use =
      static_cast<long>(s.limits->max_pixels * 16 + (std::int64_t{64} << 20));
  jpeg_mem_src(&s.cinfo, bytes.data(), static_cast<unsigned long>(bytes.size()));
  if (jpeg_read_header(&s.cinfo, TRUE) != JPEG_HEADER_OK) {
    s.failure = error{errc::corrupt_data, "JPEG: the file holds tables but no image"};
    return false;
  }
  if (auto ok = check_dimensions("JPEG", s.cinfo.image_width, s.cinfo.image_height, *s.limits);
      !ok) {
    s.failure = ok.error();
    return false;
  }
  switch (s.cinfo.jpeg_color_space) {
    case JCS_GRAYSCALE:
      s.cinfo.out_color_space = JCS_GRAYSCALE;
      break;
    case JCS_CMYK:
    case JCS_YCCK:
      s.cinfo.out_color_space = JCS_CMYK;
      break;
    default:
      s.cinfo.out_color_space = JCS_RGB;
      break;
  }
  jpeg_start_decompress(&s.cinfo);
  s.components = s.cinfo.output_components;
  const std::size_t w = s.cinfo.output_width;
  const std::size_t h = s.cinfo.output_height;
  if ((s.components != 1 && s.components != 3 && s.components != 4) || w != s.cinfo.image_width ||
      h != s.cinfo.image_height) {
    s.failure =
        error{errc::unsupported_op,
              "JPEG: unsupported layout (" + std::to_string(s.components) + " output components)"};
    return false;
  }
  const std::size_t row_bytes = w * static_cast<std::size_t>(s.components);
  try {
    s.pixels.resize(row_bytes * h);
  } catch (const std::bad_alloc&) {
    s.failure =
        error{errc::out_of_memory, "JPEG: out of memory for " + dims(static_cast<std::int64_t>(w),
                                                                     static_cast<std::int64_t>(h))};
    return false;
  }
  while (s.cinfo.output_scanline < h) {
    JSAMPROW row = s.pixels.data() + row_bytes * s.cinfo.output_scanline;
    if (jpeg_read_scanlines(&s.cinfo, &row, 1) != 1) {
      s.failure = error{errc::corrupt_data, "JPEG: decoder stopped early"};
      return false;
    }
  }
  jpeg_finish_decompress(&s.cinfo);
  return true;
}

result<image> decode_jpeg(std::span<const std::uint8_t> bytes, const image_limits& limits) {
  jpeg_state s;
  s.limits = &limits;
  s.cinfo.err = jpeg_std_error(&s.err);
  s.err.error_exit = jpeg_on_error;
  s.err.emit_message = jpeg_on_message;
  s.err.output_message = jpeg_on_output;
  s.progress.progress_monitor = jpeg_on_progress;
  s.cinfo.client_data = &s;
  if (!jpeg_run(s, bytes)) {
    if (s.failure) {
      return std::unexpected(*s.failure);
    }
    if (s.truncated) {
      return make_error(errc::corrupt_data,
                        std::string("JPEG: truncated data (") + s.message + ")");
    }
    // libjpeg's corrupt-data warnings already say "Corrupt JPEG data: ".
    std::string_view msg = s.message;
    if (msg.starts_with("Corrupt JPEG data: ")) {
      msg.remove_prefix(19);
    }
    return make_error(errc::corrupt_data, "JPEG: corrupt data: " + std::string(msg));
  }
  image out;
  out.width = static_cast<int>(s.cinfo.output_width);
  out.height = static_cast<int>(s.cinfo.output_height);
  const std::size_t n = static_cast<std::size_t>(out.width) * static_cast<std::size_t>(out.height);
  if (s.components == 3) {
    out.rgb = std::move(s.pixels);
    return out;
  }
  out.rgb.resize(n * 3);
  const std::uint8_t* in = s.pixels.data();
  std::uint8_t* o = out.rgb.data();
  if (s.components == 1) {
    for (std::size_t i = 0; i < n; ++i, o += 3) {
      o[0] = o[1] = o[2] = in[i];
    }
    return out;
  }
  // CMYK: PIL reads JPEG CMYK as Adobe-inverted ("CMYK;I") and converts
  // with rgb = clip(nk - c * nk / 255) where nk = 255 - k, its rounding.
  auto muldiv255 = [](int a, int b) {
    const int t = a * b + 128;
    return ((t >> 8) + t) >> 8;
  };
  for (std::size_t i = 0; i < n; ++i, in += 4, o += 3) {
    const int nk = in[3];  // 255 - (255 - raw k)
    for (int c = 0; c < 3; ++c) {
      o[c] = static_cast<std::uint8_t>(std::clamp(nk - muldiv255(255 - in[c], nk), 0, 255));
    }
  }
  return out;
}

}  // namespace

result<image> decode_image(std::span<const std::uint8_t> bytes, const image_limits& limits) {
  if (bytes.empty()) {
    return make_error(errc::corrupt_data, "empty image data (0 bytes)");
  }
  const std::size_t sig = std::min<std::size_t>(bytes.size(), sizeof png_signature);
  if (std::memcmp(bytes.data(), png_signature, sig) == 0) {
    return decode_png(bytes, limits);
  }
  if (bytes.size() >= 3 && bytes[0] == 0xff && bytes[1] == 0xd8 && bytes[2] == 0xff) {
    return decode_jpeg(bytes, limits);
  }
  return make_error(errc::unsupported_op, describe_unknown(bytes));
}

result<image> load_image(const std::string& path, const image_limits& limits) {
  auto file = mapped_file::open(path);
  if (!file) {
    return std::unexpected(file.error());
  }
  const auto raw = (*file)->bytes();
  if (raw.size() > limits.max_file_bytes) {
    return make_error(errc::invalid_argument, path + ": " + std::to_string(raw.size()) +
                                                  " bytes is larger than the image file limit of " +
                                                  std::to_string(limits.max_file_bytes));
  }
  auto img = decode_image({reinterpret_cast<const std::uint8_t*>(raw.data()), raw.size()}, limits);
  if (!img) {
    return make_error(img.error().code, path + ": " + img.error().message);
  }
  return img;
}

}  // namespace troupe::models
