#include "kernels/cpu/cpu_device.hpp"

#include <sched.h>
#include <unistd.h>

#include <set>
#include <string>
#include <thread>

#include "kernels/attention.hpp"
#include "kernels/matmul.hpp"
#include "kernels/ops.hpp"

namespace troupe::kernels::cpu {

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

result<void> cpu_backend(device_kind k, std::string_view what) {
  if (k != device_kind::cpu)
    return make_error(errc::device_unavailable, std::string(what) + " was prepared by a " +
                                                    std::string(to_string(k)) +
                                                    " device; a CPU device cannot run it");
  return {};
}

}  // namespace

result<std::unique_ptr<cpu_device>> cpu_device::create(const cpu_device_options& opts) {
  if (opts.check_cores) {
    const auto allowed = allowed_cores();
    const std::set<int> allowed_set(allowed.begin(), allowed.end());
    std::set<int> seen;
    for (int c : opts.cores) {
      if (!allowed_set.count(c))
        return make_error(errc::invalid_argument,
                          "core " + std::to_string(c) + " is not available to this process");
      if (!seen.insert(c).second)
        return make_error(errc::invalid_argument, "core " + std::to_string(c) + " listed twice");
    }
  }
  if (opts.cores.empty() && opts.threads < 0)
    return make_error(errc::invalid_argument, "a CPU device needs at least one worker");
  const int threads = !opts.cores.empty() ? static_cast<int>(opts.cores.size())
                      : opts.threads > 0
                          ? opts.threads
                          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::unique_ptr<cpu_device> dev(new cpu_device());
  dev->info_.name = opts.name;
  dev->info_.kind = device_kind::cpu;
  dev->info_.index = opts.index;
  dev->info_.cores = threads;
  dev->info_.memory_bytes =
      opts.memory_limit_bytes ? opts.memory_limit_bytes : physical_memory_bytes();
  dev->ctx_ = context::create(threads, opts.cores, opts.memory_limit_bytes);
  dev->info_.detail = std::string(to_string(dev->ctx_->level()));
  return dev;
}

std::unique_ptr<cpu_device> cpu_device::with_threads(int threads) {
  cpu_device_options o;
  o.threads = threads < 1 ? 1 : threads;
  o.check_cores = false;
  return std::move(*create(o));  // cannot fail: no cores to check, threads >= 1
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

bool cpu_device::supports(op_kind op, weight_format) const {
  // Every storage format has a packed matmul and a dequantizing embedding.
  return op == op_kind::matmul || op == op_kind::embedding;
}

result<matrix> cpu_device::prepare(const weight_matrix& w) {
  auto p = packed_matrix::pack(*ctx_, w);
  if (!p) return std::unexpected(p.error());
  auto shared = std::make_shared<const packed_matrix>(std::move(*p));
  const auto rows = shared->rows(), cols = shared->cols();
  const auto fmt = shared->format();
  const auto bytes = shared->bytes();
  return matrix(device_kind::cpu, std::move(shared), rows, cols, fmt, bytes);
}

result<patch_conv> cpu_device::prepare_patch_conv(const tensor& weight, const tensor& bias) {
  auto p = patch_embedding::create(weight, bias);
  if (!p) return std::unexpected(p.error());
  std::shared_ptr<patch_embedding> shared(std::move(*p));
  const auto h = shared->hidden(), c = shared->channels(), s = shared->patch();
  return patch_conv(device_kind::cpu, std::move(shared), h, c, s);
}

result<void> cpu_device::matmul(const tensor& x, const matrix& w, tensor& y) {
  if (w.empty()) return make_error(errc::invalid_argument, "matmul: empty weight matrix");
  if (auto r = cpu_backend(w.backend(), "matmul: the weight matrix"); !r) return r;
  return kernels::matmul(*ctx_, x, *static_cast<const packed_matrix*>(w.impl()), y);
}

result<void> cpu_device::embedding(const weight_matrix& table, const tensor& ids,
                                   const tensor& out) {
  return kernels::embedding(*ctx_, table, ids, out);
}

result<void> cpu_device::rms_norm(const tensor& x, const tensor& weight, float eps,
                                  const tensor& out) {
  return kernels::rms_norm(*ctx_, x, weight, eps, out);
}

result<void> cpu_device::layer_norm(const tensor& x, const tensor& weight, const tensor& bias,
                                    float eps, const tensor& out) {
  return kernels::layer_norm(*ctx_, x, weight, bias, eps, out);
}

result<void> cpu_device::rope(const tensor& x, std::span<const std::int32_t> positions,
                              const rope_params& params, const tensor& out) {
  return kernels::rope(*ctx_, x, positions, params, out);
}

result<void> cpu_device::silu(const tensor& x, const tensor& out) {
  return kernels::silu(*ctx_, x, out);
}

result<void> cpu_device::gelu(const tensor& x, gelu_kind kind, const tensor& out) {
  return kernels::gelu(*ctx_, x, kind, out);
}

result<void> cpu_device::swiglu(const tensor& gate, const tensor& up, const tensor& out) {
  return kernels::swiglu(*ctx_, gate, up, out);
}

result<void> cpu_device::geglu(const tensor& gate, const tensor& up, const tensor& out) {
  return kernels::geglu(*ctx_, gate, up, out);
}

result<void> cpu_device::scale(const tensor& x, float s, const tensor& out) {
  return kernels::scale(*ctx_, x, s, out);
}

result<void> cpu_device::softcap(const tensor& x, float c, const tensor& out) {
  return kernels::softcap(*ctx_, x, c, out);
}

result<void> cpu_device::softmax(const tensor& x, const tensor& out, float scale) {
  return kernels::softmax(*ctx_, x, out, scale);
}

result<void> cpu_device::add(const tensor& a, const tensor& b, const tensor& out) {
  return kernels::add(*ctx_, a, b, out);
}

result<void> cpu_device::attention(const tensor& q, const tensor& k, const tensor& v,
                                   const tensor& out, const attention_options& opt,
                                   std::int64_t q_start) {
  return kernels::attention(*ctx_, q, k, v, out, opt, q_start);
}

result<void> cpu_device::append_kv(paged_kv_cache& cache, std::span<const std::int32_t> block_table,
                                   std::int64_t start, const tensor& k, const tensor& v) {
  return kernels::append_kv(cache, block_table, start, k, v);
}

result<void> cpu_device::attention_paged(const paged_kv_cache& cache,
                                         std::span<const attention_sequence> seqs,
                                         const attention_options& opt) {
  return kernels::attention_paged(*ctx_, cache, seqs, opt);
}

result<void> cpu_device::run_patch_conv(const patch_conv& conv, const tensor& input,
                                        const tensor& out) {
  if (conv.empty()) return make_error(errc::invalid_argument, "patch conv: not prepared");
  if (auto r = cpu_backend(conv.backend(), "the patch embedding"); !r) return r;
  return static_cast<patch_embedding*>(conv.impl())->run(*ctx_, input, out);
}

void cpu_device::host_parallel_for(std::int64_t n, std::int64_t grain,
                                   const std::function<void(std::int64_t, std::int64_t, int)>& fn) {
  ctx_->pool().parallel_for(n, grain, fn);
}

}  // namespace troupe::kernels::cpu
