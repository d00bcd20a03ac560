#include "bench/common/measure.hpp"

#include <immintrin.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace troupe::bench {

using namespace troupe::kernels;

namespace {

std::vector<int> first_cores(int n) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cores;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cores;
  for (int c = 0; c < CPU_SETSIZE && static_cast<int>(cores.size()) < n; ++c)
    if (CPU_ISSET(c, &set)) cores.push_back(c);
  if (static_cast<int>(cores.size()) < n) cores.clear();  // fewer cores than threads: do not pin
  return cores;
}

// 4 independent 32-byte loads per 128 bytes; PF: prefetch 8 KiB ahead (as
// the kernels do), else the hardware prefetchers alone.
template <bool PF>
__attribute__((target("avx2"))) std::uint64_t read_avx2(const std::byte* p, std::size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 128 <= bytes; i += 128) {
    if constexpr (PF) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 8192), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + 8192 + 64), _MM_HINT_T0);
    }
    a0 = _mm256_or_si256(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_or_si256(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_or_si256(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_or_si256(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i a = _mm256_or_si256(_mm256_or_si256(a0, a1), _mm256_or_si256(a2, a3));
  return static_cast<std::uint64_t>(_mm256_extract_epi64(a, 0) | _mm256_extract_epi64(a, 1) |
                                    _mm256_extract_epi64(a, 2) | _mm256_extract_epi64(a, 3));
}

// AVX-512: S streams (the range cut in S parts read in lockstep), one 64-byte
// line of each per step, optionally prefetching 8 KiB ahead in each.
template <int S, bool PF>
__attribute__((target("avx512f"))) std::uint64_t read_avx512(const std::byte* p,
                                                             std::size_t bytes) {
  const std::size_t part = bytes / S / 256 * 256;
  __m512i a[S][4];
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < 4; ++j) a[s][j] = _mm512_setzero_si512();
  for (std::size_t i = 0; i + 256 <= part; i += 256)
    for (int s = 0; s < S; ++s) {
      const std::byte* q = p + s * part + i;
      if constexpr (PF) {
        _mm_prefetch(reinterpret_cast<const char*>(q + 8192), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + 8192 + 64), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + 8192 + 128), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(q + 8192 + 192), _MM_HINT_T0);
      }
      for (int j = 0; j < 4; ++j) a[s][j] = _mm512_or_si512(a[s][j], _mm512_load_si512(q + 64 * j));
    }
  __m512i r = _mm512_setzero_si512();
  for (int s = 0; s < S; ++s)
    for (int j = 0; j < 4; ++j) r = _mm512_or_si512(r, a[s][j]);
  alignas(64) std::uint64_t lanes[8];
  _mm512_store_si512(lanes, r);
  std::uint64_t out = 0;
  for (auto v : lanes) out |= v;
  return out;
}

std::uint64_t read_scalar(const std::byte* p, std::size_t bytes) {
  std::uint64_t acc = 0;
  for (std::size_t i = 0; i + 8 <= bytes; i += 8) {
    std::uint64_t v;
    std::memcpy(&v, p + i, 8);
    acc |= v;
  }
  return acc;
}

volatile std::uint64_t g_sink = 0;

}  // namespace

std::unique_ptr<cpu::context> make_ctx(int threads) {
  return cpu::context::create(threads, first_cores(threads));
}

std::unique_ptr<cpu::cpu_device> make_device(int threads) {
  cpu::cpu_device_options o;
  o.name = "bench";
  o.cores = first_cores(threads);
  o.check_cores = false;
  return std::move(*cpu::cpu_device::create(o));
}

bw_buffer make_bw_buffer(cpu::context& ctx, std::size_t bytes) {
  bw_buffer b;
  auto buf = ctx.memory().allocate(bytes);
  if (!buf) {
    std::printf("cannot allocate %zu bytes for the bandwidth buffer\n", bytes);
    return b;
  }
  b.storage = std::move(*buf);
  b.bytes = bytes;
  std::memset(b.storage->data(), 1, bytes);
  return b;
}

double bandwidth_pass(cpu::context& ctx, const std::byte* buf, std::size_t bytes) {
  const bool avx2 = ctx.level() >= cpu::isa::avx2;
  const auto lines = static_cast<std::int64_t>(bytes / 4096);
  const double t0 = now_s();
  ctx.pool().parallel_for(lines, 1, [&](std::int64_t b, std::int64_t e, int) {
    const std::byte* p = buf + b * 4096;
    const auto n = static_cast<std::size_t>((e - b) * 4096);
    g_sink = g_sink + (avx2 ? read_avx2<true>(p, n) : read_scalar(p, n));
  });
  return static_cast<double>(lines * 4096) / (now_s() - t0) / 1e9;
}

const std::vector<read_kernel>& read_kernels() {
  static const std::vector<read_kernel> all = [] {
    std::vector<read_kernel> v;
    if (__builtin_cpu_supports("avx2")) {
      v.push_back({"avx2 1 stream, prefetch", read_avx2<true>});
      v.push_back({"avx2 1 stream", read_avx2<false>});
    }
    if (__builtin_cpu_supports("avx512f")) {
      v.push_back({"avx512 1 stream, prefetch", read_avx512<1, true>});
      v.push_back({"avx512 1 stream", read_avx512<1, false>});
      v.push_back({"avx512 2 streams, prefetch", read_avx512<2, true>});
      v.push_back({"avx512 2 streams", read_avx512<2, false>});
      v.push_back({"avx512 4 streams, prefetch", read_avx512<4, true>});
      v.push_back({"avx512 4 streams", read_avx512<4, false>});
    }
    if (v.empty()) v.push_back({"scalar", read_scalar});
    return v;
  }();
  return all;
}

double read_pass(cpu::context& ctx, const read_kernel& k, const std::byte* buf, std::size_t bytes) {
  const auto lines = static_cast<std::int64_t>(bytes / 4096);
  const double t0 = now_s();
  ctx.pool().parallel_for(lines, 1, [&](std::int64_t b, std::int64_t e, int) {
    g_sink = g_sink + k.read(buf + b * 4096, static_cast<std::size_t>((e - b) * 4096));
  });
  return static_cast<double>(lines * 4096) / (now_s() - t0) / 1e9;
}

read_limit bandwidth_best(cpu::context& ctx, const std::byte* buf, std::size_t bytes) {
  read_limit out;
  for (const auto& k : read_kernels()) {
    const double g = read_pass(ctx, k, buf, bytes);
    if (g > out.gbps) {
      out.gbps = g;
      out.kernel = k.name;
    }
  }
  return out;
}

double best(const std::vector<double>& v) {
  return v.empty() ? 0 : *std::max_element(v.begin(), v.end());
}

std::string load_average() {
  double l = 0;
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = 0;
    std::fclose(f);
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", l);
  return buf;
}

}  // namespace troupe::bench
