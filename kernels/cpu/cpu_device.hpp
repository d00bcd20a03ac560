#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/cpu/context.hpp"
#include "kernels/device.hpp"

namespace troupe::kernels::cpu {

/// How to make a CPU device.
struct cpu_device_options {
  std::string name = "cpu";
  int index = 0;
  /// Cores the workers are pinned to, one worker each; empty: `threads`
  /// unpinned workers.
  std::vector<int> cores;
  int threads = 0;                       ///< with no cores; 0 = every hardware thread
  std::uint64_t memory_limit_bytes = 0;  ///< cap on the pool (0 = none)
  /// Check that each core is in this process's affinity mask, once.
  bool check_cores = true;
};

/// A CPU device: a set of cores with its own worker team and pool, running
/// the kernels of kernels/ops.hpp, matmul.hpp and attention.hpp.
class cpu_device final : public device {
 public:
  static result<std::unique_ptr<cpu_device>> create(const cpu_device_options& opts);
  /// `threads` unpinned workers (tests, tools, benchmarks).
  static std::unique_ptr<cpu_device> with_threads(int threads);

  const device_info& info() const override { return info_; }
  bool supports(op_kind op, dtype t) const override;
  bool supports(op_kind op, weight_format f) const override;
  memory_pool& memory() override { return ctx_->memory(); }
  bool host_visible() const override { return true; }

  result<matrix> prepare(const weight_matrix& w) override;
  result<patch_conv> prepare_patch_conv(const tensor& weight, const tensor& bias) override;

  result<void> matmul(const tensor& x, const matrix& w, tensor& y) override;
  result<void> embedding(const weight_matrix& table, const tensor& ids, const tensor& out) override;
  result<void> rms_norm(const tensor& x, const tensor& weight, float eps,
                        const tensor& out) override;
  result<void> layer_norm(const tensor& x, const tensor& weight, const tensor& bias, float eps,
                          const tensor& out) override;
  result<void> rope(const tensor& x, std::span<const std::int32_t> positions,
                    const rope_params& params, const tensor& out) override;
  result<void> silu(const tensor& x, const tensor& out) override;
  result<void> gelu(const tensor& x, gelu_kind kind, const tensor& out) override;
  result<void> swiglu(const tensor& gate, const tensor& up, const tensor& out) override;
  result<void> geglu(const tensor& gate, const tensor& up, const tensor& out) override;
  result<void> scale(const tensor& x, float s, const tensor& out) override;
  result<void> softcap(const tensor& x, float c, const tensor& out) override;
  result<void> softmax(const tensor& x, const tensor& out, float scale = 1.0f) override;
  result<void> add(const tensor& a, const tensor& b, const tensor& out) override;
  result<void> attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                         const attention_options& opt, std::int64_t q_start = -1) override;
  result<void> append_kv(paged_kv_cache& cache, std::span<const std::int32_t> block_table,
                         std::int64_t start, const tensor& k, const tensor& v) override;
  result<void> attention_paged(const paged_kv_cache& cache,
                               std::span<const attention_sequence> seqs,
                               const attention_options& opt) override;
  result<void> run_patch_conv(const patch_conv& conv, const tensor& input,
                              const tensor& out) override;
  void host_parallel_for(std::int64_t n, std::int64_t grain,
                         const std::function<void(std::int64_t, std::int64_t, int)>& fn) override;

  /// The kernels' context (its team, ISA level and pool): for kernel tests,
  /// benchmarks and the device probe.
  context& ctx() { return *ctx_; }

 private:
  cpu_device() = default;
  device_info info_;
  std::unique_ptr<context> ctx_;
};

/// Cores this process may run on (its affinity mask).
std::vector<int> allowed_cores();

}  // namespace troupe::kernels::cpu
