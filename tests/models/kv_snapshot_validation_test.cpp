// Bad KV snapshots are clear errors that leave the cache unchanged: another
// shape, dtype or window policy, a wrong length, truncated or padded data,
// live block indices out of order, repeated, negative, beyond the length or
// inside the window's holes, and imports when blocks run out. (Runs under
// ASan+UBSan in CI.)
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/kv_cache.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

void expect_same(const kv_usage& a, const kv_usage& b) {
  EXPECT_EQ(a.total_blocks, b.total_blocks);
  EXPECT_EQ(a.free_blocks, b.free_blocks);
  EXPECT_EQ(a.sequences, b.sequences);
  EXPECT_EQ(a.tokens, b.tokens);
}

// A sequence of `n` tokens (keys and values left as the pool had them).
seq_id grow(kv_cache& c, std::int64_t n) {
  const seq_id s = c.add_sequence();
  for (std::int64_t len = 1; len <= n; ++len) {
    EXPECT_TRUE(c.reserve(s, len));
    EXPECT_TRUE(c.commit(s, len));
  }
  return s;
}

}  // namespace

TEST(KvSnapshotValidation, MismatchedOrCorruptSnapshotsAreRejected) {
  auto pool = k::memory_pool::create();
  const kv_options opts{
      .block_size = 4, .type = k::dtype::i8, .capacity_tokens = 128, .window = 9, .sinks = 3};
  auto cache = kv_cache::create(*pool, 2, 2, 8, opts);
  ASSERT_TRUE(cache);
  const seq_id s = grow(*cache, 30);
  auto snap = cache->export_sequence(s);
  ASSERT_TRUE(snap) << snap.error().message;
  // 30 tokens in blocks of 4: 8 entries; window start 22: blocks 1..4 are holes.
  ASSERT_EQ(snap->live, (std::vector<std::int32_t>{0, 5, 6, 7}));
  const kv_usage before = cache->usage();

  using mutation = std::pair<const char*, std::function<void(kv_snapshot&)>>;
  const std::vector<mutation> bad{
      {"more layers", [](kv_snapshot& x) { x.layers = 3; }},
      {"fewer layers", [](kv_snapshot& x) { x.layers = 1; }},
      {"no layers", [](kv_snapshot& x) { x.layers = 0; }},
      {"heads", [](kv_snapshot& x) { x.n_kv_heads = 1; }},
      {"head_dim", [](kv_snapshot& x) { x.head_dim = 16; }},
      {"negative head_dim", [](kv_snapshot& x) { x.head_dim = -8; }},
      {"block size", [](kv_snapshot& x) { x.block_size = 8; }},
      {"zero block size", [](kv_snapshot& x) { x.block_size = 0; }},
      {"dtype f16", [](kv_snapshot& x) { x.type = k::dtype::f16; }},
      {"dtype f32", [](kv_snapshot& x) { x.type = k::dtype::f32; }},
      {"dtype q4_0", [](kv_snapshot& x) { x.type = k::dtype::q4_0; }},
      {"no window", [](kv_snapshot& x) { x.window = 0; }},
      {"another window", [](kv_snapshot& x) { x.window = 10; }},
      {"other sinks", [](kv_snapshot& x) { x.sinks = 0; }},
      {"negative length", [](kv_snapshot& x) { x.length = -1; }},
      {"a block longer", [](kv_snapshot& x) { x.length += 4; }},
      {"much shorter", [](kv_snapshot& x) { x.length = 3; }},
      {"huge length", [](kv_snapshot& x) { x.length = std::int64_t{1} << 50; }},
      {"too many table entries", [](kv_snapshot& x) { x.length = std::int64_t{1} << 36; }},
      {"length at int64 max", [](kv_snapshot& x) { x.length = INT64_MAX; }},
      {"truncated data", [](kv_snapshot& x) { x.data.pop_back(); }},
      {"one block short", [](kv_snapshot& x) { x.data.resize(x.data.size() - x.block_bytes()); }},
      {"extra byte", [](kv_snapshot& x) { x.data.push_back(std::byte{1}); }},
      {"no data", [](kv_snapshot& x) { x.data.clear(); }},
      {"out of order", [](kv_snapshot& x) { std::swap(x.live[1], x.live[2]); }},
      {"repeated", [](kv_snapshot& x) { x.live[2] = x.live[1]; }},
      {"negative index", [](kv_snapshot& x) { x.live[0] = -1; }},
      {"beyond the length", [](kv_snapshot& x) { x.live[3] = 8; }},
      {"far beyond", [](kv_snapshot& x) { x.live[3] = INT32_MAX; }},
      {"a hole as live", [](kv_snapshot& x) { x.live[1] = 4; }},
      {"a live block missing", [](kv_snapshot& x) { x.live.pop_back(); }},
      {"an extra live block", [](kv_snapshot& x) { x.live.insert(x.live.begin() + 1, 2); }},
      {"no live blocks", [](kv_snapshot& x) { x.live.clear(); }},
  };
  for (const auto& [what, mutate] : bad) {
    SCOPED_TRACE(what);
    kv_snapshot x = *snap;
    mutate(x);
    auto r = cache->import_sequence(x);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code, k::errc::invalid_argument) << r.error().message;
    EXPECT_FALSE(r.error().message.empty());
    expect_same(cache->usage(), before);
  }
  // The unchanged snapshot still imports, and the copy holds the same blocks.
  auto id = cache->import_sequence(*snap);
  ASSERT_TRUE(id) << id.error().message;
  EXPECT_EQ(cache->length(*id), 30);
  EXPECT_EQ(cache->usage().free_blocks, before.free_blocks - 4);
  auto again = cache->export_sequence(*id);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->live, snap->live);
  EXPECT_EQ(again->data, snap->data);
}

TEST(KvSnapshotValidation, UnknownSequencesAndEmptySequences) {
  auto pool = k::memory_pool::create();
  auto cache = kv_cache::create(*pool, 1, 1, 4, kv_options{.block_size = 4, .capacity_tokens = 16});
  ASSERT_TRUE(cache);
  auto none = cache->export_sequence(42);
  ASSERT_FALSE(none);
  EXPECT_EQ(none.error().code, k::errc::invalid_argument);
  // A sequence with no tokens (but reserved room) exports as nothing.
  const seq_id s = cache->add_sequence();
  ASSERT_TRUE(cache->reserve(s, 6));
  auto empty = cache->export_sequence(s);
  ASSERT_TRUE(empty);
  EXPECT_EQ(empty->length, 0);
  EXPECT_TRUE(empty->live.empty());
  EXPECT_TRUE(empty->data.empty());
  const std::int64_t free = cache->free_blocks();
  auto id = cache->import_sequence(*empty);
  ASSERT_TRUE(id);
  EXPECT_NE(*id, s);
  EXPECT_EQ(cache->length(*id), 0);
  EXPECT_EQ(cache->free_blocks(), free);
  // A snapshot with the fields left at their defaults does not fit.
  EXPECT_FALSE(cache->import_sequence(kv_snapshot{}));
  EXPECT_EQ(kv_snapshot{}.block_bytes(), 0u);
}

TEST(KvSnapshotValidation, ImportWithoutEnoughBlocksChangesNothing) {
  auto pool = k::memory_pool::create();
  for (int window : {0, 6}) {
    SCOPED_TRACE(window);
    const kv_options opts{
        .block_size = 4, .capacity_tokens = 40, .window = window, .sinks = window ? 2 : 0};
    auto cache = kv_cache::create(*pool, 2, 1, 4, opts);
    ASSERT_TRUE(cache);
    ASSERT_EQ(cache->total_blocks(), 10);
    // Without a window, 24 tokens hold 6 blocks; with one, 22 tokens hold 3
    // (block 0 for the sinks, 4 and 5 for the window) and a second sequence
    // fills the rest.
    const seq_id a = grow(*cache, window ? 22 : 24);
    const seq_id b = window ? grow(*cache, 22) : cache->add_sequence();
    if (window) {
      ASSERT_TRUE(cache->reserve(b, 40));  // room for 40 tokens: the pool is full
    }
    auto snap = cache->export_sequence(a);
    ASSERT_TRUE(snap);
    const kv_usage before = cache->usage();
    ASSERT_LT(before.free_blocks, static_cast<std::int64_t>(snap->live.size()));
    auto r = cache->import_sequence(*snap);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code, k::errc::out_of_memory);
    expect_same(cache->usage(), before);
    EXPECT_EQ(cache->length(a), snap->length);
    cache->release(a);
    auto id = cache->import_sequence(*snap);
    ASSERT_TRUE(id) << id.error().message;
    expect_same(cache->usage(), before);
    cache->release(*id);
    cache->release(b);
    EXPECT_EQ(cache->free_blocks(), 10);
  }
}
