#include "actors/device.hpp"

#include <map>
#include <mutex>

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cuda/cuda_device.hpp"

namespace troupe::actors {

namespace {

struct openers {
  std::mutex mtx;
  std::map<std::string, device_opener> by_kind;
};

openers& registered() {
  static openers o;
  return o;
}

}  // namespace

bool device_kind_registered(const std::string& kind) {
  auto& r = registered();
  std::lock_guard lock(r.mtx);
  return r.by_kind.count(kind) != 0;
}

kernels::result<void> register_device_kind(const std::string& kind, device_opener open) {
  if (kind.empty() || kind == "cpu" || kind == "cuda" || kind == "npu" ||
      kind.find_first_of(":,") != std::string::npos || !open)
    return kernels::make_error(kernels::errc::invalid_argument,
                               "register_device_kind: '" + kind + "' cannot be registered");
  auto& r = registered();
  std::lock_guard lock(r.mtx);
  r.by_kind[kind] = std::move(open);
  return {};
}

kernels::result<std::shared_ptr<kernels::device>> open_device(const device_spec& spec) {
  if (spec.kind == "cpu") {
    kernels::cpu::cpu_device_options o;
    o.name = spec.name;
    o.cores = spec.cores;
    o.check_cores = false;  // parse_devices checked them against the affinity mask
    auto d = kernels::cpu::cpu_device::create(o);
    if (!d) return std::unexpected(d.error());
    return std::shared_ptr<kernels::device>(std::move(*d));
  }
  if (spec.kind == "cuda") {
    kernels::cuda::cuda_device_options o;
    o.index = spec.index;
    auto d = kernels::cuda::make_device(o);
    if (!d)
      return kernels::make_error(d.error().code,
                                 "device '" + spec.name + "': " + d.error().message);
    return std::shared_ptr<kernels::device>(std::move(*d));
  }
  device_opener open;
  {
    auto& r = registered();
    std::lock_guard lock(r.mtx);
    if (auto it = r.by_kind.find(spec.kind); it != r.by_kind.end()) open = it->second;
  }
  if (!open)
    return kernels::make_error(kernels::errc::device_unavailable,
                               "device '" + spec.name + "': no backend for '" + spec.kind + "'");
  auto d = open(spec);
  if (!d)
    return kernels::make_error(d.error().code, "device '" + spec.name + "': " + d.error().message);
  if (!*d)
    return kernels::make_error(kernels::errc::device_unavailable,
                               "device '" + spec.name + "': its backend made no device");
  return d;
}

}  // namespace troupe::actors
