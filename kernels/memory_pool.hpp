#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
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
  /// The pool the block came from (nullptr: host memory of no pool).
  virtual class memory_pool* pool() const { return nullptr; }

 private:
  void* data_;
  std::size_t bytes_;
};

using buffer_ptr = std::shared_ptr<buffer>;

/// Where a pool's blocks come from: host memory (64-byte aligned) unless a
/// device backend gives its own (device memory through its runtime; the
/// blocks are then not addressable by host code).
struct block_allocator {
  /// A block of `bytes`, or nullptr when there is no memory.
  std::function<void*(std::size_t bytes)> allocate;
  std::function<void(void*)> release;
  /// Whether host code may read and write the blocks.
  bool host_accessible = true;
  /// Copies between a block and host memory, returning when the bytes are
  /// there (nullptr, or an error's text). Needed where the blocks are not
  /// host-accessible; a plain memcpy otherwise.
  std::function<const char*(void* host_dst, const void* src, std::size_t bytes)> to_host;
  std::function<const char*(void* dst, const void* host_src, std::size_t bytes)> from_host;
  static block_allocator host();
};

/// A size-class pool of allocations. Released buffers go back to a free
/// list of their size class and are handed out again, so a steady-state
/// decode loop allocates nothing. Thread-safe.
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
  /// A pool whose blocks come from `blocks`.
  static std::shared_ptr<memory_pool> create(std::size_t limit_bytes, block_allocator blocks);
  ~memory_pool();

  result<buffer_ptr> allocate(std::size_t bytes);
  /// Frees every cached (unused) block.
  void trim();
  stats snapshot() const;
  std::size_t limit_bytes() const { return limit_bytes_; }
  /// Whether host code may touch this pool's memory (false for a GPU's).
  bool host_accessible() const { return blocks_.host_accessible; }
  /// `bytes` from `src` (in one of this pool's blocks) to host memory, and
  /// back: what moves a tensor between devices and processes without
  /// knowing which device's memory it is in.
  result<void> copy_to_host(const void* src, void* host_dst, std::size_t bytes) const;
  result<void> copy_from_host(void* dst, const void* host_src, std::size_t bytes) const;

 private:
  memory_pool(std::size_t limit_bytes, block_allocator blocks)
      : limit_bytes_(limit_bytes), blocks_(std::move(blocks)) {}
  class pooled_buffer;
  void give_back(void* data, std::size_t size_class);
  static std::size_t size_class_of(std::size_t bytes);

  std::size_t limit_bytes_;
  block_allocator blocks_;
  mutable std::mutex mtx_;
  std::map<std::size_t, std::vector<void*>> free_;
  stats stats_;
};

}  // namespace troupe::kernels
