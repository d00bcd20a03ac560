// Attention against PyTorch's scaled_dot_product_attention (float64, GQA by
// repeating KV heads), from tests/fixtures/kernels/attention.bin written by
// tools/make_fixtures.py. Runs the contiguous entry point and the paged one
// (shuffled block table) at every ISA level.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/cpu/context.hpp"
#include "kernels/kv_layout.hpp"
#include "tests/kernels/fixture_reader.hpp"

using namespace troupe::kernels;

namespace {

constexpr float atol = 3e-5f;

void expect_close(const std::vector<float>& got, const std::vector<float>& want,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], atol + 1e-4f * std::fabs(want[i])) << what << " element " << i;
}

class AttentionFixture : public ::testing::TestWithParam<const char*> {};

TEST_P(AttentionFixture, MatchesTorchSdpa) {
  const std::string path = troupe::test::fixture_path("attention.bin");
  // The fixture is committed: a missing file is a broken checkout, not a skip.
  ASSERT_TRUE(std::filesystem::exists(path))
      << path << " is missing (committed; tools/make_fixtures.py writes it)";
  const auto fx = troupe::test::load_fixture(path);
  const std::string name = GetParam();
  for (const char* part : {".q", ".k", ".v", ".out", ".params"})
    ASSERT_TRUE(fx.count(name + part)) << "fixture lacks " << name << part;
  auto q = fx.at(name + ".q").as<float>();
  auto k = fx.at(name + ".k").as<float>();
  auto v = fx.at(name + ".v").as<float>();
  const auto want = fx.at(name + ".out").as<float>();
  const auto params = fx.at(name + ".params").as<std::int64_t>();
  ASSERT_EQ(params.size(), 5u);
  const auto& qd = fx.at(name + ".q").dims;
  const auto& kd = fx.at(name + ".k").dims;
  ASSERT_EQ(qd.size(), 3u);
  ASSERT_EQ(kd.size(), 3u);
  const std::int64_t n_q = qd[0], n_heads = qd[1], d = qd[2], n_kv = kd[0], n_kv_heads = kd[1];
  ASSERT_EQ(n_heads, params[3]);
  ASSERT_EQ(n_kv_heads, params[4]);
  attention_options opt;
  opt.causal = params[0] != 0;
  opt.window = static_cast<int>(params[1]);
  opt.sinks = static_cast<int>(params[2]);
  // The fixtures put causal rows at positions 0..n_q-1 (n_q == n_kv).
  const std::int64_t q_start = 0;

  auto qt = *tensor::view(q.data(), dtype::f32, {n_q, n_heads, d});
  auto kt = *tensor::view(k.data(), dtype::f32, {n_kv, n_kv_heads, d});
  auto vt = *tensor::view(v.data(), dtype::f32, {n_kv, n_kv_heads, d});
  std::vector<float> out(want.size());
  auto ot = *tensor::view(out.data(), dtype::f32, {n_q, n_heads, d});

  // The same keys in a paged cache, blocks in shuffled order.
  auto pool = memory_pool::create();
  const int bs = 8;
  const std::int64_t n_blocks = (n_kv + bs - 1) / bs;
  auto cache = paged_kv_cache::create(*pool, {bs, static_cast<int>(n_kv_heads), static_cast<int>(d),
                                              dtype::f32, n_blocks + 3, true});
  ASSERT_TRUE(cache);
  std::vector<std::int32_t> table(static_cast<std::size_t>(n_blocks + 3));
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(1);
  std::shuffle(table.begin(), table.end(), rng);
  table.resize(static_cast<std::size_t>(n_blocks));
  ASSERT_TRUE(append_kv(*cache, table, 0, kt, vt));
  std::vector<float> out_paged(want.size());
  attention_sequence seq{qt, *tensor::view(out_paged.data(), dtype::f32, {n_q, n_heads, d}),
                         q_start, n_kv, table};

  auto ctx = cpu::context::create(2);
  for (cpu::isa l : {cpu::isa::scalar, cpu::isa::avx2}) {
    if (cpu::hardware_isa() < l) continue;
    ctx->set_level(l);
    const std::string what = name + " " + std::string(cpu::to_string(l));
    std::fill(out.begin(), out.end(), NAN);
    ASSERT_TRUE(attention(*ctx, qt, kt, vt, ot, opt, q_start));
    expect_close(out, want, what + " contiguous");
    std::fill(out_paged.begin(), out_paged.end(), NAN);
    ASSERT_TRUE(attention_paged(*ctx, *cache, {&seq, 1}, opt));
    expect_close(out_paged, want, what + " paged");
  }
}

INSTANTIATE_TEST_SUITE_P(Torch, AttentionFixture,
                         ::testing::Values("causal_gqa", "bidir", "window"));

}  // namespace
