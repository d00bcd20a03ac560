#pragma once

// NCCL: collectives inside a group of GPUs (one rank per GPU, in one or
// several processes). Built when CUDA is found (WITH_CUDA); otherwise every
// call says it is unavailable. The group id travels over the control plane
// as bytes, like an engine address. Plain C++ interface: CUDA and NCCL
// headers stay in transport/nccl.cpp.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/status.hpp"

namespace troupe::transport {

/// Device memory for collectives (allocation and host copies).
class device_buffer {
 public:
  static kernels::result<device_buffer> alloc(int device, std::size_t bytes);
  device_buffer() = default;
  device_buffer(device_buffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_), device_(o.device_) {
    o.ptr_ = nullptr;
  }
  device_buffer& operator=(device_buffer&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    std::swap(device_, o.device_);
    return *this;
  }
  ~device_buffer();
  kernels::result<void> upload(std::span<const std::uint8_t> host);
  kernels::result<void> download(std::span<std::uint8_t> host) const;
  void* data() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  int device_ = 0;
};

class nccl_group {
 public:
  /// Whether this build has CUDA and NCCL and the machine a CUDA device;
  /// `why_unavailable` says what is missing otherwise.
  static bool available();
  static std::string why_unavailable();
  static int device_count();

  /// A fresh group id (made by rank 0, sent to the others).
  static kernels::result<std::vector<std::uint8_t>> new_id();
  /// Joins the group `id` as `rank` of `size` on CUDA device `device`
  /// (every rank must call it; it returns once all have joined).
  static kernels::result<std::unique_ptr<nccl_group>> join(int device, int rank, int size,
                                                           std::span<const std::uint8_t> id);
  ~nccl_group();

  /// Sums `count` floats of device memory over the group, in place; returns
  /// when the result is in `data`.
  kernels::result<void> all_reduce_sum(float* data, std::size_t count);
  /// Point-to-point between two ranks of the group (both must call).
  kernels::result<void> send(const void* data, std::size_t bytes, int peer);
  kernels::result<void> recv(void* data, std::size_t bytes, int peer);

  int rank() const;
  int size() const;

  struct impl;

 private:
  explicit nccl_group(std::unique_ptr<impl> p);
  std::unique_ptr<impl> p_;
};

}  // namespace troupe::transport
