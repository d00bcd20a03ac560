#pragma once

// The CUDA kernels behind a plain C++ interface (nvcc builds launch.cu as
// C++20 and the rest of troupe is C++23; no CUDA header crosses this line).
// Every function returns nullptr on success or the CUDA error's text; the
// caller (cuda_device.cpp) validates shapes and dtypes first. Pointers are
// device memory unless a name says host. `stream` is a cudaStream_t.
//
// The kernels keep one fixed reduction order per output, whatever the batch:
// a matmul output is 32 lane partial sums over k = lane, lane + 32, ... (in
// increasing k, fused multiply-add) added by a butterfly of shuffles (float
// addition is commutative, so every lane holds the same bits); a row norm
// or softmax is summed by one block of 256 threads in a fixed tree; an
// attention row walks its keys in tiles of 32 in increasing position with
// an online softmax. So a row's result does not depend on its batch-mates,
// the batch size or the chunking (the bit contract of docs/architecture.md).

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/weight_math.hpp"

namespace troupe::kernels::cuda::launch {

const char* init(int device, void** stream);
/// Makes `device` the calling thread's current GPU (every op calls it
/// first: a launch into another GPU's stream fails).
const char* bind(int device);
void destroy_stream(int device, void* stream);
const char* memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes);
/// nullptr when the device has no such memory.
void* device_alloc(int device, std::size_t bytes);
void device_free(int device, void* p);
/// Waits for the work queued on `stream`.
const char* synchronize(void* stream);
/// Blocking copies through `stream`.
const char* copy_to_device(void* stream, void* dst, const void* host_src, std::size_t bytes);
const char* copy_to_host(void* stream, void* host_dst, const void* src, std::size_t bytes);
/// Queued on `stream`, not waited for.
const char* fill_zero(void* stream, void* dst, std::size_t bytes);
const char* copy_on_device(void* stream, void* dst, const void* src, std::size_t bytes);

/// y[m, w.rows] = x[m, w.cols] * w^T.
const char* matmul(void* stream, const float* x, std::int64_t m, const weight_view& w, float* y);
/// out[i, :] = row ids[i] of `table` (ids checked by the caller).
const char* embedding(void* stream, const weight_view& table, const std::int32_t* ids,
                      std::int64_t n, float* out);
const char* rms_norm(void* stream, const float* x, std::int64_t rows, std::int64_t cols,
                     const float* w, float eps, float* out);
const char* layer_norm(void* stream, const float* x, std::int64_t rows, std::int64_t cols,
                       const float* w, const float* b, float eps, float* out);
/// x [tokens, heads, head_dim]; pos [tokens]; inv_freq [rot / 2].
const char* rope(void* stream, const float* x, std::int64_t tokens, std::int64_t heads,
                 std::int64_t head_dim, const std::int32_t* pos, const float* inv_freq, int rot,
                 bool neox, float* out);

enum class unary_kind : std::uint8_t { silu, gelu_tanh, gelu_erf, gelu_quick };
const char* unary(void* stream, unary_kind kind, const float* x, std::int64_t n, float* out);
const char* swiglu(void* stream, const float* gate, const float* up, std::int64_t n, float* out);
/// out[i] = a[i] + b[i % period] (period n: same shape; the row width: a bias).
const char* add(void* stream, const float* a, const float* b, std::int64_t n, std::int64_t period,
                float* out);
const char* softmax(void* stream, const float* x, std::int64_t rows, std::int64_t cols, float scale,
                    float* out);

struct attention_args {
  const float* q = nullptr;  ///< [nq, heads, d]
  const void* k = nullptr;   ///< [nkv, kv_heads, d], f32 or f16
  const void* v = nullptr;
  bool kv_f16 = false;
  float* out = nullptr;  ///< [nq, heads, d]
  std::int64_t nq = 0, nkv = 0;
  int heads = 0, kv_heads = 0, d = 0;
  std::int64_t q_start = 0;  ///< position of query row 0
  bool causal = true;
  int window = 0, sinks = 0;
  float scale = 0;
};
/// Largest head_dim the attention kernel takes.
constexpr int attention_max_head_dim = 256;
const char* attention(void* stream, const attention_args& a);

/// One layer's paged KV cache in device memory (kernels/kv_layout.hpp):
/// k, v [n_blocks, kv_heads, block_size, d] of f32, f16 or i8; for i8 the
/// scales f32 [n_blocks, kv_heads, block_size]; summaries (optional) f32
/// [n_blocks, kv_heads, 2, d].
struct paged_cache {
  void* k = nullptr;
  void* v = nullptr;
  float* k_scales = nullptr;
  float* v_scales = nullptr;
  float* k_summary = nullptr;
  int type = 0;  ///< 0 f32, 1 f16, 2 i8
  int block_size = 0, kv_heads = 0, d = 0;
};
/// Stores n tokens (k, v f32 [n, kv_heads, d]) at positions [start, start +
/// n) through `table` (device, the sequence's block ids), with the CPU's
/// rounding (f16 round-to-nearest-even; i8 scale max|x| / 127 per token and
/// head, codes rounded half to even) and summaries (min/max of the stored
/// keys; a write to slot 0 restarts a block's).
const char* append_kv(void* stream, const paged_cache& c, const std::int32_t* table,
                      std::int64_t start, std::int64_t n, const float* k, const float* v);

/// One sequence of a paged attention call.
struct paged_sequence {
  const float* q = nullptr;  ///< [nq, heads, d]
  float* out = nullptr;
  std::int64_t nq = 0, q_start = 0, kv_len = 0;
  std::int64_t table_offset = 0;  ///< into the call's concatenated block tables
};
struct paged_args {
  paged_cache cache;
  const paged_sequence* seqs = nullptr;  ///< device
  int n_seqs = 0;
  std::int64_t max_nq = 0;
  const std::int32_t* tables = nullptr;  ///< device
  int heads = 0;
  bool causal = true;
  int window = 0, sinks = 0;
  float scale = 0;
};
const char* attention_paged(void* stream, const paged_args& a);

/// in [batch, channels, h, w] -> out [batch, (h/p)*(w/p), hidden]; weight
/// [hidden, channels, p, p], bias [hidden].
const char* patch_conv(void* stream, const float* in, std::int64_t batch, std::int64_t channels,
                       std::int64_t h, std::int64_t w, const float* weight, const float* bias,
                       std::int64_t hidden, std::int64_t patch, float* out);

}  // namespace troupe::kernels::cuda::launch
