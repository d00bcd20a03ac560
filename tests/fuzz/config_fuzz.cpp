// libFuzzer target: config.json and generation_config.json parsing.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "models/llama_config.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::models;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  (void)parse_llama_config(text, "fuzz/config.json");
  (void)parse_generation_config(text, "fuzz/generation_config.json");
  return 0;
}
