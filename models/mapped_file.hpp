#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/status.hpp"

namespace troupe::models {

using kernels::errc;
using kernels::error;
using kernels::make_error;
using kernels::result;

/// A read-only memory map of a whole file. Weights are used in place from
/// the map (no copy); the map lives as long as any holder of the pointer.
class mapped_file {
 public:
  static result<std::shared_ptr<mapped_file>> open(const std::string& path);
  /// An in-memory stand-in holding a copy of `bytes` (fuzzers, tests);
  /// `name` is used in messages.
  static std::shared_ptr<mapped_file> from_memory(std::string name,
                                                  std::span<const std::byte> bytes);
  ~mapped_file();
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;

  std::span<const std::byte> bytes() const { return {data_, size_}; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  mapped_file() = default;
  const std::byte* data_ = nullptr;
  std::unique_ptr<std::byte[]> owned_;  ///< from_memory's copy
  std::size_t size_ = 0;
  std::string path_;
};

/// A bounds-checked little-endian reader over a byte span. Every read
/// checks the remaining length; a failed read leaves the cursor unchanged.
class byte_reader {
 public:
  explicit byte_reader(std::span<const std::byte> data) : data_(data) {}
  std::size_t offset() const { return pos_; }
  std::size_t remaining() const { return data_.size() - pos_; }
  bool read(void* out, std::size_t n);
  bool skip(std::size_t n);
  template <class T>
  bool read_value(T& out) {
    return read(&out, sizeof(T));
  }

 private:
  std::span<const std::byte> data_;
  std::size_t pos_ = 0;
};

/// The bytes of the regular file `path`, at most `max_bytes` (a directory,
/// a device or a pipe is refused, and a larger file, with its size): for
/// inputs a user names, such as an image on the command line.
result<std::vector<std::uint8_t>> read_file_bytes(const std::string& path, std::uint64_t max_bytes);

/// A seek over `size` bytes in memory (a decoder's I/O callback): from
/// `pos`, by `offset`, relative to the start, `pos` or the end (`whence`
/// SEEK_SET, SEEK_CUR, SEEK_END). The new position, or -1 when it would
/// leave [0, size], overflow, or `whence` is none of them.
std::int64_t seek_within(std::int64_t pos, std::int64_t size, std::int64_t offset, int whence);

}  // namespace troupe::models
