// The scheduler's KV books against a real models::kv_cache driven the way
// the stages drive theirs: whatever the books say a sequence holds, the
// cache holds, and a booking the books refuse is one the cache could not
// give.
#include "actors/core/kv_books.hpp"

#include <gtest/gtest.h>

#include <algorithm>
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

// -- naming books (prefix caching) -------------------------------------------------------------

// Random rounds of what the scheduler does with naming books (new
// sequences taking cached prefixes, growth, naming full blocks, settling,
// ends), each step's delta applied to a real cache in named mode the way a
// stage applies it. After every round: the cache's tables are the books'
// tables, an id is in two live tables only when it is a named block both
// took, `used` counts the distinct held ids, and nothing is booked past
// the pool.
TEST(KvBooks, NamingBooksAndANamedCacheAgreeUnderRandomTraffic) {
  models::kv_options layout;
  layout.block_size = 4;
  layout.capacity_tokens = 160;  // 40 blocks
  auto pool = kernels::memory_pool::create();
  auto cache = models::kv_cache::create(*pool, 1, 1, 4, layout);
  ASSERT_TRUE(cache);
  ASSERT_TRUE(cache->name_blocks());
  kv_books books(layout, cache->total_blocks(), true);
  ASSERT_TRUE(books.names_blocks());
  struct live {
    models::seq_id cache_id = 0;
    std::int64_t committed = 0;
    std::int64_t prefix = 0;  // which of the 4 prompt families it extends
    std::int64_t named = 0;
  };
  // Four families of prompts: block i of family f is named (f, i).
  auto name = [](std::int64_t f, std::int64_t i) {
    return sha256("family " + std::to_string(f) + " block " + std::to_string(i));
  };
  std::map<std::int64_t, live> seqs;
  std::mt19937 rng(7);
  std::int64_t next = 1, hits = 0;
  auto apply_delta = [&](std::int64_t id, live& q) {
    auto d = books.take_delta(id);
    if (d.from < 0) return;
    ASSERT_TRUE(cache->assign(q.cache_id, d.from, d.ids, q.committed));
  };
  for (int round = 0; round < 4000; ++round) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 2 || seqs.empty()) {  // a new sequence: take a cached prefix, then a chunk
      const auto id = next++;
      live q;
      q.prefix = static_cast<std::int64_t>(rng() % 4);
      std::vector<block_hash> names;
      for (std::int64_t i = 0; i < 6; ++i) names.push_back(name(q.prefix, i));
      const auto got = books.attach(id, names);
      EXPECT_EQ(got, books.cached_prefix(names));
      hits += got;
      q.committed = got * layout.block_size;
      q.named = got;
      const std::int64_t chunk = 1 + static_cast<std::int64_t>(rng() % 20);
      if (!books.reserve(id, q.committed, q.committed + chunk)) {
        books.release(id);
        continue;
      }
      q.cache_id = cache->add_sequence();
      apply_delta(id, q);
      ASSERT_TRUE(cache->reserve(q.cache_id, q.committed + chunk));
      q.committed += chunk;
      ASSERT_TRUE(cache->commit(q.cache_id, q.committed));
      books.settle(id, q.committed);
      seqs[id] = q;
    } else if (op < 8) {  // growth, then full blocks of the family's chain get their names
      auto it = std::next(seqs.begin(), static_cast<long>(rng() % seqs.size()));
      auto& q = it->second;
      const std::int64_t chunk = op < 4 ? 1 + static_cast<std::int64_t>(rng() % 12) : 1;
      if (!books.reserve(it->first, q.committed, q.committed + chunk + 3)) continue;  // ahead
      apply_delta(it->first, q);
      ASSERT_TRUE(cache->reserve(q.cache_id, q.committed + chunk));
      q.committed += chunk;
      ASSERT_TRUE(cache->commit(q.cache_id, q.committed));
      books.settle(it->first, q.committed);
      for (; q.named < std::min<std::int64_t>(6, q.committed / layout.block_size); ++q.named)
        books.publish(it->first, q.named, name(q.prefix, q.named));
    } else {  // the sequence ends
      auto it = std::next(seqs.begin(), static_cast<long>(rng() % seqs.size()));
      books.release(it->first);
      cache->release(it->second.cache_id);
      seqs.erase(it);
    }
    // Agreement and sharing.
    std::map<std::int32_t, int> owners;
    for (const auto& [id, q] : seqs) {
      const auto want = books.table(id);
      const auto have = cache->block_table(q.cache_id);
      // The cache may keep a stale tail the books let go (settle) until
      // the sequence's next delta; it holds no tokens.
      ASSERT_GE(have.size(), want.size());
      ASSERT_TRUE(std::equal(want.begin(), want.end(), have.begin()))
          << "round " << round << " seq " << id;
      ASSERT_LE(cache->length(q.cache_id),
                static_cast<std::int64_t>(want.size()) * layout.block_size);
      for (auto b : want) {
        ASSERT_GE(b, 1);
        ASSERT_LE(b, books.total());
        ++owners[b];
      }
    }
    ASSERT_EQ(books.used(), static_cast<std::int64_t>(owners.size())) << "round " << round;
    ASSERT_LE(books.used() + books.cached_free(), books.total());
    for (const auto& [b, n] : owners)
      if (n > 1) {
        // Shared: it must be the same named block in each.
        std::int64_t family = -1, index = -1;
        for (const auto& [id, q] : seqs) {
          const auto t = books.table(id);
          for (std::size_t i = 0; i < t.size(); ++i)
            if (t[i] == b) {
              if (family >= 0) {
                EXPECT_EQ(q.prefix, family) << "block " << b << " shared across families";
                EXPECT_EQ(static_cast<std::int64_t>(i), index);
              }
              family = q.prefix;
              index = static_cast<std::int64_t>(i);
            }
        }
      }
  }
  EXPECT_GT(hits, 100) << "the traffic exercised the cache";
  EXPECT_GT(books.evictions(), 0) << "and its eviction";
}

TEST(KvBooks, CachedBlocksCountAsFreeAndAreEvictedLeastRecentlyUsedTailFirst) {
  models::kv_options o;
  o.block_size = 4;
  kv_books books(o, 6, true);
  ASSERT_TRUE(books.reserve(1, 0, 12));  // 3 blocks
  const auto t1 = std::vector<std::int32_t>(books.table(1).begin(), books.table(1).end());
  const std::vector<block_hash> a = {sha256("a0"), sha256("a1"), sha256("a2")};
  for (int i = 0; i < 3; ++i) books.publish(1, i, a[static_cast<std::size_t>(i)]);
  EXPECT_EQ(books.release(1), 0) << "naming books free at once";
  EXPECT_EQ(books.used(), 0);
  EXPECT_EQ(books.available(), 6) << "cached blocks nobody holds count as free";
  EXPECT_EQ(books.cached_free(), 3);
  // A twin: another sequence computed the same first block; its copy stays private.
  ASSERT_TRUE(books.reserve(2, 0, 4));
  books.publish(2, 0, a[0]);
  EXPECT_EQ(books.named(), 3);
  books.release(2);
  // Booking 4 blocks: 3 free ones, then the LRU tail of chain a (its last block).
  ASSERT_TRUE(books.reserve(3, 0, 16));
  EXPECT_EQ(books.evictions(), 1);
  EXPECT_EQ(books.cached_prefix(a), 2) << "the tail went first; the head is still cached";
  const auto t3 = books.table(3);
  EXPECT_EQ(std::count(t3.begin(), t3.end(), t1[2]), 1) << "the evicted block was reused";
  // Taking the cached head: both blocks are held again, by a new sequence.
  EXPECT_EQ(books.attach(4, a), 2);
  EXPECT_EQ(books.used(), 6);
  EXPECT_EQ(books.available(), 0);
  EXPECT_FALSE(books.reserve(4, 8, 12)) << "nothing left to evict";
  auto d = books.take_delta(4);
  EXPECT_EQ(d.from, 0);
  EXPECT_EQ(d.ids, std::vector<std::int32_t>(t1.begin(), t1.begin() + 2));
  EXPECT_EQ(books.take_delta(4).from, -1) << "a delta is taken once";
  // Forgetting names: held blocks stay held (private now), nothing cached.
  books.release(3);
  EXPECT_EQ(books.forget_names(), 0) << "no cached block was free";
  EXPECT_EQ(books.named(), 0);
  books.release(4);
  EXPECT_EQ(books.cached_free(), 0);
  EXPECT_EQ(books.available(), 6);
}

TEST(BlockHash, Sha256MatchesTheStandardsTestVectorAndChainsDependOnEveryInput) {
  // FIPS 180-2, appendix B.1.
  EXPECT_EQ(to_hex(sha256("abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const auto root = root_hash("model", "");
  const std::vector<std::int32_t> toks = {1, 2, 3, 4};
  const auto h = chain_hash(root, toks, {});
  EXPECT_EQ(h, chain_hash(root, toks, {}));
  EXPECT_NE(h, chain_hash(root_hash("model", "salt"), toks, {}));
  EXPECT_NE(h, chain_hash(root_hash("model2", ""), toks, {}));
  EXPECT_NE(root_hash("ab", "c"), root_hash("a", "bc")) << "fields are length-prefixed";
  EXPECT_NE(h, chain_hash(root, std::vector<std::int32_t>{1, 2, 3, 5}, {}));
  const std::vector<block_hash> img = {sha256("pixels")};
  EXPECT_NE(h, chain_hash(root, toks, img));
  // A chain: block 1's name depends on block 0's tokens.
  block_chain x(root, 2, -1, 0, {}), y(root, 2, -1, 0, {});
  x.extend(std::vector<std::int32_t>{1, 2, 3, 4, 5});
  y.extend(std::vector<std::int32_t>{9, 2, 3, 4});
  ASSERT_EQ(x.hashes().size(), 2u) << "full blocks only";
  ASSERT_EQ(y.hashes().size(), 2u);
  EXPECT_NE(x.hashes()[1], y.hashes()[1]);
  // Extending in pieces gives the names extending at once gives.
  block_chain z(root, 2, -1, 0, {});
  z.extend(std::vector<std::int32_t>{1, 2, 3});
  z.extend(std::vector<std::int32_t>{1, 2, 3, 4, 5});
  EXPECT_EQ(z.hashes(), x.hashes());
}

// A partly filled block's name: never a full block's (its token count is
// in it), and it depends on its parent, its tokens and its images.
TEST(BlockHash, APartialBlockNameDependsOnItsTokensParentAndImages) {
  const auto root = root_hash("model", "");
  const std::vector<std::int32_t> toks = {1, 2, 3, 4, 5, 6, 7};
  block_chain x(root, 4, -1, 0, {});
  x.extend(toks);
  ASSERT_EQ(x.hashes().size(), 1u);
  const auto p = x.partial(toks, 1, 7);  // positions 4..6
  ASSERT_TRUE(p);
  EXPECT_EQ(*p, chain_hash(x.hashes()[0], std::vector<std::int32_t>{5, 6, 7}, {}));
  EXPECT_NE(*p, *x.partial(toks, 1, 6));
  auto other = toks;
  other[0] = 9;  // another parent
  block_chain y(root, 4, -1, 0, {});
  y.extend(other);
  EXPECT_NE(*p, *y.partial(other, 1, 7));
  EXPECT_FALSE(x.partial(toks, 1, 4)) << "empty";
  EXPECT_FALSE(x.partial(toks, 0, 4)) << "a full block";
  EXPECT_FALSE(x.partial(toks, 2, 7)) << "past the named blocks";
  // Image rows (token 0, two rows per image) bring their image in.
  const std::vector<std::int32_t> img = {1, 0, 0, 2, 0, 0, 3};
  block_chain a(root, 4, 0, 2, {sha256("a"), sha256("b")});
  block_chain b(root, 4, 0, 2, {sha256("a"), sha256("c")});
  a.extend(img);
  b.extend(img);
  EXPECT_EQ(a.hashes(), b.hashes()) << "the first block holds rows of image a only";
  EXPECT_NE(*a.partial(img, 1, 7), *b.partial(img, 1, 7)) << "the second image differs";
}

// Items of their own row counts (images and audio clips in prompt order):
// each block names the items whose rows it holds, once each, in order.
TEST(BlockHash, ItemsOfTheirOwnRowCountsNameTheirBlocks) {
  const auto root = root_hash("model", "");
  const auto ha = sha256("clip a"), hb = sha256("image b");
  // Markers (0): 3 rows of item a, then 5 of item b; blocks of 4.
  const std::vector<std::int32_t> toks = {0, 0, 0, 0, 0, 0, 0, 0, 7, 8, 9};
  block_chain c(root, 4, 0, std::vector<std::int64_t>{3, 5}, {ha, hb});
  c.extend(toks);
  ASSERT_EQ(c.hashes().size(), 2u);
  const auto first = chain_hash(root, std::span(toks).first(4), std::vector{ha, hb});
  EXPECT_EQ(c.hashes()[0], first) << "rows 0-3: a's three and b's first";
  EXPECT_EQ(c.hashes()[1], chain_hash(first, std::span(toks).subspan(4, 4), std::vector{hb}))
      << "rows 4-7: b's";
  EXPECT_EQ(*c.partial(toks, 2, 11), chain_hash(c.hashes()[1], std::span(toks).subspan(8), {}));
  // Equal counts name blocks as the fixed-count chain does.
  block_chain fixed(root, 4, 0, 4, {ha, hb});
  block_chain items(root, 4, 0, std::vector<std::int64_t>{4, 4}, {ha, hb});
  fixed.extend(toks);
  items.extend(toks);
  EXPECT_EQ(fixed.hashes(), items.hashes());
  EXPECT_NE(c.hashes(), fixed.hashes()) << "the counts decide which item a row is";
}

}  // namespace
}  // namespace troupe::actors::core
