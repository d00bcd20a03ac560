#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/memory_pool.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor.hpp"

namespace troupe::kernels {

enum class device_kind : std::uint8_t { cpu, cuda, npu };
std::string_view to_string(device_kind k);

/// What a device is and what it offers.
struct device_info {
  std::string name;  ///< "cpu", "cpu:1", "cuda:0"
  device_kind kind = device_kind::cpu;
  int index = 0;
  std::uint64_t memory_bytes = 0;  ///< usable memory (limit for CPU devices)
  int cores = 0;                   ///< CPU cores (CPU), SMs (CUDA)
  std::string detail;              ///< ISA level, GPU model, ...
};

/// Operations a backend may or may not implement. A backend without an op
/// reports it unsupported; callers fall back to another device.
enum class op_kind : std::uint8_t {
  matmul,
  embedding,
  rms_norm,
  layer_norm,
  rope,
  activation,
  softmax,
  add,
  attention,
  conv2d_patch,
};

/// A compute device: allocates buffers and answers capability queries.
/// Kernels take the concrete backend context (e.g. cpu::context) obtained
/// from it.
class device {
 public:
  virtual ~device() = default;
  virtual const device_info& info() const = 0;
  virtual result<buffer_ptr> allocate(std::size_t bytes) = 0;
  /// Whether `op` runs here with weights (or data) of dtype `t`.
  virtual bool supports(op_kind op, dtype t) const = 0;
  /// Pool that backs `allocate` (host-visible devices only; null otherwise).
  virtual memory_pool* host_pool() { return nullptr; }
};

/// Options for discovering devices.
struct registry_options {
  /// CPU devices as sets of core ids, e.g. {{0}, {1}}: two CPU devices of
  /// one core each. Empty: one CPU device over all cores this process may use.
  std::vector<std::vector<int>> cpu_core_sets;
  /// Cap each CPU device's pool (0 = no cap).
  std::uint64_t cpu_memory_limit_bytes = 0;
  bool probe_cuda = true;
};

/// All devices of this process: CPU devices (from core sets) and CUDA
/// devices found by the probe.
class device_registry {
 public:
  static result<std::unique_ptr<device_registry>> discover(const registry_options& opts = {});

  const std::vector<std::unique_ptr<device>>& devices() const { return devices_; }
  /// Looks a device up by name ("cpu", "cpu:1", "cuda:0").
  result<device*> find(std::string_view name) const;
  /// Why no CUDA device is present ("" when there is one).
  const std::string& cuda_status() const { return cuda_status_; }

 private:
  std::vector<std::unique_ptr<device>> devices_;
  std::string cuda_status_;
};

}  // namespace troupe::kernels
