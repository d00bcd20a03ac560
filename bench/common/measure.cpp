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

// 4 independent 32-byte loads per 128 bytes, prefetch 8 KiB ahead.
__attribute__((target("avx2"))) std::uint64_t read_avx2(const std::byte* p, std::size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i + 128 <= bytes; i += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i + 8192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + i + 8192 + 64), _MM_HINT_T0);
    a0 = _mm256_or_si256(a0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_or_si256(a1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_or_si256(a2, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_or_si256(a3, _mm256_load_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  const __m256i a = _mm256_or_si256(_mm256_or_si256(a0, a1), _mm256_or_si256(a2, a3));
  return static_cast<std::uint64_t>(_mm256_extract_epi64(a, 0) | _mm256_extract_epi64(a, 1) |
                                    _mm256_extract_epi64(a, 2) | _mm256_extract_epi64(a, 3));
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
    g_sink = g_sink + (avx2 ? read_avx2(p, n) : read_scalar(p, n));
  });
  return static_cast<double>(lines * 4096) / (now_s() - t0) / 1e9;
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
