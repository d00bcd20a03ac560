#include "kernels/device.hpp"

#include <sched.h>
#include <unistd.h>

#include <fstream>
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

namespace cpu {

std::vector<int> allowed_cores() {
  std::vector<int> out;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  if (out.empty()) out.push_back(0);
  return out;
}

namespace {
std::uint64_t physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? std::uint64_t(pages) * std::uint64_t(page) : 0;
}
}  // namespace

result<std::unique_ptr<cpu_device>> cpu_device::create(int index, std::vector<int> cores,
                                                       std::uint64_t memory_limit_bytes) {
  if (cores.empty())
    return make_error(errc::invalid_argument, "a CPU device needs at least one core");
  const auto allowed = allowed_cores();
  const std::set<int> allowed_set(allowed.begin(), allowed.end());
  std::set<int> seen;
  for (int c : cores) {
    if (!allowed_set.count(c))
      return make_error(errc::invalid_argument,
                        "core " + std::to_string(c) + " is not available to this process");
    if (!seen.insert(c).second)
      return make_error(errc::invalid_argument, "core " + std::to_string(c) + " listed twice");
  }
  std::unique_ptr<cpu_device> dev(new cpu_device());
  dev->info_.name = index == 0 ? "cpu" : "cpu:" + std::to_string(index);
  dev->info_.kind = device_kind::cpu;
  dev->info_.index = index;
  dev->info_.cores = static_cast<int>(cores.size());
  dev->info_.memory_bytes = memory_limit_bytes ? memory_limit_bytes : physical_memory_bytes();
  dev->ctx_ = context::create(static_cast<int>(cores.size()), cores, memory_limit_bytes);
  dev->info_.detail = std::string(to_string(dev->ctx_->level()));
  return dev;
}

bool cpu_device::supports(op_kind op, dtype t) const {
  switch (op) {
    case op_kind::matmul:
    case op_kind::embedding:
      return t != dtype::i32 && t != dtype::u8;
    case op_kind::attention:
      return t == dtype::f32 || t == dtype::f16 || t == dtype::i8;
    default:
      return t == dtype::f32;
  }
}

}  // namespace cpu

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
    auto dev = cpu::cpu_device::create(static_cast<int>(i), sets[i], opts.cpu_memory_limit_bytes);
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
