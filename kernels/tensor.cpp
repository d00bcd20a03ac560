#include "kernels/tensor.hpp"

#include <cstring>
#include <limits>

namespace troupe::kernels {

shape_t::shape_t(std::initializer_list<std::int64_t> d) {
  for (auto v : d) {
    if (ndim == max_dims) break;
    dims[static_cast<std::size_t>(ndim++)] = v;
  }
}

std::int64_t shape_t::numel() const {
  std::int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= dims[static_cast<std::size_t>(i)];
  return n;
}

bool shape_t::operator==(const shape_t& other) const {
  if (ndim != other.ndim) return false;
  for (int i = 0; i < ndim; ++i)
    if (dims[static_cast<std::size_t>(i)] != other.dims[static_cast<std::size_t>(i)]) return false;
  return true;
}

std::string shape_t::to_string() const {
  std::string s = "[";
  for (int i = 0; i < ndim; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[static_cast<std::size_t>(i)]);
  }
  return s + "]";
}

namespace {

// Validates a shape (non-negative, overflow-free, whole blocks) and returns
// its dense byte size and strides.
result<std::size_t> dense_layout(dtype t, const shape_t& shape,
                                 std::array<std::size_t, max_dims>& strides) {
  if (shape.ndim < 0 || shape.ndim > max_dims)
    return make_error(errc::invalid_argument, "tensor rank must be 0..4");
  for (int i = 0; i < shape.ndim; ++i)
    if (shape[i] < 0)
      return make_error(errc::invalid_argument, "negative extent in shape " + shape.to_string());
  auto rb = row_bytes(t, shape.inner());
  if (!rb) return std::unexpected(rb.error());
  std::size_t stride = *rb;
  if (shape.ndim == 0) return stride;
  strides[static_cast<std::size_t>(shape.ndim - 1)] = block_bytes(t);
  for (int i = shape.ndim - 2; i >= 0; --i) {
    strides[static_cast<std::size_t>(i)] = stride;
    const auto extent = static_cast<std::size_t>(shape[i]);
    if (extent != 0 && stride > std::numeric_limits<std::size_t>::max() / extent)
      return make_error(errc::invalid_argument, "shape " + shape.to_string() + " overflows");
    stride *= extent;
  }
  return stride;
}

}  // namespace

result<tensor> tensor::empty(memory_pool& pool, dtype t, shape_t shape) {
  tensor out;
  auto bytes = dense_layout(t, shape, out.strides_);
  if (!bytes) return std::unexpected(bytes.error());
  auto buf = pool.allocate(*bytes);
  if (!buf) return std::unexpected(buf.error());
  out.type_ = t;
  out.shape_ = shape;
  out.storage_ = std::move(*buf);
  out.data_ = out.storage_->data();
  return out;
}

result<tensor> tensor::zeros(memory_pool& pool, dtype t, shape_t shape) {
  if (!pool.host_accessible())
    return make_error(errc::unsupported_op,
                      "zeros: the pool's memory is a device's, not the host's (fill it through "
                      "the device)");
  auto out = empty(pool, t, shape);
  if (out) std::memset(out->data(), 0, out->nbytes());
  return out;
}

result<tensor> tensor::view(void* data, dtype t, shape_t shape) {
  tensor out;
  auto bytes = dense_layout(t, shape, out.strides_);
  if (!bytes) return std::unexpected(bytes.error());
  if (data == nullptr && *bytes != 0)
    return make_error(errc::invalid_argument, "view of null memory");
  out.type_ = t;
  out.shape_ = shape;
  out.data_ = data;
  return out;
}

std::size_t tensor::nbytes() const {
  if (shape_.ndim == 0) return block_bytes(type_);
  return strides_[0] * static_cast<std::size_t>(shape_[0]) /
         (shape_.ndim == 1 ? static_cast<std::size_t>(block_elems(type_)) : 1);
}

bool tensor::is_contiguous() const {
  std::array<std::size_t, max_dims> dense{};
  if (!dense_layout(type_, shape_, dense)) return false;
  for (int i = 0; i < shape_.ndim; ++i)
    if (shape_[i] > 1 &&
        dense[static_cast<std::size_t>(i)] != strides_[static_cast<std::size_t>(i)])
      return false;
  return true;
}

std::byte* tensor::row(std::int64_t i) const {
  // Row i of the (outer, inner) view: unravel i over the leading dims.
  std::size_t off = 0;
  for (int d = shape_.ndim - 2; d >= 0; --d) {
    const auto extent = shape_[d];
    off += static_cast<std::size_t>(i % extent) * strides_[static_cast<std::size_t>(d)];
    i /= extent;
  }
  return static_cast<std::byte*>(data_) + off;
}

result<tensor> tensor::slice_rows(std::int64_t begin, std::int64_t count) const {
  if (shape_.ndim == 0) return make_error(errc::invalid_argument, "cannot slice a scalar");
  if (begin < 0 || count < 0 || begin > shape_[0] || count > shape_[0] - begin)
    return make_error(errc::invalid_argument, "slice [" + std::to_string(begin) + ", +" +
                                                  std::to_string(count) + ") outside " +
                                                  shape_.to_string());
  tensor out = *this;
  out.shape_.dims[0] = count;
  std::size_t step = shape_.ndim == 1 ? block_bytes(type_) : strides_[0];
  if (shape_.ndim == 1 && begin % block_elems(type_) != 0)
    return make_error(errc::invalid_argument, "slice does not start on a block boundary");
  out.data_ =
      static_cast<std::byte*>(data_) +
      static_cast<std::size_t>(shape_.ndim == 1 ? begin / block_elems(type_) : begin) * step;
  return out;
}

result<tensor> tensor::reshape(shape_t shape) const {
  if (!is_contiguous()) return make_error(errc::invalid_argument, "reshape of a strided tensor");
  if (shape.numel() != numel())
    return make_error(errc::shape_mismatch,
                      "reshape " + shape_.to_string() + " -> " + shape.to_string());
  auto out = view(data_, type_, shape);
  if (!out) return out;
  out->storage_ = storage_;
  return out;
}

result<void> expect_tensor(const tensor& t, dtype want, int ndim, const char* what) {
  if (t.empty_view() && t.numel() != 0)
    return make_error(errc::invalid_argument, std::string(what) + " is empty");
  if (t.type() != want)
    return make_error(errc::unsupported_dtype, std::string(what) + " must be " +
                                                   std::string(to_string(want)) + ", got " +
                                                   std::string(to_string(t.type())));
  if (ndim >= 0 && t.ndim() != ndim)
    return make_error(errc::shape_mismatch, std::string(what) + " must have " +
                                                std::to_string(ndim) + " dims, got " +
                                                t.shape().to_string());
  if (!t.is_contiguous())
    return make_error(errc::invalid_argument, std::string(what) + " must be contiguous");
  return {};
}

}  // namespace troupe::kernels
