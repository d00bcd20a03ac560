#pragma once

// A device whose memory host code cannot touch, made from a CPU device, so
// that the GPU paths above the seam are tested on a machine without a GPU:
// its pool hands out host blocks at an address moved into the
// non-canonical range (any dereference by host code faults, as a device
// pointer would), write/read/copy/fill_zero move bytes between the two, and
// every op moves its tensors back and runs the CPU kernel. Through the seam
// it gives the CPU device's bits; a model or actor that reads tensor memory
// itself crashes here, as it would on a GPU.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels/cpu/cpu_device.hpp"
#include "kernels/device.hpp"

namespace troupe::test {

class remote_memory_device final : public kernels::device {
 public:
  /// Addresses at or above 2^47 are not user-space addresses on x86-64.
  static constexpr std::uintptr_t offset = std::uintptr_t{1} << 47;

  explicit remote_memory_device(int threads = 2)
      : inner_(kernels::cpu::cpu_device::with_threads(threads)) {
    info_ = inner_->info();
    info_.name = "remote";
    info_.kind = kernels::device_kind::npu;  // a backend of its own
    kernels::block_allocator blocks;
    blocks.allocate = [](std::size_t b) -> void* {
      void* p = std::aligned_alloc(kernels::tensor_alignment, b);
      return p ? static_cast<std::byte*>(p) + offset : nullptr;
    };
    blocks.release = [](void* p) { std::free(static_cast<std::byte*>(p) - offset); };
    blocks.host_accessible = false;
    blocks.to_host = [](void* host, const void* src, std::size_t n) -> const char* {
      std::memcpy(host, static_cast<const std::byte*>(src) - offset, n);
      return nullptr;
    };
    blocks.from_host = [](void* dst, const void* host, std::size_t n) -> const char* {
      std::memcpy(static_cast<std::byte*>(dst) - offset, host, n);
      return nullptr;
    };
    pool_ = kernels::memory_pool::create(0, std::move(blocks));
  }

  static bool remote(const void* p) { return reinterpret_cast<std::uintptr_t>(p) >= offset; }

  /// The host view of a tensor of this device (host tensors pass as they are).
  static kernels::tensor local(const kernels::tensor& t) {
    if (t.empty_view() || !remote(t.data())) return t;
    auto v = kernels::tensor::view(static_cast<std::byte*>(t.data()) - offset, t.type(), t.shape());
    return v ? *v : kernels::tensor{};
  }

  const kernels::device_info& info() const override { return info_; }
  bool supports(kernels::op_kind op, kernels::dtype t) const override {
    return inner_->supports(op, t);
  }
  bool supports(kernels::op_kind op, kernels::weight_format f) const override {
    return inner_->supports(op, f);
  }
  kernels::memory_pool& memory() override { return *pool_; }
  bool host_visible() const override { return false; }

  kernels::result<void> write(const kernels::tensor& dst, std::span<const std::byte> src) override {
    if (auto r = check_dense(dst, src.size(), "write"); !r) return r;
    if (!src.empty()) std::memcpy(local(dst).data(), src.data(), src.size());
    return {};
  }
  kernels::result<void> read(const kernels::tensor& src, std::span<std::byte> dst) override {
    if (auto r = check_dense(src, dst.size(), "read"); !r) return r;
    if (!dst.empty()) std::memcpy(dst.data(), local(src).data(), dst.size());
    return {};
  }
  kernels::result<void> copy(const kernels::tensor& src, const kernels::tensor& dst) override {
    return inner_->copy(local(src), local(dst));
  }
  kernels::result<void> fill_zero(const kernels::tensor& t) override {
    return inner_->fill_zero(local(t));
  }

  kernels::result<kernels::matrix> prepare(const kernels::weight_matrix& w) override {
    auto m = inner_->prepare(host_weights(w));
    if (!m) return m;
    // Re-labelled as this backend's, so another backend's matmul refuses it.
    return kernels::matrix(info_.kind, std::shared_ptr<const void>(m->impl_shared()), m->rows(),
                           m->cols(), m->format(), m->bytes());
  }
  kernels::result<kernels::patch_conv> prepare_patch_conv(const kernels::tensor& w,
                                                          const kernels::tensor& b) override {
    return inner_->prepare_patch_conv(local(w), local(b));
  }

  kernels::result<void> matmul(const kernels::tensor& x, const kernels::matrix& w,
                               kernels::tensor& y) override {
    if (w.backend() != info_.kind)
      return kernels::make_error(kernels::errc::device_unavailable,
                                 "matmul: the weight matrix was prepared by another device");
    kernels::matrix cpu(kernels::device_kind::cpu, w.impl_shared(), w.rows(), w.cols(), w.format(),
                        w.bytes());
    auto ly = local(y);
    return inner_->matmul(local(x), cpu, ly);
  }
  kernels::result<void> embedding(const kernels::weight_matrix& table, const kernels::tensor& ids,
                                  const kernels::tensor& out) override {
    return inner_->embedding(host_weights(table), local(ids), local(out));
  }
  kernels::result<void> rms_norm(const kernels::tensor& x, const kernels::tensor& w, float eps,
                                 const kernels::tensor& out) override {
    return inner_->rms_norm(local(x), local(w), eps, local(out));
  }
  kernels::result<void> layer_norm(const kernels::tensor& x, const kernels::tensor& w,
                                   const kernels::tensor& b, float eps,
                                   const kernels::tensor& out) override {
    return inner_->layer_norm(local(x), local(w), local(b), eps, local(out));
  }
  kernels::result<void> rope(const kernels::tensor& x, std::span<const std::int32_t> pos,
                             const kernels::rope_params& p, const kernels::tensor& out) override {
    return inner_->rope(local(x), pos, p, local(out));
  }
  kernels::result<void> silu(const kernels::tensor& x, const kernels::tensor& out) override {
    return inner_->silu(local(x), local(out));
  }
  kernels::result<void> gelu(const kernels::tensor& x, kernels::gelu_kind k,
                             const kernels::tensor& out) override {
    return inner_->gelu(local(x), k, local(out));
  }
  kernels::result<void> swiglu(const kernels::tensor& g, const kernels::tensor& u,
                               const kernels::tensor& out) override {
    return inner_->swiglu(local(g), local(u), local(out));
  }
  kernels::result<void> geglu(const kernels::tensor& g, const kernels::tensor& u,
                              const kernels::tensor& out) override {
    return inner_->geglu(local(g), local(u), local(out));
  }
  kernels::result<void> scale(const kernels::tensor& x, float s,
                              const kernels::tensor& out) override {
    return inner_->scale(local(x), s, local(out));
  }
  kernels::result<void> softmax(const kernels::tensor& x, const kernels::tensor& out,
                                float scale) override {
    return inner_->softmax(local(x), local(out), scale);
  }
  kernels::result<void> add(const kernels::tensor& a, const kernels::tensor& b,
                            const kernels::tensor& out) override {
    return inner_->add(local(a), local(b), local(out));
  }
  kernels::result<void> attention(const kernels::tensor& q, const kernels::tensor& k,
                                  const kernels::tensor& v, const kernels::tensor& out,
                                  const kernels::attention_options& opt,
                                  std::int64_t q_start) override {
    return inner_->attention(local(q), local(k), local(v), local(out), opt, q_start);
  }
  kernels::result<void> append_kv(kernels::paged_kv_cache& cache,
                                  std::span<const std::int32_t> table, std::int64_t start,
                                  const kernels::tensor& k, const kernels::tensor& v) override {
    auto c = local(cache);
    return inner_->append_kv(c, table, start, local(k), local(v));
  }
  kernels::result<void> attention_paged(const kernels::paged_kv_cache& cache,
                                        std::span<const kernels::attention_sequence> seqs,
                                        const kernels::attention_options& opt) override {
    std::vector<kernels::attention_sequence> s(seqs.begin(), seqs.end());
    for (auto& q : s) {
      q.q = local(q.q);
      q.out = local(q.out);
    }
    return inner_->attention_paged(local(cache), s, opt);
  }
  kernels::result<void> run_patch_conv(const kernels::patch_conv& conv, const kernels::tensor& in,
                                       const kernels::tensor& out) override {
    return inner_->run_patch_conv(conv, local(in), local(out));
  }
  void host_parallel_for(std::int64_t n, std::int64_t grain,
                         const std::function<void(std::int64_t, std::int64_t, int)>& fn) override {
    inner_->host_parallel_for(n, grain, fn);
  }

 private:
  static kernels::paged_kv_cache local(const kernels::paged_kv_cache& c) {
    kernels::paged_kv_cache out = c;
    out.k = local(c.k);
    out.v = local(c.v);
    out.k_scales = local(c.k_scales);
    out.v_scales = local(c.v_scales);
    out.k_summary = local(c.k_summary);
    return out;
  }
  static kernels::weight_matrix host_weights(const kernels::weight_matrix& w) {
    kernels::weight_matrix out = w;
    out.data = local(w.data);
    out.scales = local(w.scales);
    out.zeros = local(w.zeros);
    return out;
  }

  std::unique_ptr<kernels::cpu::cpu_device> inner_;
  std::shared_ptr<kernels::memory_pool> pool_;
  kernels::device_info info_;
};

}  // namespace troupe::test
