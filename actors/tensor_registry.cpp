#include "actors/tensor_registry.hpp"

namespace troupe::actors {

tensor_registry& tensor_registry::local() {
  static tensor_registry r;
  return r;
}

tensor_ref tensor_registry::put(const std::string& device, kernels::tensor t) {
  tensor_ref ref;
  ref.device = device;
  ref.dtype = static_cast<std::uint8_t>(t.type());
  for (int i = 0; i < t.shape().ndim; ++i) ref.shape.push_back(t.shape()[i]);
  std::lock_guard lock(mtx_);
  ref.transfer_id = next_++;
  parked_.emplace(ref.transfer_id, std::move(t));
  return ref;
}

kernels::result<kernels::tensor> tensor_registry::take(const tensor_ref& ref) {
  kernels::tensor t;
  {
    std::lock_guard lock(mtx_);
    auto it = parked_.find(ref.transfer_id);
    if (it == parked_.end())
      return kernels::make_error(
          kernels::errc::not_found,
          "transfer " + std::to_string(ref.transfer_id) + " is unknown or was already taken");
    t = std::move(it->second);
    parked_.erase(it);
  }
  bool same = static_cast<std::uint8_t>(t.type()) == ref.dtype &&
              ref.shape.size() == static_cast<std::size_t>(t.shape().ndim);
  for (int i = 0; same && i < t.shape().ndim; ++i)
    same = ref.shape[static_cast<std::size_t>(i)] == t.shape()[i];
  if (!same)
    return kernels::make_error(
        kernels::errc::shape_mismatch,
        "transfer " + std::to_string(ref.transfer_id) + " does not match its descriptor");
  return t;
}

void tensor_registry::drop(const tensor_ref& ref) {
  std::lock_guard lock(mtx_);
  parked_.erase(ref.transfer_id);
}

std::size_t tensor_registry::pending() const {
  std::lock_guard lock(mtx_);
  return parked_.size();
}

}  // namespace troupe::actors
