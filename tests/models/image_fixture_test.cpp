// Fidelity: PNG/JPEG decoding against PIL's Image.open(f).convert("RGB"),
// and the whole preprocessing against transformers' CLIPImageProcessor
// pixel_values (tools/make_image_fixtures.py; PIL 9.4 on Debian's
// libjpeg-turbo 2.1.5, transformers 4.46.3). The resize reproduces PIL's
// fixed-point resampler (uint8 between passes), so both match exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "kernels/half.hpp"
#include "models/image.hpp"
#include "models/image_processor.hpp"
#include "models/safetensors.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/images";

// Measured on Debian 12 (libpng 1.6.39, libjpeg-turbo 2.1.5, the library PIL
// uses there): every decoded pixel and every pixel_values float is
// bit-exact, PNG and JPEG, for all 65 image/config pairs. The tolerances are
// therefore zero. A JPEG decoded by a different libjpeg-turbo build could
// move a pixel by a level (0.0146 after normalize) and would fail here.
constexpr float decode_tolerance = 0.0f;  // levels
constexpr float pixel_tolerance = 0.0f;   // pixel_values units

std::vector<float> to_floats(const safetensors_model& m, const safetensors_tensor& t) {
  auto v = m.view(t);
  EXPECT_TRUE(v) << t.name;
  std::vector<float> out(static_cast<std::size_t>(t.shape.numel()));
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = t.type == kernels::dtype::f16 ? kernels::to_f32(v->data_as<kernels::f16>()[i])
                                           : v->data_as<float>()[i];
  }
  return out;
}

struct fixture {
  safetensors_model expected;
  static const fixture& get() {
    static const fixture f{[] {
      auto m = safetensors_model::open(dir + "/expected.safetensors");
      if (!m) {  // committed: missing or unreadable is a failure (and no tensors to compare)
        ADD_FAILURE() << m.error().message;
        return safetensors_model{};
      }
      return std::move(*m);
    }()};
    return f;
  }
};

}  // namespace

TEST(ImageFixture, DecodeMatchesPil) {
  const auto& ref = fixture::get().expected;
  int checked = 0;
  for (const auto& t : ref.tensors()) {
    if (!t.name.starts_with("decode/")) {
      continue;
    }
    const std::string file = t.name.substr(7);
    auto img = load_image(dir + "/" + file);
    ASSERT_TRUE(img) << img.error().message;
    ASSERT_EQ(t.shape.ndim, 3);
    ASSERT_EQ(img->height, t.shape[0]) << file;
    ASSERT_EQ(img->width, t.shape[1]) << file;
    const auto want = to_floats(ref, t);
    ASSERT_EQ(img->rgb.size(), want.size());
    float worst = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<float>(img->rgb[i]) - want[i]));
    }
    std::printf("decode %-26s %3dx%-3d max |diff| %g levels\n", file.c_str(), img->width,
                img->height, worst);
    EXPECT_LE(worst, decode_tolerance) << file;
    ++checked;
  }
  EXPECT_GE(checked, 16);
}

TEST(ImageFixture, PixelValuesMatchTransformers) {
  const auto& ref = fixture::get().expected;
  std::map<std::string, image_processor_config> configs;
  int checked = 0;
  std::size_t exact = 0, total = 0;
  for (const auto& t : ref.tensors()) {
    const auto slash = t.name.find('/');
    const std::string config_name = t.name.substr(0, slash), file = t.name.substr(slash + 1);
    if (config_name == "decode") {
      continue;
    }
    if (!configs.contains(config_name)) {
      auto c = load_image_processor_config(dir + "/configs/" + config_name + ".json");
      ASSERT_TRUE(c) << c.error().message;
      configs[config_name] = *c;
    }
    auto img = load_image(dir + "/" + file);
    ASSERT_TRUE(img) << img.error().message;
    auto px = preprocess_image(*img, configs[config_name]);
    ASSERT_TRUE(px) << t.name << ": " << px.error().message;
    ASSERT_EQ(t.shape.ndim, 3);
    ASSERT_EQ(t.shape[0], 3);
    ASSERT_EQ(px->height, t.shape[1]) << t.name;
    ASSERT_EQ(px->width, t.shape[2]) << t.name;
    const auto want = to_floats(ref, t);
    ASSERT_EQ(px->data.size(), want.size());
    float worst = 0;
    std::size_t same = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const float d = std::abs(px->data[i] - want[i]);
      worst = std::max(worst, d);
      same += d == 0.0f ? 1 : 0;
    }
    exact += same;
    total += want.size();
    std::printf("%-12s %-26s [3,%lld,%lld] max |diff| %g, exact %zu/%zu\n", config_name.c_str(),
                file.c_str(), static_cast<long long>(px->height), static_cast<long long>(px->width),
                worst, same, want.size());
    EXPECT_LE(worst, pixel_tolerance) << t.name;
    ++checked;
  }
  std::printf("pixel_values: %d image/config pairs, %zu of %zu values bit-exact\n", checked, exact,
              total);
  EXPECT_GE(checked, 60);
}

// The pixel_values view is what the vision tower consumes.
TEST(ImageFixture, PixelValuesView) {
  auto img = load_image(dir + "/photo_80x120.jpg");
  ASSERT_TRUE(img) << img.error().message;
  auto c = load_image_processor_config(dir + "/configs/clip64.json");
  ASSERT_TRUE(c) << c.error().message;
  auto px = preprocess_image(*img, *c);
  ASSERT_TRUE(px);
  auto v = px->view();
  ASSERT_TRUE(v) << v.error().message;
  EXPECT_EQ(v->shape(), (kernels::shape_t{3, 64, 64}));
  EXPECT_EQ(v->data_as<float>(), px->data.data());
}
