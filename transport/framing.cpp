#include "transport/framing.hpp"

#include <cstring>

namespace troupe::transport {

std::uint64_t fnv1a64(std::span<const std::uint8_t> bytes) {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (const std::uint8_t b : bytes) {
    h ^= b;
    h *= 0x100000001b3ull;
  }
  return h;
}

namespace {
void put_u32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void put_u64(std::vector<std::uint8_t>& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
std::uint64_t get_le(const std::uint8_t* p, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= std::uint64_t{p[i]} << (8 * i);
  return v;
}
}  // namespace

std::vector<std::uint8_t> frame(std::uint32_t magic, std::span<const std::uint8_t> body) {
  std::vector<std::uint8_t> out;
  out.reserve(body.size() + 16);
  put_u32(out, magic);
  put_u32(out, static_cast<std::uint32_t>(body.size()));
  out.insert(out.end(), body.begin(), body.end());
  put_u64(out, fnv1a64(body));
  return out;
}

kernels::result<std::vector<std::uint8_t>> unframe(std::uint32_t magic,
                                                   std::span<const std::uint8_t> blob,
                                                   std::size_t max_body, const std::string& what) {
  using kernels::errc;
  if (blob.size() < 16) {
    return kernels::make_error(errc::corrupt_data,
                               what + ": " + std::to_string(blob.size()) + " bytes is too short");
  }
  if (get_le(blob.data(), 4) != magic)
    return kernels::make_error(errc::corrupt_data, what + ": wrong magic");
  const std::uint64_t len = get_le(blob.data() + 4, 4);
  if (len > max_body) {
    return kernels::make_error(
        errc::corrupt_data,
        what + ": body of " + std::to_string(len) + " bytes exceeds " + std::to_string(max_body));
  }
  if (len + 16 != blob.size()) {
    return kernels::make_error(errc::corrupt_data,
                               what + ": length field says " + std::to_string(len) +
                                   " bytes but the blob holds " + std::to_string(blob.size() - 16));
  }
  const auto body = blob.subspan(8, len);
  if (get_le(blob.data() + 8 + len, 8) != fnv1a64(body)) {
    return kernels::make_error(errc::corrupt_data, what + ": checksum mismatch");
  }
  return std::vector<std::uint8_t>(body.begin(), body.end());
}

}  // namespace troupe::transport
