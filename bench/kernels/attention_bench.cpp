// Attention: flash-style dense vs sparse (Quest-style block selection) over a
// paged f16 KV cache, one layer's head group: 8 query heads, 2 KV heads,
// head_dim 128, blocks of 16 tokens. Two shapes of work:
//  - prefill: the last 64 queries of the sequence (a prefill chunk) against
//    the whole causal prefix;
//  - decode: one query at the end.
// Sparse keeps the first 64 tokens, a window of 512 and the top-k KV blocks
// (k = 1/16 of the blocks) ranked by the per-block min/max bound.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "bench/kernels/bench.hpp"
#include "kernels/attention.hpp"
#include "kernels/kv_layout.hpp"

namespace troupe::bench {
namespace {

using namespace troupe::kernels;

constexpr int n_heads = 8, n_kv_heads = 2, head_dim = 128, block = 16;

// Runs the variants in turn, `reps` rounds (after one warm-up round), and
// returns each variant's median time and the median over rounds of
// time(variant 0) / time(variant i): paired ratios, because this machine's
// speed drifts between runs.
struct paired {
  std::vector<double> median_s;
  std::vector<double> speedup;
};

template <class F>
paired time_paired(const std::vector<F>& fns, int reps) {
  for (const auto& f : fns) f();
  std::vector<std::vector<double>> t(fns.size()), r(fns.size());
  for (int i = 0; i < reps; ++i) {
    for (std::size_t v = 0; v < fns.size(); ++v) {
      const double t0 = now_s();
      fns[v]();
      t[v].push_back(now_s() - t0);
    }
    for (std::size_t v = 0; v < fns.size(); ++v) r[v].push_back(t[0].back() / t[v].back());
  }
  auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  paired out;
  for (std::size_t v = 0; v < fns.size(); ++v) {
    out.median_s.push_back(median(t[v]));
    out.speedup.push_back(median(r[v]));
  }
  return out;
}

// Keys a causal row at position p sees under `o` (sinks + window + top_k blocks).
double kept_keys(std::int64_t p, const attention_options& o) {
  if (o.window == 0) return static_cast<double>(p + 1);
  const std::int64_t ws = std::max<std::int64_t>(0, p + 1 - o.window);
  if (ws <= o.sinks) return static_cast<double>(p + 1);
  const std::int64_t middle = ws - o.sinks;
  const std::int64_t blocks = std::min<std::int64_t>(o.top_k, (middle + block - 1) / block);
  return static_cast<double>(std::min(p + 1, o.sinks + o.window + blocks * block));
}

void run_case(cpu::context& ctx, int tokens, dtype kv_type, int n_q, int reps) {
  auto pool = memory_pool::create();
  const std::int64_t n_blocks = tokens / block;
  auto cache =
      paged_kv_cache::create(*pool, {block, n_kv_heads, head_dim, kv_type, n_blocks, true});
  if (!cache) {
    std::printf("attention: %s\n", cache.error().message.c_str());
    return;
  }
  std::vector<std::int32_t> table(static_cast<std::size_t>(n_blocks));
  std::iota(table.begin(), table.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(table.begin(), table.end(), rng);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  {
    const int chunk = 1024;
    std::vector<float> k(static_cast<std::size_t>(chunk) * n_kv_heads * head_dim), v(k.size());
    for (int start = 0; start < tokens; start += chunk) {
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      auto kt = *tensor::view(k.data(), dtype::f32, {chunk, n_kv_heads, head_dim});
      auto vt = *tensor::view(v.data(), dtype::f32, {chunk, n_kv_heads, head_dim});
      if (auto ok = append_kv(*cache, table, start, kt, vt); !ok) {
        std::printf("attention: %s\n", ok.error().message.c_str());
        return;
      }
    }
  }
  std::vector<float> q(static_cast<std::size_t>(n_q) * n_heads * head_dim), out(q.size());
  for (auto& x : q) x = nd(rng);
  attention_sequence seq;
  seq.q = *tensor::view(q.data(), dtype::f32, {n_q, n_heads, head_dim});
  seq.out = *tensor::view(out.data(), dtype::f32, {n_q, n_heads, head_dim});
  seq.q_start = tokens - n_q;
  seq.kv_len = tokens;
  seq.block_table = table;

  attention_options dense;
  attention_options sparse;
  sparse.window = 512;
  sparse.sinks = 64;
  sparse.top_k = static_cast<int>(n_blocks / 16);
  attention_options sparse_qb = sparse;
  sparse_qb.query_block = 16;

  bool ok = true;
  auto call = [&](const attention_options& o) {
    return std::function<void()>([&ctx, &cache, &seq, &ok, o] {
      ok = ok && attention_paged(ctx, *cache, {&seq, 1}, o).has_value();
    });
  };
  std::vector<std::function<void()>> fns{call(dense), call(sparse)};
  if (n_q >= 16) fns.push_back(call(sparse_qb));
  const paired p = time_paired(fns, reps);
  if (!ok) {
    std::printf("attention: kernel call failed\n");
    return;
  }
  double keys_dense = 0, keys_sparse = 0;
  for (std::int64_t p = tokens - n_q; p < tokens; ++p) {
    keys_dense += static_cast<double>(p + 1);
    keys_sparse += kept_keys(p, sparse);
  }
  // 2 flops per multiply-add, q.k and p.v: 4 * d per (row, head, key).
  const double gflop = 4.0 * head_dim * n_heads * keys_dense * 1e-9;
  const std::vector<int> widths{7, 5, 10, 9, 8, 9, 9, 8, 9, 8};
  print_row({std::to_string(tokens), std::string(to_string(kv_type)),
             n_q == 1 ? "decode" : "prefill" + std::to_string(n_q), fmt(p.median_s[0] * 1e3, 3),
             fmt(gflop / p.median_s[0], 1), fmt(p.median_s[1] * 1e3, 3), fmt(keys_sparse / n_q, 0),
             fmt(p.speedup[1], 2) + "x", n_q >= 16 ? fmt(p.median_s[2] * 1e3, 3) : "-",
             n_q >= 16 ? fmt(p.speedup[2], 2) + "x" : "-"},
            widths);
}

}  // namespace

void run_attention(const options& opt) {
  auto ctx = kernels::cpu::context::create(opt.threads);
  std::printf(
      "\nattention (paged KV, blocks of 16 shuffled, 8 heads / 2 KV heads, d=128): flash-style\n"
      "dense vs sparse = 64 global + window 512 + top-k 1/16 of the blocks by min/max bound;\n"
      "qb1: selection per query position, qb16: per 16 queries. prefill64 = the last 64 queries\n"
      "against the causal prefix. speedup = median over rounds of paired dense/sparse times\n");
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    double load = 0;
    if (std::fscanf(f, "%lf", &load) == 1)
      std::printf("load average (1 min) at start: %.2f on %d threads\n", load, opt.threads);
    std::fclose(f);
  }
  print_row({"tokens", "kv", "queries", "dense ms", "GFLOP/s", "qb1 ms", "keys/row", "speedup",
             "qb16 ms", "speedup"},
            {7, 5, 10, 9, 8, 9, 9, 8, 9, 8});
  const std::vector<int> sizes =
      opt.quick ? std::vector<int>{1024, 2048} : std::vector<int>{4096, 16384};
  const int reps = opt.quick ? 1 : 7;
  for (int tokens : sizes) {
    run_case(*ctx, tokens, kernels::dtype::f16, 64, reps);
    run_case(*ctx, tokens, kernels::dtype::f16, 1, reps * 4);
  }
  if (!opt.quick) run_case(*ctx, sizes.back(), kernels::dtype::f32, 64, reps);
}

}  // namespace troupe::bench
