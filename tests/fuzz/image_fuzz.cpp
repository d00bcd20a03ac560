// libFuzzer target: PNG/JPEG decoding (small limits, so no input can ask for
// much memory or time), then the CLIP preprocessing of whatever decoded.
#include <cstddef>
#include <cstdint>
#include <span>

#include "models/image.hpp"
#include "models/image_processor.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::models;
  image_limits limits;
  limits.max_pixels = 1 << 20;
  limits.max_side = 4096;
  limits.max_jpeg_scans = 64;
  auto img = decode_image(std::span<const std::uint8_t>(data, size), limits);
  if (!img) {
    return 0;
  }
  image_processor_config config;  // the bundled model's: shortest edge 64, crop 64
  config.shortest_edge = 64;
  config.crop_height = config.crop_width = 64;
  config.max_step_pixels = 1 << 20;
  config.pad_to_square = (size & 1) != 0;  // both paths, picked by the input
  (void)preprocess_image(*img, config);
  return 0;
}
