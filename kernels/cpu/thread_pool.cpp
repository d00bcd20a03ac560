#include "kernels/cpu/thread_pool.hpp"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>

namespace troupe::kernels::cpu {

thread_pool::thread_pool(int threads, std::vector<int> cores)
    : threads_(std::max(1, threads)), cores_(std::move(cores)) {
  if (!cores_.empty()) threads_ = static_cast<int>(cores_.size());
  for (int i = 1; i < threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard<std::mutex> guard(mtx_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

bool thread_pool::pin_current_thread(const std::vector<int>& cores) {
  if (cores.empty()) return true;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cores)
    if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set) == 0;
}

void thread_pool::split(std::int64_t n, std::int64_t grain, int workers, int w, std::int64_t& begin,
                        std::int64_t& end) {
  grain = std::max<std::int64_t>(1, grain);
  const std::int64_t chunks = (n + grain - 1) / grain;
  const std::int64_t per = chunks / workers, extra = chunks % workers;
  const std::int64_t c0 = w * per + std::min<std::int64_t>(w, extra);
  const std::int64_t c1 = c0 + per + (w < extra ? 1 : 0);
  begin = std::min(n, c0 * grain);
  end = std::min(n, c1 * grain);
}

void thread_pool::worker_loop(int index) {
  if (!cores_.empty()) pin_current_thread({cores_[static_cast<std::size_t>(index)]});
  std::uint64_t seen = 0;
  for (;;) {
    // Spin briefly (decode issues hundreds of small loops per token), then sleep.
    // The clock is read every 64 pauses (it was every pause: ~1 % of a
    // decode profile went to clock_gettime).
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(200);
    for (unsigned i = 1; generation_.load(std::memory_order_acquire) == seen; ++i) {
      __builtin_ia32_pause();
      if (i % 64 == 0 && std::chrono::steady_clock::now() >= spin_until) break;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(mtx_);
      cv_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    std::int64_t b = 0, e = 0;
    split(job_n_, job_grain_, threads_, index, b, e);
    if (b < e) (*job_)(b, e, index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void thread_pool::parallel_for(std::int64_t n, std::int64_t grain,
                               const std::function<void(std::int64_t, std::int64_t, int)>& fn) {
  if (n <= 0) return;
  if (threads_ == 1 || n <= std::max<std::int64_t>(1, grain)) {
    fn(0, n, 0);
    return;
  }
  {
    std::lock_guard<std::mutex> guard(mtx_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    pending_.store(threads_ - 1, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  std::int64_t b = 0, e = 0;
  split(n, grain, threads_, 0, b, e);
  if (b < e) fn(b, e, 0);
  while (pending_.load(std::memory_order_acquire) != 0) __builtin_ia32_pause();
}

}  // namespace troupe::kernels::cpu
