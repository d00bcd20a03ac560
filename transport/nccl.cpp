// NCCL with CUDA: one communicator per group, a stream per rank; every call
// is synchronous (returns when its result is in place) and turns CUDA/NCCL
// errors into messages.
#include "transport/nccl.hpp"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>

namespace troupe::transport {

using kernels::errc;
using kernels::make_error;
using kernels::result;

namespace {

result<void> cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return {};
  cudaGetLastError();
  return make_error(errc::device_unavailable,
                    std::string("CUDA: ") + what + ": " + cudaGetErrorString(e));
}

result<void> nccl_ok(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return {};
  return make_error(errc::io_error, std::string("NCCL: ") + what + ": " + ncclGetErrorString(r));
}

}  // namespace

struct nccl_group::impl {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int device = 0, rank = 0, size = 0;
  ~impl() {
    if (comm) {
      cudaSetDevice(device);
      ncclCommDestroy(comm);
    }
    if (stream) cudaStreamDestroy(stream);
  }
  result<void> sync(const char* what) { return cuda_ok(cudaStreamSynchronize(stream), what); }
};

result<device_buffer> device_buffer::alloc(int device, std::size_t bytes) {
  device_buffer b;
  if (auto r = cuda_ok(cudaSetDevice(device), "selecting the device"); !r)
    return std::unexpected(r.error());
  if (auto r = cuda_ok(cudaMalloc(&b.ptr_, bytes), "allocating device memory"); !r)
    return std::unexpected(r.error());
  b.bytes_ = bytes;
  b.device_ = device;
  return b;
}
device_buffer::~device_buffer() {
  if (ptr_) {
    cudaSetDevice(device_);
    cudaFree(ptr_);
  }
}
result<void> device_buffer::upload(std::span<const std::uint8_t> host) {
  if (host.size() > bytes_)
    return make_error(errc::invalid_argument, "device_buffer: upload larger than the buffer");
  if (auto r = cuda_ok(cudaSetDevice(device_), "selecting the device"); !r) return r;
  return cuda_ok(cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice),
                 "copying to the device");
}
result<void> device_buffer::download(std::span<std::uint8_t> host) const {
  if (host.size() > bytes_)
    return make_error(errc::invalid_argument, "device_buffer: download larger than the buffer");
  if (auto r = cuda_ok(cudaSetDevice(device_), "selecting the device"); !r) return r;
  return cuda_ok(cudaMemcpy(host.data(), ptr_, host.size(), cudaMemcpyDeviceToHost),
                 "copying from the device");
}

int nccl_group::device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

bool nccl_group::available() {
  return device_count() > 0;
}

std::string nccl_group::why_unavailable() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  cudaGetLastError();
  if (e != cudaSuccess) return std::string("no CUDA device (") + cudaGetErrorName(e) + ")";
  return n > 0 ? std::string() : std::string("no CUDA device");
}

result<std::vector<std::uint8_t>> nccl_group::new_id() {
  ncclUniqueId id;
  if (auto r = nccl_ok(ncclGetUniqueId(&id), "making a group id"); !r)
    return std::unexpected(r.error());
  std::vector<std::uint8_t> bytes(sizeof id.internal);
  std::memcpy(bytes.data(), id.internal, bytes.size());
  return bytes;
}

result<std::unique_ptr<nccl_group>> nccl_group::join(int device, int rank, int size,
                                                     std::span<const std::uint8_t> id) {
  ncclUniqueId uid;
  if (id.size() != sizeof uid.internal) {
    return make_error(errc::corrupt_data, "NCCL: a group id has " +
                                              std::to_string(sizeof uid.internal) + " bytes, got " +
                                              std::to_string(id.size()));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return make_error(errc::invalid_argument,
                      "NCCL: rank " + std::to_string(rank) + " of " + std::to_string(size));
  }
  std::memcpy(uid.internal, id.data(), id.size());
  auto p = std::make_unique<impl>();
  p->device = device;
  p->rank = rank;
  p->size = size;
  if (auto r = cuda_ok(cudaSetDevice(device), "selecting the device"); !r)
    return std::unexpected(r.error());
  if (auto r = cuda_ok(cudaStreamCreate(&p->stream), "creating a stream"); !r)
    return std::unexpected(r.error());
  if (auto r = nccl_ok(ncclCommInitRank(&p->comm, size, uid, rank), "joining the group"); !r) {
    p->comm = nullptr;
    return std::unexpected(r.error());
  }
  return std::unique_ptr<nccl_group>(new nccl_group(std::move(p)));
}

nccl_group::nccl_group(std::unique_ptr<impl> p) : p_(std::move(p)) {}
nccl_group::~nccl_group() = default;

result<void> nccl_group::all_reduce_sum(float* data, std::size_t count) {
  if (auto r = cuda_ok(cudaSetDevice(p_->device), "selecting the device"); !r) return r;
  if (auto r = nccl_ok(ncclAllReduce(data, data, count, ncclFloat32, ncclSum, p_->comm, p_->stream),
                       "all-reduce");
      !r)
    return r;
  return p_->sync("all-reduce");
}

result<void> nccl_group::send(const void* data, std::size_t bytes, int peer) {
  if (auto r = cuda_ok(cudaSetDevice(p_->device), "selecting the device"); !r) return r;
  if (auto r = nccl_ok(ncclSend(data, bytes, ncclUint8, peer, p_->comm, p_->stream), "send"); !r)
    return r;
  return p_->sync("send");
}

result<void> nccl_group::recv(void* data, std::size_t bytes, int peer) {
  if (auto r = cuda_ok(cudaSetDevice(p_->device), "selecting the device"); !r) return r;
  if (auto r = nccl_ok(ncclRecv(data, bytes, ncclUint8, peer, p_->comm, p_->stream), "recv"); !r)
    return r;
  return p_->sync("recv");
}

int nccl_group::rank() const {
  return p_->rank;
}
int nccl_group::size() const {
  return p_->size;
}

}  // namespace troupe::transport
