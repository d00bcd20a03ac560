#pragma once
// Measurement helpers shared by the benchmarks: read bandwidth with the
// project's fastest read loop, medians (bench/common/stats.hpp), the
// machine's load.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench/common/stats.hpp"
#include "kernels/cpu/context.hpp"
#include "kernels/cpu/cpu_device.hpp"

namespace troupe::bench {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// A context of `threads` workers pinned to the first cores this process may use.
std::unique_ptr<kernels::cpu::context> make_ctx(int threads);
/// The same cores as a device, for benchmarks that run a model.
std::unique_ptr<kernels::cpu::cpu_device> make_device(int threads);

/// A buffer for bandwidth passes (allocated from the context's pool and
/// written once, so its pages exist).
struct bw_buffer {
  kernels::buffer_ptr storage;
  std::size_t bytes = 0;
  const std::byte* data() const { return static_cast<const std::byte*>(storage->data()); }
};
bw_buffer make_bw_buffer(kernels::cpu::context& ctx, std::size_t bytes);

/// One read pass over `bytes` of `buf` with the context's team (one
/// contiguous range per thread, AVX2 loads, software prefetch 8 KiB ahead
/// as the kernels do). Returns GB/s.
double bandwidth_pass(kernels::cpu::context& ctx, const std::byte* buf, std::size_t bytes);

/// A read loop for the bandwidth limit: reads `bytes` at p, returns an OR of
/// what it read (so the loads stay).
struct read_kernel {
  const char* name;
  std::uint64_t (*read)(const std::byte* p, std::size_t bytes);
};
/// Every read loop this CPU can run: AVX2 and AVX-512 loads, one or several
/// streams per thread, with and without software prefetch.
const std::vector<read_kernel>& read_kernels();
/// One pass of `k` over the buffer with the context's team (a contiguous
/// range per thread). Returns GB/s.
double read_pass(kernels::cpu::context& ctx, const read_kernel& k, const std::byte* buf,
                 std::size_t bytes);

/// The read bandwidth limit: the best pass of all read_kernels(), and which
/// one gave it.
struct read_limit {
  double gbps = 0;
  const char* kernel = "";
};
read_limit bandwidth_best(kernels::cpu::context& ctx, const std::byte* buf, std::size_t bytes);

double best(const std::vector<double>& v);
/// The 1-minute load average, formatted: figures mean little on a busy machine.
std::string load_average();

}  // namespace troupe::bench
