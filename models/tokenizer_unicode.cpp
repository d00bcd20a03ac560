#include "models/tokenizer_unicode.hpp"

namespace troupe::models::unicode {

bool is_whitespace(char32_t cp) {
  if (cp < 0x80) return cp == ' ' || (cp >= 0x09 && cp <= 0x0D);
  return cp == 0x85 || cp == 0xA0 || cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) ||
         cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

std::size_t decode_utf8(std::string_view s, std::size_t i, char32_t& cp) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const std::size_t n = s.size();
  if (i >= n) return 0;
  const unsigned c0 = b(i);
  if (c0 < 0x80) {
    cp = c0;
    return 1;
  }
  std::size_t len = 0;
  char32_t v = 0, min = 0;
  if ((c0 & 0xE0) == 0xC0) {
    len = 2, v = c0 & 0x1F, min = 0x80;
  } else if ((c0 & 0xF0) == 0xE0) {
    len = 3, v = c0 & 0x0F, min = 0x800;
  } else if ((c0 & 0xF8) == 0xF0) {
    len = 4, v = c0 & 0x07, min = 0x10000;
  } else {
    return 0;
  }
  if (n - i < len) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    if ((b(i + k) & 0xC0) != 0x80) return 0;
    v = (v << 6) | (b(i + k) & 0x3F);
  }
  if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 0;
  cp = v;
  return len;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::size_t find_invalid_utf8(std::string_view s) {
  char32_t cp = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t len = decode_utf8(s, i, cp);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

namespace {

// Length of the longest prefix of s[i..] that can begin a valid sequence
// (the "maximal subpart" of the Unicode standard, section 3.9), at least 1.
std::size_t maximal_subpart(std::string_view s, std::size_t i, bool& complete_possible) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned c0 = b(i);
  std::size_t len = 0;
  unsigned lo = 0x80, hi = 0xBF;
  if (c0 >= 0xC2 && c0 <= 0xDF) {
    len = 2;
  } else if (c0 >= 0xE0 && c0 <= 0xEF) {
    len = 3;
    if (c0 == 0xE0) lo = 0xA0;
    if (c0 == 0xED) hi = 0x9F;
  } else if (c0 >= 0xF0 && c0 <= 0xF4) {
    len = 4;
    if (c0 == 0xF0) lo = 0x90;
    if (c0 == 0xF4) hi = 0x8F;
  } else {
    complete_possible = false;
    return 1;
  }
  std::size_t k = 1;
  for (; k < len && i + k < s.size(); ++k) {
    const unsigned c = b(i + k);
    if (k == 1 ? (c < lo || c > hi) : (c & 0xC0) != 0x80) {
      complete_possible = false;
      return k;
    }
  }
  complete_possible = (k < len);  // ran out of input: could still complete
  return k;
}

}  // namespace

std::size_t incomplete_utf8_tail(std::string_view s) {
  // A valid unfinished sequence is at most 3 bytes and starts at a lead byte.
  for (std::size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const std::size_t i = s.size() - back;
    const unsigned c = static_cast<unsigned char>(s[i]);
    if ((c & 0xC0) == 0x80) continue;  // continuation byte: look further back
    bool possible = false;
    const std::size_t got = maximal_subpart(s, i, possible);
    return (possible && got == back) ? back : 0;
  }
  return 0;
}

std::string to_valid_utf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  char32_t cp = 0;
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t len = decode_utf8(s, i, cp);
    if (len > 0) {
      out.append(s.substr(i, len));
      i += len;
      continue;
    }
    bool possible = false;
    i += maximal_subpart(s, i, possible);
    out += "\xEF\xBF\xBD";
  }
  return out;
}

namespace {

struct byte_tables {
  std::array<std::string, 256> to_unicode;
  std::array<std::int16_t, 324> from_unicode{};  // stand-ins are < U+0144
  byte_tables() {
    from_unicode.fill(-1);
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable =
          (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      const char32_t cp =
          printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + extra++);
      append_utf8(to_unicode[b], cp);
      from_unicode[cp] = static_cast<std::int16_t>(b);
    }
  }
};

const byte_tables& tables() {
  static const byte_tables t;
  return t;
}

}  // namespace

const std::array<std::string, 256>& byte_to_unicode() {
  return tables().to_unicode;
}

int unicode_to_byte(char32_t cp) {
  if (cp >= tables().from_unicode.size()) return -1;
  return tables().from_unicode[cp];
}

namespace {

constexpr std::string_view gpt2_regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view llama3_regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view qwen2_regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The text as code points, with the byte offset of each (offsets[n] = size).
struct decoded_text {
  std::vector<char32_t> cps;
  std::vector<std::size_t> offsets;
};

decoded_text decode_all(std::string_view text) {
  decoded_text d;
  d.cps.reserve(text.size());
  d.offsets.reserve(text.size() + 1);
  char32_t cp = 0;
  for (std::size_t i = 0; i < text.size();) {
    std::size_t len = decode_utf8(text, i, cp);
    if (len == 0) cp = 0xFFFD, len = 1;  // callers validate; never loop forever
    d.cps.push_back(cp);
    d.offsets.push_back(i);
    i += len;
  }
  d.offsets.push_back(text.size());
  return d;
}

// Matches the regex alternatives at position i; returns the end (> i) of
// the first alternative that matches, or i when none does.
class splitter {
 public:
  splitter(const std::vector<char32_t>& cps, split_pattern p) : c_(cps), n_(cps.size()), p_(p) {}

  std::size_t match(std::size_t i) const {
    if (std::size_t e = contraction(i); e > i) return e;
    if (p_ == split_pattern::gpt2) {
      if (std::size_t e = opt_space_run(i, &splitter::letter); e > i) return e;
      if (std::size_t e = opt_space_run(i, &splitter::number); e > i) return e;
      if (std::size_t e = opt_space_run(i, &splitter::other); e > i) return e;
    } else {
      // [^\r\n\p{L}\p{N}]?\p{L}+
      if (letter(i)) return run(i, &splitter::letter);
      if (i + 1 < n_ && !crlf(i) && !number(i) && letter(i + 1))
        return run(i + 1, &splitter::letter);
      // \p{N}{1,3} or \p{N}
      if (number(i)) {
        const std::size_t cap = p_ == split_pattern::llama3 ? 3 : 1;
        std::size_t e = i;
        while (e < n_ && e - i < cap && number(e)) ++e;
        return e;
      }
      // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
      if (std::size_t e = opt_space_run(i, &splitter::other); e > i) {
        while (e < n_ && crlf(e)) ++e;
        return e;
      }
      // \s*[\r\n]+ : the whitespace run up to and including its last CR/LF
      if (space(i)) {
        const std::size_t k = run(i, &splitter::space);
        for (std::size_t j = k; j > i; --j)
          if (crlf(j - 1)) return j;
      }
    }
    if (space(i)) {
      const std::size_t k = run(i, &splitter::space);
      if (k == n_) return k;         // \s+(?!\S) at the end
      if (k - i >= 2) return k - 1;  // \s+(?!\S): leave one space for the next word
      return k;                      // \s+
    }
    return i;
  }

 private:
  bool letter(std::size_t i) const { return i < n_ && is_letter(c_[i]); }
  bool number(std::size_t i) const { return i < n_ && is_number(c_[i]); }
  bool space(std::size_t i) const { return i < n_ && is_whitespace(c_[i]); }
  bool other(std::size_t i) const {
    return i < n_ && !is_whitespace(c_[i]) && !is_letter(c_[i]) && !is_number(c_[i]);
  }
  bool crlf(std::size_t i) const { return i < n_ && (c_[i] == '\r' || c_[i] == '\n'); }

  std::size_t run(std::size_t i, bool (splitter::*pred)(std::size_t) const) const {
    while (i < n_ && (this->*pred)(i)) ++i;
    return i;
  }
  // ' ?X+'
  std::size_t opt_space_run(std::size_t i, bool (splitter::*pred)(std::size_t) const) const {
    std::size_t j = i;
    if (j < n_ && c_[j] == ' ' && (this->*pred)(j + 1)) ++j;
    if (!(this->*pred)(j)) return i;
    return run(j, pred);
  }
  // 's|'t|'re|'ve|'m|'ll|'d, case-insensitive for llama3/qwen2 (with
  // Unicode simple case folding: U+017F LONG S folds to s, U+212A KELVIN to k).
  std::size_t contraction(std::size_t i) const {
    if (c_[i] != '\'' || i + 1 >= n_) return i;
    const bool fold = p_ != split_pattern::gpt2;
    auto at = [&](std::size_t k) -> char32_t {
      if (k >= n_) return 0;
      char32_t c = c_[k];
      if (fold) {
        if (c >= 'A' && c <= 'Z') c += 32;
        if (c == 0x17F) c = 's';
      }
      return c;
    };
    const char32_t a = at(i + 1), b = at(i + 2);
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if ((a == 'r' || a == 'v') && b == 'e') return i + 3;
    if (a == 'l' && b == 'l') return i + 3;
    return i;
  }

  const std::vector<char32_t>& c_;
  std::size_t n_;
  split_pattern p_;
};

}  // namespace

std::optional<split_pattern> recognise_split_pattern(std::string_view regex) {
  if (regex == gpt2_regex) return split_pattern::gpt2;
  if (regex == llama3_regex) return split_pattern::llama3;
  if (regex == qwen2_regex) return split_pattern::qwen2;
  return std::nullopt;
}

std::string_view split_pattern_text(split_pattern p) {
  switch (p) {
    case split_pattern::gpt2:
      return gpt2_regex;
    case split_pattern::llama3:
      return llama3_regex;
    case split_pattern::qwen2:
      return qwen2_regex;
  }
  return {};
}

std::vector<std::string_view> split_pretokens(std::string_view text, split_pattern p) {
  std::vector<std::string_view> out;
  const decoded_text d = decode_all(text);
  const splitter s(d.cps, p);
  std::size_t gap = 0;  // start of an unmatched stretch
  for (std::size_t i = 0; i < d.cps.size();) {
    const std::size_t e = s.match(i);
    if (e == i) {
      ++i;
      continue;
    }
    if (gap < i) out.push_back(text.substr(d.offsets[gap], d.offsets[i] - d.offsets[gap]));
    out.push_back(text.substr(d.offsets[i], d.offsets[e] - d.offsets[i]));
    i = gap = e;
  }
  if (gap < d.cps.size()) out.push_back(text.substr(d.offsets[gap]));
  return out;
}

}  // namespace troupe::models::unicode
