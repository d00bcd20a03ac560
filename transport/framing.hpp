#pragma once

// Framing for the opaque bytes engines hand to peers (addresses, region
// keys): a magic, the body's length and a 64-bit FNV-1a checksum, so a
// truncated or corrupted blob is refused before a library parses it.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.hpp"

namespace troupe::transport {

std::uint64_t fnv1a64(std::span<const std::uint8_t> bytes);

/// magic (4) | length (4) | body | checksum (8), little-endian.
std::vector<std::uint8_t> frame(std::uint32_t magic, std::span<const std::uint8_t> body);

/// The body of a framed blob; an error naming `what` when the magic,
/// length, bound or checksum is wrong.
kernels::result<std::vector<std::uint8_t>> unframe(std::uint32_t magic,
                                                   std::span<const std::uint8_t> blob,
                                                   std::size_t max_body, const std::string& what);

}  // namespace troupe::transport
