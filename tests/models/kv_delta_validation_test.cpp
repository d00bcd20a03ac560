// KV deltas for live migration: a sequence copied whole, then extended by
// the blocks that changed while it grew (kv_cache::import_tail), ends up
// identical to the source; a bad delta is a clear error that leaves the
// cache unchanged. (Runs under ASan+UBSan in CI.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "models/kv_cache.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

// Fills every block of every layer with random bytes, so each block's
// content is its own (f32 data stays finite: small random integers).
void scramble(kv_cache& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  for (int l = 0; l < c.layers(); ++l) {
    auto& layer = c.layer(l);
    for (auto* t : {&layer.k, &layer.v, &layer.k_scales, &layer.v_scales}) {
      if (t->data() == nullptr || t->nbytes() == 0) continue;
      if (t->type() == k::dtype::f32) {
        auto* p = t->data_as<float>();
        for (std::int64_t i = 0; i < t->shape().numel(); ++i)
          p[i] = static_cast<float>(rng() % 2001) - 1000.0f;
      } else {
        auto* p = t->data_as<std::uint8_t>();
        for (std::size_t i = 0; i < t->nbytes(); ++i) p[i] = static_cast<std::uint8_t>(rng());
      }
    }
  }
}

void grow_to(kv_cache& c, seq_id s, std::int64_t n) {
  for (std::int64_t len = c.length(s) + 1; len <= n; ++len) {
    ASSERT_TRUE(c.reserve(s, len));
    ASSERT_TRUE(c.commit(s, len));
  }
}

void expect_same_sequence(const kv_cache& a, seq_id sa, const kv_cache& b, seq_id sb) {
  auto x = a.export_sequence(sa);
  auto y = b.export_sequence(sb);
  ASSERT_TRUE(x && y);
  EXPECT_EQ(x->length, y->length);
  EXPECT_EQ(x->live, y->live);
  EXPECT_TRUE(x->data == y->data) << "the copies' KV bytes differ";
}

class KvDelta : public ::testing::TestWithParam<k::dtype> {};

}  // namespace

TEST_P(KvDelta, RoundsOfDeltasRebuildTheSequence) {
  auto pool = k::memory_pool::create();
  const kv_options opts{.block_size = 4, .type = GetParam(), .capacity_tokens = 256};
  auto src = kv_cache::create(*pool, 3, 2, 8, opts);
  auto dst = kv_cache::create(*pool, 3, 2, 8, opts);
  ASSERT_TRUE(src && dst);
  scramble(*src, 1);
  scramble(*dst, 2);                         // stale data in the target's free blocks
  const seq_id other = src->add_sequence();  // another sequence in between: block ids differ
  const seq_id s = src->add_sequence();
  grow_to(*src, other, 6);
  grow_to(*src, s, 10);
  // Round 1: the whole sequence.
  auto whole = src->export_sequence(s);
  ASSERT_TRUE(whole);
  auto t = dst->import_sequence(*whole);
  ASSERT_TRUE(t) << t.error().message;
  expect_same_sequence(*src, s, *dst, *t);
  // The source grows (the partial block 2 fills, blocks 3 and 4 are new);
  // each round sends the blocks from the one that was partial.
  std::int64_t copied = 10;
  for (std::int64_t to : {23, 24, 30, 30, 41}) {
    grow_to(*src, s, to);
    scramble(*src, static_cast<std::uint32_t>(
                       to));  // new content everywhere: the delta must carry the sent blocks' own
    const auto from = static_cast<std::int32_t>(copied / 4);
    auto d = src->export_sequence(s, from);
    ASSERT_TRUE(d) << d.error().message;
    EXPECT_EQ(d->live.empty() ? -1 : d->live.front(), d->live.empty() ? -1 : from);
    const auto before = dst->usage();
    auto r = dst->import_tail(*t, *d, from);
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_EQ(dst->length(*t), to);
    EXPECT_EQ(dst->usage().free_blocks, before.free_blocks - ((to + 3) / 4 - (copied + 3) / 4));
    // Blocks before `from` were not sent: they keep round 1's content, so
    // compare only the sent range.
    auto mine = dst->export_sequence(*t, from);
    ASSERT_TRUE(mine);
    EXPECT_EQ(mine->live, d->live);
    EXPECT_TRUE(mine->data == d->data) << "the delta landed elsewhere";
    copied = to;
  }
}

TEST_P(KvDelta, AUnchangedSourceGivesAnIdenticalCopy) {
  auto pool = k::memory_pool::create();
  const kv_options opts{.block_size = 4, .type = GetParam(), .capacity_tokens = 256};
  auto src = kv_cache::create(*pool, 2, 2, 8, opts);
  auto dst = kv_cache::create(*pool, 2, 2, 8, opts);
  ASSERT_TRUE(src && dst);
  scramble(*src, 7);
  const seq_id s = src->add_sequence();
  grow_to(*src, s, 9);
  auto t = dst->import_sequence(*src->export_sequence(s));
  ASSERT_TRUE(t);
  for (std::int64_t to : {13, 16, 17, 35}) {  // the source grows; its committed slots never change
    const auto from = static_cast<std::int32_t>(dst->length(*t) / 4);
    // New slots get new values in the source (as a decode step writes them).
    grow_to(*src, s, to);
    auto d = src->export_sequence(s, from);
    ASSERT_TRUE(d);
    ASSERT_TRUE(dst->import_tail(*t, *d, from));
    expect_same_sequence(*src, s, *dst, *t);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, KvDelta,
                         ::testing::Values(k::dtype::f32, k::dtype::f16, k::dtype::i8));

TEST(KvDeltaValidation, BadDeltasAreRefusedAndChangeNothing) {
  auto pool = k::memory_pool::create();
  const kv_options opts{.block_size = 4, .type = k::dtype::f32, .capacity_tokens = 64};
  auto src = kv_cache::create(*pool, 2, 2, 8, opts);
  auto dst = kv_cache::create(*pool, 2, 2, 8, opts);
  ASSERT_TRUE(src && dst);
  scramble(*src, 3);
  const seq_id s = src->add_sequence();
  grow_to(*src, s, 10);
  auto t = dst->import_sequence(*src->export_sequence(s));
  ASSERT_TRUE(t);
  grow_to(*src, s, 21);
  const auto good = src->export_sequence(s, 2);
  ASSERT_TRUE(good);
  const auto usage = dst->usage();
  const auto held = dst->export_sequence(*t);
  auto expect_refused = [&](const char* what, kv_snapshot x, std::int32_t from, seq_id target) {
    auto r = dst->import_tail(target, x, from);
    ASSERT_FALSE(r) << what;
    EXPECT_EQ(r.error().code, k::errc::invalid_argument) << what;
    EXPECT_FALSE(r.error().message.empty());
    EXPECT_EQ(dst->usage().free_blocks, usage.free_blocks) << what;
    EXPECT_EQ(dst->length(*t), 10) << what;
    EXPECT_TRUE(dst->export_sequence(*t)->data == held->data) << what;
  };
  expect_refused("unknown sequence", *good, 2, *t + 100);
  expect_refused("first block past the copy", *src->export_sequence(s, 4), 4, *t);
  expect_refused("negative first block", *good, -1, *t);
  auto shrink = *src->export_sequence(s, 2);
  shrink.length = 9;
  expect_refused("a shorter length", shrink, 2, *t);
  auto gap = *good;
  gap.live.erase(gap.live.begin());
  expect_refused("a missing block", gap, 2, *t);
  auto shifted = *good;
  for (auto& b : shifted.live) ++b;
  expect_refused("blocks not from the first", shifted, 2, *t);
  auto truncated = *good;
  truncated.data.pop_back();
  expect_refused("truncated data", truncated, 2, *t);
  auto other_shape = *good;
  other_shape.head_dim = 16;
  expect_refused("another shape", other_shape, 2, *t);
  EXPECT_FALSE(src->export_sequence(s, -1));
  // A cache with a window takes whole sequences only.
  const kv_options win{.block_size = 4, .type = k::dtype::f32, .capacity_tokens = 64, .window = 8};
  auto wsrc = kv_cache::create(*pool, 2, 2, 8, win);
  auto wdst = kv_cache::create(*pool, 2, 2, 8, win);
  ASSERT_TRUE(wsrc && wdst);
  const seq_id ws = wsrc->add_sequence();
  grow_to(*wsrc, ws, 5);
  auto wt = wdst->import_sequence(*wsrc->export_sequence(ws));
  ASSERT_TRUE(wt);
  grow_to(*wsrc, ws, 7);
  auto wr = wdst->import_tail(*wt, *wsrc->export_sequence(ws, 1), 1);
  ASSERT_FALSE(wr);
  EXPECT_NE(wr.error().message.find("window"), std::string::npos) << wr.error().message;
  // Too few free blocks: out_of_memory, nothing changed.
  const kv_options tiny{.block_size = 4, .type = k::dtype::f32, .capacity_tokens = 12};
  auto small = kv_cache::create(*pool, 2, 2, 8, tiny);
  ASSERT_TRUE(small);
  const seq_id s2 = src->add_sequence();
  grow_to(*src, s2, 4);
  auto st = small->import_sequence(*src->export_sequence(s2));
  ASSERT_TRUE(st);
  grow_to(*src, s2, 40);
  const auto free_before = small->free_blocks();
  auto oom = small->import_tail(*st, *src->export_sequence(s2, 1), 1);
  ASSERT_FALSE(oom);
  EXPECT_EQ(oom.error().code, k::errc::out_of_memory);
  EXPECT_EQ(small->free_blocks(), free_before);
  EXPECT_EQ(small->length(*st), 4);
}
