// NCCL without CUDA: every call says so.
#include "transport/nccl.hpp"

namespace troupe::transport {

namespace {
kernels::error unavailable() {
  return kernels::error{kernels::errc::device_unavailable,
                        "NCCL: this build has no CUDA (configure with WITH_CUDA=ON)"};
}
}  // namespace

struct nccl_group::impl {};

kernels::result<device_buffer> device_buffer::alloc(int, std::size_t) {
  return std::unexpected(unavailable());
}
device_buffer::~device_buffer() = default;
kernels::result<void> device_buffer::upload(std::span<const std::uint8_t>) {
  return std::unexpected(unavailable());
}
kernels::result<void> device_buffer::download(std::span<std::uint8_t>) const {
  return std::unexpected(unavailable());
}

bool nccl_group::available() {
  return false;
}
std::string nccl_group::why_unavailable() {
  return unavailable().message;
}
int nccl_group::device_count() {
  return 0;
}
kernels::result<std::vector<std::uint8_t>> nccl_group::new_id() {
  return std::unexpected(unavailable());
}
kernels::result<std::unique_ptr<nccl_group>> nccl_group::join(int, int, int,
                                                              std::span<const std::uint8_t>) {
  return std::unexpected(unavailable());
}
nccl_group::nccl_group(std::unique_ptr<impl> p) : p_(std::move(p)) {}
nccl_group::~nccl_group() = default;
kernels::result<void> nccl_group::all_reduce_sum(float*, std::size_t) {
  return std::unexpected(unavailable());
}
kernels::result<void> nccl_group::send(const void*, std::size_t, int) {
  return std::unexpected(unavailable());
}
kernels::result<void> nccl_group::recv(void*, std::size_t, int) {
  return std::unexpected(unavailable());
}
int nccl_group::rank() const {
  return 0;
}
int nccl_group::size() const {
  return 0;
}

}  // namespace troupe::transport
