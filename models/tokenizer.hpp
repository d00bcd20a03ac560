#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "models/gguf.hpp"
#include "models/mapped_file.hpp"

namespace troupe::models {

using token_id = std::int32_t;

namespace detail {
struct tokenizer_impl;
}

/// The special tokens a tokenizer names (absent ones are nullopt).
struct special_token_ids {
  std::optional<token_id> bos, eos, pad, unk;
};

/// Limits applied while loading untrusted tokenizer files.
struct tokenizer_limits {
  std::size_t max_vocab = 1u << 22;  ///< tokens, ids must be below this
  std::size_t max_merges = 1u << 23;
  std::size_t max_token_bytes = 1u << 16;  ///< one token's text
  std::size_t max_json_bytes = 256u << 20;
};

/// A text tokenizer: byte-level BPE (GPT-2 / LLaMA-3 / Qwen2 style) or
/// SentencePiece-style BPE (LLaMA-2 style: metaspace, byte fallback), loaded
/// from a Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) or from
/// GGUF metadata. Encoding reproduces the `tokenizers` library (and for GGUF
/// "llama" vocabularies, llama.cpp's score-based merging). Immutable after
/// loading; copies share the tables and may be used from several threads.
class tokenizer {
 public:
  /// Parses `tokenizer.json` text and, when non-empty, `tokenizer_config.json`
  /// text (special tokens by name, add_bos_token/add_eos_token, chat_template).
  /// `source` names the input in error messages.
  static result<tokenizer> from_json(std::string_view tokenizer_json, std::string_view config_json,
                                     const std::string& source,
                                     const tokenizer_limits& limits = {});
  /// Loads `PATH/tokenizer.json` (and `PATH/tokenizer_config.json` if present)
  /// when PATH is a folder, else PATH as the tokenizer.json file.
  static result<tokenizer> load(const std::string& path, const tokenizer_limits& limits = {});
  /// Reads the tokenizer.ggml.* metadata of a GGUF file ("llama" or "gpt2").
  static result<tokenizer> from_gguf(const gguf_file& file, const tokenizer_limits& limits = {});

  /// Token ids of UTF-8 `text`. `add_special` adds what the file's
  /// post-processor (or GGUF add_bos/add_eos) adds, e.g. BOS. With
  /// `parse_special`, special added tokens written in the text (e.g.
  /// "<|eot_id|>") become their ids; without it they are tokenized as plain
  /// text (non-special added tokens always match). Invalid UTF-8 is an error.
  result<std::vector<token_id>> encode(std::string_view text, bool add_special = true,
                                       bool parse_special = true) const;
  /// Text of `ids` as the file's decoder makes it (Hugging Face semantics:
  /// byte fallback, metaspace, leading-space strip; invalid byte sequences
  /// become U+FFFD). Ids outside the vocabulary are skipped, as tokenizers does.
  std::string decode(std::span<const token_id> ids, bool skip_special = false) const;
  /// The bytes one token stands for when decoded alone (may be part of a
  /// UTF-8 sequence, e.g. a <0xE2> byte token); an error for unknown ids.
  result<std::string> token_to_piece(token_id id) const;
  /// The token's entry as stored in the vocabulary (e.g. "Ġhello", "▁the").
  result<std::string> token_text(token_id id) const;
  std::optional<token_id> token_to_id(std::string_view text) const;

  /// One past the largest id (model vocabulary plus added tokens).
  std::size_t vocab_size() const;
  const special_token_ids& special_ids() const;
  /// Added tokens marked special (and GGUF control/unknown tokens).
  bool is_special(token_id id) const;
  /// Whether encode(add_special = true) puts BOS first.
  bool adds_bos() const;
  /// The chat template source (tokenizer_config.json / GGUF), or "".
  const std::string& chat_template_source() const;
  /// "byte-level BPE", "SentencePiece BPE" or "SentencePiece (llama.cpp scores)".
  std::string_view model_kind() const;

  const detail::tokenizer_impl& impl() const { return *impl_; }
  explicit tokenizer(std::shared_ptr<const detail::tokenizer_impl> impl) : impl_(std::move(impl)) {}

 private:
  std::shared_ptr<const detail::tokenizer_impl> impl_;
};

/// Turns ids produced one at a time into text, emitting only complete UTF-8:
/// bytes of an unfinished sequence (byte-fallback tokens, byte-level pieces
/// of a multi-byte character) are held back until the sequence completes.
/// For ids whose decode() is valid text, the concatenation of everything
/// push() and finish() return equals decode(ids). Invalid sequences come out
/// as U+FFFD, so the output is always valid UTF-8.
class stream_decoder {
 public:
  explicit stream_decoder(tokenizer tok, bool skip_special = false);
  /// The text that `id` completes (often empty or a whole word piece).
  std::string push(token_id id);
  /// Emits what is held back (an unfinished sequence becomes U+FFFD) and resets.
  std::string finish();

 private:
  std::string emit(std::string bytes);
  tokenizer tok_;
  bool skip_special_;
  bool first_ = true;
  std::size_t strip_left_ = 0;  ///< leading chars still to strip (Strip decoder)
  std::string pending_;         ///< bytes of an unfinished UTF-8 sequence
};

}  // namespace troupe::models
