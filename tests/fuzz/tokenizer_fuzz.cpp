// libFuzzer target: tokenizer.json loading, then encode/decode of a slice
// of the input with whatever tokenizer came out.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "models/tokenizer.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe::models;
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  tokenizer_limits limits;
  limits.max_vocab = 1 << 16;
  limits.max_merges = 1 << 16;
  auto tok = tokenizer::from_json(all, "", "fuzz/tokenizer.json", limits);
  if (!tok) return 0;
  const std::string_view text = all.substr(size / 2);
  auto ids = tok->encode(text, true, true);
  if (ids) (void)tok->decode(*ids);
  return 0;
}
