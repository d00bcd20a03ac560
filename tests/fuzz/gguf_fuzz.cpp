// libFuzzer target: the GGUF parser, and every tensor view it hands out.
#include <cstddef>
#include <cstdint>

#include "models/gguf.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::models;
  auto file =
      mapped_file::from_memory("fuzz.gguf", {reinterpret_cast<const std::byte*>(data), size});
  gguf_limits limits;
  limits.max_array_elems = 1 << 16;
  auto g = gguf_file::parse(file, limits);
  if (!g) return 0;
  volatile std::uint8_t sink = 0;
  for (const auto& t : g->tensors()) {
    auto v = g->view(t);
    if (!v || t.bytes == 0) continue;
    const auto* p = static_cast<const std::uint8_t*>(v->data());
    sink = sink + p[0] + p[t.bytes - 1];
  }
  if (g->find("general.architecture")) (void)g->find("general.architecture")->as_string();
  return 0;
}
