#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::models::unicode {

/// An inclusive code point range.
struct codepoint_range {
  char32_t first;
  char32_t last;
};

/// General category L* (letters), as `\p{L}` in the pre-tokenizer regexes.
bool is_letter(char32_t cp);
/// General category N* (numbers), as `\p{N}`.
bool is_number(char32_t cp);
/// The White_Space property, as Oniguruma's `\s` in Unicode mode.
bool is_whitespace(char32_t cp);
/// Whether NFC may change or reorder `cp` (non-zero combining class, not
/// its own NFC form, or the second half of a canonical composition). Text
/// with none of these is already in NFC.
bool may_change_under_nfc(char32_t cp);

/// Decodes the code point starting at `s[i]`; returns its length in bytes
/// (1-4), or 0 when the bytes there are not a valid UTF-8 sequence
/// (overlong forms, surrogates and values above U+10FFFF are invalid).
std::size_t decode_utf8(std::string_view s, std::size_t i, char32_t& cp);
/// Appends the UTF-8 form of `cp`.
void append_utf8(std::string& out, char32_t cp);
/// Offset of the first byte that does not start a valid sequence, or npos.
std::size_t find_invalid_utf8(std::string_view s);
/// How many bytes at the end of `s` form a valid but unfinished sequence
/// (0-3): the bytes a streaming decoder must hold back.
std::size_t incomplete_utf8_tail(std::string_view s);
/// `bytes` with each maximal invalid subsequence replaced by U+FFFD (the
/// policy of Rust's `String::from_utf8_lossy` and of the WHATWG decoder).
std::string to_valid_utf8(std::string_view bytes);

/// GPT-2's ByteLevel table: byte -> the UTF-8 string of its stand-in char.
const std::array<std::string, 256>& byte_to_unicode();
/// The inverse: the byte a stand-in char means, or -1.
int unicode_to_byte(char32_t cp);

/// The pre-tokenizer split regexes implemented by hand (std::regex has no
/// `\p{L}`); each reproduces the backtracking regex's leftmost-first match.
enum class split_pattern : std::uint8_t {
  gpt2,    ///< 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  llama3,  ///< (?i:'s|...)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
           ///< ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|...
  qwen2,   ///< llama3 with single digits (\p{N})
};

/// Recognises a regex string of tokenizer.json's Split pre-tokenizer.
std::optional<split_pattern> recognise_split_pattern(std::string_view regex);
/// The regex text of a pattern (for messages and tests).
std::string_view split_pattern_text(split_pattern p);
/// Splits valid UTF-8 text into the pieces the regex matches, in order, with
/// any unmatched stretch as its own piece ("Isolated" split behaviour).
std::vector<std::string_view> split_pretokens(std::string_view text, split_pattern p);

}  // namespace troupe::models::unicode
