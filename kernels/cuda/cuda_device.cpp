#include "kernels/cuda/cuda_device.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/launch.hpp"
#include "kernels/cuda/probe.hpp"

namespace troupe::kernels::cuda {
namespace {

static_assert(static_cast<int>(wfmt::q4_0) == static_cast<int>(weight_format::q4_0));
static_assert(static_cast<int>(wfmt::int4_asym) == static_cast<int>(weight_format::int4_asym));

result<void> cuda_ok(const char* err, const std::string& what) {
  if (err == nullptr) return {};
  return make_error(errc::internal, what + ": CUDA: " + err);
}

// A weight matrix uploaded in its stored format.
struct device_weights {
  int device = 0;  ///< the GPU whose memory holds them
  weight_view view;
  buffer_ptr data, scales, zeros;
};

result<void> same_shape(const tensor& a, const tensor& b, const char* what) {
  if (!(a.shape() == b.shape()))
    return make_error(errc::shape_mismatch, std::string(what) + ": shapes " +
                                                a.shape().to_string() + " and " +
                                                b.shape().to_string() + " differ");
  return {};
}

result<void> dense_f32(const tensor& t, const char* what) {
  if (t.type() != dtype::f32)
    return make_error(errc::unsupported_dtype, std::string(what) + " must be f32");
  if (t.empty_view() || !t.is_contiguous())
    return make_error(errc::invalid_argument, std::string(what) + " must be dense");
  return {};
}

const float* f32(const tensor& t) {
  return static_cast<const float*>(t.data());
}
float* f32_out(const tensor& t) {
  return static_cast<float*>(t.data());
}

class cuda_device final : public device {
 public:
  ~cuda_device() override {
    embeddings_.clear();
    pool_.reset();
    if (stream_) launch::destroy_stream(index_, stream_);
  }

  static result<std::unique_ptr<device>> create(const cuda_device_options& opts) {
    const auto found = probe();
    const gpu_info* gpu = nullptr;
    for (const auto& g : found.gpus)
      if (g.index == opts.index) gpu = &g;
    if (gpu == nullptr)
      return make_error(errc::device_unavailable,
                        "no CUDA device " + std::to_string(opts.index) +
                            (found.status.empty() ? "" : " (" + found.status + ")"));
    if (!(opts.memory_fraction > 0 && opts.memory_fraction <= 1))
      return make_error(errc::invalid_argument, "memory_fraction must be in (0, 1]");
    std::unique_ptr<cuda_device> dev(new cuda_device());
    dev->index_ = opts.index;
    if (auto r = cuda_ok(launch::init(opts.index, &dev->stream_), "creating a stream"); !r)
      return std::unexpected(r.error());
    std::size_t free_bytes = 0, total_bytes = 0;
    if (auto r = cuda_ok(launch::memory_info(opts.index, &free_bytes, &total_bytes), "memory"); !r)
      return std::unexpected(r.error());
    const auto limit =
        static_cast<std::size_t>(static_cast<double>(free_bytes) * opts.memory_fraction);
    const int index = opts.index;
    void* const stream = dev->stream_;
    block_allocator blocks;
    blocks.allocate = [index](std::size_t b) { return launch::device_alloc(index, b); };
    blocks.release = [index](void* p) { launch::device_free(index, p); };
    blocks.host_accessible = false;
    // Copies on the device's stream, after the kernels queued there (a
    // tensor's bytes are read once what writes them has run).
    blocks.to_host = [index, stream](void* host, const void* src, std::size_t n) -> const char* {
      if (const char* e = launch::bind(index)) return e;
      return launch::copy_to_host(stream, host, src, n);
    };
    blocks.from_host = [index, stream](void* dst, const void* host, std::size_t n) -> const char* {
      if (const char* e = launch::bind(index)) return e;
      return launch::copy_to_device(stream, dst, host, n);
    };
    dev->pool_ = memory_pool::create(limit, std::move(blocks));
    dev->info_.name = "cuda:" + std::to_string(opts.index);
    dev->info_.kind = device_kind::cuda;
    dev->info_.index = opts.index;
    dev->info_.memory_bytes = limit;
    dev->info_.cores = gpu->multiprocessors;
    dev->info_.detail = gpu->name + ", sm_" + std::to_string(gpu->compute_major) +
                        std::to_string(gpu->compute_minor);
    return std::unique_ptr<device>(std::move(dev));
  }

  const device_info& info() const override { return info_; }

  bool supports(op_kind op, dtype t) const override {
    switch (op) {
      case op_kind::matmul:
      case op_kind::embedding:
        // The GGUF formats past Q4_0 have no CUDA kernel yet: their layers
        // run on a CPU device.
        return t != dtype::i32 && t != dtype::u8 && t <= dtype::q4_0;
      case op_kind::attention:
        // f32 and f16 K/V, and int8 in a paged cache; not sparse yet.
        return t == dtype::f32 || t == dtype::f16 || t == dtype::i8;
      case op_kind::geglu:
      case op_kind::scale:
      case op_kind::softcap:
        return false;  // no CUDA kernels yet (Gemma runs on a CPU device)
      default:
        return t == dtype::f32;
    }
  }
  bool supports(op_kind op, weight_format f) const override {
    return (op == op_kind::matmul || op == op_kind::embedding) && f <= weight_format::q4_0;
  }

  memory_pool& memory() override { return *pool_; }
  bool host_visible() const override { return false; }

  result<void> write(const tensor& dst, std::span<const std::byte> src) override {
    if (auto r = use(); !r) return r;
    if (auto r = check_dense(dst, src.size(), "write"); !r) return r;
    if (src.empty()) return {};
    return cuda_ok(launch::copy_to_device(stream_, dst.data(), src.data(), src.size()), "write");
  }
  result<void> read(const tensor& src, std::span<std::byte> dst) override {
    if (auto r = use(); !r) return r;
    if (auto r = check_dense(src, dst.size(), "read"); !r) return r;
    if (dst.empty()) return {};
    return cuda_ok(launch::copy_to_host(stream_, dst.data(), src.data(), dst.size()), "read");
  }

  result<matrix> prepare(const weight_matrix& w) override {
    if (auto r = use(); !r) return std::unexpected(r.error());
    auto up = upload(w);
    if (!up) return std::unexpected(up.error());
    const std::size_t bytes = w.storage_bytes();
    return matrix(device_kind::cuda, std::shared_ptr<const void>(std::move(*up)), w.rows, w.cols,
                  w.format, bytes);
  }

  result<patch_conv> prepare_patch_conv(const tensor& weight, const tensor& bias) override {
    if (auto r = use(); !r) return std::unexpected(r.error());
    if (auto r = expect_tensor(weight, dtype::f32, 4, "patch weight"); !r)
      return std::unexpected(r.error());
    if (auto r = expect_tensor(bias, dtype::f32, 1, "patch bias"); !r)
      return std::unexpected(r.error());
    if (weight.dim(2) != weight.dim(3) || bias.dim(0) != weight.dim(0))
      return make_error(errc::shape_mismatch, "patch conv: weight " + weight.shape().to_string() +
                                                  ", bias " + bias.shape().to_string());
    auto conv = std::make_shared<conv_weights>();
    conv->device = index_;
    auto w = copy_in(weight.data(), weight.nbytes());
    auto b = copy_in(bias.data(), bias.nbytes());
    if (!w) return std::unexpected(w.error());
    if (!b) return std::unexpected(b.error());
    conv->weight = std::move(*w);
    conv->bias = std::move(*b);
    return patch_conv(device_kind::cuda, conv, weight.dim(0), weight.dim(1), weight.dim(2));
  }

  result<void> matmul(const tensor& x, const matrix& w, tensor& y) override {
    if (auto r = use(); !r) return r;
    if (w.empty()) return make_error(errc::invalid_argument, "matmul: empty weight matrix");
    if (w.backend() != device_kind::cuda)
      return make_error(errc::device_unavailable, "matmul: the weight matrix was prepared by a " +
                                                      std::string(to_string(w.backend())) +
                                                      " device");
    if (auto r = dense_f32(x, "matmul input"); !r) return r;
    if (auto r = dense_f32(y, "matmul output"); !r) return r;
    const std::int64_t m = x.rows();
    if (x.cols() != w.cols() || y.cols() != w.rows() || y.rows() != m)
      return make_error(errc::shape_mismatch,
                        "matmul: x " + x.shape().to_string() + ", w [" + std::to_string(w.rows()) +
                            ", " + std::to_string(w.cols()) + "], y " + y.shape().to_string());
    const auto* dw = static_cast<const device_weights*>(w.impl());
    if (dw->device != index_)
      return make_error(errc::device_unavailable,
                        "matmul: the weight matrix is in cuda:" + std::to_string(dw->device) +
                            "'s memory, not " + info_.name + "'s");
    return cuda_ok(launch::matmul(stream_, f32(x), m, dw->view, f32_out(y)), "matmul");
  }

  result<void> embedding(const weight_matrix& table, const tensor& ids,
                         const tensor& out) override {
    if (auto r = use(); !r) return r;
    if (ids.type() != dtype::i32 || !ids.is_contiguous())
      return make_error(errc::unsupported_dtype, "embedding ids must be dense i32");
    if (auto r = dense_f32(out, "embedding output"); !r) return r;
    const std::int64_t n = ids.numel();
    if (out.rows() != n || out.cols() != table.cols)
      return make_error(errc::shape_mismatch,
                        "embedding: " + std::to_string(n) + " ids into " + out.shape().to_string());
    // An id outside the table is an error and nothing is written.
    std::vector<std::int32_t> host(static_cast<std::size_t>(n));
    if (auto r = read(ids, std::as_writable_bytes(std::span<std::int32_t>(host))); !r) return r;
    for (auto id : host)
      if (id < 0 || id >= table.rows)
        return make_error(errc::invalid_argument, "embedding: id " + std::to_string(id) +
                                                      " outside [0, " + std::to_string(table.rows) +
                                                      ")");
    auto dw = embedding_table(table);
    if (!dw) return std::unexpected(dw.error());
    return cuda_ok(launch::embedding(stream_, (*dw)->view,
                                     static_cast<const std::int32_t*>(ids.data()), n, f32_out(out)),
                   "embedding");
  }

  result<void> rms_norm(const tensor& x, const tensor& weight, float eps,
                        const tensor& out) override {
    if (auto r = use(); !r) return r;
    if (auto r = row_op(x, out, "rms_norm"); !r) return r;
    if (auto r = check_eps(eps, "rms_norm"); !r) return r;
    if (auto r = dense_f32(weight, "rms_norm weight"); !r) return r;
    if (weight.numel() != x.cols())
      return make_error(errc::shape_mismatch, "rms_norm: weight " + weight.shape().to_string());
    return cuda_ok(
        launch::rms_norm(stream_, f32(x), x.rows(), x.cols(), f32(weight), eps, f32_out(out)),
        "rms_norm");
  }

  result<void> layer_norm(const tensor& x, const tensor& weight, const tensor& bias, float eps,
                          const tensor& out) override {
    if (auto r = use(); !r) return r;
    if (auto r = row_op(x, out, "layer_norm"); !r) return r;
    if (auto r = check_eps(eps, "layer_norm"); !r) return r;
    if (auto r = dense_f32(weight, "layer_norm weight"); !r) return r;
    if (auto r = dense_f32(bias, "layer_norm bias"); !r) return r;
    if (weight.numel() != x.cols() || bias.numel() != x.cols())
      return make_error(errc::shape_mismatch, "layer_norm: weight " + weight.shape().to_string() +
                                                  ", bias " + bias.shape().to_string());
    return cuda_ok(launch::layer_norm(stream_, f32(x), x.rows(), x.cols(), f32(weight), f32(bias),
                                      eps, f32_out(out)),
                   "layer_norm");
  }

  result<void> rope(const tensor& x, std::span<const std::int32_t> positions,
                    const rope_params& params, const tensor& out) override {
    if (auto r = use(); !r) return r;
    if (auto r = row_op(x, out, "rope"); !r) return r;
    if (x.ndim() != 3)
      return make_error(errc::shape_mismatch, "rope: x must be [tokens, heads, head_dim]");
    const std::int64_t tokens = x.dim(0), heads = x.dim(1), d = x.dim(2);
    if (static_cast<std::int64_t>(positions.size()) != tokens)
      return make_error(errc::shape_mismatch, "rope: " + std::to_string(positions.size()) +
                                                  " positions for " + std::to_string(tokens) +
                                                  " tokens");
    for (auto p : positions)
      if (p < 0) return make_error(errc::invalid_argument, "rope: a negative position");
    if (d > rope_max_head_dim || d % 2)
      return make_error(errc::invalid_argument, "rope: head_dim " + std::to_string(d));
    const int rot = params.rotary_dims ? params.rotary_dims : static_cast<int>(d);
    if (rot <= 0 || rot > d || rot % 2)
      return make_error(errc::invalid_argument, "rope: rotary_dims " + std::to_string(rot));
    // The frequencies as the CPU computes them (transformers' float32 rule).
    std::vector<float> inv(static_cast<std::size_t>(rot / 2));
    if (auto r = rope_inv_freq(params, static_cast<int>(d), inv); !r) return r;
    auto pos_dev = copy_in(positions.data(), positions.size_bytes());
    auto inv_dev = copy_in(inv.data(), inv.size() * sizeof(float));
    if (!pos_dev) return std::unexpected(pos_dev.error());
    if (!inv_dev) return std::unexpected(inv_dev.error());
    auto r = cuda_ok(launch::rope(stream_, f32(x), tokens, heads, d,
                                  static_cast<const std::int32_t*>((*pos_dev)->data()),
                                  static_cast<const float*>((*inv_dev)->data()), rot,
                                  params.layout == rope_layout::neox, f32_out(out)),
                     "rope");
    if (!r) return r;
    // The scratch buffers go back to the pool only once the kernel is done.
    return synchronize("rope");
  }

  result<void> silu(const tensor& x, const tensor& out) override {
    if (auto r = use(); !r) return r;
    return unary(x, out, launch::unary_kind::silu, "silu");
  }
  result<void> gelu(const tensor& x, gelu_kind kind, const tensor& out) override {
    if (auto r = use(); !r) return r;
    const auto k = kind == gelu_kind::tanh  ? launch::unary_kind::gelu_tanh
                   : kind == gelu_kind::erf ? launch::unary_kind::gelu_erf
                                            : launch::unary_kind::gelu_quick;
    return unary(x, out, k, "gelu");
  }
  result<void> swiglu(const tensor& gate, const tensor& up, const tensor& out) override {
    if (auto r = use(); !r) return r;
    if (auto r = row_op(gate, out, "swiglu"); !r) return r;
    if (auto r = row_op(up, out, "swiglu"); !r) return r;
    return cuda_ok(launch::swiglu(stream_, f32(gate), f32(up), gate.numel(), f32_out(out)),
                   "swiglu");
  }
  result<void> softmax(const tensor& x, const tensor& out, float scale) override {
    if (auto r = use(); !r) return r;
    if (auto r = row_op(x, out, "softmax"); !r) return r;
    if (!std::isfinite(scale) || scale <= 0.0f)
      return make_error(errc::invalid_argument, "softmax scale must be finite and > 0");
    return cuda_ok(launch::softmax(stream_, f32(x), x.rows(), x.cols(), scale, f32_out(out)),
                   "softmax");
  }
  result<void> add(const tensor& a, const tensor& b, const tensor& out) override {
    if (auto r = use(); !r) return r;
    if (auto r = row_op(a, out, "add"); !r) return r;
    const std::int64_t cols = a.numel() / std::max<std::int64_t>(1, a.rows());
    const bool bias = b.numel() == cols && (b.ndim() == 1 || (b.ndim() == 2 && b.dim(0) == 1));
    if (bias) {
      if (auto r = dense_f32(b, "add bias"); !r) return r;
    } else if (auto r = row_op(b, out, "add"); !r) {
      return r;
    }
    return cuda_ok(
        launch::add(stream_, f32(a), f32(b), a.numel(), bias ? cols : a.numel(), f32_out(out)),
        "add");
  }

  result<void> attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                         const attention_options& opt, std::int64_t q_start) override {
    if (auto r = use(); !r) return r;
    if (auto r = dense_f32(q, "attention q"); !r) return r;
    if (auto r = dense_f32(out, "attention out"); !r) return r;
    if (q.ndim() != 3 || k.ndim() != 3 || v.ndim() != 3 || !(q.shape() == out.shape()) ||
        !(k.shape() == v.shape()) || k.type() != v.type())
      return make_error(errc::shape_mismatch,
                        "attention: q " + q.shape().to_string() + ", k " + k.shape().to_string() +
                            ", v " + v.shape().to_string() + ", out " + out.shape().to_string());
    if (k.type() != dtype::f32 && k.type() != dtype::f16)
      return make_error(errc::unsupported_dtype, "attention: K/V must be f32 or f16");
    if (!k.is_contiguous() || !v.is_contiguous())
      return make_error(errc::invalid_argument, "attention: K/V must be dense");
    if (auto r = check_options(opt); !r) return r;
    if (opt.top_k >= 0)
      return make_error(errc::unsupported_op, "attention: sparse attention needs a paged cache");
    launch::attention_args a;
    a.nq = q.dim(0);
    a.heads = static_cast<int>(q.dim(1));
    a.d = static_cast<int>(q.dim(2));
    a.nkv = k.dim(0);
    a.kv_heads = static_cast<int>(k.dim(1));
    if (k.dim(2) != a.d || a.kv_heads <= 0 || a.heads % a.kv_heads)
      return make_error(errc::shape_mismatch, "attention: heads " + std::to_string(a.heads) +
                                                  " over KV heads " + std::to_string(a.kv_heads));
    if (a.d > launch::attention_max_head_dim)
      return make_error(errc::unsupported_op, "attention: head_dim " + std::to_string(a.d) +
                                                  " over " +
                                                  std::to_string(launch::attention_max_head_dim));
    if (q_start < -1)
      return make_error(errc::invalid_argument,
                        "attention q_start must be >= -1, got " + std::to_string(q_start));
    a.q_start = q_start >= 0 ? q_start : a.nkv - a.nq;
    if (a.q_start < 0 || (opt.causal && a.q_start + a.nq > a.nkv))
      return make_error(errc::invalid_argument, "attention: causal rows past the keys");
    if (a.nq > 0 && a.nkv < 1) return make_error(errc::invalid_argument, "attention has no keys");
    a.q = f32(q);
    a.k = k.data();
    a.v = v.data();
    a.kv_f16 = k.type() == dtype::f16;
    a.out = f32_out(out);
    a.causal = opt.causal;
    a.window = opt.window;
    a.sinks = opt.sinks;
    a.scale = opt.scale > 0 ? opt.scale : 1.0f / std::sqrt(static_cast<float>(a.d));
    return cuda_ok(launch::attention(stream_, a), "attention");
  }

  result<void> copy(const tensor& src, const tensor& dst) override {
    if (auto r = use(); !r) return r;
    if (auto r = check_dense(dst, src.nbytes(), "copy"); !r) return r;
    if (auto r = check_dense(src, src.nbytes(), "copy"); !r) return r;
    if (src.nbytes() == 0) return {};
    return cuda_ok(launch::copy_on_device(stream_, dst.data(), src.data(), src.nbytes()), "copy");
  }

  result<void> fill_zero(const tensor& t) override {
    if (auto r = use(); !r) return r;
    if (auto r = check_dense(t, t.nbytes(), "fill_zero"); !r) return r;
    if (t.nbytes() == 0) return {};
    return cuda_ok(launch::fill_zero(stream_, t.data(), t.nbytes()), "fill_zero");
  }

  result<void> append_kv(paged_kv_cache& cache, std::span<const std::int32_t> block_table,
                         std::int64_t start, const tensor& k, const tensor& v) override {
    if (auto r = use(); !r) return r;
    if (auto r = cache.validate(); !r) return r;
    const auto& c = cache.config;
    if (auto r = expect_tensor(k, dtype::f32, 3, "append_kv k"); !r) return r;
    if (auto r = expect_tensor(v, dtype::f32, 3, "append_kv v"); !r) return r;
    if (k.dim(1) != c.n_kv_heads || k.dim(2) != c.head_dim || !(v.shape() == k.shape()))
      return make_error(errc::shape_mismatch,
                        "append_kv: k " + k.shape().to_string() + ", v " + v.shape().to_string());
    if (c.head_dim > launch::attention_max_head_dim)
      return make_error(errc::unsupported_op, "append_kv: head_dim " + std::to_string(c.head_dim));
    if (start < 0 || start > (std::int64_t{1} << 40))
      return make_error(errc::invalid_argument, "append_kv: start " + std::to_string(start));
    const std::int64_t n = k.dim(0);
    if (auto r = check_block_table(c, block_table, start + n); !r) return r;
    if (n == 0) return {};
    auto table = copy_in(block_table.data(), block_table.size_bytes());
    if (!table) return std::unexpected(table.error());
    auto r = cuda_ok(launch::append_kv(stream_, view_of(cache),
                                       static_cast<const std::int32_t*>((*table)->data()), start, n,
                                       f32(k), f32(v)),
                     "append_kv");
    if (!r) return r;
    return synchronize("append_kv");
  }

  result<void> attention_paged(const paged_kv_cache& cache,
                               std::span<const attention_sequence> seqs,
                               const attention_options& opt) override {
    if (auto r = use(); !r) return r;
    if (auto r = cache.validate(); !r) return r;
    const auto& c = cache.config;
    if (auto r = check_options(opt); !r) return r;
    if (opt.top_k >= 0)
      return make_error(errc::unsupported_op,
                        info_.name + ": sparse (top_k) attention is not on the GPU yet");
    if (c.head_dim > launch::attention_max_head_dim)
      return make_error(errc::unsupported_op,
                        "attention_paged: head_dim " + std::to_string(c.head_dim));
    std::vector<launch::paged_sequence> descs;
    std::vector<std::int32_t> tables;
    int heads = 0;
    std::int64_t max_nq = 0;
    for (const auto& s : seqs) {
      if (auto r = dense_f32(s.q, "attention_paged q"); !r) return r;
      if (auto r = dense_f32(s.out, "attention_paged out"); !r) return r;
      if (s.q.ndim() != 3 || !(s.q.shape() == s.out.shape()) || s.q.dim(2) != c.head_dim)
        return make_error(errc::shape_mismatch, "attention_paged: q " + s.q.shape().to_string() +
                                                    ", out " + s.out.shape().to_string());
      const int h = static_cast<int>(s.q.dim(1));
      if (heads == 0) heads = h;
      if (h != heads || h % c.n_kv_heads)
        return make_error(errc::shape_mismatch, "attention_paged: " + std::to_string(h) +
                                                    " heads over " + std::to_string(c.n_kv_heads) +
                                                    " KV heads");
      const std::int64_t nq = s.q.dim(0);
      if (s.q_start < 0 || s.kv_len < 0 || (nq > 0 && s.kv_len < 1) ||
          (opt.causal && s.q_start + nq > s.kv_len))
        return make_error(errc::invalid_argument, "attention_paged: rows at " +
                                                      std::to_string(s.q_start) + " over " +
                                                      std::to_string(s.kv_len) + " keys");
      if (auto r = check_block_table(c, s.block_table, s.kv_len); !r) return r;
      launch::paged_sequence d;
      d.q = f32(s.q);
      d.out = f32_out(s.out);
      d.nq = nq;
      d.q_start = s.q_start;
      d.kv_len = s.kv_len;
      d.table_offset = static_cast<std::int64_t>(tables.size());
      tables.insert(tables.end(), s.block_table.begin(), s.block_table.end());
      descs.push_back(d);
      max_nq = std::max(max_nq, nq);
    }
    if (descs.empty() || max_nq == 0) return {};
    if (tables.empty()) tables.push_back(0);
    auto descs_dev = copy_in(descs.data(), descs.size() * sizeof(launch::paged_sequence));
    auto tables_dev = copy_in(tables.data(), tables.size() * sizeof(std::int32_t));
    if (!descs_dev) return std::unexpected(descs_dev.error());
    if (!tables_dev) return std::unexpected(tables_dev.error());
    launch::paged_args a;
    a.cache = view_of(cache);
    a.seqs = static_cast<const launch::paged_sequence*>((*descs_dev)->data());
    a.n_seqs = static_cast<int>(descs.size());
    a.max_nq = max_nq;
    a.tables = static_cast<const std::int32_t*>((*tables_dev)->data());
    a.heads = heads;
    a.causal = opt.causal;
    a.window = opt.window;
    a.sinks = opt.sinks;
    a.scale = opt.scale > 0 ? opt.scale : 1.0f / std::sqrt(static_cast<float>(c.head_dim));
    if (auto r = cuda_ok(launch::attention_paged(stream_, a), "attention_paged"); !r) return r;
    return synchronize("attention_paged");
  }

  result<void> run_patch_conv(const patch_conv& conv, const tensor& input,
                              const tensor& out) override {
    if (auto r = use(); !r) return r;
    if (conv.empty() || conv.backend() != device_kind::cuda)
      return make_error(errc::invalid_argument, "patch conv: not prepared by a CUDA device");
    if (auto r = dense_f32(input, "patch conv input"); !r) return r;
    if (auto r = dense_f32(out, "patch conv output"); !r) return r;
    if (input.ndim() != 4 || input.dim(1) != conv.channels() || input.dim(2) % conv.patch() ||
        input.dim(3) % conv.patch())
      return make_error(errc::shape_mismatch, "patch conv: input " + input.shape().to_string());
    const std::int64_t patches = (input.dim(2) / conv.patch()) * (input.dim(3) / conv.patch());
    if (out.ndim() != 3 || out.dim(0) != input.dim(0) || out.dim(1) != patches ||
        out.dim(2) != conv.hidden())
      return make_error(errc::shape_mismatch, "patch conv: output " + out.shape().to_string());
    const auto* cw = static_cast<const conv_weights*>(conv.impl());
    if (cw->device != index_)
      return make_error(errc::device_unavailable,
                        "patch conv: prepared in cuda:" + std::to_string(cw->device) +
                            "'s memory, not " + info_.name + "'s");
    return cuda_ok(launch::patch_conv(stream_, f32(input), input.dim(0), input.dim(1), input.dim(2),
                                      input.dim(3), static_cast<const float*>(cw->weight->data()),
                                      static_cast<const float*>(cw->bias->data()), conv.hidden(),
                                      conv.patch(), f32_out(out)),
                   "patch conv");
  }

  void host_parallel_for(std::int64_t n, std::int64_t,
                         const std::function<void(std::int64_t, std::int64_t, int)>& fn) override {
    if (n > 0) fn(0, n, 0);
  }

 private:
  struct conv_weights {
    int device = 0;
    buffer_ptr weight, bias;
  };
  struct cached_table {
    std::weak_ptr<buffer> source;
    std::shared_ptr<const device_weights> weights;
  };

  cuda_device() = default;

  static launch::paged_cache view_of(const paged_kv_cache& cache) {
    launch::paged_cache c;
    c.k = cache.k.data();
    c.v = cache.v.data();
    c.k_scales = cache.k_scales.empty_view() ? nullptr : static_cast<float*>(cache.k_scales.data());
    c.v_scales = cache.v_scales.empty_view() ? nullptr : static_cast<float*>(cache.v_scales.data());
    c.k_summary = cache.has_summaries() ? static_cast<float*>(cache.k_summary.data()) : nullptr;
    c.type = cache.config.type == dtype::f16 ? 1 : cache.config.type == dtype::i8 ? 2 : 0;
    c.block_size = cache.config.block_size;
    c.kv_heads = cache.config.n_kv_heads;
    c.d = cache.config.head_dim;
    return c;
  }

  // Every op first makes this GPU the calling thread's current one.
  result<void> use() { return cuda_ok(launch::bind(index_), info_.name); }

  result<void> synchronize(const char* what) { return cuda_ok(launch::synchronize(stream_), what); }

  static result<void> check_eps(float eps, const char* what) {
    if (!(eps >= 0.0f) || !std::isfinite(eps))
      return make_error(errc::invalid_argument,
                        std::string(what) + ": eps must be finite and >= 0");
    return {};
  }

  // The option checks of the CPU kernels (kernels/cpu/attention.cpp).
  static result<void> check_options(const attention_options& o) {
    if (!std::isfinite(o.scale) || o.scale < 0.0f)
      return make_error(errc::invalid_argument,
                        "attention scale must be finite and >= 0 (0 = 1/sqrt(d))");
    if (o.window < 0 || o.sinks < 0)
      return make_error(errc::invalid_argument, "attention window and sinks must be >= 0");
    if (o.sinks > 0 && o.window == 0)
      return make_error(errc::invalid_argument, "attention sinks need a window (window > 0)");
    if (o.window > 0 && !o.causal)
      return make_error(errc::invalid_argument, "a sliding window needs causal attention");
    if (o.top_k < -1 || o.query_block < 1)
      return make_error(errc::invalid_argument, "attention top_k must be >= -1, query_block >= 1");
    if (o.softcap != 0.0f)
      return make_error(errc::unsupported_op,
                        "attention soft-capping (Gemma 2) is not on the GPU yet: run the model's "
                        "layers on a CPU device");
    return {};
  }

  static result<void> row_op(const tensor& x, const tensor& out, const char* what) {
    if (auto r = dense_f32(x, what); !r) return r;
    if (auto r = dense_f32(out, what); !r) return r;
    return same_shape(x, out, what);
  }

  result<void> unary(const tensor& x, const tensor& out, launch::unary_kind k, const char* what) {
    if (auto r = row_op(x, out, what); !r) return r;
    return cuda_ok(launch::unary(stream_, k, f32(x), x.numel(), f32_out(out)), what);
  }

  result<buffer_ptr> copy_in(const void* host, std::size_t bytes) {
    if (auto r = use(); !r) return std::unexpected(r.error());
    auto b = pool_->allocate(bytes);
    if (!b) return std::unexpected(b.error());
    if (bytes)
      if (auto r = cuda_ok(launch::copy_to_device(stream_, (*b)->data(), host, bytes), "upload");
          !r)
        return std::unexpected(r.error());
    return b;
  }

  result<std::shared_ptr<const device_weights>> upload(const weight_matrix& w) {
    if (auto r = w.validate(); !r) return std::unexpected(r.error());
    auto dw = std::make_shared<device_weights>();
    dw->device = index_;
    auto data = copy_in(w.data.data(), w.data.nbytes());
    if (!data) return std::unexpected(data.error());
    dw->data = std::move(*data);
    if (!w.scales.empty_view()) {
      auto s = copy_in(w.scales.data(), w.scales.nbytes());
      if (!s) return std::unexpected(s.error());
      dw->scales = std::move(*s);
    }
    if (!w.zeros.empty_view()) {
      auto z = copy_in(w.zeros.data(), w.zeros.nbytes());
      if (!z) return std::unexpected(z.error());
      dw->zeros = std::move(*z);
    }
    dw->view.format = static_cast<wfmt>(w.format);
    dw->view.rows = w.rows;
    dw->view.cols = w.cols;
    dw->view.group = w.group;
    dw->view.data = static_cast<const std::uint8_t*>(dw->data->data());
    dw->view.scales = dw->scales ? static_cast<const float*>(dw->scales->data()) : nullptr;
    dw->view.zeros = dw->zeros ? static_cast<const std::uint8_t*>(dw->zeros->data()) : nullptr;
    return std::shared_ptr<const device_weights>(std::move(dw));
  }

  // The embedding op takes the host table (the seam's signature): it is
  // uploaded on first use and kept while the host table lives.
  result<std::shared_ptr<const device_weights>> embedding_table(const weight_matrix& table) {
    std::lock_guard<std::mutex> guard(embeddings_mtx_);
    const void* key = table.data.data();
    auto it = embeddings_.find(key);
    if (it != embeddings_.end()) {
      if (!it->second.source.expired() && it->second.source.lock() == table.data.storage())
        return it->second.weights;
      embeddings_.erase(it);
    }
    auto up = upload(table);
    if (!up) return up;
    embeddings_[key] = cached_table{table.data.storage(), *up};
    return *up;
  }

  device_info info_;
  int index_ = 0;
  void* stream_ = nullptr;
  std::shared_ptr<memory_pool> pool_;
  std::mutex embeddings_mtx_;
  std::map<const void*, cached_table> embeddings_;
};

}  // namespace

result<std::unique_ptr<device>> make_device(const cuda_device_options& opts) {
  return cuda_device::create(opts);
}

}  // namespace troupe::kernels::cuda
