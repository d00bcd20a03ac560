#include "kernels/device.hpp"

#include <set>
#include <string>

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cuda/probe.hpp"

namespace troupe::kernels {

std::string_view to_string(device_kind k) {
  switch (k) {
    case device_kind::cpu:
      return "cpu";
    case device_kind::cuda:
      return "cuda";
    case device_kind::npu:
      return "npu";
  }
  return "unknown";
}

std::string_view to_string(op_kind op) {
  switch (op) {
    case op_kind::matmul:
      return "matmul";
    case op_kind::embedding:
      return "embedding";
    case op_kind::rms_norm:
      return "rms_norm";
    case op_kind::layer_norm:
      return "layer_norm";
    case op_kind::rope:
      return "rope";
    case op_kind::activation:
      return "activation";
    case op_kind::softmax:
      return "softmax";
    case op_kind::add:
      return "add";
    case op_kind::attention:
      return "attention";
    case op_kind::conv2d_patch:
      return "conv2d_patch";
  }
  return "unknown";
}

result<std::unique_ptr<device_registry>> device_registry::discover(const registry_options& opts) {
  auto reg = std::make_unique<device_registry>();
  std::vector<std::vector<int>> sets = opts.cpu_core_sets;
  if (sets.empty()) sets.push_back(cpu::allowed_cores());
  std::set<int> used;
  for (std::size_t i = 0; i < sets.size(); ++i) {
    for (int c : sets[i])
      if (!used.insert(c).second)
        return make_error(errc::invalid_argument,
                          "core " + std::to_string(c) + " is in two CPU devices");
    cpu::cpu_device_options o;
    o.index = static_cast<int>(i);
    o.name = i == 0 ? "cpu" : "cpu:" + std::to_string(i);
    o.cores = sets[i];
    o.memory_limit_bytes = opts.cpu_memory_limit_bytes;
    if (o.cores.empty())
      return make_error(errc::invalid_argument, "a CPU device needs at least one core");
    auto dev = cpu::cpu_device::create(o);
    if (!dev) return std::unexpected(dev.error());
    reg->devices_.push_back(std::move(*dev));
  }
  if (opts.probe_cuda) {
    auto probe = cuda::probe();
    reg->cuda_status_ = probe.status;
    // CUDA compute backends arrive with the data-plane work; the probe
    // records what is present so placement can see it.
  } else {
    reg->cuda_status_ = "not probed";
  }
  return reg;
}

result<device*> device_registry::find(std::string_view name) const {
  for (const auto& d : devices_)
    if (d->info().name == name) return d.get();
  return make_error(errc::device_unavailable, "no device named '" + std::string(name) + "'");
}

}  // namespace troupe::kernels
