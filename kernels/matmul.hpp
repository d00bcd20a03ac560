#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/context.hpp"
#include "kernels/cpu/matmul_layout.hpp"
#include "kernels/memory_pool.hpp"
#include "kernels/quant.hpp"
#include "kernels/tensor.hpp"

namespace troupe::kernels {

/// A weight matrix [rows = N outputs, cols = K inputs] repacked once (at
/// load) into the CPU kernels' column-panel layout. Cheap to copy (the
/// packed bytes are shared).
///
/// Every output is computed in one fixed arithmetic order that does not
/// depend on how many activation rows come with it, on the thread count or
/// on the ISA path (scalar and AVX2 are bit-identical):
///  - float formats: acc = fma(x[k], w[k], acc) for k = 0, 1, ..., K-1;
///  - integer formats: each activation row is quantized to int8 blocks of 32
///    (scale dx_b = max|x| / 127, codes round-to-nearest-even); per block an
///    exact integer dot isum_b, then acc = fma(float(isum_b - zp * sum(xq_b)),
///    s_w * dx_b, acc) over b = 0, 1, ...; int8 formats (one scale per row)
///    use s_w = 1 per block and multiply by the row scale at the end.
class packed_matrix {
 public:
  packed_matrix() = default;

  /// Packs `w` (validated first). The bytes come from ctx.memory().
  static result<packed_matrix> pack(cpu::context& ctx, const weight_matrix& w);
  /// A deep copy in new memory from ctx.memory() (e.g. to rotate through
  /// many distinct matrices in a benchmark).
  result<packed_matrix> clone(cpu::context& ctx) const;

  std::int64_t rows() const { return layout_.n; }
  std::int64_t cols() const { return layout_.k; }
  weight_format format() const { return format_; }
  int group() const { return group_; }
  /// Bytes the kernels stream per full pass (packed codes, scales and padding).
  std::size_t bytes() const {
    return static_cast<std::size_t>(layout_.panels * layout_.panel_bytes);
  }
  bool empty() const { return data_ == nullptr; }

  const cpu::mm_layout& layout() const { return layout_; }
  const std::byte* data() const { return data_; }

 private:
  cpu::mm_layout layout_;
  weight_format format_ = weight_format::f32;
  int group_ = 0;
  buffer_ptr storage_;
  std::byte* data_ = nullptr;
};

/// y[M, N] = x[M, K] * w^T for any M >= 1; x and y dense f32, not
/// overlapping. Work is split over output columns (or rows), never over K.
result<void> matmul(cpu::context& ctx, const tensor& x, const packed_matrix& w, tensor& y);

}  // namespace troupe::kernels
