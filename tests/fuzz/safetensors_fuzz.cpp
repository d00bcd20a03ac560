// libFuzzer target: a safetensors header and the tensor views it describes.
#include <cstddef>
#include <cstdint>

#include "models/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::models;
  auto file = mapped_file::from_memory("fuzz.safetensors",
                                       {reinterpret_cast<const std::byte*>(data), size});
  auto m = safetensors_model::parse(file);
  if (!m) return 0;
  volatile std::uint8_t sink = 0;
  for (const auto& t : m->tensors()) {
    auto v = m->view(t);
    if (!v || t.bytes == 0) continue;
    const auto* p = static_cast<const std::uint8_t*>(v->data());
    sink = sink + p[0] + p[t.bytes - 1];
  }
  return 0;
}
