// Image decoding and CLIP preprocessing: hand-built PNGs with known pixels,
// the resampler against a plain floating-point convolution, crop and pad
// geometry, and preprocessor_config.json parsing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "image_test_util.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::test::make_png;

namespace {

const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/images";

image pattern(int w, int h, unsigned seed) {
  image im;
  im.width = w;
  im.height = h;
  im.rgb.resize(static_cast<std::size_t>(w * h * 3));
  std::uint32_t s = seed;
  for (auto& v : im.rgb) {
    s = s * 1664525u + 1013904223u;
    v = static_cast<std::uint8_t>(s >> 24);
  }
  return im;
}

// A plain double-precision version of the same resampling (PIL's filter
// placement and support scaling, no fixed point, rounding at each pass).
double cubic(double x) {
  x = std::abs(x);
  if (x < 1) {
    return 1.5 * x * x * x - 2.5 * x * x + 1;
  }
  if (x < 2) {
    return -0.5 * x * x * x + 2.5 * x * x - 4 * x + 2;
  }
  return 0;
}

std::vector<double> resample_line(const std::vector<double>& in, int out_n) {
  const int n = static_cast<int>(in.size());
  const double scale = static_cast<double>(n) / out_n, fs = std::max(scale, 1.0);
  std::vector<double> out(static_cast<std::size_t>(out_n));
  for (int o = 0; o < out_n; ++o) {
    const double c = (o + 0.5) * scale;
    double sum = 0, wsum = 0;
    for (int i = 0; i < n; ++i) {
      const double w = cubic((i + 0.5 - c) / fs);
      sum += w * in[static_cast<std::size_t>(i)];
      wsum += w;
    }
    out[static_cast<std::size_t>(o)] = std::clamp(std::round(sum / wsum), 0.0, 255.0);
  }
  return out;
}

image reference_resize(const image& in, int w, int h) {
  std::vector<double> tmp(static_cast<std::size_t>(w * in.height * 3));
  for (int y = 0; y < in.height; ++y) {
    for (int c = 0; c < 3; ++c) {
      std::vector<double> line(static_cast<std::size_t>(in.width));
      for (int x = 0; x < in.width; ++x) {
        line[static_cast<std::size_t>(x)] =
            in.rgb[static_cast<std::size_t>((y * in.width + x) * 3 + c)];
      }
      const auto r = in.width == w ? line : resample_line(line, w);
      for (int x = 0; x < w; ++x) {
        tmp[static_cast<std::size_t>((y * w + x) * 3 + c)] = r[static_cast<std::size_t>(x)];
      }
    }
  }
  image out;
  out.width = w;
  out.height = h;
  out.rgb.resize(static_cast<std::size_t>(w * h * 3));
  for (int x = 0; x < w; ++x) {
    for (int c = 0; c < 3; ++c) {
      std::vector<double> line(static_cast<std::size_t>(in.height));
      for (int y = 0; y < in.height; ++y) {
        line[static_cast<std::size_t>(y)] = tmp[static_cast<std::size_t>((y * w + x) * 3 + c)];
      }
      const auto r = in.height == h ? line : resample_line(line, h);
      for (int y = 0; y < h; ++y) {
        out.rgb[static_cast<std::size_t>((y * w + x) * 3 + c)] =
            static_cast<std::uint8_t>(r[static_cast<std::size_t>(y)]);
      }
    }
  }
  return out;
}

}  // namespace

TEST(Image, DecodesHandBuiltPngs) {
  // 2x2 RGB, gray, gray+alpha, RGBA, 16-bit RGB and palette, pixels known.
  const std::vector<std::uint8_t> rgb = {255, 0, 0, 0, 255, 0, 0, 0, 255, 10, 20, 30};
  auto a =
      decode_image(make_png(2, 2, 2, 8, {{0, 255, 0, 0, 0, 255, 0}, {0, 0, 0, 255, 10, 20, 30}}));
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(a->width, 2);
  EXPECT_EQ(a->height, 2);
  EXPECT_EQ(a->rgb, rgb);

  auto g = decode_image(make_png(2, 2, 0, 8, {{0, 7, 200}, {0, 0, 255}}));
  ASSERT_TRUE(g) << g.error().message;
  EXPECT_EQ(g->rgb, (std::vector<std::uint8_t>{7, 7, 7, 200, 200, 200, 0, 0, 0, 255, 255, 255}));

  auto ga = decode_image(make_png(2, 2, 4, 8, {{0, 7, 0, 200, 9}, {0, 1, 255, 2, 128}}));
  ASSERT_TRUE(ga) << ga.error().message;
  EXPECT_EQ(ga->rgb, (std::vector<std::uint8_t>{7, 7, 7, 200, 200, 200, 1, 1, 1, 2, 2, 2}));

  // RGBA: alpha dropped, not composited (PIL's convert("RGB")).
  auto rgba = decode_image(make_png(
      2, 2, 6, 8, {{0, 255, 0, 0, 0, 0, 255, 0, 128}, {0, 0, 0, 255, 1, 10, 20, 30, 255}}));
  ASSERT_TRUE(rgba) << rgba.error().message;
  EXPECT_EQ(rgba->rgb, rgb);

  // 16-bit: the high byte of each sample.
  auto w16 = decode_image(make_png(2, 2, 2, 16,
                                   {{0, 255, 255, 0, 1, 0, 0, 0, 0, 255, 0, 0, 255},
                                    {0, 0, 0, 0, 0, 255, 255, 10, 99, 20, 0, 30, 255}}));
  ASSERT_TRUE(w16) << w16.error().message;
  EXPECT_EQ(w16->rgb, rgb);

  // 1-bit gray: 0 / 255.
  auto bits = decode_image(make_png(2, 2, 0, 1, {{0, 0x80}, {0, 0x40}}));
  ASSERT_TRUE(bits) << bits.error().message;
  EXPECT_EQ(bits->rgb, (std::vector<std::uint8_t>{255, 255, 255, 0, 0, 0, 0, 0, 0, 255, 255, 255}));

  // Palette (8-bit indices) with PLTE.
  auto pal =
      decode_image(make_png(2, 2, 3, 8, {{0, 1, 0}, {0, 2, 1}}, {9, 9, 9, 255, 0, 0, 0, 0, 255}));
  ASSERT_TRUE(pal) << pal.error().message;
  EXPECT_EQ(pal->rgb, (std::vector<std::uint8_t>{255, 0, 0, 9, 9, 9, 0, 0, 255, 255, 0, 0}));
}

TEST(Image, LoadMatchesDecodeOfTheSameBytes) {
  auto a = load_image(dir + "/shapes_97x61.png");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(a->width, 97);
  EXPECT_EQ(a->height, 61);
  EXPECT_EQ(a->rgb.size(), 97u * 61u * 3u);
  auto j = load_image(dir + "/photo_80x120.jpg");
  ASSERT_TRUE(j) << j.error().message;
  EXPECT_EQ(j->width, 80);
  EXPECT_EQ(j->height, 120);
}

TEST(Image, ResizeMatchesAPlainConvolution) {
  // Fixed point and per-pass rounding may move a value by a level or two.
  struct size_case {
    int w, h, ow, oh;
  };
  for (const auto& c :
       {size_case{37, 23, 64, 40}, size_case{97, 61, 30, 19}, size_case{64, 64, 64, 20},
        size_case{50, 9, 13, 9}, size_case{2, 2, 17, 5}, size_case{300, 7, 11, 60}}) {
    const image in = pattern(c.w, c.h, static_cast<unsigned>(c.w * 7 + c.h));
    auto got = resize_image(in, c.ow, c.oh, resample_filter::bicubic);
    ASSERT_TRUE(got) << got.error().message;
    ASSERT_EQ(got->width, c.ow);
    ASSERT_EQ(got->height, c.oh);
    const image want = reference_resize(in, c.ow, c.oh);
    int worst = 0;
    for (std::size_t i = 0; i < want.rgb.size(); ++i) {
      worst = std::max(worst, std::abs(int{got->rgb[i]} - int{want.rgb[i]}));
    }
    EXPECT_LE(worst, 2) << c.w << "x" << c.h << " -> " << c.ow << "x" << c.oh;
  }
}

TEST(Image, ResizeKeepsFlatImagesAndIdentity) {
  image flat;
  flat.width = 31;
  flat.height = 17;
  flat.rgb.assign(31 * 17 * 3, 0);
  for (std::size_t i = 0; i < flat.rgb.size(); i += 3) {
    flat.rgb[i] = 200;
    flat.rgb[i + 1] = 3;
    flat.rgb[i + 2] = 99;
  }
  for (auto f : {resample_filter::bicubic, resample_filter::bilinear}) {
    auto r = resize_image(flat, 64, 45, f);
    ASSERT_TRUE(r);
    for (std::size_t i = 0; i < r->rgb.size(); i += 3) {
      ASSERT_EQ(r->rgb[i], 200);
      ASSERT_EQ(r->rgb[i + 1], 3);
      ASSERT_EQ(r->rgb[i + 2], 99);
    }
  }
  const image p = pattern(9, 7, 1);
  auto same = resize_image(p, 9, 7, resample_filter::bicubic);
  ASSERT_TRUE(same);
  EXPECT_EQ(same->rgb, p.rgb);
}

TEST(Image, ResizeOutputSizeFollowsTransformers) {
  image_processor_config c;
  c.shortest_edge = 64;
  // int(64 * 97 / 61) = 101; the short side gets exactly 64.
  EXPECT_EQ(resize_output_size(c, 61, 97), (std::array<std::int64_t, 2>{64, 101}));
  EXPECT_EQ(resize_output_size(c, 120, 80), (std::array<std::int64_t, 2>{96, 64}));
  EXPECT_EQ(resize_output_size(c, 50, 50), (std::array<std::int64_t, 2>{64, 64}));
  c.shortest_edge = 336;
  EXPECT_EQ(resize_output_size(c, 3, 1000), (std::array<std::int64_t, 2>{336, 112000}));
  c.shortest_edge = 0;
  c.resize_height = 50;
  c.resize_width = 70;
  EXPECT_EQ(resize_output_size(c, 3, 1000), (std::array<std::int64_t, 2>{50, 70}));
}

TEST(Image, CenterCropAndPadGeometry) {
  const image p = pattern(5, 4, 3);
  auto px = [&](const image& im, int x, int y, int c) {
    return im.rgb[static_cast<std::size_t>((y * im.width + x) * 3 + c)];
  };
  // 5x4 -> 2x3: offsets (4-3)//2 = 0 rows, (5-2)//2 = 1 column.
  auto c1 = center_crop(p, 3, 2);
  ASSERT_TRUE(c1);
  EXPECT_EQ(px(*c1, 0, 0, 0), px(p, 1, 0, 0));
  EXPECT_EQ(px(*c1, 1, 2, 2), px(p, 2, 2, 2));
  // 5x4 -> 8x7: the image lands at (ceil(3/2), ceil(3/2)) = (2, 2), zeros around.
  auto c2 = center_crop(p, 7, 8);
  ASSERT_TRUE(c2);
  EXPECT_EQ(c2->width, 8);
  EXPECT_EQ(c2->height, 7);
  EXPECT_EQ(px(*c2, 2, 2, 1), px(p, 0, 0, 1));
  EXPECT_EQ(px(*c2, 6, 5, 0), px(p, 4, 3, 0));
  EXPECT_EQ(px(*c2, 1, 2, 0), 0);
  EXPECT_EQ(px(*c2, 7, 6, 2), 0);
  EXPECT_EQ(px(*c2, 2, 1, 2), 0);

  // Pad: 5x4 -> 5x5 with the image at row (5-4)//2 = 0; 4x7 -> 7x7 at column 1.
  auto s1 = pad_to_square(p, {1, 2, 3});
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->width, 5);
  EXPECT_EQ(s1->height, 5);
  EXPECT_EQ(px(*s1, 3, 0, 0), px(p, 3, 0, 0));
  EXPECT_EQ(px(*s1, 3, 4, 0), 1);
  EXPECT_EQ(px(*s1, 3, 4, 2), 3);
  const image q = pattern(4, 7, 5);
  auto s2 = pad_to_square(q, {1, 2, 3});
  ASSERT_TRUE(s2);
  EXPECT_EQ(px(*s2, 1, 0, 0), px(q, 0, 0, 0));
  EXPECT_EQ(px(*s2, 4, 6, 1), px(q, 3, 6, 1));
  EXPECT_EQ(px(*s2, 0, 3, 1), 2);
  EXPECT_EQ(px(*s2, 5, 3, 1), 2);
}

TEST(Image, PreprocessRescalesAndNormalizesInF32) {
  image im;
  im.width = im.height = 2;
  im.rgb = {0, 128, 255, 10, 20, 30, 40, 50, 60, 70, 80, 90};
  image_processor_config c;
  c.do_resize = false;
  c.do_center_crop = false;
  auto px = preprocess_image(im, c);
  ASSERT_TRUE(px);
  ASSERT_EQ(px->data.size(), 12u);
  // Channel-first: plane 0 holds red.
  const float r0 = (static_cast<float>(0 / 255.0) - 0.48145466f) / 0.26862954f;
  const float g0 = (static_cast<float>(128 / 255.0) - 0.4578275f) / 0.26130258f;
  const float b3 = (static_cast<float>(90 / 255.0) - 0.40821073f) / 0.27577711f;
  EXPECT_EQ(px->data[0], r0);
  EXPECT_EQ(px->data[4], g0);
  EXPECT_EQ(px->data[11], b3);
  c.do_normalize = false;
  c.do_rescale = false;
  auto raw = preprocess_image(im, c);
  ASSERT_TRUE(raw);
  EXPECT_EQ(raw->data[1], 10.0f);
  EXPECT_EQ(raw->data[5], 20.0f);
}

TEST(ImageProcessorConfig, ParsesPublishedForms) {
  // openai/clip-vit-large-patch14-336: int size = shortest edge, int crop = square.
  auto a = load_image_processor_config(dir + "/configs/clip336.json");
  ASSERT_TRUE(a) << a.error().message;
  EXPECT_EQ(a->shortest_edge, 336);
  EXPECT_EQ(a->crop_height, 336);
  EXPECT_EQ(a->crop_width, 336);
  EXPECT_EQ(a->resample, resample_filter::bicubic);
  EXPECT_FALSE(a->pad_to_square);

  auto b = parse_image_processor_config(R"({"size": {"height": 50, "width": 70}, "resample": 2,
      "crop_size": [40, 24], "image_mean": 0.5, "image_std": [0.1, 0.2, 0.3], "do_rescale": false,
      "rescale_factor": 0.5, "some_unknown_key": {"x": 1}})",
                                        "b.json");
  ASSERT_TRUE(b) << b.error().message;
  EXPECT_EQ(b->shortest_edge, 0);
  EXPECT_EQ(b->resize_height, 50);
  EXPECT_EQ(b->resize_width, 70);
  EXPECT_EQ(b->resample, resample_filter::bilinear);
  EXPECT_EQ(b->crop_height, 40);
  EXPECT_EQ(b->crop_width, 24);
  EXPECT_EQ(b->image_mean, (std::array<double, 3>{0.5, 0.5, 0.5}));
  EXPECT_EQ(b->image_std[2], 0.3);
  EXPECT_FALSE(b->do_rescale);
  EXPECT_EQ(b->rescale_factor, 0.5);

  // Defaults are CLIPImageProcessor's.
  auto d = parse_image_processor_config("{}", "d.json");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->shortest_edge, 224);
  EXPECT_EQ(d->crop_height, 224);
  EXPECT_TRUE(d->do_resize && d->do_center_crop && d->do_rescale && d->do_normalize);
  EXPECT_EQ(d->rescale_factor, 1.0 / 255.0);

  // Pad to square: LLaVA's image_aspect_ratio, or LlavaImageProcessor's do_pad;
  // CLIPImageProcessor ignores do_pad, as in transformers.
  auto p1 = parse_image_processor_config(R"({"image_aspect_ratio": "pad"})", "p.json");
  ASSERT_TRUE(p1);
  EXPECT_TRUE(p1->pad_to_square);
  auto p2 = parse_image_processor_config(
      R"({"image_processor_type": "LlavaImageProcessor", "do_pad": true})", "p.json");
  ASSERT_TRUE(p2);
  EXPECT_TRUE(p2->pad_to_square);
  auto p3 = parse_image_processor_config(
      R"({"image_processor_type": "CLIPImageProcessor", "do_pad": true})", "p.json");
  ASSERT_TRUE(p3);
  EXPECT_FALSE(p3->pad_to_square);

  // {shortest_edge, longest_edge}: CLIP resizes by the shortest edge only.
  auto s = parse_image_processor_config(R"({"size": {"shortest_edge": 64, "longest_edge": 100}})",
                                        "s.json");
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ(s->shortest_edge, 64);
  auto sq = parse_image_processor_config(
      R"({"size": {"shortest_edge": 64}, "use_square_size": true})", "s.json");
  ASSERT_TRUE(sq);
  EXPECT_EQ(sq->shortest_edge, 0);
  EXPECT_EQ(sq->resize_height, 64);
  EXPECT_EQ(sq->resize_width, 64);
}

TEST(ImageProcessorConfig, PadUsesTruncatedMeanColor) {
  // int(mean * 255) per channel, as LLaVA's expand2square call: 122, 116, 104.
  image im;
  im.width = 4;
  im.height = 2;
  im.rgb.assign(4 * 2 * 3, 0);
  image_processor_config c;
  c.pad_to_square = true;
  c.do_resize = false;
  c.do_center_crop = false;
  c.do_normalize = false;
  c.do_rescale = false;
  auto px = preprocess_image(im, c);
  ASSERT_TRUE(px);
  ASSERT_EQ(px->height, 4);
  ASSERT_EQ(px->width, 4);
  EXPECT_EQ(px->data[0], 122.0f);        // red plane, row 0 (padding)
  EXPECT_EQ(px->data[16], 116.0f);       // green plane, row 0
  EXPECT_EQ(px->data[32 + 15], 104.0f);  // blue plane, row 3
  EXPECT_EQ(px->data[4], 0.0f);          // red plane, row 1: the image
}
