#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "kernels/dtype.hpp"
#include "kernels/memory_pool.hpp"

namespace troupe::kernels {

constexpr int max_dims = 4;

/// Shape, outermost first (PyTorch order): {rows, cols} for a matrix.
struct shape_t {
  std::array<std::int64_t, max_dims> dims{};
  int ndim = 0;

  shape_t() = default;
  shape_t(std::initializer_list<std::int64_t> d);
  std::int64_t operator[](int i) const { return dims[static_cast<std::size_t>(i)]; }
  std::int64_t numel() const;
  /// Extent of the innermost dimension (1 for a scalar).
  std::int64_t inner() const { return ndim == 0 ? 1 : dims[static_cast<std::size_t>(ndim - 1)]; }
  /// Product of all but the innermost dimension.
  std::int64_t outer() const { return ndim == 0 ? 1 : numel() / (inner() == 0 ? 1 : inner()); }
  bool operator==(const shape_t& other) const;
  std::string to_string() const;
};

/// A typed, strided view of memory, optionally owning it through a shared
/// buffer (a tensor copy shares the buffer). Strides are in bytes; the
/// innermost dimension is always dense. Block dtypes (q8_0, q4_0) count
/// elements in the shape and need the innermost extent to be a multiple of 32.
class tensor {
 public:
  tensor() = default;

  /// A new dense tensor from `pool` (contents uninitialised).
  static result<tensor> empty(memory_pool& pool, dtype t, shape_t shape);
  /// A new dense tensor from `pool`, zero-filled.
  static result<tensor> zeros(memory_pool& pool, dtype t, shape_t shape);
  /// A dense, non-owning view of `data` (caller keeps it alive).
  static result<tensor> view(void* data, dtype t, shape_t shape);

  dtype type() const { return type_; }
  const shape_t& shape() const { return shape_; }
  int ndim() const { return shape_.ndim; }
  std::int64_t dim(int i) const { return shape_[i]; }
  std::int64_t numel() const { return shape_.numel(); }
  std::size_t stride_bytes(int i) const { return strides_[static_cast<std::size_t>(i)]; }
  /// Bytes spanned by the dense tensor (numel for plain types).
  std::size_t nbytes() const;
  bool is_contiguous() const;
  bool empty_view() const { return data_ == nullptr; }

  void* data() const { return data_; }
  template <class T>
  T* data_as() const {
    return static_cast<T*>(data_);
  }
  /// Start of row `i` of the tensor seen as (outer, inner).
  std::byte* row(std::int64_t i) const;
  template <class T>
  T* row_as(std::int64_t i) const {
    return reinterpret_cast<T*>(row(i));
  }
  std::int64_t rows() const { return shape_.outer(); }
  std::int64_t cols() const { return shape_.inner(); }

  /// Rows [begin, begin+count) of the leading dimension, sharing memory.
  result<tensor> slice_rows(std::int64_t begin, std::int64_t count) const;
  /// Same bytes, new dense shape with the same numel.
  result<tensor> reshape(shape_t shape) const;

  const buffer_ptr& storage() const { return storage_; }

 private:
  dtype type_ = dtype::f32;
  shape_t shape_;
  std::array<std::size_t, max_dims> strides_{};
  void* data_ = nullptr;
  buffer_ptr storage_;
};

/// Checks that `t` has dtype `want`, `ndim` dims and is contiguous; the
/// message names `what`.
result<void> expect_tensor(const tensor& t, dtype want, int ndim, const char* what);

}  // namespace troupe::kernels
