#pragma once

// Internal: what a loaded tokenizer holds, filled by the tokenizer.json and
// GGUF loaders and used by tokenizer.cpp (not a public API).

#include <array>
#include <string>
#include <variant>
#include <vector>

#include "models/tokenizer.hpp"
#include "models/tokenizer_model.hpp"
#include "models/tokenizer_unicode.hpp"

namespace troupe::models::detail {

/// Normalizer steps (applied to each text segment between added tokens).
struct norm_prepend {
  std::string text;  ///< prepended when the segment is not empty
};
struct norm_replace {
  std::string from, to;
};
using norm_step = std::variant<norm_prepend, norm_replace>;

/// Pre-tokenizer steps (each maps every current piece to pieces).
struct pre_split {
  unicode::split_pattern pattern;
};
struct pre_byte_level {
  bool add_prefix_space = false;
  bool use_regex = true;  ///< split with the GPT-2 pattern first
};
struct pre_metaspace {
  std::string replacement = "\xE2\x96\x81";
  enum class scheme : std::uint8_t { always, first, never } prepend = scheme::always;
  bool split = true;
};
using pre_step = std::variant<pre_split, pre_byte_level, pre_metaspace>;

/// Decoder steps, Hugging Face's decode_chain semantics.
struct dec_byte_level {};
struct dec_replace {
  std::string from, to;
};
struct dec_byte_fallback {};
struct dec_fuse {};
struct dec_strip {
  std::string content;  ///< one character
  std::size_t start = 0, stop = 0;
};
struct dec_metaspace {
  std::string replacement = "\xE2\x96\x81";
  bool strip_first = true;  ///< prepend_scheme != never
};
using dec_step = std::variant<dec_byte_level, dec_replace, dec_byte_fallback, dec_fuse, dec_strip,
                              dec_metaspace>;

struct added_token {
  std::string content;
  token_id id = 0;
  bool special = false;
  bool lstrip = false, rstrip = false, single_word = false;
  bool normalized = false;
};

enum class model_type : std::uint8_t { bpe, spm_scores };

struct tokenizer_impl {
  std::string source;
  tokenizer_limits limits;
  model_type model = model_type::bpe;
  bpe_model bpe;
  spm_model spm;

  /// id -> vocabulary text; `present` false for ids no token has.
  std::vector<std::string> id_to_text;
  std::vector<std::uint8_t> present, special;
  vocab_map all_tokens;  ///< model vocabulary plus added tokens

  std::vector<norm_step> normalizers;
  /// An NFC normalizer: identity on text that is already NFC; other text
  /// is refused (no composition tables here).
  bool nfc = false;
  std::vector<pre_step> pre_tokenizers;
  std::vector<added_token> added;
  /// What each added token matches (its content, normalized if it is a
  /// normalized token), and the tokens by the first byte of that pattern.
  using added_index = std::array<std::vector<std::uint32_t>, 256>;
  std::vector<std::string> added_patterns;
  added_index raw_index, norm_index;
  std::vector<dec_step> decoders;
  bool has_decoder = true;  ///< without one, tokenizers joins tokens with " "

  std::vector<token_id> prefix_ids, suffix_ids;  ///< added by add_special
  special_token_ids specials;
  std::string chat_template;
  std::string kind_name;

  /// Registers token `text` with `id` (checks range and duplicates).
  result<void> add_vocab_entry(const std::string& text, std::int64_t id);
  /// Fills byte_tokens from "<0xNN>" entries and checks the tables; call last.
  result<void> finish();

  std::string normalize(std::string_view text) const;
  void encode_text(std::string_view text, bool at_start, std::vector<token_id>& out) const;
  /// A token's bytes as the decoder makes them when it is the `first` token.
  std::string token_bytes(token_id id, bool first) const;
  std::string decode_pieces(std::vector<std::string> tokens) const;
  /// Leading characters the decoder strips from the whole text (Strip after Fuse).
  std::pair<std::string, std::size_t> leading_strip() const;
};

}  // namespace troupe::models::detail
