// The CUDA kernels (see launch.hpp for the contract and the reduction
// order). Written for correctness and a fixed order first; the decode GEMV
// streams each weight row once per 4 activation rows.
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "kernels/cuda/launch.hpp"

namespace troupe::kernels::cuda::launch {
namespace {

constexpr int warp = 32;
constexpr int block_threads = 256;

const char* check(cudaError_t e) {
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

// The launch's own error (bad configuration), without waiting for it.
const char* launched() {
  return check(cudaGetLastError());
}

cudaStream_t as_stream(void* s) {
  return static_cast<cudaStream_t>(s);
}

unsigned blocks_for(std::int64_t n, int per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = warp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = warp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// A fixed-order sum over the 256 threads of a block (every thread gets it).
__device__ float block_sum(float v, float* shared) {
  const int t = threadIdx.x;
  shared[t] = v;
  __syncthreads();
  for (int s = block_threads / 2; s > 0; s >>= 1) {
    if (t < s) shared[t] += shared[t + s];
    __syncthreads();
  }
  const float total = shared[0];
  __syncthreads();
  return total;
}

__device__ float block_max(float v, float* shared) {
  const int t = threadIdx.x;
  shared[t] = v;
  __syncthreads();
  for (int s = block_threads / 2; s > 0; s >>= 1) {
    if (t < s) shared[t] = fmaxf(shared[t], shared[t + s]);
    __syncthreads();
  }
  const float total = shared[0];
  __syncthreads();
  return total;
}

// --- matmul: one warp per output column n, 4 activation rows per pass ------

constexpr int mm_rows = 4;

template <wfmt F>
__global__ void matmul_kernel(const float* __restrict__ x, std::int64_t m, weight_view w,
                              float* __restrict__ y) {
  const int lane = threadIdx.x % warp;
  const std::int64_t n =
      static_cast<std::int64_t>(blockIdx.x) * (block_threads / warp) + threadIdx.x / warp;
  if (n >= w.rows) return;
  w.format = F;  // a constant the compiler folds into weight_at
  const std::int64_t k_len = w.cols;
  for (std::int64_t m0 = static_cast<std::int64_t>(blockIdx.y) * mm_rows; m0 < m;
       m0 += static_cast<std::int64_t>(gridDim.y) * mm_rows) {
    float acc[mm_rows];
#pragma unroll
    for (int i = 0; i < mm_rows; ++i) acc[i] = 0.0f;
    for (std::int64_t k = lane; k < k_len; k += warp) {
      const float wk = weight_at(w, n, k);
#pragma unroll
      for (int i = 0; i < mm_rows; ++i)
        if (m0 + i < m) acc[i] = fmaf(x[(m0 + i) * k_len + k], wk, acc[i]);
    }
#pragma unroll
    for (int i = 0; i < mm_rows; ++i) {
      const float s = warp_sum(acc[i]);
      if (lane == 0 && m0 + i < m) y[(m0 + i) * w.rows + n] = s;
    }
  }
}

template <wfmt F>
void launch_matmul(cudaStream_t s, const float* x, std::int64_t m, const weight_view& w, float* y) {
  const dim3 grid(blocks_for(w.rows, block_threads / warp),
                  static_cast<unsigned>(std::min<std::int64_t>((m + mm_rows - 1) / mm_rows, 1024)));
  matmul_kernel<F><<<grid, block_threads, 0, s>>>(x, m, w, y);
}

// --- embedding ---------------------------------------------------------------

__global__ void embedding_kernel(weight_view table, const std::int32_t* __restrict__ ids,
                                 std::int64_t n, float* __restrict__ out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n * table.cols) return;
  const std::int64_t r = i / table.cols, c = i % table.cols;
  out[i] = weight_at(table, ids[r], c);
}

// --- norms -------------------------------------------------------------------

__global__ void rms_norm_kernel(const float* x, std::int64_t cols, const float* __restrict__ w,
                                float eps, float* out) {
  __shared__ float shared[block_threads];
  const float* row = x + static_cast<std::int64_t>(blockIdx.x) * cols;
  float* dst = out + static_cast<std::int64_t>(blockIdx.x) * cols;
  float ss = 0.0f;
  for (std::int64_t c = threadIdx.x; c < cols; c += block_threads) ss = fmaf(row[c], row[c], ss);
  const float total = block_sum(ss, shared);
  const float inv = 1.0f / sqrtf(total / static_cast<float>(cols) + eps);
  for (std::int64_t c = threadIdx.x; c < cols; c += block_threads) dst[c] = w[c] * (row[c] * inv);
}

__global__ void layer_norm_kernel(const float* x, std::int64_t cols, const float* __restrict__ w,
                                  const float* __restrict__ b, float eps, float* out) {
  __shared__ float shared[block_threads];
  const float* row = x + static_cast<std::int64_t>(blockIdx.x) * cols;
  float* dst = out + static_cast<std::int64_t>(blockIdx.x) * cols;
  float sum = 0.0f;
  for (std::int64_t c = threadIdx.x; c < cols; c += block_threads) sum += row[c];
  const float mean = block_sum(sum, shared) / static_cast<float>(cols);
  float var = 0.0f;
  for (std::int64_t c = threadIdx.x; c < cols; c += block_threads) {
    const float d = row[c] - mean;
    var = fmaf(d, d, var);
  }
  const float inv = 1.0f / sqrtf(block_sum(var, shared) / static_cast<float>(cols) + eps);
  for (std::int64_t c = threadIdx.x; c < cols; c += block_threads)
    dst[c] = (row[c] - mean) * inv * w[c] + b[c];
}

// --- rope --------------------------------------------------------------------

__global__ void rope_kernel(const float* x, std::int64_t tokens, std::int64_t heads, std::int64_t d,
                            const std::int32_t* __restrict__ pos,
                            const float* __restrict__ inv_freq, int rot, bool neox, float* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t per_head = d - rot / 2;  // rot/2 pairs + (d - rot) passed-through dims
  if (i >= tokens * heads * per_head) return;
  const std::int64_t th = i / per_head, j = i % per_head;
  const std::int64_t t = th / heads;
  const float* src = x + th * d;
  float* dst = out + th * d;
  if (j < rot / 2) {
    const float angle = static_cast<float>(pos[t]) * inv_freq[j];
    float s, c;
    sincosf(angle, &s, &c);
    const std::int64_t a = neox ? j : 2 * j;
    const std::int64_t b = neox ? j + rot / 2 : 2 * j + 1;
    const float x0 = src[a], x1 = src[b];
    dst[a] = x0 * c - x1 * s;
    dst[b] = x0 * s + x1 * c;
  } else {
    const std::int64_t c = rot + (j - rot / 2);
    dst[c] = src[c];
  }
}

// --- element-wise ------------------------------------------------------------

__device__ __forceinline__ float sigmoidf(float v) {
  return 1.0f / (1.0f + expf(-v));
}

__global__ void unary_kernel(unary_kind kind, const float* x, std::int64_t n, float* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float v = x[i];
  switch (kind) {
    case unary_kind::silu:
      out[i] = v * sigmoidf(v);
      break;
    case unary_kind::gelu_tanh:
      out[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
      break;
    case unary_kind::gelu_erf:
      out[i] = 0.5f * v * (1.0f + erff(v * 0.7071067811865476f));
      break;
    case unary_kind::gelu_quick:
      out[i] = v * sigmoidf(1.702f * v);
      break;
  }
}

__global__ void swiglu_kernel(const float* g, const float* u, std::int64_t n, float* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = g[i] * sigmoidf(g[i]) * u[i];
}

__global__ void add_kernel(const float* a, const float* b, std::int64_t n, std::int64_t period,
                           float* out) {
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[period == n ? i : i % period];
}

__global__ void softmax_kernel(const float* x, std::int64_t cols, float scale, float* out) {
  __shared__ float shared[block_threads];
  const float* row = x + static_cast<std::int64_t>(blockIdx.x) * cols;
  float* dst = out + static_cast<std::int64_t>(blockIdx.x) * cols;
  float mx = -INFINITY;
  for (std::int64_t c = threadIdx.x; c < cols; c += block_threads) mx = fmaxf(mx, scale * row[c]);
  mx = block_max(mx, shared);
  if (mx == -INFINITY) {  // every entry masked: zeros
    for (std::int64_t c = threadIdx.x; c < cols; c += block_threads) dst[c] = 0.0f;
    return;
  }
  float sum = 0.0f;
  for (std::int64_t c = threadIdx.x; c < cols; c += block_threads) sum += expf(scale * row[c] - mx);
  const float inv = 1.0f / block_sum(sum, shared);
  for (std::int64_t c = threadIdx.x; c < cols; c += block_threads)
    dst[c] = expf(scale * row[c] - mx) * inv;
}

// --- attention: one warp per (query row, head) -------------------------------

constexpr int attn_warps = 4;
constexpr int attn_dims_per_lane = attention_max_head_dim / warp;

__device__ __forceinline__ float kv_at(const void* p, bool f16, std::int64_t i) {
  return f16 ? __half2float(static_cast<const __half*>(p)[i]) : static_cast<const float*>(p)[i];
}

// One query row of one head (one warp): the online softmax over keys
// [0, nkv) in tiles of 32 in increasing position, q in shared memory.
// `kv` addresses the keys and values: row(j) is key j's row, key(r, c) and
// value(r, c) its elements (contiguous and paged K/V differ only there).
template <class KV>
__device__ void attend_row(const KV& kv, const float* q_row, std::int64_t nkv, std::int64_t p,
                           bool causal, int window, int sinks, float scale, int d, float* out) {
  const int lane = threadIdx.x % warp;
  for (int c = lane; c < d; c += warp) kv.q_shared[c] = q_row[c];
  __syncwarp();
  float acc[attn_dims_per_lane];
#pragma unroll
  for (int t = 0; t < attn_dims_per_lane; ++t) acc[t] = 0.0f;
  float m = -INFINITY, l = 0.0f;
  for (std::int64_t j0 = 0; j0 < nkv; j0 += warp) {
    const std::int64_t j = j0 + lane;
    float s = -INFINITY;
    if (j < nkv && key_visible(causal, window, sinks, p, j)) {
      const std::int64_t row = kv.row(j);
      float dot = 0.0f;
      for (int c = 0; c < d; ++c) dot = fmaf(kv.q_shared[c], kv.key(row, c), dot);
      s = dot * scale;
    }
    const float tile_max = warp_max(s);
    const float new_m = fmaxf(m, tile_max);
    if (new_m == -INFINITY) continue;  // nothing visible yet
    const float corr = m == -INFINITY ? 0.0f : expf(m - new_m);
    const float pj = s == -INFINITY ? 0.0f : expf(s - new_m);
    l = l * corr + warp_sum(pj);
#pragma unroll
    for (int t = 0; t < attn_dims_per_lane; ++t) acc[t] *= corr;
    for (int jj = 0; jj < warp; ++jj) {
      const float pk = __shfl_sync(0xffffffffu, pj, jj);
      if (pk == 0.0f) continue;
      const std::int64_t row = kv.row(j0 + jj);
#pragma unroll
      for (int t = 0; t < attn_dims_per_lane; ++t) {
        const int c = lane + t * warp;
        if (c < d) acc[t] = fmaf(pk, kv.value(row, c), acc[t]);
      }
    }
    m = new_m;
  }
#pragma unroll
  for (int t = 0; t < attn_dims_per_lane; ++t) {
    const int c = lane + t * warp;
    if (c < d) out[c] = l > 0.0f ? acc[t] / l : 0.0f;
  }
}

// Contiguous K/V [nkv, kv_heads, d] of f32 or f16.
struct contiguous_kv {
  const attention_args* a;
  int kh;
  float* q_shared;
  __device__ std::int64_t row(std::int64_t j) const { return j * a->kv_heads + kh; }
  __device__ float key(std::int64_t r, int c) const { return kv_at(a->k, a->kv_f16, r * a->d + c); }
  __device__ float value(std::int64_t r, int c) const {
    return kv_at(a->v, a->kv_f16, r * a->d + c);
  }
};

__global__ void attention_kernel(attention_args a) {
  __shared__ float q_shared[attn_warps][attention_max_head_dim];
  const int wid = threadIdx.x / warp;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * attn_warps + wid;
  if (item >= a.nq * a.heads) return;
  const std::int64_t i = item / a.heads;
  const int h = static_cast<int>(item % a.heads);
  const contiguous_kv kv{&a, h / (a.heads / a.kv_heads), q_shared[wid]};
  attend_row(kv, a.q + item * a.d, a.nkv, a.q_start + i, a.causal, a.window, a.sinks, a.scale, a.d,
             a.out + item * a.d);
}

// --- the paged KV cache --------------------------------------------------------

__device__ __forceinline__ std::int64_t cache_row(const paged_cache& c, std::int64_t block, int h,
                                                  std::int64_t slot) {
  return (block * c.kv_heads + h) * c.block_size + slot;
}

__device__ __forceinline__ float cache_at(const paged_cache& c, const void* base,
                                          const float* scales, std::int64_t row, int col) {
  const std::int64_t i = row * c.d + col;
  switch (c.type) {
    case 1:
      return __half2float(static_cast<const __half*>(base)[i]);
    case 2:
      return scales[row] * static_cast<float>(static_cast<const std::int8_t*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

// Stores one row of d values; lanes stride over the row. Returns the scale.
__device__ float store_row(const paged_cache& c, const float* src, void* base, std::int64_t row) {
  const int lane = threadIdx.x % warp;
  if (c.type == 0) {
    for (int i = lane; i < c.d; i += warp) static_cast<float*>(base)[row * c.d + i] = src[i];
    return 1.0f;
  }
  if (c.type == 1) {
    for (int i = lane; i < c.d; i += warp)
      static_cast<__half*>(base)[row * c.d + i] = __float2half_rn(src[i]);
    return 1.0f;
  }
  float amax = 0.0f;
  for (int i = lane; i < c.d; i += warp) amax = fmaxf(amax, fabsf(src[i]));
  amax = warp_max(amax);
  const float scale = amax / 127.0f;
  for (int i = lane; i < c.d; i += warp) {
    float qv = scale > 0.0f ? rintf(src[i] / scale) : 0.0f;
    if (!(qv >= -127.0f)) qv = qv > 0.0f ? 127.0f : (qv < 0.0f ? -127.0f : 0.0f);
    if (qv > 127.0f) qv = 127.0f;
    static_cast<std::int8_t*>(base)[row * c.d + i] = static_cast<std::int8_t>(qv);
  }
  return scale;
}

// One warp per (token, KV head).
__global__ void append_kv_kernel(paged_cache c, const std::int32_t* __restrict__ table,
                                 std::int64_t start, std::int64_t n, const float* __restrict__ k,
                                 const float* __restrict__ v) {
  const int lane = threadIdx.x % warp;
  const std::int64_t item =
      static_cast<std::int64_t>(blockIdx.x) * (block_threads / warp) + threadIdx.x / warp;
  if (item >= n * c.kv_heads) return;
  const std::int64_t t = item / c.kv_heads;
  const int h = static_cast<int>(item % c.kv_heads);
  const std::int64_t pos = start + t;
  const std::int64_t row = cache_row(c, table[pos / c.block_size], h, pos % c.block_size);
  const float ks = store_row(c, k + item * c.d, c.k, row);
  const float vs = store_row(c, v + item * c.d, c.v, row);
  if (c.type == 2 && lane == 0) {
    c.k_scales[row] = ks;
    c.v_scales[row] = vs;
  }
}

// One thread per (block of the call, KV head, channel): the block's key
// summary over the slots written, from the stored values (min and max are
// exact, so this equals the CPU's slot-by-slot update).
__global__ void kv_summary_kernel(paged_cache c, const std::int32_t* __restrict__ table,
                                  std::int64_t start, std::int64_t n) {
  const std::int64_t first = start / c.block_size, last = (start + n - 1) / c.block_size;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t per_block = static_cast<std::int64_t>(c.kv_heads) * c.d;
  if (i >= (last - first + 1) * per_block) return;
  const std::int64_t j = first + i / per_block;
  const int h = static_cast<int>(i % per_block / c.d);
  const int col = static_cast<int>(i % c.d);
  const std::int64_t block = table[j];
  const std::int64_t s0 = max(start, j * c.block_size) - j * c.block_size;
  const std::int64_t s1 = min(start + n, (j + 1) * c.block_size) - j * c.block_size;
  float* mn = c.k_summary + (block * c.kv_heads + h) * 2 * c.d;
  float* mx = mn + c.d;
  float lo = s0 == 0 ? INFINITY : mn[col], hi = s0 == 0 ? -INFINITY : mx[col];
  for (std::int64_t s = s0; s < s1; ++s) {
    const float x = cache_at(c, c.k, c.k_scales, cache_row(c, block, h, s), col);
    if (s == 0) {
      lo = x;
      hi = x;
    } else {
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
  }
  mn[col] = lo;
  mx[col] = hi;
}

// The paged cache of one sequence: key j in block table[j / block_size].
struct paged_kv {
  const paged_cache* c;
  const std::int32_t* table;
  int kh;
  float* q_shared;
  __device__ std::int64_t row(std::int64_t j) const {
    return cache_row(*c, table[j / c->block_size], kh, j % c->block_size);
  }
  __device__ float key(std::int64_t r, int col) const {
    return cache_at(*c, c->k, c->k_scales, r, col);
  }
  __device__ float value(std::int64_t r, int col) const {
    return cache_at(*c, c->v, c->v_scales, r, col);
  }
};

// One warp per (query row, head) of one sequence (blockIdx.y).
__global__ void attention_paged_kernel(paged_args a) {
  __shared__ float q_shared[attn_warps][attention_max_head_dim];
  const paged_sequence sq = a.seqs[blockIdx.y];
  const int wid = threadIdx.x / warp;
  const std::int64_t item = static_cast<std::int64_t>(blockIdx.x) * attn_warps + wid;
  if (item >= sq.nq * a.heads) return;
  const std::int64_t i = item / a.heads;
  const int h = static_cast<int>(item % a.heads);
  const paged_kv kv{&a.cache, a.tables + sq.table_offset, h / (a.heads / a.cache.kv_heads),
                    q_shared[wid]};
  attend_row(kv, sq.q + item * a.cache.d, sq.kv_len, sq.q_start + i, a.causal, a.window, a.sinks,
             a.scale, a.cache.d, sq.out + item * a.cache.d);
}

// --- patch embedding (conv2d, stride = kernel = patch) -------------------------

__global__ void patch_conv_kernel(const float* __restrict__ in, std::int64_t batch,
                                  std::int64_t channels, std::int64_t h, std::int64_t w,
                                  const float* __restrict__ weight, const float* __restrict__ bias,
                                  std::int64_t hidden, std::int64_t p, float* out) {
  const std::int64_t side_x = w / p, patches = (h / p) * side_x;
  const std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= batch * patches * hidden) return;
  const std::int64_t o = i % hidden, np = i / hidden;
  const std::int64_t n = np / patches, patch = np % patches;
  const std::int64_t py = patch / side_x, px = patch % side_x;
  float acc = bias[o];
  for (std::int64_t c = 0; c < channels; ++c)
    for (std::int64_t y = 0; y < p; ++y) {
      const float* src = in + ((n * channels + c) * h + py * p + y) * w + px * p;
      const float* wt = weight + ((o * channels + c) * p + y) * p;
      for (std::int64_t x = 0; x < p; ++x) acc = fmaf(src[x], wt[x], acc);
    }
  out[i] = acc;
}

}  // namespace

const char* init(int device, void** stream) {
  if (auto e = check(cudaSetDevice(device))) return e;
  cudaStream_t s = nullptr;
  if (auto e = check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking))) return e;
  *stream = s;
  return nullptr;
}

const char* bind(int device) {
  return check(cudaSetDevice(device));
}

void destroy_stream(int device, void* stream) {
  cudaSetDevice(device);
  cudaStreamDestroy(as_stream(stream));
}

const char* memory_info(int device, std::size_t* free_bytes, std::size_t* total_bytes) {
  if (auto e = check(cudaSetDevice(device))) return e;
  return check(cudaMemGetInfo(free_bytes, total_bytes));
}

void* device_alloc(int device, std::size_t bytes) {
  if (cudaSetDevice(device) != cudaSuccess) return nullptr;
  void* p = nullptr;
  if (cudaMalloc(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return p;
}

void device_free(int device, void* p) {
  cudaSetDevice(device);
  cudaFree(p);
}

const char* synchronize(void* stream) {
  return check(cudaStreamSynchronize(as_stream(stream)));
}

const char* copy_to_device(void* stream, void* dst, const void* host_src, std::size_t bytes) {
  if (auto e =
          check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, as_stream(stream))))
    return e;
  return check(cudaStreamSynchronize(as_stream(stream)));
}

const char* copy_to_host(void* stream, void* host_dst, const void* src, std::size_t bytes) {
  if (auto e =
          check(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, as_stream(stream))))
    return e;
  return check(cudaStreamSynchronize(as_stream(stream)));
}

const char* fill_zero(void* stream, void* dst, std::size_t bytes) {
  return check(cudaMemsetAsync(dst, 0, bytes, as_stream(stream)));
}

const char* copy_on_device(void* stream, void* dst, const void* src, std::size_t bytes) {
  return check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, as_stream(stream)));
}

const char* matmul(void* stream, const float* x, std::int64_t m, const weight_view& w, float* y) {
  if (m == 0 || w.rows == 0) return nullptr;
  if (w.cols == 0)
    return check(cudaMemsetAsync(y, 0, sizeof(float) * m * w.rows, as_stream(stream)));
  // One instantiation per format, in wfmt's order.
  using launcher = void (*)(cudaStream_t, const float*, std::int64_t, const weight_view&, float*);
  static constexpr launcher by_format[] = {
      launch_matmul<wfmt::f32>,       launch_matmul<wfmt::f16>,       launch_matmul<wfmt::bf16>,
      launch_matmul<wfmt::int8_sym>,  launch_matmul<wfmt::int8_asym>, launch_matmul<wfmt::int4_sym>,
      launch_matmul<wfmt::int4_asym>, launch_matmul<wfmt::q8_0>,      launch_matmul<wfmt::q4_0>};
  const auto f = static_cast<std::size_t>(w.format);
  if (f >= sizeof by_format / sizeof by_format[0]) return "unknown weight format";
  by_format[f](as_stream(stream), x, m, w, y);
  return launched();
}

const char* embedding(void* stream, const weight_view& table, const std::int32_t* ids,
                      std::int64_t n, float* out) {
  const std::int64_t total = n * table.cols;
  if (n == 0 || table.cols == 0) return nullptr;
  embedding_kernel<<<blocks_for(total, block_threads), block_threads, 0, as_stream(stream)>>>(
      table, ids, n, out);
  return launched();
}

const char* rms_norm(void* stream, const float* x, std::int64_t rows, std::int64_t cols,
                     const float* w, float eps, float* out) {
  if (rows == 0 || cols == 0) return nullptr;
  rms_norm_kernel<<<static_cast<unsigned>(rows), block_threads, 0, as_stream(stream)>>>(x, cols, w,
                                                                                        eps, out);
  return launched();
}

const char* layer_norm(void* stream, const float* x, std::int64_t rows, std::int64_t cols,
                       const float* w, const float* b, float eps, float* out) {
  if (rows == 0 || cols == 0) return nullptr;
  layer_norm_kernel<<<static_cast<unsigned>(rows), block_threads, 0, as_stream(stream)>>>(
      x, cols, w, b, eps, out);
  return launched();
}

const char* rope(void* stream, const float* x, std::int64_t tokens, std::int64_t heads,
                 std::int64_t head_dim, const std::int32_t* pos, const float* inv_freq, int rot,
                 bool neox, float* out) {
  const std::int64_t total = tokens * heads * (head_dim - rot / 2);
  if (total == 0) return nullptr;
  rope_kernel<<<blocks_for(total, block_threads), block_threads, 0, as_stream(stream)>>>(
      x, tokens, heads, head_dim, pos, inv_freq, rot, neox, out);
  return launched();
}

const char* unary(void* stream, unary_kind kind, const float* x, std::int64_t n, float* out) {
  if (n == 0) return nullptr;
  unary_kernel<<<blocks_for(n, block_threads), block_threads, 0, as_stream(stream)>>>(kind, x, n,
                                                                                      out);
  return launched();
}

const char* swiglu(void* stream, const float* gate, const float* up, std::int64_t n, float* out) {
  if (n == 0) return nullptr;
  swiglu_kernel<<<blocks_for(n, block_threads), block_threads, 0, as_stream(stream)>>>(gate, up, n,
                                                                                       out);
  return launched();
}

const char* add(void* stream, const float* a, const float* b, std::int64_t n, std::int64_t period,
                float* out) {
  if (n == 0) return nullptr;
  if (period < 1) return "add: the period of b must be >= 1";
  add_kernel<<<blocks_for(n, block_threads), block_threads, 0, as_stream(stream)>>>(a, b, n, period,
                                                                                    out);
  return launched();
}

const char* softmax(void* stream, const float* x, std::int64_t rows, std::int64_t cols, float scale,
                    float* out) {
  if (rows == 0 || cols == 0) return nullptr;
  softmax_kernel<<<static_cast<unsigned>(rows), block_threads, 0, as_stream(stream)>>>(x, cols,
                                                                                       scale, out);
  return launched();
}

const char* attention(void* stream, const attention_args& a) {
  const std::int64_t items = a.nq * a.heads;
  if (items == 0 || a.d == 0) return nullptr;
  attention_kernel<<<blocks_for(items, attn_warps), attn_warps * warp, 0, as_stream(stream)>>>(a);
  return launched();
}

const char* append_kv(void* stream, const paged_cache& c, const std::int32_t* table,
                      std::int64_t start, std::int64_t n, const float* k, const float* v) {
  if (n <= 0) return nullptr;
  const auto s = as_stream(stream);
  append_kv_kernel<<<blocks_for(n * c.kv_heads, block_threads / warp), block_threads, 0, s>>>(
      c, table, start, n, k, v);
  if (auto e = launched()) return e;
  if (c.k_summary == nullptr) return nullptr;
  const std::int64_t blocks = (start + n - 1) / c.block_size - start / c.block_size + 1;
  kv_summary_kernel<<<blocks_for(blocks * c.kv_heads * c.d, block_threads), block_threads, 0, s>>>(
      c, table, start, n);
  return launched();
}

const char* attention_paged(void* stream, const paged_args& a) {
  if (a.n_seqs == 0 || a.max_nq == 0 || a.heads == 0) return nullptr;
  const dim3 grid(blocks_for(a.max_nq * a.heads, attn_warps), static_cast<unsigned>(a.n_seqs));
  attention_paged_kernel<<<grid, attn_warps * warp, 0, as_stream(stream)>>>(a);
  return launched();
}

const char* patch_conv(void* stream, const float* in, std::int64_t batch, std::int64_t channels,
                       std::int64_t h, std::int64_t w, const float* weight, const float* bias,
                       std::int64_t hidden, std::int64_t patch, float* out) {
  const std::int64_t total = batch * (h / patch) * (w / patch) * hidden;
  if (total == 0) return nullptr;
  patch_conv_kernel<<<blocks_for(total, block_threads), block_threads, 0, as_stream(stream)>>>(
      in, batch, channels, h, w, weight, bias, hidden, patch, out);
  return launched();
}

}  // namespace troupe::kernels::cuda::launch
