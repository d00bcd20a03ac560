#pragma once

#include <memory>
#include <vector>

#include "kernels/cpu/context.hpp"
#include "kernels/device.hpp"

namespace troupe::kernels::cpu {

/// A CPU device: a set of cores with its own pinned worker team and pool.
class cpu_device final : public device {
 public:
  static result<std::unique_ptr<cpu_device>> create(int index, std::vector<int> cores,
                                                    std::uint64_t memory_limit_bytes);
  const device_info& info() const override { return info_; }
  result<buffer_ptr> allocate(std::size_t bytes) override { return ctx_->memory().allocate(bytes); }
  bool supports(op_kind op, dtype t) const override;
  memory_pool* host_pool() override { return &ctx_->memory(); }
  context& ctx() { return *ctx_; }

 private:
  cpu_device() = default;
  device_info info_;
  std::unique_ptr<context> ctx_;
};

/// Cores this process may run on (its affinity mask).
std::vector<int> allowed_cores();

}  // namespace troupe::kernels::cpu
