#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/tensor.hpp"
#include "models/image.hpp"

namespace troupe::models {

/// Resampling filters of the resize step (PIL's `resample` codes).
enum class resample_filter : std::uint8_t { bilinear = 2, bicubic = 3 };

/// A validated `preprocessor_config.json` of a CLIPImageProcessor,
/// LlavaImageProcessor or SiglipImageProcessor; absent keys take the
/// processor's defaults.
struct image_processor_config {
  bool do_resize = true;
  /// Resize target: the shortest edge becomes `shortest_edge` (aspect ratio
  /// kept) when it is > 0, otherwise exactly `resize_height` × `resize_width`.
  std::int64_t shortest_edge = 224;
  std::int64_t resize_height = 0;
  std::int64_t resize_width = 0;
  resample_filter resample = resample_filter::bicubic;
  bool do_center_crop = true;
  std::int64_t crop_height = 224;
  std::int64_t crop_width = 224;
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = true;
  std::array<double, 3> image_mean{0.48145466, 0.4578275, 0.40821073};
  std::array<double, 3> image_std{0.26862954, 0.26130258, 0.27577711};
  /// Decoded images are always RGB; kept for completeness.
  bool do_convert_rgb = true;
  /// LLaVA-1.5 ("image_aspect_ratio": "pad", or LlavaImageProcessor's
  /// "do_pad"): pad to a centred square of color int(mean × 255) first.
  bool pad_to_square = false;
  /// Largest image (in pixels) any step may produce; not read from the file.
  std::int64_t max_step_pixels = std::int64_t{64} << 20;
};

/// One preprocessed image, f32 channel-first [3, height, width]: what
/// transformers returns as `pixel_values[i]`.
struct pixel_values {
  std::int64_t height = 0;
  std::int64_t width = 0;
  std::vector<float> data;

  /// A non-owning [3, height, width] f32 tensor over `data`.
  result<kernels::tensor> view();
};

/// Parses a `preprocessor_config.json`; unknown keys are ignored, known keys
/// with a wrong type or value are errors naming `source` and the key.
result<image_processor_config> parse_image_processor_config(std::string_view json_text,
                                                            const std::string& source);
/// `path`: a preprocessor_config.json or a folder holding one.
result<image_processor_config> load_image_processor_config(const std::string& path);

/// transformers' resize target (height, width) for an image of `height` ×
/// `width`: with `shortest_edge`, the long side is int(size × long / short).
std::array<std::int64_t, 2> resize_output_size(const image_processor_config& config,
                                               std::int64_t height, std::int64_t width);

/// PIL's `Image.resize` for RGB8: separable filter scaled by the reduction
/// factor, 22-bit fixed-point weights, horizontal pass first, each pass
/// rounded and clipped to uint8. `max_pixels` bounds output and intermediate.
result<image> resize_image(const image& in, int width, int height, resample_filter filter,
                           std::int64_t max_pixels = std::int64_t{64} << 20);

/// LLaVA's expand2square: a max(w, h) square of `color` with the image
/// centred (offset (long - short) / 2, rounded down).
result<image> pad_to_square(const image& in, std::array<std::uint8_t, 3> color,
                            std::int64_t max_pixels = std::int64_t{64} << 20);

/// transformers' center_crop: crops the centre, zero-pads when the image is
/// smaller than the crop (offsets (size - crop) // 2, floored).
result<image> center_crop(const image& in, std::int64_t height, std::int64_t width,
                          std::int64_t max_pixels = std::int64_t{64} << 20);

/// The CLIPImageProcessor pipeline: [pad to square] → resize → center crop
/// → rescale (f64 product rounded to f32) → normalize ((x - mean) / std in f32).
result<pixel_values> preprocess_image(const image& in, const image_processor_config& config);

}  // namespace troupe::models
