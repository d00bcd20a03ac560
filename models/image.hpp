#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "models/mapped_file.hpp"

namespace troupe::models {

/// A decoded image: 8-bit RGB, interleaved, rows top to bottom
/// (`rgb[(y * width + x) * 3 + c]`).
struct image {
  int width = 0;
  int height = 0;
  std::vector<std::uint8_t> rgb;
};

/// Limits checked against the header before any pixel is decoded.
struct image_limits {
  std::int64_t max_pixels = std::int64_t{64} << 20;  ///< width × height (64 Mi)
  int max_side = 16384;                              ///< widest / tallest accepted
  int min_side = 2;                                  ///< 1×1 (and any side < 2) is refused
  int max_jpeg_scans = 500;  ///< progressive JPEGs with more scans are refused (CPU bound)
  std::uint64_t max_file_bytes = std::uint64_t{256} << 20;  ///< load_image only
};

/// Decodes a PNG or JPEG (detected by its magic bytes) to RGB8, converting
/// the way PIL's `convert("RGB")` does: gray is replicated, alpha dropped
/// (not composited), palettes expanded, 16-bit samples keep their high byte,
/// CMYK/YCCK JPEGs use PIL's inverted-CMYK formula. EXIF orientation and
/// gamma/ICC data are ignored, as PIL and transformers do. Corrupt, truncated,
/// zero-sized, too small or too large images are errors; no input aborts.
/// One divergence from PIL: a 16-bit grayscale PNG keeps its high byte,
/// where PIL clips the 16-bit value to 255 (turning it white).
result<image> decode_image(std::span<const std::uint8_t> bytes, const image_limits& limits = {});

/// Reads and decodes an image file; messages start with `path`.
result<image> load_image(const std::string& path, const image_limits& limits = {});

}  // namespace troupe::models
