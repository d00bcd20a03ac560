#pragma once

// The compute seam: the one device abstraction that models/ and actors/
// take. A registry discovers devices; a device allocates its buffers, says
// which ops it runs for which dtype (supports), prepares weights into its
// own form (a matrix packed for the CPU kernels, resident in device memory
// for a GPU) and runs every op a model needs. The CPU backend
// (kernels/cpu/cpu_device.hpp) runs the kernels of kernels/ops.hpp,
// matmul.hpp and attention.hpp on its pinned worker team; a GPU backend
// adds a class beside it, and nothing above kernels/ changes.
//
// Shaped after ggml-backend (registry -> device -> buffers -> supports_op),
// with the ops as virtual calls rather than a graph: the models here are
// written as op sequences, and one virtual call per op costs nothing next
// to the op.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/attention.hpp"
#include "kernels/kv_layout.hpp"
#include "kernels/memory_pool.hpp"
#include "kernels/ops.hpp"
#include "kernels/quant.hpp"
#include "kernels/status.hpp"
#include "kernels/tensor.hpp"

namespace troupe::kernels {

enum class device_kind : std::uint8_t { cpu, cuda, npu };
std::string_view to_string(device_kind k);

/// What a device is and what it offers.
struct device_info {
  std::string name;  ///< "cpu", "cpu:1", "cpu:0-3", "cuda:0"
  device_kind kind = device_kind::cpu;
  int index = 0;
  std::uint64_t memory_bytes = 0;  ///< usable memory (limit for CPU devices)
  int cores = 0;                   ///< CPU cores (CPU), SMs (CUDA)
  std::string detail;              ///< ISA level, GPU model, ...
};

/// Operations a backend may or may not implement. A backend without an op
/// reports it unsupported; callers place the work on another device.
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
  geglu,    ///< gelu_tanh(gate) * up (Gemma's FFN)
  scale,    ///< x * s (Gemma's embedding scale)
  softcap,  ///< c * tanh(x / c) (Gemma 2's logits)
};
std::string_view to_string(op_kind op);

class device;

/// A weight matrix [rows = N outputs, cols = K inputs] prepared by a device
/// for its matmul. Cheap to copy (the prepared bytes are shared). Any device
/// of the backend that prepared it may use it (CPU devices share host
/// memory); another backend's matmul refuses it.
class matrix {
 public:
  matrix() = default;
  matrix(device_kind backend, std::shared_ptr<const void> impl, std::int64_t rows,
         std::int64_t cols, weight_format format, std::size_t bytes)
      : backend_(backend),
        impl_(std::move(impl)),
        rows_(rows),
        cols_(cols),
        format_(format),
        bytes_(bytes) {}

  std::int64_t rows() const { return rows_; }
  std::int64_t cols() const { return cols_; }
  weight_format format() const { return format_; }
  /// Bytes a full pass over the prepared form streams.
  std::size_t bytes() const { return bytes_; }
  bool empty() const { return impl_ == nullptr; }
  device_kind backend() const { return backend_; }
  /// The backend's own form (only the backend that made it knows its type).
  const void* impl() const { return impl_.get(); }
  const std::shared_ptr<const void>& impl_shared() const { return impl_; }

 private:
  device_kind backend_ = device_kind::cpu;
  std::shared_ptr<const void> impl_;
  std::int64_t rows_ = 0, cols_ = 0;
  weight_format format_ = weight_format::f32;
  std::size_t bytes_ = 0;
};

/// A CLIP/ViT patch embedding (conv2d, stride = kernel = patch, plus bias)
/// prepared by a device. Shared like `matrix`.
class patch_conv {
 public:
  patch_conv() = default;
  patch_conv(device_kind backend, std::shared_ptr<void> impl, std::int64_t hidden,
             std::int64_t channels, std::int64_t patch)
      : backend_(backend),
        impl_(std::move(impl)),
        hidden_(hidden),
        channels_(channels),
        patch_(patch) {}

  std::int64_t hidden() const { return hidden_; }
  std::int64_t channels() const { return channels_; }
  std::int64_t patch() const { return patch_; }
  bool empty() const { return impl_ == nullptr; }
  device_kind backend() const { return backend_; }
  void* impl() const { return impl_.get(); }

 private:
  device_kind backend_ = device_kind::cpu;
  std::shared_ptr<void> impl_;
  std::int64_t hidden_ = 0, channels_ = 0, patch_ = 0;
};

/// A compute device. Every op validates its arguments and returns an error
/// instead of crashing; the contracts (shapes, dtypes, what may alias, the
/// fixed arithmetic order that makes results batch- and thread-invariant)
/// are those documented beside the CPU kernels in kernels/ops.hpp,
/// kernels/matmul.hpp and kernels/attention.hpp; every backend keeps them.
/// Tensors passed to a device's ops live in memory from its `memory()`.
class device {
 public:
  virtual ~device() = default;
  virtual const device_info& info() const = 0;
  /// Whether `op` runs here with weights (or data) of dtype `t`.
  virtual bool supports(op_kind op, dtype t) const = 0;
  /// Whether `op` (matmul, embedding) runs here on weights stored in `f`.
  virtual bool supports(op_kind op, weight_format f) const = 0;

  // --- memory ---
  /// The pool this device's tensors come from (host memory for CPU devices).
  virtual memory_pool& memory() = 0;
  result<buffer_ptr> allocate(std::size_t bytes) { return memory().allocate(bytes); }
  /// Whether the device's memory is directly addressable by host code (CPU
  /// devices: yes). Code that reads or writes tensor bytes itself (image
  /// patches, sampling) needs it.
  virtual bool host_visible() const = 0;
  /// Copies `src` into the dense tensor `dst` (of this device's memory), or
  /// the dense tensor `src` out to host memory `dst`; the byte counts must
  /// equal the tensor's. For host-visible devices a memcpy; a GPU backend
  /// copies through its stream and returns when the bytes are there.
  virtual result<void> write(const tensor& dst, std::span<const std::byte> src);
  virtual result<void> read(const tensor& src, std::span<std::byte> dst);
  /// dst = src: two dense tensors of this device's memory with the same
  /// byte count (rows gathered into a batch, say). Not overlapping.
  virtual result<void> copy(const tensor& src, const tensor& dst);
  /// Sets every byte of the dense tensor `t` (of this device) to zero.
  virtual result<void> fill_zero(const tensor& t);

  // --- weights ---
  /// `w` (validated) in this device's form for `matmul`.
  virtual result<matrix> prepare(const weight_matrix& w) = 0;
  /// A patch embedding from `weight` f32 [hidden, channels, patch, patch]
  /// and `bias` f32 [hidden] (both copied).
  virtual result<patch_conv> prepare_patch_conv(const tensor& weight, const tensor& bias) = 0;

  // --- ops ---
  virtual result<void> matmul(const tensor& x, const matrix& w, tensor& y) = 0;
  virtual result<void> embedding(const weight_matrix& table, const tensor& ids,
                                 const tensor& out) = 0;
  virtual result<void> rms_norm(const tensor& x, const tensor& weight, float eps,
                                const tensor& out) = 0;
  virtual result<void> layer_norm(const tensor& x, const tensor& weight, const tensor& bias,
                                  float eps, const tensor& out) = 0;
  virtual result<void> rope(const tensor& x, std::span<const std::int32_t> positions,
                            const rope_params& params, const tensor& out) = 0;
  virtual result<void> silu(const tensor& x, const tensor& out) = 0;
  virtual result<void> gelu(const tensor& x, gelu_kind kind, const tensor& out) = 0;
  virtual result<void> swiglu(const tensor& gate, const tensor& up, const tensor& out) = 0;
  /// out = gelu_tanh(gate) * up (the same shapes). A device without it
  /// says so (supports(op_kind::geglu, ...) is false) and errs here.
  virtual result<void> geglu(const tensor& gate, const tensor& up, const tensor& out);
  /// out = x * s over f32 rows. The same rule as geglu.
  virtual result<void> scale(const tensor& x, float s, const tensor& out);
  /// out = c * tanh(x / c) over f32 rows (c > 0). The same rule as geglu.
  virtual result<void> softcap(const tensor& x, float c, const tensor& out);
  virtual result<void> softmax(const tensor& x, const tensor& out, float scale = 1.0f) = 0;
  /// out = a + b over rows of f32: `b` has a's shape, or is one row (a
  /// bias: [cols] or [1, cols]) added to every row of `a`.
  virtual result<void> add(const tensor& a, const tensor& b, const tensor& out) = 0;
  virtual result<void> attention(const tensor& q, const tensor& k, const tensor& v,
                                 const tensor& out, const attention_options& opt,
                                 std::int64_t q_start = -1) = 0;
  /// Stores the keys and values of k.dim(0) tokens at positions [start,
  /// start + n) of the sequence with `block_table` in `cache` (a cache in
  /// this device's memory), as kernels::append_kv defines it.
  virtual result<void> append_kv(paged_kv_cache& cache, std::span<const std::int32_t> block_table,
                                 std::int64_t start, const tensor& k, const tensor& v) = 0;
  virtual result<void> attention_paged(const paged_kv_cache& cache,
                                       std::span<const attention_sequence> seqs,
                                       const attention_options& opt) = 0;
  /// input f32 [batch, channels, H, W] -> out f32 [batch, patches, hidden].
  virtual result<void> run_patch_conv(const patch_conv& conv, const tensor& input,
                                      const tensor& out) = 0;

  // --- host work beside the device ---
  /// Runs fn(begin, end, worker) over [0, n) on the device's host workers
  /// (sampling the rows of a logits tensor, say); returns when all are done.
  virtual void host_parallel_for(
      std::int64_t n, std::int64_t grain,
      const std::function<void(std::int64_t, std::int64_t, int)>& fn) = 0;

  /// Held by the actor computing on the device (a shard's step, an
  /// encoder's batch): actors placed on one device take turns, because two
  /// at once would oversubscribe its cores (or streams).
  std::mutex& run_lock() { return run_; }

 protected:
  /// `t` is a dense tensor of `bytes` bytes (what write/read/copy need).
  static result<void> check_dense(const tensor& t, std::size_t bytes, const char* what);

 private:
  std::mutex run_;
};

/// `t` (dense, of `dev`) as host memory: `t` itself where host code can
/// read the device's memory, else a copy read through the device into
/// `keep`, which must outlive the returned view.
result<tensor> host_view(device& dev, const tensor& t, std::vector<std::byte>& keep);

/// The pool `t`'s bytes live in (nullptr: host memory of no pool, a view).
memory_pool* pool_of(const tensor& t);
/// Whether host code may read and write `t`'s bytes.
bool host_readable(const tensor& t);
/// The bytes of the dense tensor `t`, in whatever memory they live, copied
/// into `dst` (exactly t.nbytes()).
result<void> copy_to_host(const tensor& t, std::span<std::byte> dst);
/// `t` where `dev` computes on it: `t` itself when it is in dev's memory
/// (or both are host memory), else a new dense tensor of dev's memory with
/// its bytes. How a tensor made on one device (a stage's activations, an
/// encoder's rows) reaches an actor on another.
result<tensor> to_device(device& dev, const tensor& t);
/// `t` in host memory: itself when host code can read it, else a copy in a
/// tensor from `host_pool` (what a transfer to another process sends).
result<tensor> to_host(const tensor& t, memory_pool& host_pool);

/// A zero-filled paged KV cache with `config`'s shape in `dev`'s memory
/// (paged_kv_cache::create for a host-visible device).
result<paged_kv_cache> create_paged_kv_cache(device& dev, const kv_cache_config& config);

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
