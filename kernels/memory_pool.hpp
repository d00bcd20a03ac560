#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "kernels/status.hpp"

namespace troupe::kernels {

constexpr std::size_t tensor_alignment = 64;

/// A block of device memory. Returned to its pool (if any) when the last
/// reference goes.
class buffer {
 public:
  buffer(void* data, std::size_t bytes) : data_(data), bytes_(bytes) {}
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;
  virtual ~buffer() = default;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_;
  std::size_t bytes_;
};

using buffer_ptr = std::shared_ptr<buffer>;

/// A size-class pool of 64-byte aligned host allocations. Released buffers
/// go back to a free list of their size class and are handed out again, so a
/// steady-state decode loop allocates nothing. Thread-safe.
class memory_pool : public std::enable_shared_from_this<memory_pool> {
 public:
  struct stats {
    std::uint64_t allocations = 0;  ///< calls to the system allocator
    std::uint64_t reuses = 0;       ///< requests served from a free list
    std::size_t bytes_in_use = 0;
    std::size_t bytes_cached = 0;
  };

  /// `limit_bytes` caps bytes in use plus cached (0 = no limit).
  static std::shared_ptr<memory_pool> create(std::size_t limit_bytes = 0);
  ~memory_pool();

  result<buffer_ptr> allocate(std::size_t bytes);
  /// Frees every cached (unused) block.
  void trim();
  stats snapshot() const;
  std::size_t limit_bytes() const { return limit_bytes_; }

 private:
  explicit memory_pool(std::size_t limit_bytes) : limit_bytes_(limit_bytes) {}
  class pooled_buffer;
  void give_back(void* data, std::size_t size_class);
  static std::size_t size_class_of(std::size_t bytes);

  std::size_t limit_bytes_;
  mutable std::mutex mtx_;
  std::map<std::size_t, std::vector<void*>> free_;
  stats stats_;
};

}  // namespace troupe::kernels
