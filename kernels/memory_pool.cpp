#include "kernels/memory_pool.hpp"

#include <malloc.h>

#include <bit>
#include <cstdlib>
#include <cstring>
#include <string>

namespace troupe::kernels {

class memory_pool::pooled_buffer : public buffer {
 public:
  pooled_buffer(void* data, std::size_t bytes, std::size_t size_class,
                std::shared_ptr<memory_pool> pool)
      : buffer(data, bytes), size_class_(size_class), pool_(std::move(pool)) {}
  ~pooled_buffer() override { pool_->give_back(data(), size_class_); }
  memory_pool* pool() const override { return pool_.get(); }

 private:
  std::size_t size_class_;
  std::shared_ptr<memory_pool> pool_;
};

block_allocator block_allocator::host() {
  block_allocator b;
  b.allocate = [](std::size_t bytes) { return std::aligned_alloc(tensor_alignment, bytes); };
  b.release = [](void* p) { std::free(p); };
  b.host_accessible = true;
  return b;
}

std::shared_ptr<memory_pool> memory_pool::create(std::size_t limit_bytes) {
  return create(limit_bytes, block_allocator::host());
}

std::shared_ptr<memory_pool> memory_pool::create(std::size_t limit_bytes, block_allocator blocks) {
  return std::shared_ptr<memory_pool>(new memory_pool(limit_bytes, std::move(blocks)));
}

memory_pool::~memory_pool() {
  trim();
}

// Size classes: multiples of 64 bytes up to 4 KiB, then four classes per
// power of two (at most 25% slack).
std::size_t memory_pool::size_class_of(std::size_t bytes) {
  if (bytes <= 4096) return (bytes + 63) / 64 * 64;
  const std::size_t p = std::bit_floor(bytes);
  const std::size_t step = p / 4;
  return (bytes + step - 1) / step * step;
}

result<buffer_ptr> memory_pool::allocate(std::size_t bytes) {
  if (bytes > (std::size_t{1} << 46))
    return make_error(errc::out_of_memory,
                      "allocation of " + std::to_string(bytes) + " bytes refused");
  const std::size_t cls = size_class_of(bytes == 0 ? 1 : bytes);
  void* data = nullptr;
  {
    std::lock_guard<std::mutex> guard(mtx_);
    auto it = free_.find(cls);
    if (it != free_.end() && !it->second.empty()) {
      data = it->second.back();
      it->second.pop_back();
      stats_.reuses++;
      stats_.bytes_cached -= cls;
    } else {
      if (limit_bytes_ != 0 && stats_.bytes_in_use + stats_.bytes_cached + cls > limit_bytes_) {
        // Drop cached blocks of other sizes before giving up.
        for (auto& [c, list] : free_) {
          for (void* p : list) blocks_.release(p);
          stats_.bytes_cached -= c * list.size();
          list.clear();
        }
        if (stats_.bytes_in_use + cls > limit_bytes_)
          return make_error(errc::out_of_memory,
                            "memory pool limit of " + std::to_string(limit_bytes_) +
                                " bytes reached (" + std::to_string(stats_.bytes_in_use) +
                                " in use, " + std::to_string(bytes) + " requested)");
      }
      data = blocks_.allocate(cls);
      if (data == nullptr)
        return make_error(errc::out_of_memory,
                          "out of memory allocating " + std::to_string(cls) + " bytes");
      stats_.allocations++;
    }
    stats_.bytes_in_use += cls;
  }
  return std::make_shared<pooled_buffer>(data, bytes, cls, shared_from_this());
}

result<void> memory_pool::copy_to_host(const void* src, void* host_dst, std::size_t bytes) const {
  if (bytes == 0) return {};
  if (blocks_.to_host) {
    if (const char* e = blocks_.to_host(host_dst, src, bytes))
      return make_error(errc::io_error, std::string("copying device memory to the host: ") + e);
    return {};
  }
  if (!blocks_.host_accessible)
    return make_error(errc::unsupported_op, "this pool's memory cannot be copied to the host");
  std::memcpy(host_dst, src, bytes);
  return {};
}

result<void> memory_pool::copy_from_host(void* dst, const void* host_src, std::size_t bytes) const {
  if (bytes == 0) return {};
  if (blocks_.from_host) {
    if (const char* e = blocks_.from_host(dst, host_src, bytes))
      return make_error(errc::io_error, std::string("copying host memory to the device: ") + e);
    return {};
  }
  if (!blocks_.host_accessible)
    return make_error(errc::unsupported_op, "this pool's memory cannot be written from the host");
  std::memcpy(dst, host_src, bytes);
  return {};
}

void memory_pool::give_back(void* data, std::size_t size_class) {
  std::lock_guard<std::mutex> guard(mtx_);
  stats_.bytes_in_use -= size_class;
  stats_.bytes_cached += size_class;
  free_[size_class].push_back(data);
}

void memory_pool::trim() {
  std::lock_guard<std::mutex> guard(mtx_);
  bool released = false;
  for (auto& [c, list] : free_) {
    for (void* p : list) blocks_.release(p);
    released |= !list.empty();
    stats_.bytes_cached -= c * list.size();
    list.clear();
  }
  // glibc keeps freed heap pages (and raises its mmap threshold after large
  // frees, so big blocks come from the heap too): hand them back.
  if (released && blocks_.host_accessible) malloc_trim(0);
}

memory_pool::stats memory_pool::snapshot() const {
  std::lock_guard<std::mutex> guard(mtx_);
  return stats_;
}

}  // namespace troupe::kernels
