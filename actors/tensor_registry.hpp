#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "actors/protocol.hpp"
#include "kernels/tensor.hpp"

namespace troupe::actors {

/// The in-process data plane: a sender parks a tensor under a fresh transfer
/// id and sends the `tensor_ref`; the receiver takes it out (zero copies:
/// the buffer is shared). The data-plane issue puts UCX/NCCL transfers
/// behind the same refs. Thread-safe.
class tensor_registry {
 public:
  /// The process's registry.
  static tensor_registry& local();

  /// Parks `t` (of `device`) and returns its ref.
  tensor_ref put(const std::string& device, kernels::tensor t);
  /// Takes the tensor out; an error when the id is unknown or already taken,
  /// or when dtype/shape disagree with the ref.
  kernels::result<kernels::tensor> take(const tensor_ref& ref);
  /// Drops a parked tensor that will not be taken (a failed step).
  void drop(const tensor_ref& ref);
  /// Tensors parked and not yet taken (leak checks in tests).
  std::size_t pending() const;

 private:
  mutable std::mutex mtx_;
  std::unordered_map<std::uint64_t, kernels::tensor> parked_;
  std::uint64_t next_ = 1;
};

}  // namespace troupe::actors
