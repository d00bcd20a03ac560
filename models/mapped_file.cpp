#include "models/mapped_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace troupe::models {

result<std::shared_ptr<mapped_file>> mapped_file::open(const std::string& path) {
  // O_NONBLOCK: a pipe would otherwise block the open until a writer came.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return make_error(errc::io_error, path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return make_error(errc::io_error, path + ": not a regular file");
  }
  std::shared_ptr<mapped_file> f(new mapped_file());
  f->path_ = path;
  f->size_ = static_cast<std::size_t>(st.st_size);
  if (f->size_ > 0) {
    void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return make_error(errc::io_error, path + ": mmap failed: " + std::strerror(e));
    }
    f->data_ = static_cast<const std::byte*>(p);
  }
  ::close(fd);
  return f;
}

std::shared_ptr<mapped_file> mapped_file::from_memory(std::string name,
                                                      std::span<const std::byte> bytes) {
  std::shared_ptr<mapped_file> f(new mapped_file());
  f->path_ = std::move(name);
  f->size_ = bytes.size();
  // Exactly sized (and never empty), so ASan sees any read past the end.
  f->owned_ = std::make_unique<std::byte[]>(bytes.size() + (bytes.empty() ? 1 : 0));
  if (!bytes.empty()) std::memcpy(f->owned_.get(), bytes.data(), bytes.size());
  f->data_ = bytes.empty() ? nullptr : f->owned_.get();
  return f;
}

mapped_file::~mapped_file() {
  if (data_ != nullptr && !owned_) ::munmap(const_cast<std::byte*>(data_), size_);
}

bool byte_reader::read(void* out, std::size_t n) {
  if (n > remaining()) return false;
  if (n) std::memcpy(out, data_.data() + pos_, n);
  pos_ += n;
  return true;
}

bool byte_reader::skip(std::size_t n) {
  if (n > remaining()) return false;
  pos_ += n;
  return true;
}

result<std::vector<std::uint8_t>> read_file_bytes(const std::string& path,
                                                  std::uint64_t max_bytes) {
  auto f = mapped_file::open(path);
  if (!f) return std::unexpected(f.error());
  const auto b = (*f)->bytes();
  if (b.size() > max_bytes)
    return make_error(errc::invalid_argument, path + ": " + std::to_string(b.size()) +
                                                  " bytes, over the limit of " +
                                                  std::to_string(max_bytes));
  const auto* p = reinterpret_cast<const std::uint8_t*>(b.data());
  return std::vector<std::uint8_t>(p, p + b.size());
}

std::int64_t seek_within(std::int64_t pos, std::int64_t size, std::int64_t offset, int whence) {
  std::int64_t base = 0;
  switch (whence) {
    case SEEK_SET:
      base = 0;
      break;
    case SEEK_CUR:
      base = pos;
      break;
    case SEEK_END:
      base = size;
      break;
    default:
      return -1;
  }
  if ((offset > 0 && base > size - offset) || base + offset < 0) return -1;
  return base + offset;
}

}  // namespace troupe::models
