#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace troupe::kernels::cpu {

/// A fixed team of worker threads, optionally pinned to cores, that runs
/// one parallel loop at a time. The calling thread takes part as worker 0.
/// Work is split statically into contiguous ranges, so which index lands
/// in which range depends only on (n, thread count), never on timing.
class thread_pool {
 public:
  /// `cores`: CPU ids to pin the team to (worker i to cores[i]); empty
  /// means `threads` unpinned workers.
  thread_pool(int threads, std::vector<int> cores = {});
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  int size() const { return threads_; }
  const std::vector<int>& cores() const { return cores_; }

  /// Calls fn(begin, end, worker) on disjoint ranges covering [0, n), with
  /// range boundaries at multiples of `grain`. Returns when all are done.
  /// Not re-entrant: fn must not call parallel_for on the same pool.
  void parallel_for(std::int64_t n, std::int64_t grain,
                    const std::function<void(std::int64_t, std::int64_t, int)>& fn);

  /// The range worker `w` of `workers` gets for [0, n) with `grain`.
  static void split(std::int64_t n, std::int64_t grain, int workers, int w, std::int64_t& begin,
                    std::int64_t& end);

  /// Pins the calling thread to `cores` (no-op when empty).
  static bool pin_current_thread(const std::vector<int>& cores);

 private:
  void worker_loop(int index);

  int threads_;
  std::vector<int> cores_;
  std::vector<std::thread> workers_;
  std::mutex mtx_;
  std::condition_variable cv_;
  std::atomic<std::uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  bool stop_ = false;
  const std::function<void(std::int64_t, std::int64_t, int)>* job_ = nullptr;
  std::int64_t job_n_ = 0, job_grain_ = 1;
};

}  // namespace troupe::kernels::cpu
