#include "models/kv_tiers.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

namespace troupe::models {

using kernels::errc;
using kernels::make_error;

namespace {

/// slots * bytes of tier `what`; an error past 2^46 (64 TiB: no tier is
/// that large).
result<std::size_t> tier_bytes(const char* what, std::size_t slot_bytes, std::int64_t slots) {
  const auto n = static_cast<unsigned __int128>(slot_bytes) * static_cast<std::uint64_t>(slots);
  if (slot_bytes == 0 || n > (static_cast<unsigned __int128>(1) << 46))
    return make_error(errc::invalid_argument,
                      std::string("KV ") + what + " tier: " + std::to_string(slots) + " slots of " +
                          std::to_string(slot_bytes) + " bytes is too large");
  return static_cast<std::size_t>(n);
}

}  // namespace

result<std::unique_ptr<kv_tiers>> kv_tiers::create(std::size_t slot_bytes, std::int64_t host_slots,
                                                   std::int64_t disk_slots,
                                                   const std::string& disk_dir) {
  if (host_slots < 0 || disk_slots < 0)
    return make_error(errc::invalid_argument, "KV tiers: a negative slot count");
  std::unique_ptr<kv_tiers> t(new kv_tiers);
  t->slot_bytes_ = slot_bytes;
  if (host_slots > 0) {
    auto len = tier_bytes("host", slot_bytes, host_slots);
    if (!len) return std::unexpected(len.error());
    t->host_len_ = *len;
    // Pages are taken as slots fill, so a tier larger than the machine's
    // memory would only fail later, by swapping or the OOM killer: refuse it.
    const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0 &&
        t->host_len_ / static_cast<std::size_t>(page) >= static_cast<std::size_t>(pages))
      return make_error(
          errc::out_of_memory,
          "KV host tier: " + std::to_string(host_slots) + " blocks of " +
              std::to_string(slot_bytes) + " bytes (" + std::to_string(t->host_len_ >> 20) +
              " MiB) exceed this machine's " +
              std::to_string((static_cast<std::size_t>(pages) * static_cast<std::size_t>(page)) >>
                             20) +
              " MiB of memory");
    void* p = ::mmap(nullptr, t->host_len_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
      return make_error(errc::out_of_memory, "KV host tier of " + std::to_string(t->host_len_) +
                                                 " bytes: " + std::strerror(errno));
    t->host_ = static_cast<std::byte*>(p);
    t->host_slots_ = host_slots;
  }
  if (disk_slots > 0) {
    auto len = tier_bytes("disk", slot_bytes, disk_slots);
    if (!len) return std::unexpected(len.error());
    t->disk_len_ = *len;
    std::error_code ec;
    const std::filesystem::path dir = disk_dir.empty() ? std::filesystem::temp_directory_path(ec)
                                                       : std::filesystem::path(disk_dir);
    std::string name = (dir / "troupe-kv-XXXXXX").string();
    std::vector<char> buf(name.begin(), name.end());
    buf.push_back('\0');
    const int fd = ::mkostemp(buf.data(), O_CLOEXEC);
    if (fd < 0)
      return make_error(errc::io_error, "KV disk tier: cannot create a file in " + dir.string() +
                                            ": " + std::strerror(errno));
    ::unlink(buf.data());  // the file lives as long as the mapping
    // The space is taken now, so that a full disk is an error here and not
    // a SIGBUS on a later write.
    const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(t->disk_len_));
    if (err != 0) {
      ::close(fd);
      return make_error(errc::io_error, "KV disk tier: " + std::to_string(t->disk_len_) +
                                            " bytes in " + dir.string() + ": " +
                                            std::strerror(err));
    }
    void* p = ::mmap(nullptr, t->disk_len_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int saved = errno;
    ::close(fd);
    if (p == MAP_FAILED)
      return make_error(errc::io_error,
                        "KV disk tier: mapping " + dir.string() + ": " + std::strerror(saved));
    t->disk_ = static_cast<std::byte*>(p);
    t->disk_slots_ = disk_slots;
  }
  return t;
}

kv_tiers::~kv_tiers() {
  if (host_ != nullptr) ::munmap(host_, host_len_);
  if (disk_ != nullptr) ::munmap(disk_, disk_len_);
}

std::span<std::byte> kv_tiers::slot(kv_tier t, std::int32_t i) {
  auto* base = t == kv_tier::host ? host_ : disk_;
  return {base + static_cast<std::size_t>(i) * slot_bytes_, slot_bytes_};
}

result<void> kv_tiers::apply(kv_cache& cache, std::span<const kv_move> moves) {
  if (moves.empty()) return {};
  if (cache.slot_bytes() != slot_bytes_)
    return make_error(errc::invalid_argument, "KV tiers: slots of " + std::to_string(slot_bytes_) +
                                                  " bytes for a cache whose blocks have " +
                                                  std::to_string(cache.slot_bytes()));
  auto valid = [&](std::uint8_t tier, std::int32_t i) {
    switch (static_cast<kv_tier>(tier)) {
      case kv_tier::device:
        return i >= 1 && i <= cache.total_blocks();
      case kv_tier::host:
        return i >= 0 && i < host_slots_;
      case kv_tier::disk:
        return i >= 0 && i < disk_slots_;
      case kv_tier::remote:
        return false;  // the stage's own (over the data plane)
    }
    return false;
  };
  for (const auto& m : moves)
    if (!valid(m.from, m.from_index) || !valid(m.to, m.to_index) || m.from == m.to)
      return make_error(errc::invalid_argument,
                        "KV tiers: a move from tier " + std::to_string(m.from) + " slot " +
                            std::to_string(m.from_index) + " to tier " + std::to_string(m.to) +
                            " slot " + std::to_string(m.to_index) + " is outside this store");
  for (const auto& m : moves) {
    const auto from = static_cast<kv_tier>(m.from);
    const auto to = static_cast<kv_tier>(m.to);
    if (from == kv_tier::device) {
      if (auto r = cache.read_block(m.from_index, slot(to, m.to_index)); !r) return r;
    } else if (to == kv_tier::device) {
      if (auto r = cache.write_block(m.to_index, slot(from, m.from_index)); !r) return r;
    } else {
      const auto src = slot(from, m.from_index);
      std::memcpy(slot(to, m.to_index).data(), src.data(), src.size());
    }
    ++moves_;
    bytes_ += static_cast<std::int64_t>(slot_bytes_);
  }
  return {};
}

}  // namespace troupe::models
