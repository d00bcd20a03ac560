#pragma once

#include <memory>
#include <vector>

#include "kernels/cpu/isa.hpp"
#include "kernels/cpu/thread_pool.hpp"
#include "kernels/memory_pool.hpp"

namespace troupe::kernels::cpu {

/// What a CPU kernel needs: the device's worker team, the ISA level to run
/// at and the pool for scratch memory. Kernels split work over output rows
/// only, so results do not depend on the team's size.
class context {
 public:
  /// A context over `threads` workers pinned to `cores` (if given), at the
  /// detected ISA level.
  static std::unique_ptr<context> create(int threads, std::vector<int> cores = {},
                                         std::size_t pool_limit_bytes = 0);

  thread_pool& pool() { return *pool_; }
  int threads() const { return pool_->size(); }
  memory_pool& memory() { return *memory_; }
  const std::shared_ptr<memory_pool>& memory_ptr() const { return memory_; }

  isa level() const { return level_; }
  /// Runs kernels at `level` or lower (tests use this to run every path).
  void set_level(isa level) { level_ = level < hardware_ ? level : hardware_; }
  isa hardware_level() const { return hardware_; }
  /// Float matmuls on zmm at the AVX-512 levels: on by default where the
  /// CPU runs 512-bit FMAs at full width (full_width_avx512()); tests turn
  /// it on to run that path on any AVX-512 CPU.
  bool wide_float_matmul() const { return wide_float_; }
  void set_wide_float_matmul(bool on) { wide_float_ = on; }

  /// Call before using oneDNN from this thread: sizes the calling thread's
  /// OpenMP team to this device's core count.
  void prepare_onednn_thread() const;

 private:
  context() = default;
  std::unique_ptr<thread_pool> pool_;
  std::shared_ptr<memory_pool> memory_;
  isa level_ = isa::scalar;
  isa hardware_ = isa::scalar;
  bool wide_float_ = full_width_avx512();
};

}  // namespace troupe::kernels::cpu
