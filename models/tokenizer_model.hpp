#pragma once

// Internal: the subword models behind models::tokenizer (not a public API).

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace troupe::models::detail {

using token_id = std::int32_t;

/// Hash map keyed by string with heterogeneous string_view lookup.
struct string_hash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using vocab_map = std::unordered_map<std::string, token_id, string_hash, std::equal_to<>>;

inline std::optional<token_id> find_token(const vocab_map& v, std::string_view s) {
  auto it = v.find(s);
  if (it == v.end()) return std::nullopt;
  return it->second;
}

/// Hugging Face's BPE model: merges applied by rank (lowest first, leftmost
/// on ties, as tokenizers' Word::merge_all), optional byte fallback to
/// <0xNN> tokens, unknown token (fused or not), ignore_merges.
struct bpe_model {
  vocab_map vocab;  ///< the model's own vocabulary
  /// (left id << 32 | right id) -> (rank, merged id)
  std::unordered_map<std::uint64_t, std::pair<std::int32_t, token_id>> merges;
  std::optional<token_id> unk;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
  std::array<token_id, 256> byte_tokens{};  ///< <0xNN> ids, -1 when absent

  static std::uint64_t key(token_id a, token_id b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }
  /// Appends the ids of one pre-tokenized word.
  void encode_word(std::string_view word, std::vector<token_id>& out) const;
};

/// llama.cpp's SentencePiece model for GGUF "llama" vocabularies: pairs of
/// adjacent symbols merge while their concatenation is a token, the one with
/// the highest score first (leftmost on ties); leftover symbols that are not
/// tokens become <0xNN> byte tokens.
struct spm_model {
  vocab_map vocab;
  std::vector<float> scores;  ///< by id
  std::optional<token_id> unk;
  std::array<token_id, 256> byte_tokens{};

  void encode(std::string_view text, std::vector<token_id>& out) const;
};

}  // namespace troupe::models::detail
