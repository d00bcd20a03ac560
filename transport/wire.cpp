#include "transport/wire.hpp"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include <cstring>

#include "transport/schema/wire.capnp.h"

namespace troupe::transport {

using kernels::errc;
using kernels::make_error;
using kernels::result;

namespace {

std::vector<std::uint8_t> to_bytes(capnp::MessageBuilder& mb) {
  auto words = capnp::messageToFlatArray(mb);
  auto bytes = words.asBytes();
  return {bytes.begin(), bytes.end()};
}

// Cap'n Proto reads 8-byte-aligned words; the input may be any bytes.
struct aligned_words {
  std::vector<capnp::word> words;
  explicit aligned_words(std::span<const std::uint8_t> b) : words(b.size() / sizeof(capnp::word)) {
    std::memcpy(words.data(), b.data(), words.size() * sizeof(capnp::word));
  }
};

capnp::ReaderOptions reader_options(const wire_limits& l) {
  capnp::ReaderOptions o;
  o.traversalLimitInWords = l.max_message_bytes / 8 + 64;
  o.nestingLimit = 8;
  return o;
}

result<void> check_bytes(std::span<const std::uint8_t> b, const wire_limits& l, const char* what) {
  if (b.empty()) return make_error(errc::corrupt_data, std::string(what) + ": empty message");
  if (b.size() % 8 != 0) {
    return make_error(errc::corrupt_data, std::string(what) + ": " + std::to_string(b.size()) +
                                              " bytes is not a whole number of words");
  }
  if (b.size() > l.max_message_bytes) {
    return make_error(errc::corrupt_data, std::string(what) + ": " + std::to_string(b.size()) +
                                              " bytes exceeds the limit");
  }
  return {};
}

result<kernels::dtype> check_dtype(std::uint8_t v, const char* what) {
  if (v > static_cast<std::uint8_t>(kernels::last_dtype)) {
    return make_error(errc::corrupt_data,
                      std::string(what) + ": unknown dtype " + std::to_string(v));
  }
  return static_cast<kernels::dtype>(v);
}

result<std::uint64_t> tensor_bytes(kernels::dtype t, const std::vector<std::int64_t>& shape) {
  if (shape.empty()) return make_error(errc::corrupt_data, "tensor header: empty shape");
  std::int64_t outer = 1;
  for (std::size_t i = 0; i + 1 < shape.size(); ++i) {
    if (shape[i] < 0) return make_error(errc::corrupt_data, "tensor header: negative dimension");
    if (shape[i] != 0 && outer > (std::int64_t{1} << 40) / shape[i]) {
      return make_error(errc::corrupt_data, "tensor header: shape overflows");
    }
    outer *= shape[i];
  }
  if (shape.back() < 0) return make_error(errc::corrupt_data, "tensor header: negative dimension");
  auto row = kernels::row_bytes(t, shape.back());
  if (!row) return make_error(errc::corrupt_data, "tensor header: " + row.error().message);
  if (outer != 0 && *row > (std::uint64_t{1} << 62) / static_cast<std::uint64_t>(outer)) {
    return make_error(errc::corrupt_data, "tensor header: size overflows");
  }
  return static_cast<std::uint64_t>(outer) * *row;
}

std::uint32_t chunks_for(std::uint64_t total, std::uint64_t chunk) {
  return total == 0 ? 0u : static_cast<std::uint32_t>((total + chunk - 1) / chunk);
}

}  // namespace

result<void> plan_chunks(tensor_header& h, std::uint64_t chunk_bytes) {
  if (chunk_bytes == 0)
    return make_error(errc::invalid_argument, "plan_chunks: chunk size must be positive");
  auto total = tensor_bytes(h.type, h.shape);
  if (!total) return make_error(errc::invalid_argument, total.error().message);
  const std::uint64_t count = *total == 0 ? 0 : (*total + chunk_bytes - 1) / chunk_bytes;
  if (count > 0xffff) {
    return make_error(errc::invalid_argument, "plan_chunks: " + std::to_string(count) +
                                                  " chunks exceed 65535; use larger chunks");
  }
  h.total_bytes = *total;
  h.chunk_bytes = chunk_bytes;
  h.chunk_count = static_cast<std::uint32_t>(count);
  return {};
}

std::vector<std::uint8_t> encode(const tensor_header& h) {
  capnp::MallocMessageBuilder mb;
  auto r = mb.initRoot<wire::TensorHeader>();
  r.setTransferId(h.transfer_id);
  r.setPayload(static_cast<wire::Payload>(h.kind));
  r.setDtype(static_cast<std::uint8_t>(h.type));
  auto s = r.initShape(static_cast<unsigned>(h.shape.size()));
  for (unsigned i = 0; i < h.shape.size(); ++i) s.set(i, h.shape[i]);
  r.setTotalBytes(h.total_bytes);
  r.setChunkBytes(h.chunk_bytes);
  r.setChunkCount(h.chunk_count);
  r.setDevice(h.device);
  return to_bytes(mb);
}

std::vector<std::uint8_t> encode(const kv_block_descriptor& d) {
  capnp::MallocMessageBuilder mb;
  auto r = mb.initRoot<wire::KvBlockDescriptor>();
  r.setTransferId(d.transfer_id);
  r.setLayerBegin(d.layer_begin);
  r.setLayerEnd(d.layer_end);
  r.setBlockTokens(d.block_tokens);
  r.setBytesPerBlock(d.bytes_per_block);
  r.setDtype(static_cast<std::uint8_t>(d.type));
  auto ids = r.initBlockIds(static_cast<unsigned>(d.block_ids.size()));
  for (unsigned i = 0; i < d.block_ids.size(); ++i) ids.set(i, d.block_ids[i]);
  r.setRegionKey(
      kj::arrayPtr(reinterpret_cast<const kj::byte*>(d.region_key.data()), d.region_key.size()));
  r.setRegionBytes(d.region_bytes);
  return to_bytes(mb);
}

result<tensor_header> decode_tensor_header(std::span<const std::uint8_t> bytes,
                                           const wire_limits& limits) {
  if (auto c = check_bytes(bytes, limits, "tensor header"); !c) return std::unexpected(c.error());
  tensor_header h;
  try {
    aligned_words w(bytes);
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(w.words.data(), w.words.size()),
                                         reader_options(limits));
    auto r = reader.getRoot<wire::TensorHeader>();
    h.transfer_id = r.getTransferId();
    const auto kind = static_cast<std::uint16_t>(r.getPayload());
    if (kind > static_cast<std::uint16_t>(payload::partial_sum)) {
      return make_error(errc::corrupt_data,
                        "tensor header: unknown payload " + std::to_string(kind));
    }
    h.kind = static_cast<payload>(kind);
    auto t = check_dtype(r.getDtype(), "tensor header");
    if (!t) return std::unexpected(t.error());
    h.type = *t;
    auto s = r.getShape();
    if (s.size() > limits.max_rank) {
      return make_error(errc::corrupt_data, "tensor header: rank " + std::to_string(s.size()) +
                                                " exceeds " + std::to_string(limits.max_rank));
    }
    for (auto d : s) h.shape.push_back(d);
    h.total_bytes = r.getTotalBytes();
    h.chunk_bytes = r.getChunkBytes();
    h.chunk_count = r.getChunkCount();
    auto dev = r.getDevice();
    if (dev.size() > 256)
      return make_error(errc::corrupt_data, "tensor header: device name too long");
    h.device = std::string(dev.cStr(), dev.size());
  } catch (const kj::Exception& e) {
    return make_error(errc::corrupt_data, std::string("tensor header: malformed message: ") +
                                              e.getDescription().cStr());
  }
  auto total = tensor_bytes(h.type, h.shape);
  if (!total) return std::unexpected(total.error());
  if (*total != h.total_bytes) {
    return make_error(errc::corrupt_data,
                      "tensor header: total_bytes " + std::to_string(h.total_bytes) +
                          " disagrees with dtype and shape (" + std::to_string(*total) + ")");
  }
  if (h.total_bytes > limits.max_total_bytes) {
    return make_error(errc::corrupt_data, "tensor header: " + std::to_string(h.total_bytes) +
                                              " bytes exceeds the limit");
  }
  if (h.chunk_bytes == 0 || h.chunk_bytes > limits.max_chunk_bytes) {
    return make_error(errc::corrupt_data, "tensor header: chunk size " +
                                              std::to_string(h.chunk_bytes) + " out of range");
  }
  if (h.chunk_count != chunks_for(h.total_bytes, h.chunk_bytes)) {
    return make_error(errc::corrupt_data,
                      "tensor header: chunk_count " + std::to_string(h.chunk_count) +
                          " should be " + std::to_string(chunks_for(h.total_bytes, h.chunk_bytes)));
  }
  return h;
}

result<kv_block_descriptor> decode_kv_block_descriptor(std::span<const std::uint8_t> bytes,
                                                       const wire_limits& limits) {
  if (auto c = check_bytes(bytes, limits, "kv block descriptor"); !c)
    return std::unexpected(c.error());
  kv_block_descriptor d;
  try {
    aligned_words w(bytes);
    capnp::FlatArrayMessageReader reader(kj::arrayPtr(w.words.data(), w.words.size()),
                                         reader_options(limits));
    auto r = reader.getRoot<wire::KvBlockDescriptor>();
    d.transfer_id = r.getTransferId();
    d.layer_begin = r.getLayerBegin();
    d.layer_end = r.getLayerEnd();
    d.block_tokens = r.getBlockTokens();
    d.bytes_per_block = r.getBytesPerBlock();
    auto t = check_dtype(r.getDtype(), "kv block descriptor");
    if (!t) return std::unexpected(t.error());
    d.type = *t;
    auto ids = r.getBlockIds();
    if (ids.size() > limits.max_blocks)
      return make_error(errc::corrupt_data, "kv block descriptor: too many blocks");
    for (auto id : ids) d.block_ids.push_back(id);
    auto key = r.getRegionKey();
    if (key.size() > limits.max_key_bytes)
      return make_error(errc::corrupt_data, "kv block descriptor: region key too long");
    d.region_key.assign(key.begin(), key.end());
    d.region_bytes = r.getRegionBytes();
  } catch (const kj::Exception& e) {
    return make_error(errc::corrupt_data, std::string("kv block descriptor: malformed message: ") +
                                              e.getDescription().cStr());
  }
  if (d.layer_end <= d.layer_begin)
    return make_error(errc::corrupt_data, "kv block descriptor: empty layer range");
  if (d.block_tokens == 0 || d.bytes_per_block == 0) {
    return make_error(errc::corrupt_data, "kv block descriptor: zero block size");
  }
  if (d.bytes_per_block > limits.max_total_bytes ||
      d.block_ids.size() > limits.max_total_bytes / d.bytes_per_block ||
      d.region_bytes != d.bytes_per_block * d.block_ids.size()) {
    return make_error(errc::corrupt_data, "kv block descriptor: region_bytes " +
                                              std::to_string(d.region_bytes) +
                                              " is not blocks x bytes_per_block");
  }
  return d;
}

result<void> check_expected(const tensor_header& got, const tensor_header& want) {
  auto shape_text = [](const std::vector<std::int64_t>& s) {
    std::string t = "[";
    for (std::size_t i = 0; i < s.size(); ++i) t += (i ? "," : "") + std::to_string(s[i]);
    return t + "]";
  };
  if (got.transfer_id != want.transfer_id) {
    return make_error(errc::invalid_argument, "transfer " + std::to_string(want.transfer_id) +
                                                  ": header is for transfer " +
                                                  std::to_string(got.transfer_id));
  }
  if (got.kind != want.kind)
    return make_error(errc::invalid_argument,
                      "transfer " + std::to_string(want.transfer_id) + ": unexpected payload kind");
  if (got.type != want.type) {
    return make_error(errc::invalid_argument,
                      "transfer " + std::to_string(want.transfer_id) + ": dtype " +
                          std::string(kernels::to_string(got.type)) + ", expected " +
                          std::string(kernels::to_string(want.type)));
  }
  if (got.shape != want.shape) {
    return make_error(errc::invalid_argument, "transfer " + std::to_string(want.transfer_id) +
                                                  ": shape " + shape_text(got.shape) +
                                                  ", expected " + shape_text(want.shape));
  }
  return {};
}

}  // namespace troupe::transport
