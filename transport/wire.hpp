#pragma once

// The data plane's wire headers (transport/schema/wire.capnp) as plain
// structs, encoded to Cap'n Proto flat arrays and decoded with strict
// validation: sizes, counts, dtype and shape are checked for consistency
// and against limits before anything is allocated, and against what the
// receiver expects before any chunk is accepted.

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "kernels/dtype.hpp"
#include "kernels/status.hpp"

namespace troupe::transport {

enum class payload : std::uint8_t { activations, weights, kv_blocks, partial_sum };

struct tensor_header {
  std::uint64_t transfer_id = 0;
  payload kind = payload::activations;
  kernels::dtype type = kernels::dtype::f32;
  std::vector<std::int64_t> shape;
  std::uint64_t total_bytes = 0;
  std::uint64_t chunk_bytes = 0;
  std::uint32_t chunk_count = 0;
  std::string device;
  bool operator==(const tensor_header&) const = default;
};

struct kv_block_descriptor {
  std::uint64_t transfer_id = 0;
  std::uint32_t layer_begin = 0, layer_end = 0;
  std::uint32_t block_tokens = 0;
  std::uint64_t bytes_per_block = 0;
  kernels::dtype type = kernels::dtype::f32;
  std::vector<std::uint32_t> block_ids;
  std::vector<std::uint8_t> region_key;
  std::uint64_t region_bytes = 0;
  bool operator==(const kv_block_descriptor&) const = default;
};

/// What a receiver accepts.
struct wire_limits {
  std::uint64_t max_total_bytes = 1ull << 36;  ///< 64 GiB
  std::uint64_t max_chunk_bytes = 1ull << 30;
  std::uint32_t max_rank = 8;
  std::uint32_t max_blocks = 1u << 20;
  std::uint32_t max_key_bytes = 1u << 16;
  std::size_t max_message_bytes = 1u << 20;  ///< an encoded header
};

/// Fills total_bytes, chunk_bytes and chunk_count for `chunk_bytes`-sized
/// chunks; an error when dtype/shape do not give a whole number of bytes.
kernels::result<void> plan_chunks(tensor_header& h, std::uint64_t chunk_bytes);

std::vector<std::uint8_t> encode(const tensor_header& h);
std::vector<std::uint8_t> encode(const kv_block_descriptor& d);

/// Decodes and validates (internal consistency and limits).
kernels::result<tensor_header> decode_tensor_header(std::span<const std::uint8_t> bytes,
                                                    const wire_limits& limits = {});
kernels::result<kv_block_descriptor> decode_kv_block_descriptor(std::span<const std::uint8_t> bytes,
                                                                const wire_limits& limits = {});

/// Checks a received header against what the receiver expects (transfer
/// id, payload, dtype, shape); the error names the first difference.
kernels::result<void> check_expected(const tensor_header& got, const tensor_header& want);

}  // namespace troupe::transport
