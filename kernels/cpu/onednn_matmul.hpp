#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "kernels/cpu/context.hpp"
#include "kernels/quant.hpp"
#include "kernels/tensor.hpp"

namespace troupe::kernels::cpu {

/// Arithmetic of a oneDNN matmul.
enum class onednn_kind : std::uint8_t {
  f32,   ///< f32 x f32 -> f32
  bf16,  ///< bf16 x bf16 -> f32 (x converted per call)
  u8s8,  ///< u8 activations (per-tensor scale, 7-bit codes, zero point 64) x
         ///< s8 weights (per-output-channel scales) -> f32
};

std::string_view to_string(onednn_kind kind);

/// oneDNN 2.6 matmul y[m, N] = x[m, K] * w^T with the weights reordered once
/// (at construction) into the primitive's preferred layout. The fast
/// reference and the GEMM baseline; not the default path, because oneDNN
/// does not promise batch invariance (its per-tensor activation scale also
/// makes u8s8 results depend on the batch). Call
/// ctx.prepare_onednn_thread() on the calling thread first.
class onednn_matmul {
 public:
  /// A primitive for exactly `m` activation rows. Any weight format: f32 and
  /// bf16 kinds use the dequantized weights; u8s8 takes int8_sym codes as
  /// they are and quantizes other formats to int8_sym first.
  static result<onednn_matmul> create(context& ctx, const weight_matrix& w, std::int64_t m,
                                      onednn_kind kind);

  onednn_matmul(onednn_matmul&&) noexcept;
  onednn_matmul& operator=(onednn_matmul&&) noexcept;
  ~onednn_matmul();

  /// prepare_input(x) then execute(y).
  result<void> run(context& ctx, const tensor& x, tensor& y);
  /// Converts (bf16) or quantizes (u8s8) x f32 [m, K] into the primitive's
  /// input buffer; f32 copies it.
  result<void> prepare_input(context& ctx, const tensor& x);
  /// Runs the primitive on the last prepared input; y f32 [m, N].
  result<void> execute(context& ctx, tensor& y);

  std::int64_t m() const;
  std::int64_t rows() const;
  std::int64_t cols() const;
  onednn_kind kind() const;

 private:
  struct impl;
  explicit onednn_matmul(std::unique_ptr<impl> p);
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::kernels::cpu
