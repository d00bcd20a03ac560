// KV cache accounting and swapping: blocks_held() agrees with what a real
// cache's reserve/commit do; a sequence exported to host memory, released
// and imported (into the same cache or another one of the same shape)
// continues decoding with logits bit-identical to a run without the swap
// (f32, f16, i8 KV; with and without a sliding window with sinks); block
// counts return to where they started; imported blocks carry the same data
// and summaries; a snapshot never carries another sequence's stale slots.
#include <gtest/gtest.h>

#include "tests/remote_memory_device.hpp"

#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "../temp_path.hpp"
#include "../tiny_model.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/llama.hpp"
#include "models/random_model.hpp"
#include "step_script.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

constexpr int vocab = 300;

std::int64_t used_blocks(const kv_cache& c) {
  return c.total_blocks() - c.free_blocks();
}

}  // namespace

TEST(KvAccounting, BlocksHeldAgreesWithTheCache) {
  auto pool = k::memory_pool::create();
  std::mt19937 rng(3);
  int checked = 0;
  for (int block : {1, 3, 4, 16})
    for (int window : {0, 1, 2, 5, 12, 33})
      for (int sinks : {0, 1, 4, 7, 20}) {
        if (window == 0 && sinks != 0) continue;
        const kv_options opts{
            .block_size = block, .capacity_tokens = 4096, .window = window, .sinks = sinks};
        auto cache = kv_cache::create(*pool, 1, 1, 4, opts);
        ASSERT_TRUE(cache);
        // Two sequences growing by random steps, interleaved.
        const seq_id a = cache->add_sequence(), b = cache->add_sequence();
        std::int64_t len[2] = {0, 0};
        for (int step = 0; step < 60; ++step) {
          const int who = static_cast<int>(rng() % 2);
          const seq_id s = who == 0 ? a : b;
          const std::int64_t n = 1 + static_cast<std::int64_t>(rng() % 9);
          const std::int64_t other = kv_cache::blocks_held(opts, len[1 - who], len[1 - who]);
          ASSERT_TRUE(cache->reserve(s, len[who] + n));
          ASSERT_EQ(used_blocks(*cache) - other,
                    kv_cache::blocks_held(opts, len[who], len[who] + n))
              << "block " << block << " window " << window << " sinks " << sinks << " length "
              << len[who] << " + " << n;
          ASSERT_TRUE(cache->commit(s, len[who] + n));
          len[who] += n;
          ASSERT_EQ(used_blocks(*cache) - other, kv_cache::blocks_held(opts, len[who], len[who]))
              << "block " << block << " window " << window << " sinks " << sinks << " length "
              << len[who];
          ++checked;
        }
        const auto u = cache->usage();
        EXPECT_EQ(u.total_blocks, cache->total_blocks());
        EXPECT_EQ(u.free_blocks, cache->free_blocks());
        EXPECT_EQ(u.sequences, 2);
        EXPECT_EQ(u.tokens, len[0] + len[1]);
        cache->release(a);
        cache->release(b);
        EXPECT_EQ(cache->usage().free_blocks, cache->total_blocks());
        EXPECT_EQ(cache->usage().sequences, 0);
      }
  EXPECT_GT(checked, 1000);
  // Hand-checked values: 10 tokens in blocks of 4 hold 3 blocks; with a
  // window of 4 and no sinks, blocks 0 and 1 ([0,4), [4,8)) lie behind
  // position 10's window [7, 10]... only block 0 ends before 7.
  const kv_options w{.block_size = 4, .window = 4};
  EXPECT_EQ(kv_cache::blocks_held(kv_options{.block_size = 4}, 10, 10), 3);
  EXPECT_EQ(kv_cache::blocks_held(w, 10, 10), 2);
  EXPECT_EQ(kv_cache::blocks_held(w, 10, 13), 3);  // the new block comes before commit frees
  EXPECT_EQ(kv_cache::blocks_held(w, 0, 0), 0);
  EXPECT_EQ(kv_cache::blocks_held(w, -5, -1), 0);
}

namespace {

class KvSnapshot : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = new std::string(troupe::test::temp_path("tiny_llama_snapshot.gguf"));
    random_model_spec spec;
    spec.config = troupe::test::tiny_llama_config(vocab, 96);
    spec.format = k::weight_format::f32;
    spec.stddev = 0.08f;
    spec.seed = 23;
    ASSERT_TRUE(write_random_gguf(*path_, spec));
  }
  static void TearDownTestSuite() { delete path_; }
  static std::string* path_;
};
std::string* KvSnapshot::path_ = nullptr;

// Runs the script; after step `swap_at` (if >= 0) sequence `victim` is
// exported, released and imported (into `other` if given, which then runs
// that sequence's later steps). Returns each step's logits, concatenated,
// in the order of the script's items.
std::vector<float> run_script(k::device& ctx, const llama_model& m, kv_cache& cache,
                              kv_cache* other, const std::vector<test::scripted_sequence>& seqs,
                              const std::vector<test::scripted_step>& steps, int swap_at,
                              std::size_t victim) {
  const std::int64_t start_free = cache.free_blocks();
  const std::int64_t other_start_free = other ? other->free_blocks() : 0;
  const auto H = m.config().hidden_size;
  std::vector<seq_id> ids;
  for (std::size_t i = 0; i < seqs.size(); ++i) ids.push_back(cache.add_sequence());
  bool moved = false;
  std::vector<float> out;
  for (std::size_t step = 0; step < steps.size(); ++step) {
    std::vector<step_input> here, there;
    std::vector<std::size_t> where;  // 0: here, 1: there, per item
    for (const auto& item : steps[step]) {
      const bool away = moved && other && item.seq == victim;
      (away ? there : here).push_back(test::to_input(seqs[item.seq], item, ids[item.seq], H));
      where.push_back(away ? 1 : 0);
    }
    std::optional<k::tensor> a, b;
    if (!here.empty()) {
      auto l = m.forward(ctx, cache, here);
      EXPECT_TRUE(l) << l.error().message;
      if (!l) return {};
      a = std::move(*l);
    }
    if (!there.empty()) {
      auto l = m.forward(ctx, *other, there);
      EXPECT_TRUE(l) << l.error().message;
      if (!l) return {};
      b = std::move(*l);
    }
    // Back into script order: each item has one row, or one per token.
    std::int64_t ra = 0, rb = 0;
    for (std::size_t j = 0; j < steps[step].size(); ++j) {
      const auto& item = steps[step][j];
      const std::int64_t rows = seqs[item.seq].all_logits ? item.count : 1;
      const k::tensor& t = where[j] ? *b : *a;
      std::int64_t& r = where[j] ? rb : ra;
      // Through the device: its memory may not be the host's.
      auto part = t.slice_rows(r, rows);
      EXPECT_TRUE(part.has_value());
      if (!part) return {};
      std::vector<float> host(static_cast<std::size_t>(part->numel()));
      EXPECT_TRUE(ctx.read(*part, std::as_writable_bytes(std::span<float>(host))));
      out.insert(out.end(), host.begin(), host.end());
      r += rows;
    }
    if (static_cast<int>(step) == swap_at) {
      const seq_id old = ids[victim];
      const std::int64_t len = cache.length(old);
      const std::int64_t held = kv_cache::blocks_held(cache.options(), len, len);
      auto snap = cache.export_sequence(old);
      EXPECT_TRUE(snap) << snap.error().message;
      if (!snap) return {};
      EXPECT_EQ(snap->length, len);
      EXPECT_EQ(static_cast<std::int64_t>(snap->live.size()), held);
      EXPECT_EQ(snap->data.size(),
                static_cast<std::size_t>(snap->layers) * snap->live.size() * snap->block_bytes());
      const std::int64_t before = cache.free_blocks();
      cache.release(old);
      EXPECT_EQ(cache.free_blocks(), before + held);
      EXPECT_FALSE(cache.contains(old));
      kv_cache& target = other ? *other : cache;
      const std::int64_t target_free = target.free_blocks();
      auto id = target.import_sequence(*snap);
      EXPECT_TRUE(id) << id.error().message;
      if (!id) return {};
      EXPECT_EQ(target.length(*id), len);
      EXPECT_EQ(target.free_blocks(), target_free - held);
      ids[victim] = *id;
      moved = true;
    }
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (moved && other && i == victim) {
      other->release(ids[i]);
    } else {
      cache.release(ids[i]);
    }
  }
  EXPECT_EQ(cache.free_blocks(), start_free);
  if (other) {
    EXPECT_EQ(other->free_blocks(), other_start_free);
  }
  return out;
}

}  // namespace

namespace {

// Swapping each sequence out and back (into the same cache or another) at
// a step mid-prefill or mid-decode gives the logits of a run without swaps,
// bit for bit, for every KV dtype, with and without a window.
void swap_out_and_in(k::device& dev, const std::string& path) {
  auto* ctx = &dev;
  auto m = llama_model::load(path, *ctx);
  ASSERT_TRUE(m) << m.error().message;
  const auto seqs = test::make_sequences(vocab, 64, {11, 26, 7}, 14, 9, 5);
  const auto steps = test::make_schedule(seqs, 8);
  ASSERT_GT(steps.size(), 12u);
  for (auto type : {k::dtype::f32, k::dtype::f16, k::dtype::i8})
    for (int window : {0, 9}) {
      const kv_options opts{.block_size = 4,
                            .type = type,
                            .capacity_tokens = 256,
                            .window = window,
                            .sinks = window ? 3 : 0};
      SCOPED_TRACE(std::string(k::to_string(type)) + " window " + std::to_string(window));
      auto ref_cache = (*m)->make_cache(*ctx, opts);
      ASSERT_TRUE(ref_cache);
      const auto want = run_script(*ctx, **m, *ref_cache, nullptr, seqs, steps, -1, 0);
      ASSERT_FALSE(want.empty());
      // Swap each sequence out at a step mid-prefill or mid-decode, back
      // into the same cache or into another one.
      for (std::size_t victim = 0; victim < seqs.size(); ++victim)
        for (bool elsewhere : {false, true}) {
          const int swap_at = (victim + elsewhere) % 2 == 0 ? 2 : 7;
          SCOPED_TRACE("victim " + std::to_string(victim) + " after step " +
                       std::to_string(swap_at) + (elsewhere ? " into another cache" : ""));
          auto cache = (*m)->make_cache(*ctx, opts);
          auto other = (*m)->make_cache(*ctx, opts);
          ASSERT_TRUE(cache && other);
          const auto got = run_script(*ctx, **m, *cache, elsewhere ? &*other : nullptr, seqs, steps,
                                      swap_at, victim);
          ASSERT_EQ(got.size(), want.size());
          EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0);
        }
    }
}

}  // namespace

TEST_F(KvSnapshot, SwapOutAndInKeepsLogitsBitIdentical) {
  auto cpu = k::cpu::cpu_device::with_threads(1);
  swap_out_and_in(*cpu, *path_);
}

// The same where host code cannot touch the cache's memory (as a GPU's):
// export reads blocks and import writes them, summaries included, through
// the device.
TEST_F(KvSnapshot, SwapOutAndInThroughADeviceWhoseMemoryIsNotTheHosts) {
  troupe::test::remote_memory_device remote(1);
  swap_out_and_in(remote, *path_);
}

TEST(KvSnapshotBlocks, ImportCopiesDataAndRebuildsSummaries) {
  auto pool = k::memory_pool::create();
  for (auto type : {k::dtype::f32, k::dtype::f16, k::dtype::i8}) {
    SCOPED_TRACE(std::string(k::to_string(type)));
    const kv_options opts{.block_size = 5,
                          .type = type,
                          .capacity_tokens = 200,
                          .window = 11,
                          .sinks = 2,
                          .summaries = true};
    auto a = kv_cache::create(*pool, 3, 2, 8, opts);
    auto b = kv_cache::create(*pool, 3, 2, 8, opts);
    ASSERT_TRUE(a && b);
    // A long sequence fills and frees blocks; a shorter one then reuses them,
    // so its last block holds stale slots of the first.
    std::mt19937 rng(9);
    std::normal_distribution<float> val(0.0f, 1.0f);
    auto append = [&](kv_cache& c, seq_id s, std::int64_t n) {
      const std::int64_t start = c.length(s);
      ASSERT_TRUE(c.reserve(s, start + n));
      auto kt = k::tensor::empty(*pool, k::dtype::f32, {n, 2, 8});
      auto vt = k::tensor::empty(*pool, k::dtype::f32, {n, 2, 8});
      ASSERT_TRUE(kt && vt);
      for (std::int64_t i = 0; i < n * 16; ++i) {
        kt->data_as<float>()[i] = val(rng);
        vt->data_as<float>()[i] = val(rng);
      }
      for (int l = 0; l < c.layers(); ++l)
        ASSERT_TRUE(k::append_kv(c.layer(l), c.block_table(s), start, *kt, *vt));
      ASSERT_TRUE(c.commit(s, start + n));
    };
    const seq_id filler = a->add_sequence();
    append(*a, filler, 60);
    a->release(filler);
    const seq_id s = a->add_sequence();
    for (int n : {7, 1, 1, 9, 1, 4}) append(*a, s, n);  // 23 tokens: blocks 0 (sinks), 2..4 live
    auto snap = a->export_sequence(s);
    ASSERT_TRUE(snap) << snap.error().message;
    EXPECT_EQ(snap->length, 23);
    EXPECT_EQ(snap->live, (std::vector<std::int32_t>{0, 2, 3, 4}));
    EXPECT_EQ(snap->window, 11);
    EXPECT_EQ(snap->sinks, 2);
    EXPECT_EQ(snap->type, type);
    // Slots 3 and 4 of the last block (positions 23, 24) are zero in every
    // layer, head, k and v, scales included.
    const std::size_t esize = k::block_bytes(type);
    const std::size_t data = 2 * 5 * 8 * esize, scales = type == k::dtype::i8 ? 2 * 5 * 4 : 0;
    ASSERT_EQ(snap->block_bytes(), 2 * data + 2 * scales);
    for (int l = 0; l < 3; ++l) {
      const std::byte* blk =
          snap->data.data() + (static_cast<std::size_t>(l) * 4 + 3) * snap->block_bytes();
      for (int part = 0; part < 4; ++part) {
        const std::size_t off = part < 2 ? part * data : 2 * data + (part - 2) * scales;
        const std::size_t slot = part < 2 ? 8 * esize : 4;
        if (part >= 2 && scales == 0) continue;
        for (int h = 0; h < 2; ++h)
          for (std::size_t i = (h * 5 + 3) * slot; i < static_cast<std::size_t>(h * 5 + 5) * slot;
               ++i)
            ASSERT_EQ(blk[off + i], std::byte{0})
                << "layer " << l << " part " << part << " head " << h;
      }
    }
    // Import into another cache: same data (used slots) and summaries.
    auto id = b->import_sequence(*snap);
    ASSERT_TRUE(id) << id.error().message;
    const auto ta = a->block_table(s), tb = b->block_table(*id);
    ASSERT_EQ(ta.size(), 5u);
    ASSERT_EQ(tb.size(), 5u);
    for (std::size_t e = 0; e < 5; ++e) EXPECT_EQ(ta[e] == 0, tb[e] == 0) << "entry " << e;
    for (int l = 0; l < 3; ++l)
      for (std::size_t e = 0; e < 5; ++e) {
        if (ta[e] == 0) continue;
        const auto& la = a->layer(l);
        const auto& lb = b->layer(l);
        const std::size_t used = e == 4 ? 3 : 5;
        for (int h = 0; h < 2; ++h) {
          const std::size_t row = 8 * esize;
          const std::size_t oa = ((static_cast<std::size_t>(ta[e]) * 2 + h) * 5) * row;
          const std::size_t ob = ((static_cast<std::size_t>(tb[e]) * 2 + h) * 5) * row;
          EXPECT_EQ(std::memcmp(la.k.data_as<std::byte>() + oa, lb.k.data_as<std::byte>() + ob,
                                used * row),
                    0);
          EXPECT_EQ(std::memcmp(la.v.data_as<std::byte>() + oa, lb.v.data_as<std::byte>() + ob,
                                used * row),
                    0);
          if (type == k::dtype::i8) {
            const float* sa =
                la.k_scales.data_as<float>() + (static_cast<std::size_t>(ta[e]) * 2 + h) * 5;
            const float* sb =
                lb.k_scales.data_as<float>() + (static_cast<std::size_t>(tb[e]) * 2 + h) * 5;
            EXPECT_EQ(std::memcmp(sa, sb, used * sizeof(float)), 0);
          }
          const float* ma =
              la.k_summary.data_as<float>() + (static_cast<std::size_t>(ta[e]) * 2 + h) * 16;
          const float* mb =
              lb.k_summary.data_as<float>() + (static_cast<std::size_t>(tb[e]) * 2 + h) * 16;
          EXPECT_EQ(std::memcmp(ma, mb, 16 * sizeof(float)), 0)
              << "summary, layer " << l << " entry " << e;
        }
      }
    // Both continue alike: the same appended tokens give the same summaries.
    std::mt19937 saved = rng;
    append(*a, s, 3);
    rng = saved;
    append(*b, *id, 3);
    const auto ta2 = a->block_table(s), tb2 = b->block_table(*id);
    for (int l = 0; l < 3; ++l)
      for (std::size_t e = 0; e < ta2.size(); ++e) {
        if (ta2[e] == 0) continue;
        const float* ma =
            a->layer(l).k_summary.data_as<float>() + static_cast<std::size_t>(ta2[e]) * 2 * 16;
        const float* mb =
            b->layer(l).k_summary.data_as<float>() + static_cast<std::size_t>(tb2[e]) * 2 * 16;
        EXPECT_EQ(std::memcmp(ma, mb, 2 * 16 * sizeof(float)), 0) << "after append, layer " << l;
      }
    EXPECT_EQ(b->usage().tokens, 26);
    EXPECT_EQ(b->usage().sequences, 1);
  }
}

// Prefix caching's premise: KV a sequence takes from another one's full
// blocks (the scheduler names the blocks; the cache only writes where it
// is told) is the KV it would have computed itself. A sequence that shares
// the first blocks of another and computes only the rest gives the logits
// of one that computed everything, bit for bit, at every step after, and
// its blocks hold the same bytes; for every KV dtype, on the CPU and where
// host code cannot touch the cache's memory.
void shared_prefix_is_recomputed_prefix(k::device& dev, const std::string& path) {
  auto m = llama_model::load(path, dev);
  ASSERT_TRUE(m) << m.error().message;
  std::mt19937 rng(11);
  std::vector<std::int32_t> tokens(45);
  for (auto& t : tokens) t = static_cast<std::int32_t>(rng() % vocab);
  const std::vector<std::int32_t> decode = {5, 17, 250, 3, 99};
  auto logits_of = [&](const k::tensor& t) {
    std::vector<float> host(static_cast<std::size_t>(t.numel()));
    EXPECT_TRUE(dev.read(t, std::as_writable_bytes(std::span<float>(host))));
    return host;
  };
  for (auto type : {k::dtype::f32, k::dtype::f16, k::dtype::i8}) {
    SCOPED_TRACE(std::string(k::to_string(type)));
    const kv_options opts{.block_size = 8, .type = type, .capacity_tokens = 256};
    // Computed whole: the 45 tokens in one prefill, then decode.
    auto whole = (*m)->make_cache(dev, opts);
    ASSERT_TRUE(whole);
    const auto w = whole->add_sequence();
    std::vector<std::vector<float>> want;
    auto l = (*m)->forward(dev, *whole, std::vector<step_input>{{w, tokens, false}});
    ASSERT_TRUE(l) << l.error().message;
    want.push_back(logits_of(*l));
    for (std::size_t i = 0; i < decode.size(); ++i) {
      auto d =
          (*m)->forward(dev, *whole, std::vector<step_input>{{w, std::span(&decode[i], 1), false}});
      ASSERT_TRUE(d);
      want.push_back(logits_of(*d));
    }
    // Named blocks: sequence a computes the first 40 tokens in blocks 1..5;
    // b takes blocks 1..4 (32 tokens) and computes tokens 32..44 in 6..7.
    auto named = (*m)->make_cache(dev, opts);
    ASSERT_TRUE(named);
    ASSERT_TRUE(named->name_blocks());
    const auto a = named->add_sequence();
    ASSERT_TRUE(named->assign(a, 0, std::vector<std::int32_t>{1, 2, 3, 4, 5}, 0));
    ASSERT_TRUE((*m)->forward(
        dev, *named, std::vector<step_input>{{a, {tokens.begin(), tokens.begin() + 40}, false}}));
    const auto b = named->add_sequence();
    ASSERT_TRUE(named->assign(b, 0, std::vector<std::int32_t>{1, 2, 3, 4, 6, 7}, 32));
    EXPECT_FALSE(named->reserve(b, 49)) << "a named cache never picks a block itself";
    std::vector<std::vector<float>> got;
    l = (*m)->forward(dev, *named,
                      std::vector<step_input>{{b, {tokens.begin() + 32, tokens.end()}, false}});
    ASSERT_TRUE(l) << l.error().message;
    got.push_back(logits_of(*l));
    for (std::size_t i = 0; i < decode.size(); ++i) {
      if (i == 3) {  // past 48 tokens: the scheduler names one more block
        ASSERT_TRUE(named->assign(b, 6, std::vector<std::int32_t>{8}, named->length(b)));
      }
      auto d =
          (*m)->forward(dev, *named, std::vector<step_input>{{b, std::span(&decode[i], 1), false}});
      ASSERT_TRUE(d) << d.error().message;
      got.push_back(logits_of(*d));
    }
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i)
      EXPECT_EQ(std::memcmp(got[i].data(), want[i].data(), want[i].size() * sizeof(float)), 0)
          << "step " << i;
    auto x = whole->export_sequence(w);
    auto y = named->export_sequence(b);
    ASSERT_TRUE(x && y);
    EXPECT_TRUE(x->data == y->data) << "the KV bytes";
    EXPECT_EQ(y->ids, (std::vector<std::int32_t>{1, 2, 3, 4, 6, 7, 8}));
    // Such a snapshot goes into another named cache at the same ids (a
    // moved stage), and not into a cache that picks its own blocks.
    auto moved = (*m)->make_cache(dev, opts);
    ASSERT_TRUE(moved && moved->name_blocks());
    auto id = moved->import_sequence(*y);
    ASSERT_TRUE(id) << id.error().message;
    EXPECT_EQ(
        std::vector<std::int32_t>(moved->block_table(*id).begin(), moved->block_table(*id).end()),
        y->ids);
    auto plain = (*m)->make_cache(dev, opts);
    ASSERT_TRUE(plain);
    EXPECT_FALSE(plain->import_sequence(*y));
  }
}

TEST_F(KvSnapshot, ASharedPrefixGivesTheLogitsAndKvOfARecomputedOne) {
  auto cpu = k::cpu::cpu_device::with_threads(1);
  shared_prefix_is_recomputed_prefix(*cpu, *path_);
  troupe::test::remote_memory_device remote(1);
  shared_prefix_is_recomputed_prefix(remote, *path_);
}

// A named cache refuses tables that would lose tokens or point outside it.
TEST(KvNamedBlocks, AssignRefusesWhatWouldLoseTokensOrLeaveThePool) {
  auto pool = k::memory_pool::create();
  auto cache = kv_cache::create(*pool, 1, 1, 4, kv_options{.block_size = 4, .capacity_tokens = 32});
  ASSERT_TRUE(cache);
  const auto early = cache->add_sequence();
  EXPECT_FALSE(cache->assign(early, 0, std::vector<std::int32_t>{1}, 0)) << "not named yet";
  EXPECT_FALSE(cache->name_blocks()) << "it holds a sequence of its own";
  cache->release(early);
  ASSERT_TRUE(cache->name_blocks());
  const auto s = cache->add_sequence();
  EXPECT_FALSE(cache->assign(s, 0, std::vector<std::int32_t>{9}, 0)) << "8 blocks: 1..8";
  EXPECT_FALSE(cache->assign(s, 0, std::vector<std::int32_t>{0}, 0)) << "0 is the hole";
  EXPECT_FALSE(cache->assign(s, 0, std::vector<std::int32_t>{1}, 5)) << "5 tokens in 1 block";
  EXPECT_FALSE(cache->assign(s, 1, std::vector<std::int32_t>{1}, 0)) << "a new table from 0";
  ASSERT_TRUE(cache->assign(s, 0, std::vector<std::int32_t>{1, 2}, 0));
  ASSERT_TRUE(cache->reserve(s, 6));
  ASSERT_TRUE(cache->commit(s, 6));
  EXPECT_FALSE(cache->assign(s, 1, std::vector<std::int32_t>{3}, 6)) << "entry 1 holds tokens";
  EXPECT_FALSE(cache->assign(s, 3, std::vector<std::int32_t>{3}, 6)) << "a gap";
  EXPECT_FALSE(cache->assign(s, 2, std::vector<std::int32_t>{3}, 5)) << "wrong length";
  ASSERT_TRUE(cache->assign(s, 2, std::vector<std::int32_t>{3}, 6));
  EXPECT_TRUE(cache->reserve(s, 12));
  EXPECT_FALSE(cache->reserve(s, 13));
  const auto u = cache->usage();
  EXPECT_EQ(u.free_blocks, 5) << "3 of 8 in a table";
  cache->release(s);
  EXPECT_EQ(cache->usage().free_blocks, 8);
  auto windowed = kv_cache::create(*pool, 1, 1, 4,
                                   kv_options{.block_size = 4, .capacity_tokens = 32, .window = 8});
  ASSERT_TRUE(windowed);
  EXPECT_FALSE(windowed->name_blocks()) << "a window frees its own blocks";
}
