// Hostile images and preprocessor configs: every one must give a clear
// error, never a crash, an abort from libpng/libjpeg, or a large allocation
// (this suite also runs under ASan+UBSan).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <random>
#include <string>
#include <vector>

#include "../temp_path.hpp"
#include "image_test_util.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::test::make_png;
using troupe::test::png_ihdr;
using troupe::test::put_chunk;
using troupe::test::read_bytes;

// The largest single operator-new request while `track_allocations` is set:
// checks that a huge header is refused before any pixel buffer exists. The
// replacement new/delete pair is malloc/free, which g++ cannot see through.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
namespace {
std::atomic<bool> track_allocations{false};
std::atomic<std::size_t> largest_allocation{0};
}  // namespace

void* operator new(std::size_t n) {
  if (track_allocations.load(std::memory_order_relaxed)) {
    std::size_t cur = largest_allocation.load();
    while (n > cur && !largest_allocation.compare_exchange_weak(cur, n)) {
    }
  }
  if (void* p = std::malloc(n == 0 ? 1 : n)) {
    return p;
  }
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}

namespace {

const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/images";

// Expects an error whose message contains every one of `parts`.
void expect_error(const result<image>& r, std::initializer_list<std::string> parts,
                  const std::string& what) {
  ASSERT_FALSE(r) << what << ": decoded a " << r->width << "x" << r->height << " image";
  for (const auto& p : parts) {
    EXPECT_NE(r.error().message.find(p), std::string::npos) << what << ": " << r.error().message;
  }
}

std::vector<std::uint8_t> png_with_ihdr(std::uint32_t w, std::uint32_t h) {
  std::vector<std::uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  put_chunk(out, "IHDR", png_ihdr(w, h, 2, 8));
  put_chunk(out, "IDAT", troupe::test::zlib_stored({0, 1, 2, 3}));
  put_chunk(out, "IEND", {});
  return out;
}

// Offset of the JPEG SOFn marker's height field.
std::size_t jpeg_sof_dims(const std::vector<std::uint8_t>& j) {
  for (std::size_t i = 2; i + 9 < j.size(); ++i) {
    if (j[i] == 0xff && (j[i + 1] == 0xc0 || j[i + 1] == 0xc2)) {
      return i + 5;
    }
  }
  return 0;
}

}  // namespace

TEST(ImageValidation, EmptyAndUnknownFormats) {
  expect_error(decode_image({}), {"empty"}, "empty");
  const std::string gif("GIF89a\x02\x00\x02\x00", 10);
  expect_error(decode_image({reinterpret_cast<const std::uint8_t*>(gif.data()), gif.size()}),
               {"unrecognized image format", "GIF", "47 49 46 38", "PNG and JPEG"}, "gif");
  const std::string bmp("BM\x36\x00\x00\x00", 6);
  expect_error(decode_image({reinterpret_cast<const std::uint8_t*>(bmp.data()), bmp.size()}),
               {"BMP"}, "bmp");
  const std::string webp("RIFF\x10\x00\x00\x00WEBPVP8 ", 16);
  expect_error(decode_image({reinterpret_cast<const std::uint8_t*>(webp.data()), webp.size()}),
               {"WebP"}, "webp");
  const std::string text = "hello, world";
  expect_error(decode_image({reinterpret_cast<const std::uint8_t*>(text.data()), text.size()}),
               {"unrecognized image format", "68 65 6c 6c"}, "text");
  const std::uint8_t one[] = {0xff};
  expect_error(decode_image(one), {"unrecognized"}, "one byte");
}

TEST(ImageValidation, TruncatedPngAtEveryStage) {
  const auto png = read_bytes(dir + "/shapes_97x61.png");
  ASSERT_GT(png.size(), 100u);
  const std::size_t n = png.size();
  for (std::size_t cut : {std::size_t{1}, std::size_t{4}, std::size_t{7}, std::size_t{8},
                          std::size_t{12}, std::size_t{20}, std::size_t{24}, std::size_t{33},
                          std::size_t{41}, n / 2, n - 13, n - 12, n - 4, n - 1}) {
    expect_error(decode_image({png.data(), cut}), {"PNG", "truncated"},
                 "cut at " + std::to_string(cut));
  }
  const auto interlaced = read_bytes(dir + "/interlaced_45x31.png");
  expect_error(decode_image({interlaced.data(), interlaced.size() / 2}), {"PNG", "truncated"},
               "interlaced");
}

TEST(ImageValidation, TruncatedJpegAtEveryStage) {
  for (const char* name : {"photo_80x120.jpg", "progressive_96x64.jpg", "gray_60x40.jpg"}) {
    const auto jpg = read_bytes(dir + "/" + name);
    ASSERT_GT(jpg.size(), 300u);
    const std::size_t n = jpg.size();
    for (std::size_t cut : {std::size_t{3}, std::size_t{4}, std::size_t{20}, std::size_t{100},
                            std::size_t{250}, n / 2, n - 100, n - 2, n - 1}) {
      const auto r = decode_image({jpg.data(), cut});
      expect_error(r, {"JPEG"}, std::string(name) + " cut at " + std::to_string(cut));
      if (!r) {
        const auto& m = r.error().message;
        EXPECT_TRUE(m.find("truncated") != std::string::npos ||
                    m.find("corrupt") != std::string::npos)
            << m;
      }
    }
  }
  // Cut inside the entropy-coded data: libjpeg-turbo would fill gray and warn.
  const auto jpg = read_bytes(dir + "/photo_80x120.jpg");
  expect_error(decode_image({jpg.data(), jpg.size() - 200}),
               {"JPEG: truncated data", "Premature end"}, "scan");
}

TEST(ImageValidation, CorruptPng) {
  auto png = read_bytes(dir + "/shapes_97x61.png");
  auto ihdr = png;
  ihdr[18] ^= 0x01;  // width byte: CRC no longer matches (width stays valid)
  expect_error(decode_image(ihdr), {"PNG", "CRC"}, "IHDR crc");
  auto data = png;
  data[png.size() / 2] ^= 0x55;  // inside IDAT
  expect_error(decode_image(data), {"PNG: corrupt data"}, "IDAT byte");
  // Valid chunks around a broken zlib stream, and too little image data.
  std::vector<std::uint8_t> bad = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  put_chunk(bad, "IHDR", png_ihdr(4, 4, 2, 8));
  put_chunk(bad, "IDAT", {0x78, 0x01, 0xff, 0xff, 0xff, 0xff});
  put_chunk(bad, "IEND", {});
  expect_error(decode_image(bad), {"PNG: corrupt data"}, "zlib");
  expect_error(decode_image(make_png(4, 4, 2, 8, {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}})),
               {"PNG: corrupt data"}, "short IDAT");
  // Bad bit depth for the color type, unknown color type, bad filter byte.
  expect_error(decode_image(make_png(2, 2, 2, 4, {{0, 0}, {0, 0}})), {"PNG: corrupt data"},
               "rgb depth 4");
  expect_error(decode_image(make_png(2, 2, 5, 8, {{0, 0}, {0, 0}})), {"PNG: corrupt data"},
               "color type 5");
  expect_error(decode_image(make_png(2, 2, 0, 8, {{9, 0, 0}, {0, 0, 0}})), {"PNG: corrupt data"},
               "filter 9");
  // Palette image without PLTE.
  expect_error(decode_image(make_png(2, 2, 3, 8, {{0, 0, 0}, {0, 0, 0}})), {"PNG: corrupt data"},
               "no PLTE");
}

TEST(ImageValidation, PngSizesCheckedBeforeDecoding) {
  expect_error(decode_image(png_with_ihdr(0, 5)), {"PNG", "zero size", "0x5"}, "zero width");
  expect_error(decode_image(png_with_ihdr(7, 0)), {"PNG", "zero size"}, "zero height");
  expect_error(decode_image(make_png(1, 1, 2, 8, {{0, 1, 2, 3}})),
               {"image too small: 1x1, minimum 2x2"}, "1x1");
  expect_error(decode_image(make_png(1, 3, 0, 8, {{0, 1}, {0, 1}, {0, 1}})),
               {"image too small: 1x3"}, "1x3");
  track_allocations = true;
  largest_allocation = 0;
  const auto huge = decode_image(png_with_ihdr(100000, 100000));
  const auto many = decode_image(png_with_ihdr(16000, 16000));
  track_allocations = false;
  expect_error(huge, {"PNG", "image too large: 100000x100000", "16384"}, "100000^2");
  expect_error(many, {"image too large: 16000x16000 is 256000000 pixels"}, "16000^2");
  EXPECT_LT(largest_allocation.load(), std::size_t{1} << 20) << "a refused header allocated pixels";
  // Limits are the caller's: a 2x2 image with min_side 3, 4x4 with max_pixels 15.
  image_limits strict;
  strict.min_side = 3;
  expect_error(decode_image(make_png(2, 2, 0, 8, {{0, 1, 2}, {0, 3, 4}}), strict), {"minimum 3x3"},
               "min_side");
  strict.max_pixels = 15;
  std::vector<std::vector<std::uint8_t>> rows(4, std::vector<std::uint8_t>(5, 0));
  expect_error(decode_image(make_png(4, 4, 0, 8, rows), strict), {"16 pixels, the limit is 15"},
               "max_pixels");
}

TEST(ImageValidation, JpegSizesCheckedBeforeDecoding) {
  const auto jpg = read_bytes(dir + "/photo_80x120.jpg");
  const std::size_t at = jpeg_sof_dims(jpg);
  ASSERT_GT(at, 0u);
  auto with_dims = [&](int w, int h) {
    auto j = jpg;
    j[at] = static_cast<std::uint8_t>(h >> 8);
    j[at + 1] = static_cast<std::uint8_t>(h);
    j[at + 2] = static_cast<std::uint8_t>(w >> 8);
    j[at + 3] = static_cast<std::uint8_t>(w);
    return j;
  };
  expect_error(decode_image(with_dims(1, 1)), {"JPEG", "image too small: 1x1, minimum 2x2"}, "1x1");
  expect_error(decode_image(with_dims(80, 0)), {"JPEG", "zero size"}, "height 0");
  expect_error(decode_image(with_dims(0, 80)), {"JPEG"}, "width 0");
  track_allocations = true;
  largest_allocation = 0;
  const auto huge = decode_image(with_dims(65000, 65000));
  track_allocations = false;
  expect_error(huge, {"JPEG", "image too large: 65000x65000"}, "65000^2");
  EXPECT_LT(largest_allocation.load(), std::size_t{1} << 20);
}

TEST(ImageValidation, CorruptJpeg) {
  const auto jpg = read_bytes(dir + "/photo_80x120.jpg");
  const std::size_t at = jpeg_sof_dims(jpg);
  auto precision = jpg;
  precision[at - 1] = 7;  // sample precision
  expect_error(decode_image(precision), {"JPEG: corrupt data", "precision 7"}, "precision");
  // An EOI marker in the middle of the scan: data ends early.
  auto eoi = jpg;
  eoi[eoi.size() / 2] = 0xff;
  eoi[eoi.size() / 2 + 1] = 0xd9;
  expect_error(decode_image(eoi), {"JPEG"}, "early EOI");
  // A marker other than SOI/JFIF first, and a header with no frame.
  const std::vector<std::uint8_t> no_frame = {0xff, 0xd8, 0xff, 0xd9};
  expect_error(decode_image(no_frame), {"JPEG: corrupt data"}, "no frame");
  // Too many progressive scans for the caller's limit.
  const auto prog = read_bytes(dir + "/progressive_96x64.jpg");
  image_limits few;
  few.max_jpeg_scans = 2;
  expect_error(decode_image(prog, few), {"JPEG", "more than 2 scans"}, "scans");
  EXPECT_TRUE(decode_image(prog));
}

TEST(ImageValidation, RandomCorruptionNeverCrashes) {
  // Flip, zero or cut bytes of every committed image; anything may decode
  // or fail, but only with a message, and a decoded image is well formed.
  std::mt19937 rng(1234);
  int failed = 0, decoded = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const auto ext = e.path().extension();
    if (ext != ".png" && ext != ".jpg") {
      continue;
    }
    const auto bytes = read_bytes(e.path().string());
    for (int round = 0; round < 40; ++round) {
      auto b = bytes;
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int k = 0; k < edits; ++k) {
        const std::size_t i = rng() % b.size();
        switch (rng() % 3) {
          case 0:
            b[i] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
            break;
          case 1:
            b[i] = static_cast<std::uint8_t>(rng());
            break;
          default:
            b.resize(std::max<std::size_t>(i, 1));
            break;
        }
      }
      auto r = decode_image(b);
      if (r) {
        ++decoded;
        ASSERT_EQ(r->rgb.size(), static_cast<std::size_t>(r->width) * r->height * 3);
      } else {
        ++failed;
        EXPECT_FALSE(r.error().message.empty());
      }
    }
  }
  EXPECT_GT(failed, 100);
}

TEST(ImageValidation, Files) {
  expect_error(load_image("/nonexistent/x.png"), {"/nonexistent/x.png"}, "missing");
  expect_error(load_image(dir), {dir}, "directory");
  const std::string empty = test::temp_path("empty.png");
  { std::ofstream(empty).flush(); }
  expect_error(load_image(empty), {empty, "empty"}, "empty file");
  std::filesystem::remove(empty);
  image_limits small;
  small.max_file_bytes = 100;
  expect_error(load_image(dir + "/shapes_97x61.png", small),
               {"shapes_97x61.png", "larger than the image file limit"}, "file limit");
  // Errors from the decoder carry the path.
  const std::string cut = test::temp_path("cut.jpg");
  {
    const auto jpg = read_bytes(dir + "/photo_80x120.jpg");
    std::ofstream(cut, std::ios::binary).write(reinterpret_cast<const char*>(jpg.data()), 500);
  }
  expect_error(load_image(cut), {cut + ": JPEG: truncated data"}, "cut file");
  std::filesystem::remove(cut);
}

TEST(ImageValidation, PreprocessRefusesOversizedSteps) {
  image im;
  im.width = 16384;
  im.height = 2;
  im.rgb.assign(static_cast<std::size_t>(im.width) * 2 * 3, 7);
  image_processor_config c;
  c.shortest_edge = 336;  // 336 x 2752512 pixels
  auto r = preprocess_image(im, c);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("resize"), std::string::npos) << r.error().message;
  c.pad_to_square = true;  // 16384^2 pixels
  r = preprocess_image(im, c);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("pad to square"), std::string::npos) << r.error().message;

  image broken;
  broken.width = 4;
  broken.height = 4;
  broken.rgb.resize(10);
  auto b = preprocess_image(broken, image_processor_config{});
  ASSERT_FALSE(b);
  EXPECT_NE(b.error().message.find("not RGB8"), std::string::npos) << b.error().message;
  EXPECT_FALSE(resize_image(broken, 2, 2, resample_filter::bicubic));
  image ok;
  ok.width = ok.height = 2;
  ok.rgb.assign(12, 1);
  EXPECT_FALSE(resize_image(ok, 0, 2, resample_filter::bicubic));
  EXPECT_FALSE(center_crop(ok, -1, 2));
  EXPECT_FALSE(center_crop(ok, 1 << 20, 1 << 20));
}

TEST(ImageValidation, BadPreprocessorConfigsNameTheKey) {
  struct bad {
    std::string text;
    std::string part;
  };
  const bad cases[] = {
      {"not json", "not valid JSON"},
      {"[1, 2]", "JSON object"},
      {R"({"do_resize": "yes"})", "do_resize"},
      {R"({"do_center_crop": 1})", "do_center_crop"},
      {R"({"do_normalize": null})", "do_normalize"},
      {R"({"size": 0})", "size"},
      {R"({"size": -5})", "size"},
      {R"({"size": 1e9})", "size"},
      {R"({"size": "224"})", "size"},
      {R"({"size": [224]})", "size"},
      {R"({"size": {"height": 224}})", "size"},
      {R"({"size": {"shortest_edge": 224, "width": 3}})", "size"},
      {R"({"size": {"longest_edge": 224}})", "size"},
      {R"({"size": {"max_height": 224, "max_width": 224}})", "size"},
      {R"({"size": {"height": 224, "width": 100000}})", "size.width"},
      {R"({"crop_size": {"shortest_edge": 224}})", "crop_size"},
      {R"({"crop_size": [0, 3]})", "crop_size[0]"},
      {R"({"resample": 1})", "resample 1 (lanczos) is not supported"},
      {R"({"resample": 0})", "nearest"},
      {R"({"resample": 9})", "resample"},
      {R"({"resample": "bicubic"})", "resample"},
      {R"({"rescale_factor": 0})", "rescale_factor"},
      {R"({"rescale_factor": "1/255"})", "rescale_factor"},
      {R"({"image_mean": [0.5, 0.5]})", "image_mean"},
      {R"({"image_mean": ["a", 0.5, 0.5]})", "image_mean"},
      {R"({"image_std": [0.5, 0, 0.5]})", "image_std"},
      {R"({"image_std": -1})", "image_std"},
      {R"({"image_aspect_ratio": "anyres"})", "image_aspect_ratio"},
      {R"({"image_aspect_ratio": 1})", "image_aspect_ratio"},
      {R"({"image_aspect_ratio": "pad", "image_mean": [2, 0.5, 0.5]})", "image_mean"},
      {R"({"image_processor_type": "Idefics3ImageProcessor"})", "Idefics3ImageProcessor"},
      {R"({"image_processor_type": 3})", "image_processor_type"},
  };
  for (const auto& c : cases) {
    auto r = parse_image_processor_config(c.text, "preprocessor_config.json");
    ASSERT_FALSE(r) << c.text;
    EXPECT_NE(r.error().message.find(c.part), std::string::npos)
        << c.text << " -> " << r.error().message;
    EXPECT_NE(r.error().message.find("preprocessor_config.json"), std::string::npos)
        << r.error().message;
  }
  EXPECT_FALSE(load_image_processor_config("/nonexistent/preprocessor_config.json"));
  EXPECT_FALSE(load_image_processor_config("/nonexistent"));
}
