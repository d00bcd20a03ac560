// Bad arguments to the attention kernels and the paged KV cache return
// errors, never crash (this file also runs under ASan + UBSan).
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/cpu/context.hpp"
#include "kernels/kv_layout.hpp"

using namespace troupe::kernels;

namespace {

// A small valid setup: 2 KV heads, head_dim 8, blocks of 4, 6 tokens.
struct setup {
  std::shared_ptr<memory_pool> pool = memory_pool::create();
  std::unique_ptr<cpu::context> ctx = cpu::context::create(2);
  paged_kv_cache cache;
  std::vector<std::int32_t> table{3, 1};
  std::vector<float> kv = std::vector<float>(6 * 2 * 8, 0.5f);
  std::vector<float> q = std::vector<float>(6 * 4 * 8, 0.25f);
  std::vector<float> out = std::vector<float>(6 * 4 * 8, 0.0f);

  explicit setup(dtype t = dtype::f32) {
    cache = *paged_kv_cache::create(*pool, {4, 2, 8, t, 5, true});
    auto k = *tensor::view(kv.data(), dtype::f32, {6, 2, 8});
    EXPECT_TRUE(append_kv(cache, table, 0, k, k));
  }
  attention_sequence seq(std::int64_t n_q = 6, std::int64_t q_start = 0, std::int64_t kv_len = 6) {
    attention_sequence s;
    s.q = *tensor::view(q.data(), dtype::f32, {n_q, 4, 8});
    s.out = *tensor::view(out.data(), dtype::f32, {n_q, 4, 8});
    s.q_start = q_start;
    s.kv_len = kv_len;
    s.block_table = table;
    return s;
  }
  result<void> call(const attention_sequence& s, const attention_options& o = {}) {
    return attention_paged(*ctx, cache, {&s, 1}, o);
  }
};

TEST(AttentionValidation, ValidSetupWorks) {
  setup st;
  auto r = st.call(st.seq());
  ASSERT_TRUE(r) << r.error().message;
  // All keys equal: every output is the common value.
  for (float x : st.out) EXPECT_NEAR(x, 0.5f, 1e-6f);
}

TEST(AttentionValidation, CacheConfig) {
  auto pool = memory_pool::create();
  EXPECT_EQ(paged_kv_cache::create(*pool, {0, 2, 8, dtype::f32, 4, true}).error().code,
            errc::invalid_argument);
  EXPECT_EQ(paged_kv_cache::create(*pool, {4, 0, 8, dtype::f32, 4, true}).error().code,
            errc::invalid_argument);
  EXPECT_EQ(paged_kv_cache::create(*pool, {4, 2, 0, dtype::f32, 4, true}).error().code,
            errc::invalid_argument);
  EXPECT_EQ(paged_kv_cache::create(*pool, {4, 2, 8, dtype::f32, 0, true}).error().code,
            errc::invalid_argument);
  EXPECT_EQ(paged_kv_cache::create(*pool, {4, 2, 8, dtype::bf16, 4, true}).error().code,
            errc::unsupported_dtype);
  EXPECT_EQ(paged_kv_cache::create(*pool, {4, 2, 8, dtype::q8_0, 4, true}).error().code,
            errc::unsupported_dtype);
  EXPECT_FALSE(
      paged_kv_cache::create(*pool, {1 << 20, 1 << 20, 1 << 14, dtype::f32, 1 << 20, true}));
  // A cache whose parts disagree with its config.
  setup st;
  paged_kv_cache broken = st.cache;
  broken.config.head_dim = 16;
  EXPECT_FALSE(broken.validate());
  EXPECT_FALSE(attention_paged(*st.ctx, broken, {}, {}));
  paged_kv_cache no_k = st.cache;
  no_k.k = tensor();
  EXPECT_FALSE(no_k.validate());
  setup i8(dtype::i8);
  paged_kv_cache no_scales = i8.cache;
  no_scales.v_scales = tensor();
  EXPECT_FALSE(no_scales.validate());
}

TEST(AttentionValidation, BlockTable) {
  setup st;
  auto s = st.seq();
  std::vector<std::int32_t> bad{3, 5};  // 5 is outside the pool of 5 blocks
  s.block_table = bad;
  EXPECT_EQ(st.call(s).error().code, errc::invalid_argument);
  std::vector<std::int32_t> negative{-1, 1};
  s.block_table = negative;
  EXPECT_EQ(st.call(s).error().code, errc::invalid_argument);
  std::vector<std::int32_t> short_table{3};  // 6 tokens need 2 blocks of 4
  s.block_table = short_table;
  EXPECT_EQ(st.call(s).error().code, errc::invalid_argument);
  s.block_table = {};
  EXPECT_EQ(st.call(s).error().code, errc::invalid_argument);
  // Length beyond what the table covers.
  auto longer = st.seq(6, 0, 9);
  EXPECT_EQ(st.call(longer).error().code, errc::invalid_argument);
  auto huge = st.seq(6, 0, std::numeric_limits<std::int64_t>::max() / 2);
  EXPECT_EQ(st.call(huge).error().code, errc::invalid_argument);
  EXPECT_FALSE(check_block_table(st.cache.config, st.table, -1));
  // Appends past the table or with bad shapes.
  auto k = *tensor::view(st.kv.data(), dtype::f32, {6, 2, 8});
  EXPECT_FALSE(append_kv(st.cache, st.table, 4, k, k));
  EXPECT_FALSE(append_kv(st.cache, st.table, -1, k, k));
  EXPECT_FALSE(append_kv(st.cache, bad, 0, k, k));
  auto wrong = *tensor::view(st.kv.data(), dtype::f32, {6, 1, 16});
  EXPECT_EQ(append_kv(st.cache, st.table, 0, wrong, wrong).error().code, errc::shape_mismatch);
  auto k2 = *tensor::view(st.kv.data(), dtype::f32, {3, 2, 8});
  EXPECT_EQ(append_kv(st.cache, st.table, 0, k, k2).error().code, errc::shape_mismatch);
  auto k16 = *tensor::view(st.kv.data(), dtype::f16, {6, 2, 8});
  EXPECT_FALSE(append_kv(st.cache, st.table, 0, k16, k16));
  EXPECT_FALSE(build_kv_summaries(st.cache, bad, 6));
}

TEST(AttentionValidation, QueryShapesAndHeads) {
  setup st;
  auto s = st.seq();
  s.q = *tensor::view(st.q.data(), dtype::f32, {6, 3, 8});  // 3 heads, 2 KV heads
  s.out = *tensor::view(st.out.data(), dtype::f32, {6, 3, 8});
  EXPECT_EQ(st.call(s).error().code, errc::shape_mismatch);
  s = st.seq();
  s.q = *tensor::view(st.q.data(), dtype::f32, {12, 4, 4});  // head_dim 4 != 8
  s.out = *tensor::view(st.out.data(), dtype::f32, {12, 4, 4});
  EXPECT_EQ(st.call(s).error().code, errc::shape_mismatch);
  s = st.seq();
  s.out = *tensor::view(st.out.data(), dtype::f32, {5, 4, 8});
  EXPECT_EQ(st.call(s).error().code, errc::shape_mismatch);
  s = st.seq();
  s.q = *tensor::view(st.q.data(), dtype::f16, {6, 4, 8});
  EXPECT_EQ(st.call(s).error().code, errc::unsupported_dtype);
  s = st.seq();
  s.q = *tensor::view(st.q.data(), dtype::f32, {6, 32});
  EXPECT_FALSE(st.call(s));
  s = st.seq();
  s.q = tensor();
  EXPECT_FALSE(st.call(s));
  // Causal rows beyond the keys in the cache, negative start, no keys.
  EXPECT_EQ(st.call(st.seq(6, 1, 6)).error().code, errc::invalid_argument);
  EXPECT_EQ(st.call(st.seq(6, -1, 6)).error().code, errc::invalid_argument);
  EXPECT_EQ(st.call(st.seq(2, 0, 0)).error().code, errc::invalid_argument);
  // Zero query rows is a valid no-op.
  EXPECT_TRUE(st.call(st.seq(0, 0, 6)));
}

TEST(AttentionValidation, OptionsNonsense) {
  setup st;
  auto s = st.seq();
  auto with = [](auto f) {
    attention_options o;
    f(o);
    return o;
  };
  EXPECT_FALSE(st.call(s, with([](auto& o) { o.window = -1; })));
  EXPECT_FALSE(st.call(s, with([](auto& o) {
                         o.sinks = -2;
                         o.window = 4;
                       })));
  EXPECT_FALSE(st.call(s, with([](auto& o) { o.sinks = 2; })));  // sinks without a window
  EXPECT_FALSE(st.call(s, with([](auto& o) {
                         o.window = 4;
                         o.causal = false;
                       })));
  EXPECT_FALSE(st.call(s, with([](auto& o) { o.scale = -1.0f; })));
  EXPECT_FALSE(
      st.call(s, with([](auto& o) { o.scale = std::numeric_limits<float>::quiet_NaN(); })));
  EXPECT_FALSE(st.call(s, with([](auto& o) { o.scale = std::numeric_limits<float>::infinity(); })));
  EXPECT_FALSE(st.call(s, with([](auto& o) {
                         o.top_k = -3;
                         o.window = 4;
                       })));
  EXPECT_FALSE(st.call(s, with([](auto& o) { o.top_k = 1; })));  // sparse without a window
  EXPECT_FALSE(st.call(s, with([](auto& o) {
                         o.top_k = 1;
                         o.window = 2;
                       })));  // window < block
  EXPECT_FALSE(st.call(s, with([](auto& o) {
                         o.top_k = 1;
                         o.window = 4;
                         o.query_block = 0;
                       })));
  EXPECT_FALSE(st.call(s, with([](auto& o) {
                         o.top_k = 1;
                         o.window = 4;
                         o.causal = false;
                       })));
  EXPECT_TRUE(st.call(s, with([](auto& o) {
                        o.top_k = 1;
                        o.window = 4;
                        o.sinks = 1;
                      })));
  EXPECT_TRUE(st.call(s, with([](auto& o) {
                        o.window = 1 << 30;
                        o.sinks = 1 << 30;
                      })));
  // Sparse needs summaries.
  auto pool = memory_pool::create();
  auto plain = *paged_kv_cache::create(*pool, {4, 2, 8, dtype::f32, 5, false});
  attention_options sp;
  sp.top_k = 1;
  sp.window = 4;
  EXPECT_FALSE(attention_paged(*st.ctx, plain, {&s, 1}, sp));
  EXPECT_FALSE(build_kv_summaries(plain, st.table, 6));
  EXPECT_FALSE(sparse_selection(*st.ctx, st.cache, s, {}, 0, 0));
  EXPECT_FALSE(sparse_selection(*st.ctx, st.cache, s, sp, 6, 0));
  EXPECT_FALSE(sparse_selection(*st.ctx, st.cache, s, sp, 0, 2));
  EXPECT_TRUE(sparse_selection(*st.ctx, st.cache, s, sp, 5, 1));
}

TEST(AttentionValidation, ContiguousEntryPoint) {
  auto ctx = cpu::context::create(1);
  std::vector<float> buf(10 * 4 * 8, 0.1f), out(10 * 4 * 8);
  auto q = *tensor::view(buf.data(), dtype::f32, {10, 4, 8});
  auto o = *tensor::view(out.data(), dtype::f32, {10, 4, 8});
  auto k = *tensor::view(buf.data(), dtype::f32, {10, 2, 8});
  EXPECT_TRUE(attention(*ctx, q, k, k, o, {}));
  auto k_i8 = *tensor::view(buf.data(), dtype::i8, {10, 2, 8});
  EXPECT_EQ(attention(*ctx, q, k_i8, k_i8, o, {}).error().code, errc::unsupported_dtype);
  auto k_f16 = *tensor::view(buf.data(), dtype::f16, {10, 2, 8});
  EXPECT_FALSE(attention(*ctx, q, k, k_f16, o, {}));  // k and v dtypes differ
  auto v_short = *tensor::view(buf.data(), dtype::f32, {9, 2, 8});
  EXPECT_EQ(attention(*ctx, q, k, v_short, o, {}).error().code, errc::shape_mismatch);
  auto k3 = *tensor::view(buf.data(), dtype::f32, {10, 3, 8});
  EXPECT_EQ(attention(*ctx, q, k3, k3, o, {}).error().code, errc::shape_mismatch);
  auto k0 = *tensor::view(buf.data(), dtype::f32, {0, 2, 8});
  EXPECT_FALSE(attention(*ctx, q, k0, k0, o, {}));
  auto q_more = *tensor::view(buf.data(), dtype::f32, {20, 2, 8});
  auto o_more = *tensor::view(out.data(), dtype::f32, {20, 2, 8});
  auto k_small = *tensor::view(buf.data(), dtype::f32, {10, 1, 8});
  EXPECT_FALSE(attention(*ctx, q_more, k_small, k_small, o_more, {}));  // causal: 20 rows, 10 keys
  EXPECT_FALSE(attention(*ctx, q, k, k, o, {}, -2));
  EXPECT_FALSE(attention(*ctx, q, k, k, o, {}, 1));  // rows 1..10 need 11 keys
  attention_options sparse;
  sparse.top_k = 1;
  sparse.window = 4;
  EXPECT_EQ(attention(*ctx, q, k, k, o, sparse).error().code, errc::unsupported_op);
}

}  // namespace
