// Wire headers and framed blobs from peers: round trips, every field's
// consistency check, and random corruption that must give an error, never
// a crash (this file also runs under ASan+UBSan).
#include <gtest/gtest.h>

#include <random>

#include "transport/chunked.hpp"
#include "transport/framing.hpp"
#include "transport/wire.hpp"

namespace tr = troupe::transport;
using troupe::kernels::dtype;

namespace {

tr::tensor_header sample_header() {
  tr::tensor_header h;
  h.transfer_id = 0x123456789aULL;
  h.kind = tr::payload::activations;
  h.type = dtype::f16;
  h.shape = {3, 7, 64};
  h.device = "cpu:1";
  EXPECT_TRUE(tr::plan_chunks(h, 1000));
  return h;
}

// Re-encodes a header with one field changed behind plan_chunks' back.
template <class F>
std::vector<std::uint8_t> tampered(F&& change) {
  auto h = sample_header();
  change(h);
  return tr::encode(h);
}

std::string decode_error(const std::vector<std::uint8_t>& bytes) {
  auto r = tr::decode_tensor_header(bytes);
  return r ? std::string() : r.error().message;
}

}  // namespace

TEST(WireValidation, TensorHeaderRoundTrips) {
  const auto h = sample_header();
  EXPECT_EQ(h.total_bytes, 3u * 7 * 64 * 2);
  EXPECT_EQ(h.chunk_count, 3u);  // 2688 bytes in 1000-byte chunks
  auto back = tr::decode_tensor_header(tr::encode(h));
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, h);

  tr::tensor_header q;
  q.transfer_id = 1;
  q.type = dtype::q4_0;
  q.shape = {2, 64};
  ASSERT_TRUE(tr::plan_chunks(q, 1 << 20));
  EXPECT_EQ(q.total_bytes, 2u * 2 * 18);
  EXPECT_EQ(q.chunk_count, 1u);
  tr::tensor_header bad_q = q;
  bad_q.shape = {2, 33};  // not whole blocks
  EXPECT_FALSE(tr::plan_chunks(bad_q, 1 << 20));
  tr::tensor_header many = q;
  many.type = dtype::f32;
  many.shape = {1 << 20};
  EXPECT_FALSE(tr::plan_chunks(many, 16));  // 262144 chunks > 65535
}

TEST(WireValidation, InconsistentFieldsAreNamed) {
  EXPECT_NE(decode_error(tampered([](auto& h) {
              h.total_bytes += 2;
            })).find("disagrees with dtype and shape"),
            std::string::npos);
  EXPECT_NE(
      decode_error(tampered([](auto& h) { h.chunk_count = 2; })).find("chunk_count 2 should be 3"),
      std::string::npos);
  EXPECT_NE(decode_error(tampered([](auto& h) { h.chunk_bytes = 0; })).find("chunk size 0"),
            std::string::npos);
  EXPECT_NE(decode_error(tampered([](auto& h) {
              h.shape = {3, -7, 64};
            })).find("negative dimension"),
            std::string::npos);
  EXPECT_NE(decode_error(tampered([](auto& h) { h.shape = {}; })).find("empty shape"),
            std::string::npos);
  EXPECT_NE(decode_error(tampered([](auto& h) {
              h.type = static_cast<dtype>(42);
            })).find("unknown dtype 42"),
            std::string::npos);
  EXPECT_NE(decode_error(tampered([](auto& h) {
              h.shape = std::vector<std::int64_t>(9, 1);
            })).find("rank 9"),
            std::string::npos);
  EXPECT_NE(decode_error(tampered([](auto& h) {
              h.shape = {1ll << 40, 1ll << 40, 64};
            })).find("overflows"),
            std::string::npos);
  tr::wire_limits small;
  small.max_total_bytes = 1000;
  auto r = tr::decode_tensor_header(tr::encode(sample_header()), small);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("exceeds the limit"), std::string::npos) << r.error().message;
}

TEST(WireValidation, ReceiverExpectationsAreChecked) {
  const auto h = sample_header();
  EXPECT_TRUE(tr::check_expected(h, h));
  auto want = h;
  want.type = dtype::f32;
  auto r = tr::check_expected(h, want);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("dtype f16, expected f32"), std::string::npos)
      << r.error().message;
  want = h;
  want.transfer_id = 5;
  EXPECT_FALSE(tr::check_expected(h, want));
  want = h;
  want.kind = tr::payload::weights;
  EXPECT_FALSE(tr::check_expected(h, want));
}

TEST(WireValidation, KvBlockDescriptorRoundTripsAndChecksSizes) {
  tr::kv_block_descriptor d;
  d.transfer_id = 77;
  d.layer_begin = 2;
  d.layer_end = 4;
  d.block_tokens = 16;
  d.bytes_per_block = 4096;
  d.type = dtype::f16;
  d.block_ids = {5, 1, 9};
  d.region_key = {1, 2, 3, 4};
  d.region_bytes = 3 * 4096;
  auto back = tr::decode_kv_block_descriptor(tr::encode(d));
  ASSERT_TRUE(back) << back.error().message;
  EXPECT_EQ(*back, d);
  auto bad = d;
  bad.region_bytes = 4096;
  EXPECT_FALSE(tr::decode_kv_block_descriptor(tr::encode(bad)));
  bad = d;
  bad.layer_end = 2;
  EXPECT_FALSE(tr::decode_kv_block_descriptor(tr::encode(bad)));
}

TEST(WireValidation, RandomCorruptionNeverCrashes) {
  std::mt19937 rng(2026);
  const auto good = tr::encode(sample_header());
  tr::kv_block_descriptor d;
  d.transfer_id = 1;
  d.layer_end = 1;
  d.block_tokens = 16;
  d.bytes_per_block = 64;
  d.block_ids = {0, 1};
  d.region_bytes = 128;
  const auto good_kv = tr::encode(d);
  int refused = 0;
  for (int i = 0; i < 20000; ++i) {
    auto b = (i % 2) ? good : good_kv;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f)
      b[rng() % b.size()] ^= static_cast<std::uint8_t>(1u << (rng() % 8));
    if (i % 7 == 0) b.resize(rng() % (b.size() + 1));
    if (i % 11 == 0) b.insert(b.end(), rng() % 64, static_cast<std::uint8_t>(rng()));
    const bool ok = (i % 2) ? tr::decode_tensor_header(b).has_value()
                            : tr::decode_kv_block_descriptor(b).has_value();
    refused += ok ? 0 : 1;
  }
  // Most corruptions are caught; the rest decoded into consistent values.
  EXPECT_GT(refused, 10000);
  for (std::size_t n = 0; n < 64; ++n) {
    std::vector<std::uint8_t> junk(n * 8);
    for (auto& x : junk) x = static_cast<std::uint8_t>(rng());
    (void)tr::decode_tensor_header(junk);
    (void)tr::decode_kv_block_descriptor(junk);
  }
}

TEST(WireValidation, FramedBlobsCatchTruncationAndCorruption) {
  std::vector<std::uint8_t> body{1, 2, 3, 4, 5, 6, 7, 8, 9};
  auto blob = tr::frame(0x11223344, body);
  auto back = tr::unframe(0x11223344, blob, 100, "blob");
  ASSERT_TRUE(back);
  EXPECT_EQ(*back, body);
  EXPECT_NE(tr::unframe(0x11223345, blob, 100, "blob").error().message.find("wrong magic"),
            std::string::npos);
  EXPECT_NE(tr::unframe(0x11223344, blob, 5, "blob").error().message.find("exceeds"),
            std::string::npos);
  for (std::size_t cut = 0; cut < blob.size(); ++cut) {
    EXPECT_FALSE(tr::unframe(0x11223344, std::span(blob.data(), cut), 100, "blob")) << cut;
  }
  for (std::size_t i = 8; i < blob.size(); ++i) {
    auto b = blob;
    b[i] ^= 0x10;
    EXPECT_FALSE(tr::unframe(0x11223344, b, 100, "blob")) << i;
  }
}

TEST(WireValidation, ChunkTagsSeparateTransfersAndChunks) {
  EXPECT_NE(tr::chunk_tag(1, 0), tr::chunk_tag(2, 0));
  EXPECT_NE(tr::chunk_tag(1, 0), tr::chunk_tag(1, 1));
  EXPECT_NE(tr::header_tag(1), tr::chunk_tag(1, 65534));
  EXPECT_EQ(tr::chunk_tag(tr::max_transfer_id, 3) >> 16, tr::max_transfer_id);
}
