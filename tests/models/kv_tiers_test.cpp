// The lower KV tiers of a stage (models/kv_tiers): a block moved from the
// device cache to host memory, on to the disk file and back into another
// device block carries every byte of every layer (k, v, int8 scales, key
// summaries), through a device whose memory host code cannot touch too; a
// move outside the store is refused before anything moves; the disk tier's
// file is gone from its folder at once.
#include "models/kv_tiers.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_device.hpp"
#include "tests/remote_memory_device.hpp"
#include "tests/temp_path.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

constexpr std::uint8_t dev = 0, host = 1, disk = 2;

/// A cache of `opts` on `d` with one sequence of 23 tokens of random keys
/// and values in it; returns its block table.
std::vector<std::int32_t> fill(k::device& d, kv_cache& c, std::uint32_t seed) {
  auto pool = k::memory_pool::create();
  std::mt19937 rng(seed);
  std::normal_distribution<float> val(0.0f, 1.0f);
  const auto s = c.add_sequence();
  const std::int64_t n = 23;
  EXPECT_TRUE(c.reserve(s, n));
  const auto& cfg = c.layer(0).config;
  const std::int64_t per = static_cast<std::int64_t>(cfg.n_kv_heads) * cfg.head_dim;
  for (int l = 0; l < c.layers(); ++l) {
    std::vector<float> kv(static_cast<std::size_t>(2 * n * per));
    for (auto& x : kv) x = val(rng);
    auto kt = k::tensor::empty(d.memory(), k::dtype::f32, {n, cfg.n_kv_heads, cfg.head_dim});
    auto vt = k::tensor::empty(d.memory(), k::dtype::f32, {n, cfg.n_kv_heads, cfg.head_dim});
    EXPECT_TRUE(kt && vt);
    const auto bytes = static_cast<std::size_t>(n * per) * sizeof(float);
    EXPECT_TRUE(d.write(*kt, std::as_bytes(std::span(kv).first(bytes / sizeof(float)))));
    EXPECT_TRUE(d.write(*vt, std::as_bytes(std::span(kv).subspan(bytes / sizeof(float)))));
    EXPECT_TRUE(d.append_kv(c.layer(l), c.block_table(s), 0, *kt, *vt));
  }
  EXPECT_TRUE(c.commit(s, n));
  const auto t = c.block_table(s);
  return {t.begin(), t.end()};
}

void round_trip(k::device& d) {
  for (auto type : {k::dtype::f32, k::dtype::f16, k::dtype::i8}) {
    SCOPED_TRACE(std::string(k::to_string(type)));
    const kv_options opts{.block_size = 8, .type = type, .capacity_tokens = 128, .summaries = true};
    auto c = kv_cache::create(d, 3, 2, 16, opts);
    ASSERT_TRUE(c) << c.error().message;
    const auto table = fill(d, *c, 5);
    ASSERT_EQ(table.size(), 3u);
    const auto bytes = c->slot_bytes();
    // 3 layers of k, v (+ i8 scales) and summaries, 2 heads x 8 slots x 16.
    const std::size_t e = k::block_bytes(type);
    EXPECT_EQ(bytes, 3 * (2 * 2 * 8 * 16 * e + (type == k::dtype::i8 ? 2 * 2 * 8 * 4 : 0) +
                          2 * 2 * 16 * 4));
    const auto dir = test::temp_path("kv-tiers");
    std::filesystem::create_directories(dir);
    auto tiers = kv_tiers::create(bytes, 4, 4, dir);
    ASSERT_TRUE(tiers) << tiers.error().message;
    std::vector<std::vector<std::byte>> before;
    for (auto id : table) {
      before.emplace_back(bytes);
      ASSERT_TRUE(c->read_block(id, before.back()));
    }
    // Each block: device -> host -> disk -> a block nobody uses.
    std::vector<kv_move> moves;
    const std::int32_t spare = 10;  // of 16, beyond the sequence's 3
    for (std::size_t i = 0; i < table.size(); ++i) {
      const auto slot = static_cast<std::int32_t>(i);
      moves.push_back({dev, table[i], host, slot});
      moves.push_back({host, slot, disk, 3 - slot});
      moves.push_back({disk, 3 - slot, dev, spare + slot});
    }
    ASSERT_TRUE((*tiers)->apply(*c, moves));
    EXPECT_EQ((*tiers)->moves(), 9);
    EXPECT_EQ((*tiers)->bytes_moved(), static_cast<std::int64_t>(9 * bytes));
    for (std::size_t i = 0; i < table.size(); ++i) {
      std::vector<std::byte> after(bytes);
      ASSERT_TRUE(c->read_block(spare + static_cast<std::int32_t>(i), after));
      EXPECT_EQ(after, before[i]) << "block " << i;
    }
  }
}

}  // namespace

TEST(KvTierStore, ABlockComesBackBitIdenticalThroughHostAndDisk) {
  auto cpu = k::cpu::cpu_device::with_threads(1);
  round_trip(*cpu);
}

TEST(KvTierStore, ThroughADeviceWhoseMemoryIsNotTheHosts) {
  test::remote_memory_device remote(1);
  round_trip(remote);
}

TEST(KvTierStore, AMoveOutsideTheStoreIsRefusedBeforeAnythingMoves) {
  auto cpu = k::cpu::cpu_device::with_threads(1);
  auto c = kv_cache::create(*cpu, 1, 1, 4, kv_options{.block_size = 4, .capacity_tokens = 32});
  ASSERT_TRUE(c);
  const auto table = fill(*cpu, *c, 3);
  auto tiers = kv_tiers::create(c->slot_bytes(), 2, 0, {});
  ASSERT_TRUE(tiers);
  std::vector<std::byte> zero(c->slot_bytes()), got(c->slot_bytes());
  for (const auto& bad : std::vector<std::vector<kv_move>>{
           {{dev, table[0], host, 0}, {host, 0, dev, 0}},         // block 0 is the hole
           {{dev, table[0], host, 1}, {dev, table[1], host, 2}},  // slot 2 of 2
           {{dev, table[0], disk, 0}},                            // no disk tier
           {{dev, table[0], dev, 5}},                             // not between tiers
           {{dev, 9, host, 0}, {7, 0, dev, 3}}}) {                // no tier 7
    auto r = (*tiers)->apply(*c, bad);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code, k::errc::invalid_argument);
  }
  EXPECT_EQ((*tiers)->moves(), 0);
  // Slots not written are zero: nothing moved into host slot 1.
  ASSERT_TRUE((*tiers)->apply(*c, std::vector<kv_move>{{host, 1, dev, 6}}));
  ASSERT_TRUE(c->read_block(6, got));
  EXPECT_EQ(got, zero);
  // A slot of another size is refused too.
  auto other = kv_tiers::create(c->slot_bytes() + 4, 2, 0, {});
  ASSERT_TRUE(other);
  EXPECT_FALSE((*other)->apply(*c, std::vector<kv_move>{{dev, table[0], host, 0}}));
  EXPECT_FALSE(c->read_block(0, got));
  EXPECT_FALSE(c->read_block(static_cast<std::int32_t>(c->total_blocks()) + 1, got));
}

TEST(KvTierStore, TheDiskFileLeavesNoNameAndAMissingFolderIsAClearError) {
  const auto dir = test::temp_path("kv-disk");
  std::filesystem::create_directories(dir);
  {
    auto t = kv_tiers::create(4096, 0, 16, dir);
    ASSERT_TRUE(t) << t.error().message;
    EXPECT_EQ((*t)->disk_slots(), 16);
    EXPECT_TRUE(std::filesystem::is_empty(dir)) << "the file is unlinked once mapped";
  }
  auto missing = kv_tiers::create(4096, 0, 16, dir + "/not-there");
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().code, k::errc::io_error);
  EXPECT_NE(missing.error().message.find("not-there"), std::string::npos);
  auto huge = kv_tiers::create(std::size_t{1} << 30, std::int64_t{1} << 30, 0, {});
  ASSERT_FALSE(huge);
  EXPECT_EQ(huge.error().code, k::errc::invalid_argument);
  // A host tier larger than the machine's memory (4 TiB here) is refused
  // up front, not left to fail page by page.
  auto more = kv_tiers::create(std::size_t{1} << 30, std::int64_t{1} << 12, 0, {});
  ASSERT_FALSE(more);
  EXPECT_EQ(more.error().code, k::errc::out_of_memory);
  EXPECT_NE(more.error().message.find("exceed this machine's"), std::string::npos)
      << more.error().message;
}
