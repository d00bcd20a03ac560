// Read bandwidth, decode GEMV and GEMM figures of the matmul kernels.
//
// GEMV: every kernel pass (one sweep through >= 1 GiB of distinct packed
// matrices, so nothing is served from L3) is paired with a bandwidth pass
// taken right before it; the table reports the median of the paired
// fractions, because this host's bandwidth flips by ~1.7x every ~100 ms.
// GEMM: 512 x 2048 x 5632 for every format next to oneDNN's f32, bf16 and
// u8s8 primitives on the same shape, measured in the same run.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/common/measure.hpp"
#include "bench/kernels/bench.hpp"
#include "kernels/cpu/onednn_matmul.hpp"
#include "kernels/matmul.hpp"
#include "kernels/quant.hpp"

namespace troupe::bench {

namespace {

using namespace troupe::kernels;

constexpr std::size_t gib = std::size_t{1} << 30;

tensor random_matrix(memory_pool& pool, std::int64_t r, std::int64_t c, std::uint32_t seed) {
  auto t = tensor::empty(pool, dtype::f32, {r, c});
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (std::int64_t i = 0; i < r * c; ++i) t->data_as<float>()[i] = nd(rng);
  return *t;
}

struct format_spec {
  weight_format format;
  int group;
  const char* label;
  double target;  // GEMV fraction target (0: none)
};

const std::vector<format_spec>& gemv_formats() {
  static const std::vector<format_spec> f = {
      {weight_format::f16, 0, "f16", 0.85},
      {weight_format::int8_sym, 0, "int8", 0.85},
      {weight_format::int4_sym, 32, "int4 g32", 0.80},
      {weight_format::q8_0, 0, "q8_0", 0.85},
      {weight_format::q4_0, 0, "q4_0", 0.80},
      {weight_format::f32, 0, "f32", 0},
      {weight_format::bf16, 0, "bf16", 0},
      {weight_format::int8_asym, 0, "int8_asym", 0},
      {weight_format::int4_asym, 32, "int4_asym g32", 0},
      {weight_format::int4_sym, 128, "int4 g128", 0},
  };
  return f;
}

}  // namespace

void run_bandwidth_and_gemv(const options& opt) {
  auto ctx = make_ctx(opt.threads);
  auto ctx1 = make_ctx(1);
  const std::size_t bw_bytes = opt.quick ? (std::size_t{64} << 20) : gib;
  const int bw_passes = opt.quick ? 2 : 8;
  bw_buffer buf = make_bw_buffer(*ctx, bw_bytes);
  if (!buf.storage) return;

  // --- read bandwidth ------------------------------------------------------
  // Every read loop, best and median of its passes, at N threads and 1.
  std::printf("\n## Read bandwidth (%zu MiB buffer, %d passes per read loop; load average %s)\n",
              bw_bytes >> 20, bw_passes, load_average().c_str());
  print_row({"read loop", "threads", "best GB/s", "median GB/s"}, {28, 8, 10, 12});
  for (const auto& k : read_kernels())
    for (auto* c : {ctx.get(), ctx1.get()}) {
      std::vector<double> g;
      for (int i = 0; i < bw_passes; ++i) g.push_back(read_pass(*c, k, buf.data(), buf.bytes));
      print_row({k.name, std::to_string(c->threads()), fmt(best(g), 1), fmt(median(g), 1)},
                {28, 8, 10, 12});
    }

  // --- decode GEMV -----------------------------------------------------------
  struct shape {
    std::int64_t n, k;
  };
  const std::vector<shape> shapes =
      opt.quick ? std::vector<shape>{{256, 512}} : std::vector<shape>{{5632, 2048}, {2048, 5632}};
  const std::size_t rotate_bytes = opt.quick ? (std::size_t{16} << 20) : gib;
  const int reps = opt.quick ? 2 : 15;
  std::printf("\n## Decode GEMV, M=1, %d threads: weights [N, K], rotating through >= %zu MiB\n",
              opt.threads, rotate_bytes >> 20);
  std::printf(
      "## frac = kernel GB/s / read GB/s of the best read loop's pass right before it (median of "
      "%d pairs)\n",
      reps);
  std::printf("## best/best = best kernel pass / best bandwidth pass; load average %s\n",
              load_average().c_str());
  const std::vector<int> w = {14, 10, 8, 5, 9, 8, 9, 9, 10, 7, 4};
  print_row({"format", "NxK", "MiB/mat", "mats", "GB/s med", "bw med", "frac med", "frac min",
             "best/best", "target", "ok"},
            w);
  for (const auto& sh : shapes) {
    tensor wf = random_matrix(ctx->memory(), sh.n, sh.k, 1234);
    tensor x = random_matrix(ctx->memory(), 1, sh.k, 99);
    auto y = tensor::empty(ctx->memory(), dtype::f32, {1, sh.n});
    for (const auto& fs : gemv_formats()) {
      auto wq = quantize(ctx->memory(), wf, fs.format, fs.group ? fs.group : 32);
      if (!wq) {
        std::printf("%s: %s\n", fs.label, wq.error().message.c_str());
        continue;
      }
      auto first = packed_matrix::pack(*ctx, *wq);
      if (!first) {
        std::printf("%s: %s\n", fs.label, first.error().message.c_str());
        continue;
      }
      std::vector<packed_matrix> mats{*first};
      std::size_t total = first->bytes();
      while (total < rotate_bytes) {
        auto c = first->clone(*ctx);
        if (!c) break;
        total += c->bytes();
        mats.push_back(std::move(*c));
      }
      for (const auto& m : mats) (void)matmul(*ctx, x, m, *y);  // warm-up
      std::vector<double> frac, gbps, bws;
      for (int r = 0; r < reps; ++r) {
        const double bw = bandwidth_best(*ctx, buf.data(), std::min(buf.bytes, total)).gbps;
        const double t0 = now_s();
        for (const auto& m : mats) (void)matmul(*ctx, x, m, *y);
        const double g = static_cast<double>(total) / (now_s() - t0) / 1e9;
        frac.push_back(g / bw);
        gbps.push_back(g);
        bws.push_back(bw);
      }
      const double fm = median(frac);
      const double fmin = *std::min_element(frac.begin(), frac.end());
      print_row(
          {fs.label, std::to_string(sh.n) + "x" + std::to_string(sh.k),
           fmt(static_cast<double>(first->bytes()) / (1 << 20), 1), std::to_string(mats.size()),
           fmt(median(gbps), 1), fmt(median(bws), 1), fmt(fm, 3), fmt(fmin, 3),
           fmt(best(gbps) / best(bws), 3), fs.target > 0 ? fmt(fs.target, 2) : "-",
           fs.target > 0 ? (fm >= fs.target ? "yes" : "NO") : "-"},
          w);
      mats.clear();
      first = packed_matrix();
      ctx->memory().trim();
    }
  }
}

void run_gemm(const options& opt) {
  auto ctx = make_ctx(opt.threads);
  const std::int64_t M = opt.quick ? 32 : 512, K = opt.quick ? 256 : 2048,
                     N = opt.quick ? 512 : 5632;
  const int reps = opt.quick ? 1 : 5;
  const double ops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  std::printf(
      "\n## GEMM M=%lld K=%lld N=%lld, %d threads (median of %d runs; GOP/s = 2*M*N*K / time; "
      "load average %s)\n",
      static_cast<long long>(M), static_cast<long long>(K), static_cast<long long>(N), opt.threads,
      reps, load_average().c_str());
  tensor wf = random_matrix(ctx->memory(), N, K, 4321);
  tensor x = random_matrix(ctx->memory(), M, K, 77);
  auto y = tensor::empty(ctx->memory(), dtype::f32, {M, N});
  const std::vector<int> w = {22, 10, 10, 14};

  auto time_onednn = [&](cpu::onednn_kind kind) -> double {
    auto wsrc =
        quantize(ctx->memory(), wf,
                 kind == cpu::onednn_kind::u8s8 ? weight_format::int8_sym : weight_format::f32);
    auto mm = cpu::onednn_matmul::create(*ctx, *wsrc, M, kind);
    if (!mm) {
      print_row({"oneDNN " + std::string(cpu::to_string(kind)), "n/a", "n/a",
                 mm.error().message.substr(0, 60)},
                w);
      return 0;
    }
    if (auto r = mm->prepare_input(*ctx, x); !r) return 0;
    (void)mm->execute(*ctx, *y);
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      const double t0 = now_s();
      (void)mm->execute(*ctx, *y);
      t.push_back(now_s() - t0);
    }
    const double tm = median(t);
    print_row({"oneDNN " + std::string(cpu::to_string(kind)), fmt(tm * 1e3, 2),
               fmt(ops / tm / 1e9, 1), ""},
              w);
    return ops / tm / 1e9;
  };
  auto settle = [] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); };

  print_row({"kernel", "ms", "GOP/s", "/ oneDNN u8s8"}, w);
  time_onednn(cpu::onednn_kind::f32);
  time_onednn(cpu::onednn_kind::bf16);
  const double u8s8_a = time_onednn(cpu::onednn_kind::u8s8);
  settle();
  std::vector<std::pair<std::string, double>> ours;
  for (const auto& fs : gemv_formats()) {
    auto wq = quantize(ctx->memory(), wf, fs.format, fs.group ? fs.group : 32);
    if (!wq) {
      std::printf("%s: %s\n", fs.label, wq.error().message.c_str());
      continue;
    }
    auto p = packed_matrix::pack(*ctx, *wq);
    if (!p) {
      std::printf("%s: %s\n", fs.label, p.error().message.c_str());
      continue;
    }
    (void)matmul(*ctx, x, *p, *y);
    std::vector<double> t;
    for (int i = 0; i < reps; ++i) {
      const double t0 = now_s();
      (void)matmul(*ctx, x, *p, *y);
      t.push_back(now_s() - t0);
    }
    ours.emplace_back(fs.label, median(t));
  }
  settle();
  const double u8s8_b = time_onednn(cpu::onednn_kind::u8s8);
  const double base = std::max(u8s8_a, u8s8_b);  // the better oneDNN run: the stricter ratio
  for (const auto& [label, tm] : ours)
    print_row({std::string("troupe ") + label, fmt(tm * 1e3, 2), fmt(ops / tm / 1e9, 1),
               base > 0 ? fmt(ops / tm / 1e9 / base, 3) : "-"},
              w);
  std::printf(
      "(block-format target: q8_0 and q4_0 >= 0.5 of oneDNN u8s8 = %.1f GOP/s, the better of its "
      "two runs)\n",
      base);
}

void run_batch(const options& opt) {
  // Batched decode: M rows through one TinyLlama FFN-sized matrix, weights
  // resident in cache or not alike (the same matrix every call), against
  // M = 1 in the same run: the gain is M * t(1) / t(M).
  auto ctx = make_ctx(opt.threads);
  const std::int64_t K = opt.quick ? 256 : 2048, N = opt.quick ? 512 : 5632;
  const int reps = opt.quick ? 2 : 9;
  const std::vector<std::int64_t> ms = {1, 2, 4, 8, 16, 32};
  std::printf(
      "\n## Batched decode: M rows x [%lld, %lld], %d threads, median of %d calls (interleaved "
      "over "
      "M); gain = M * t(M=1) / t(M); load average %s\n",
      static_cast<long long>(N), static_cast<long long>(K), opt.threads, reps,
      load_average().c_str());
  std::vector<std::string> head = {"format"};
  for (auto m : ms) head.push_back("M=" + std::to_string(m) + " us");
  for (auto m : ms)
    if (m > 1) head.push_back("gain " + std::to_string(m));
  print_row(head, {14, 9, 9, 9, 9, 9, 9, 7, 7, 7, 7, 7});
  tensor wf = random_matrix(ctx->memory(), N, K, 4321);
  tensor x = random_matrix(ctx->memory(), ms.back(), K, 77);
  for (const auto& fs : gemv_formats()) {
    auto wq = quantize(ctx->memory(), wf, fs.format, fs.group ? fs.group : 32);
    if (!wq) continue;
    auto p = packed_matrix::pack(*ctx, *wq);
    if (!p) continue;
    std::vector<std::vector<double>> t(ms.size());
    std::vector<tensor> xs, ys;
    for (auto m : ms) {
      xs.push_back(*x.slice_rows(0, m));
      ys.push_back(*tensor::empty(ctx->memory(), dtype::f32, {m, N}));
    }
    for (std::size_t i = 0; i < ms.size(); ++i) (void)matmul(*ctx, xs[i], *p, ys[i]);
    for (int r = 0; r < reps; ++r)
      for (std::size_t i = 0; i < ms.size(); ++i) {
        const double t0 = now_s();
        (void)matmul(*ctx, xs[i], *p, ys[i]);
        t[i].push_back(now_s() - t0);
      }
    std::vector<std::string> row = {fs.label};
    for (auto& v : t) row.push_back(fmt(median(v) * 1e6, 0));
    for (std::size_t i = 1; i < ms.size(); ++i)
      row.push_back(fmt(double(ms[i]) * median(t[0]) / median(t[i]), 2));
    print_row(row, {14, 9, 9, 9, 9, 9, 9, 7, 7, 7, 7, 7});
  }
}

}  // namespace troupe::bench
