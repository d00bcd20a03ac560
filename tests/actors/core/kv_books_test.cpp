// The scheduler's KV books against a real models::kv_cache driven the way
// the stages drive theirs: whatever the books say a sequence holds, the
// cache holds, and a booking the books refuse is one the cache could not
// give.
#include "actors/core/kv_books.hpp"

#include <gtest/gtest.h>

#include <map>
#include <random>

#include "kernels/memory_pool.hpp"

namespace troupe::actors::core {
namespace {

struct live_seq {
  models::seq_id cache_id = 0;
  std::int64_t committed = 0;
};

/// Random reserve / commit / release rounds on both; checks agreement
/// after each.
void agree_under(const models::kv_options& layout, unsigned seed) {
  auto pool = kernels::memory_pool::create();
  auto cache = models::kv_cache::create(*pool, 1, 1, 4, layout);
  ASSERT_TRUE(cache) << cache.error().message;
  kv_books books(layout, cache->total_blocks());
  std::map<std::int64_t, live_seq> seqs;
  std::mt19937 rng(seed);
  std::int64_t next = 1, refused = 0, grown = 0;
  for (int round = 0; round < 3000; ++round) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 2 || seqs.empty()) {  // a new sequence's first chunk
      const std::int64_t chunk = 1 + static_cast<std::int64_t>(rng() % 40);
      const auto id = next++;
      if (!books.reserve(id, 0, chunk)) {
        ++refused;
        auto s = cache->add_sequence();
        EXPECT_FALSE(cache->reserve(s, chunk)) << "the books refused what the cache gives";
        cache->release(s);
        continue;
      }
      auto s = cache->add_sequence();
      ASSERT_TRUE(cache->reserve(s, chunk));
      ASSERT_TRUE(cache->commit(s, chunk));
      books.settle(id, chunk);
      seqs[id] = {s, chunk};
    } else if (op < 9) {  // an existing sequence grows by a chunk or a decode token
      auto it = std::next(seqs.begin(), static_cast<long>(rng() % seqs.size()));
      auto& q = it->second;
      const std::int64_t chunk = op < 4 ? 1 + static_cast<std::int64_t>(rng() % 20) : 1;
      if (!books.reserve(it->first, q.committed, q.committed + chunk)) {
        ++refused;
        EXPECT_FALSE(cache->reserve(q.cache_id, q.committed + chunk))
            << "the books refused what the cache gives";
        continue;
      }
      ++grown;
      ASSERT_TRUE(cache->reserve(q.cache_id, q.committed + chunk));
      q.committed += chunk;
      ASSERT_TRUE(cache->commit(q.cache_id, q.committed));
      books.settle(it->first, q.committed);
    } else {  // one ends; the store frees it, then the books
      auto it = std::next(seqs.begin(), static_cast<long>(rng() % seqs.size()));
      const auto blocks = books.release(it->first);
      cache->release(it->second.cache_id);
      books.freed(blocks);
      seqs.erase(it);
    }
    ASSERT_EQ(books.used(), cache->total_blocks() - cache->free_blocks()) << "round " << round;
  }
  EXPECT_GT(refused, 10) << "the pool was never full: the test would prove little";
  EXPECT_GT(grown, 1000);
}

TEST(KvBooks, AgreeWithTheCacheWithoutAWindow) {
  models::kv_options o;
  o.block_size = 4;
  o.capacity_tokens = 400;
  agree_under(o, 1);
}

TEST(KvBooks, AgreeWithTheCacheUnderASlidingWindowWithSinks) {
  models::kv_options o;
  o.block_size = 4;
  o.capacity_tokens = 400;
  o.window = 24;
  o.sinks = 5;
  agree_under(o, 2);
}

TEST(KvBooks, ReleasedBlocksStayUsedUntilFreedAndClearForgetsAll) {
  models::kv_options o;
  o.block_size = 16;
  kv_books books(o, 10);
  ASSERT_TRUE(books.reserve(1, 0, 40));   // 3 blocks
  ASSERT_TRUE(books.reserve(2, 0, 100));  // 7 blocks
  EXPECT_EQ(books.available(), 0);
  EXPECT_FALSE(books.reserve(3, 0, 1));
  EXPECT_EQ(books.held(3), 0) << "a refused booking leaves nothing behind";
  EXPECT_EQ(books.release(1), 3);
  EXPECT_EQ(books.available(), 0) << "not free until the stores freed it";
  books.freed(3);
  EXPECT_EQ(books.available(), 3);
  EXPECT_EQ(books.peak(), 10);
  books.clear();
  EXPECT_EQ(books.used(), 0);
  EXPECT_EQ(books.held(2), 0);
  EXPECT_TRUE(books.fits_alone(160));
  EXPECT_FALSE(books.fits_alone(162)) << "161 tokens committed + 1 need 11 blocks";
}

}  // namespace
}  // namespace troupe::actors::core
