#pragma once
// Internal row kernels of kernels/ops.hpp. The *_avx2 functions live in
// ops_avx2.cpp (compiled with AVX2/FMA); callers check the ISA level first.
// Every kernel processes one row; the tail of a row is handled with masked
// vector loads, so an element's result never depends on its position.

#include <cstdint>

namespace troupe::kernels::cpu {

// Sum of x[i]^2 (4 x 8 lane accumulators, fixed reduction order).
float sum_squares_avx2(const float* x, std::int64_t n);
// y = w * (x * r)
void scale_mul_avx2(const float* x, const float* w, float r, float* y, std::int64_t n);
// y = x / (1 + exp(-x))
void silu_row_avx2(const float* x, float* y, std::int64_t n);
// y = silu(g) * u
void swiglu_row_avx2(const float* g, const float* u, float* y, std::int64_t n);
// gelu_tanh(g) * u
void geglu_row_avx2(const float* g, const float* u, float* y, std::int64_t n);
// kind: 0 tanh, 1 erf, 2 quick (gelu_kind's values)
void gelu_row_avx2(const float* x, float* y, std::int64_t n, int kind);
// y = a + b
void add_row_avx2(const float* a, const float* b, float* y, std::int64_t n);
// softmax of scale * x
void softmax_row_avx2(const float* x, float* y, std::int64_t n, float scale);
// One token of RoPE over `heads` heads of `head_dim` (x and y may alias).
// neox: cs/sn hold rot/2 values; adjacent: rot values (each pair's value
// twice). Dims past rot are copied.
void rope_token_avx2(const float* x, float* y, int heads, int head_dim, int rot, bool adjacent,
                     const float* cs, const float* sn);

// The same on sixteen lanes (ops_avx512.cpp, AVX-512 F/DQ): the same bits.
float sum_squares_avx512(const float* x, std::int64_t n);
void scale_mul_avx512(const float* x, const float* w, float r, float* y, std::int64_t n);
void silu_row_avx512(const float* x, float* y, std::int64_t n);
void swiglu_row_avx512(const float* g, const float* u, float* y, std::int64_t n);
void geglu_row_avx512(const float* g, const float* u, float* y, std::int64_t n);
void gelu_row_avx512(const float* x, float* y, std::int64_t n, int kind);
void add_row_avx512(const float* a, const float* b, float* y, std::int64_t n);

}  // namespace troupe::kernels::cpu
