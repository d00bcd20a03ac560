#include "kernels/device.hpp"

#include <cstring>
#include <set>
#include <string>

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cuda/cuda_device.hpp"
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
    case op_kind::geglu:
      return "geglu";
    case op_kind::scale:
      return "scale";
    case op_kind::softcap:
      return "softcap";
  }
  return "unknown";
}

result<void> device::check_dense(const tensor& t, std::size_t bytes, const char* what) {
  if (t.empty_view() || !t.is_contiguous())
    return make_error(errc::invalid_argument, std::string(what) + ": the tensor is not dense");
  if (t.nbytes() != bytes)
    return make_error(errc::invalid_argument, std::string(what) + ": " + std::to_string(bytes) +
                                                  " bytes for a tensor of " +
                                                  std::to_string(t.nbytes()));
  return {};
}

result<void> device::write(const tensor& dst, std::span<const std::byte> src) {
  if (auto r = check_dense(dst, src.size(), "write"); !r) return r;
  if (!host_visible())
    return make_error(errc::unsupported_op, "write: " + info().name + " needs its own copy");
  if (!src.empty()) std::memcpy(dst.data(), src.data(), src.size());
  return {};
}

result<void> device::read(const tensor& src, std::span<std::byte> dst) {
  if (auto r = check_dense(src, dst.size(), "read"); !r) return r;
  if (!host_visible())
    return make_error(errc::unsupported_op, "read: " + info().name + " needs its own copy");
  if (!dst.empty()) std::memcpy(dst.data(), src.data(), dst.size());
  return {};
}

result<void> device::copy(const tensor& src, const tensor& dst) {
  if (auto r = check_dense(dst, src.nbytes(), "copy"); !r) return r;
  if (auto r = check_dense(src, src.nbytes(), "copy"); !r) return r;
  if (!host_visible())
    return make_error(errc::unsupported_op, "copy: " + info().name + " needs its own copy");
  if (src.nbytes()) std::memmove(dst.data(), src.data(), src.nbytes());
  return {};
}

result<void> device::fill_zero(const tensor& t) {
  if (auto r = check_dense(t, t.nbytes(), "fill_zero"); !r) return r;
  if (!host_visible())
    return make_error(errc::unsupported_op, "fill_zero: " + info().name + " needs its own fill");
  if (t.nbytes()) std::memset(t.data(), 0, t.nbytes());
  return {};
}

result<void> device::geglu(const tensor&, const tensor&, const tensor&) {
  return make_error(errc::unsupported_op, "geglu: " + info().name + " has no GeGLU kernel");
}

result<void> device::scale(const tensor&, float, const tensor&) {
  return make_error(errc::unsupported_op, "scale: " + info().name + " has no scale kernel");
}

result<void> device::softcap(const tensor&, float, const tensor&) {
  return make_error(errc::unsupported_op,
                    "softcap: " + info().name + " has no soft-capping kernel");
}

result<tensor> host_view(device& dev, const tensor& t, std::vector<std::byte>& keep) {
  if (dev.host_visible()) return t;
  if (t.empty_view() || !t.is_contiguous())
    return make_error(errc::invalid_argument, "host_view: the tensor is not dense");
  keep.resize(t.nbytes());
  if (auto r = dev.read(t, keep); !r) return std::unexpected(r.error());
  return tensor::view(keep.data(), t.type(), t.shape());
}

memory_pool* pool_of(const tensor& t) {
  return t.storage() ? t.storage()->pool() : nullptr;
}

bool host_readable(const tensor& t) {
  const auto* p = pool_of(t);
  return p == nullptr || p->host_accessible();
}

result<void> copy_to_host(const tensor& t, std::span<std::byte> dst) {
  if (t.empty_view() || !t.is_contiguous())
    return make_error(errc::invalid_argument, "copy_to_host: the tensor is not dense");
  if (dst.size() != t.nbytes())
    return make_error(errc::invalid_argument, "copy_to_host: " + std::to_string(dst.size()) +
                                                  " bytes for a tensor of " +
                                                  std::to_string(t.nbytes()));
  if (const auto* p = pool_of(t)) return p->copy_to_host(t.data(), dst.data(), dst.size());
  if (!dst.empty()) std::memcpy(dst.data(), t.data(), dst.size());
  return {};
}

result<tensor> to_device(device& dev, const tensor& t) {
  if (pool_of(t) == &dev.memory() || (dev.host_visible() && host_readable(t))) return t;
  if (t.empty_view() || !t.is_contiguous())
    return make_error(errc::invalid_argument, "to_device: the tensor is not dense");
  auto out = tensor::empty(dev.memory(), t.type(), t.shape());
  if (!out) return std::unexpected(out.error());
  std::vector<std::byte> staged;
  std::span<const std::byte> bytes;
  if (host_readable(t)) {
    bytes = {static_cast<const std::byte*>(t.data()), t.nbytes()};
  } else {
    staged.resize(t.nbytes());
    if (auto r = copy_to_host(t, staged); !r) return std::unexpected(r.error());
    bytes = staged;
  }
  if (auto r = dev.write(*out, bytes); !r) return std::unexpected(r.error());
  return out;
}

result<tensor> to_host(const tensor& t, memory_pool& host_pool) {
  if (host_readable(t)) return t;
  if (!host_pool.host_accessible())
    return make_error(errc::invalid_argument, "to_host: the pool given is not host memory");
  auto out = tensor::empty(host_pool, t.type(), t.shape());
  if (!out) return std::unexpected(out.error());
  if (auto r = copy_to_host(t, {static_cast<std::byte*>(out->data()), out->nbytes()}); !r)
    return std::unexpected(r.error());
  return out;
}

result<paged_kv_cache> create_paged_kv_cache(device& dev, const kv_cache_config& config) {
  if (dev.host_visible()) return paged_kv_cache::create(dev.memory(), config);
  paged_kv_cache cache;
  cache.config = config;
  // The shapes are those validate() checks; it runs first on the config
  // alone (no tensor yet) through a cache with no parts.
  if (config.n_blocks <= 0 || config.n_kv_heads <= 0 || config.head_dim <= 0 ||
      config.block_size <= 0)
    return make_error(errc::invalid_argument, "kv cache config: sizes must be positive");
  auto part = [&](tensor& t, dtype type, shape_t shape) -> result<void> {
    auto made = tensor::empty(dev.memory(), type, shape);
    if (!made) return std::unexpected(made.error());
    t = std::move(*made);
    return dev.fill_zero(t);
  };
  const shape_t data{config.n_blocks, config.n_kv_heads, config.block_size, config.head_dim};
  if (auto r = part(cache.k, config.type, data); !r) return std::unexpected(r.error());
  if (auto r = part(cache.v, config.type, data); !r) return std::unexpected(r.error());
  if (config.type == dtype::i8) {
    const shape_t scales{config.n_blocks, config.n_kv_heads, config.block_size};
    if (auto r = part(cache.k_scales, dtype::f32, scales); !r) return std::unexpected(r.error());
    if (auto r = part(cache.v_scales, dtype::f32, scales); !r) return std::unexpected(r.error());
  }
  if (config.summaries)
    if (auto r = part(cache.k_summary, dtype::f32,
                      {config.n_blocks, config.n_kv_heads, 2, config.head_dim});
        !r)
      return std::unexpected(r.error());
  if (auto r = cache.validate(); !r) return std::unexpected(r.error());
  return cache;
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
    for (const auto& gpu : probe.gpus) {
      cuda::cuda_device_options o;
      o.index = gpu.index;
      auto dev = cuda::make_device(o);
      if (!dev) {
        reg->cuda_status_ = "cuda:" + std::to_string(gpu.index) + ": " + dev.error().message;
        continue;
      }
      reg->devices_.push_back(std::move(*dev));
    }
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
