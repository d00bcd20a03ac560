#include "models/tokenizer.hpp"

#include <algorithm>
#include <cstdio>

#include "models/tokenizer_impl.hpp"

namespace troupe::models {

namespace detail {

namespace {

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  std::size_t pos = 0;
  for (std::size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out.append(to);
  }
  if (pos == 0) return;
  out.append(s, pos, std::string::npos);
  s = std::move(out);
}

bool starts_with(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

// "<0xNN>" -> NN, else -1.
int byte_token_value(std::string_view s) {
  if (s.size() != 6 || !starts_with(s, "<0x") || s[5] != '>') return -1;
  int v = 0;
  for (char c : s.substr(3, 2)) {
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= c - '0';
    } else if (c >= 'A' && c <= 'F') {
      v |= c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      v |= c - 'a' + 10;
    } else {
      return -1;
    }
  }
  return v;
}

// The byte a byte-level token stands for, token by token (tokenizers keeps
// a token's own UTF-8 when any of its chars is not a byte stand-in).
void byte_level_bytes(std::string_view token, std::string& out) {
  std::string bytes;
  char32_t cp = 0;
  for (std::size_t i = 0; i < token.size();) {
    const std::size_t len = unicode::decode_utf8(token, i, cp);
    const int b = len == 0 ? -1 : unicode::unicode_to_byte(cp);
    if (b < 0) {
      out.append(token);
      return;
    }
    bytes.push_back(static_cast<char>(b));
    i += len;
  }
  out += bytes;
}

bool is_word_char(char32_t c) {
  return c == '_' || unicode::is_letter(c) || unicode::is_number(c);
}

char32_t last_char(std::string_view s) {
  std::size_t i = s.size();
  while (i > 0 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i;
  if (i == 0) return 0;
  char32_t cp = 0;
  return unicode::decode_utf8(s, i - 1, cp) ? cp : 0;
}

char32_t first_char(std::string_view s) {
  char32_t cp = 0;
  return unicode::decode_utf8(s, 0, cp) ? cp : 0;
}

struct segment {
  std::size_t start, end;
  token_id id;  // -1: text
};

// Finds added tokens in `text`, leftmost-longest (tokenizers' Aho-Corasick
// LeftmostLongest), honouring single_word / lstrip / rstrip. Candidates at
// a position come from `index` (by first byte); tokens for which `skip(t)`
// holds match but are left as text (encode_special_tokens).
template <class Skip>
std::vector<segment> split_added(std::string_view text, const tokenizer_impl& im,
                                 const tokenizer_impl::added_index& index, Skip skip) {
  std::vector<segment> out;
  std::size_t start_offset = 0;
  for (std::size_t p = 0; p < text.size();) {
    const added_token* best = nullptr;
    std::size_t best_len = 0;
    for (std::uint32_t k : index[static_cast<unsigned char>(text[p])]) {
      const std::string_view c = im.added_patterns[k];
      if (c.size() > best_len && text.compare(p, c.size(), c) == 0)
        best = &im.added[k], best_len = c.size();
    }
    if (best == nullptr) {
      ++p;
      continue;
    }
    std::size_t s = p, e = p + best_len;
    p = e;
    if (skip(*best)) continue;
    if (best->single_word) {
      const bool left_ok = s == 0 || !is_word_char(last_char(text.substr(0, s)));
      const bool right_ok = e == text.size() || !is_word_char(first_char(text.substr(e)));
      if (!left_ok || !right_ok) continue;
    }
    if (best->lstrip) {
      std::size_t ns = s;
      while (ns > start_offset) {
        const char32_t c = last_char(text.substr(0, ns));
        if (!unicode::is_whitespace(c)) break;
        std::string enc;
        unicode::append_utf8(enc, c);
        ns -= enc.size();
      }
      s = std::max(ns, start_offset);
    }
    if (best->rstrip) {
      char32_t cp = 0;
      while (e < text.size()) {
        const std::size_t len = unicode::decode_utf8(text, e, cp);
        if (len == 0 || !unicode::is_whitespace(cp)) break;
        e += len;
      }
      p = e;
    }
    if (start_offset < s) out.push_back({start_offset, s, -1});
    out.push_back({s, e, best->id});
    start_offset = e;
  }
  if (start_offset < text.size()) out.push_back({start_offset, text.size(), -1});
  return out;
}

struct piece {
  std::string text;
  bool at_start;
};

void apply_pre_step(const pre_step& step, std::vector<piece>& pieces) {
  std::vector<piece> next;
  for (piece& p : pieces) {
    if (auto* sp = std::get_if<pre_split>(&step)) {
      bool first = p.at_start;
      for (std::string_view v : unicode::split_pretokens(p.text, sp->pattern)) {
        next.push_back({std::string(v), first});
        first = false;
      }
    } else if (auto* bl = std::get_if<pre_byte_level>(&step)) {
      if (bl->add_prefix_space && !p.text.empty() && p.text[0] != ' ') p.text = " " + p.text;
      std::vector<std::string_view> parts;
      if (bl->use_regex) {
        parts = unicode::split_pretokens(p.text, unicode::split_pattern::gpt2);
      } else {
        parts.push_back(p.text);
      }
      const auto& map = unicode::byte_to_unicode();
      bool first = p.at_start;
      for (std::string_view v : parts) {
        std::string mapped;
        for (char c : v) mapped += map[static_cast<unsigned char>(c)];
        next.push_back({std::move(mapped), first});
        first = false;
      }
    } else if (auto* ms = std::get_if<pre_metaspace>(&step)) {
      replace_all(p.text, " ", ms->replacement);
      const bool prepend = ms->prepend == pre_metaspace::scheme::always ||
                           (ms->prepend == pre_metaspace::scheme::first && p.at_start);
      if (prepend && !p.text.empty() && !starts_with(p.text, ms->replacement))
        p.text = ms->replacement + p.text;
      if (!ms->split) {
        next.push_back(std::move(p));
        continue;
      }
      // Split on the replacement, each occurrence starting a new piece.
      bool first = p.at_start;
      std::size_t from = 0;
      for (std::size_t hit = p.text.find(ms->replacement, 1); hit != std::string::npos;
           hit = p.text.find(ms->replacement, hit + ms->replacement.size())) {
        if (hit == from) continue;
        next.push_back({p.text.substr(from, hit - from), first});
        first = false;
        from = hit;
      }
      if (from < p.text.size()) next.push_back({p.text.substr(from), first});
    }
  }
  pieces = std::move(next);
}

}  // namespace

result<void> tokenizer_impl::add_vocab_entry(const std::string& text, std::int64_t id) {
  if (id < 0 || static_cast<std::uint64_t>(id) >= limits.max_vocab)
    return make_error(errc::corrupt_data, source + ": token id " + std::to_string(id) +
                                              " is outside [0, " +
                                              std::to_string(limits.max_vocab) + ")");
  if (text.size() > limits.max_token_bytes)
    return make_error(errc::corrupt_data, source + ": token " + std::to_string(id) +
                                              " is longer than " +
                                              std::to_string(limits.max_token_bytes) + " bytes");
  if (text.empty())
    return make_error(errc::corrupt_data, source + ": token " + std::to_string(id) + " is empty");
  if (unicode::find_invalid_utf8(text) != std::string_view::npos)
    return make_error(errc::corrupt_data,
                      source + ": token " + std::to_string(id) + " is not valid UTF-8");
  const auto i = static_cast<std::size_t>(id);
  if (i >= id_to_text.size()) {
    id_to_text.resize(i + 1);
    present.resize(i + 1, 0);
    special.resize(i + 1, 0);
  }
  if (present[i] && id_to_text[i] != text)
    return make_error(errc::corrupt_data, source + ": id " + std::to_string(id) +
                                              " is used by two tokens (\"" + id_to_text[i] +
                                              "\" and \"" + text + "\")");
  if (auto old = find_token(all_tokens, text); old && *old != id)
    return make_error(errc::corrupt_data, source + ": token \"" + text + "\" has two ids (" +
                                              std::to_string(*old) + " and " + std::to_string(id) +
                                              ")");
  id_to_text[i] = text;
  present[i] = 1;
  all_tokens.emplace(text, static_cast<token_id>(id));
  return {};
}

result<void> tokenizer_impl::finish() {
  if (all_tokens.empty())
    return make_error(errc::corrupt_data, source + ": the vocabulary is empty");
  const vocab_map& model_vocab = model == model_type::bpe ? bpe.vocab : spm.vocab;
  // Added (special) tokens alone cannot encode text: every character would
  // be dropped and generation would print nothing.
  if (model_vocab.empty())
    return make_error(errc::corrupt_data,
                      source + ": the model's vocabulary is empty (only added tokens)");
  auto& bytes = model == model_type::bpe ? bpe.byte_tokens : spm.byte_tokens;
  bytes.fill(-1);
  for (int b = 0; b < 256; ++b) {
    static const char* hex = "0123456789ABCDEF";
    const std::string name = std::string("<0x") + hex[b >> 4] + hex[b & 15] + ">";
    if (auto id = find_token(model_vocab, name)) bytes[static_cast<std::size_t>(b)] = *id;
  }
  for (std::size_t k = 0; k < added.size(); ++k) {
    const added_token& t = added[k];
    special[static_cast<std::size_t>(t.id)] = t.special ? 1 : 0;
    // Normalized tokens match the normalized text, by their normalized form.
    const bool norm = t.normalized && !normalizers.empty();
    added_patterns.push_back(norm ? normalize(t.content) : t.content);
    if (added_patterns.back().empty()) continue;
    (norm ? norm_index : raw_index)[static_cast<unsigned char>(added_patterns.back()[0])].push_back(
        static_cast<std::uint32_t>(k));
  }
  const std::size_t n = id_to_text.size();
  for (auto* id : {&specials.bos, &specials.eos, &specials.pad, &specials.unk})
    if (*id && (**id < 0 || static_cast<std::size_t>(**id) >= n ||
                !present[static_cast<std::size_t>(**id)]))
      return make_error(errc::corrupt_data, source + ": special token id " + std::to_string(**id) +
                                                " is not in the vocabulary");
  for (token_id id : prefix_ids)
    if (id < 0 || static_cast<std::size_t>(id) >= n || !present[static_cast<std::size_t>(id)])
      return make_error(errc::corrupt_data,
                        source + ": post-processor id " + std::to_string(id) + " is not a token");
  for (token_id id : suffix_ids)
    if (id < 0 || static_cast<std::size_t>(id) >= n || !present[static_cast<std::size_t>(id)])
      return make_error(errc::corrupt_data,
                        source + ": post-processor id " + std::to_string(id) + " is not a token");
  return {};
}

std::string tokenizer_impl::normalize(std::string_view text) const {
  std::string s(text);
  for (const norm_step& step : normalizers) {
    if (auto* p = std::get_if<norm_prepend>(&step)) {
      if (!s.empty()) s = p->text + s;
    } else if (auto* r = std::get_if<norm_replace>(&step)) {
      replace_all(s, r->from, r->to);
    }
  }
  return s;
}

void tokenizer_impl::encode_text(std::string_view text, bool at_start,
                                 std::vector<token_id>& out) const {
  std::vector<piece> pieces{{std::string(text), at_start}};
  for (const pre_step& step : pre_tokenizers) apply_pre_step(step, pieces);
  for (const piece& p : pieces) {
    if (model == model_type::bpe) {
      bpe.encode_word(p.text, out);
    } else {
      spm.encode(p.text, out);
    }
  }
}

std::string tokenizer_impl::token_bytes(token_id id, bool first) const {
  std::string s = id_to_text[static_cast<std::size_t>(id)];
  bool fused = false;
  for (const dec_step& step : decoders) {
    if (std::holds_alternative<dec_byte_level>(step)) {
      std::string b;
      byte_level_bytes(s, b);
      s = std::move(b);
      fused = true;
    } else if (auto* r = std::get_if<dec_replace>(&step)) {
      replace_all(s, r->from, r->to);
    } else if (std::holds_alternative<dec_byte_fallback>(step)) {
      if (const int v = byte_token_value(s); v >= 0) s = std::string(1, static_cast<char>(v));
    } else if (std::holds_alternative<dec_fuse>(step)) {
      fused = true;
    } else if (auto* st = std::get_if<dec_strip>(&step)) {
      if (fused) continue;  // applies to the whole text: see leading_strip()
      for (std::size_t k = 0; k < st->start && starts_with(s, st->content); ++k)
        s.erase(0, st->content.size());
      for (std::size_t k = 0; k < st->stop && s.ends_with(st->content); ++k)
        s.resize(s.size() - st->content.size());
    } else if (auto* m = std::get_if<dec_metaspace>(&step)) {
      replace_all(s, m->replacement, first && m->strip_first ? "" : " ");
    }
  }
  return s;
}

std::pair<std::string, std::size_t> tokenizer_impl::leading_strip() const {
  bool fused = false;
  for (const dec_step& step : decoders) {
    if (std::holds_alternative<dec_byte_level>(step) || std::holds_alternative<dec_fuse>(step))
      fused = true;
    if (auto* st = std::get_if<dec_strip>(&step); st && fused) return {st->content, st->start};
  }
  return {"", 0};
}

std::string tokenizer_impl::decode_pieces(std::vector<std::string> toks) const {
  if (!has_decoder) {
    std::string out;
    for (std::size_t i = 0; i < toks.size(); ++i) out += (i ? " " : "") + toks[i];
    return out;
  }
  for (const dec_step& step : decoders) {
    if (std::holds_alternative<dec_byte_level>(step)) {
      std::string bytes;
      for (const std::string& t : toks) byte_level_bytes(t, bytes);
      toks.assign(1, unicode::to_valid_utf8(bytes));
    } else if (auto* r = std::get_if<dec_replace>(&step)) {
      for (std::string& t : toks) replace_all(t, r->from, r->to);
    } else if (std::holds_alternative<dec_byte_fallback>(step)) {
      // Runs of <0xNN> tokens become their bytes when those are valid UTF-8,
      // else one U+FFFD per byte token (tokenizers' ByteFallback).
      std::vector<std::string> next;
      std::string run;
      std::size_t run_tokens = 0;
      auto flush = [&] {
        if (run_tokens == 0) return;
        if (unicode::find_invalid_utf8(run) == std::string_view::npos) {
          next.push_back(run);
        } else {
          for (std::size_t k = 0; k < run_tokens; ++k) next.emplace_back("\xEF\xBF\xBD");
        }
        run.clear();
        run_tokens = 0;
      };
      for (std::string& t : toks) {
        if (const int v = byte_token_value(t); v >= 0) {
          run.push_back(static_cast<char>(v));
          ++run_tokens;
        } else {
          flush();
          next.push_back(std::move(t));
        }
      }
      flush();
      toks = std::move(next);
    } else if (std::holds_alternative<dec_fuse>(step)) {
      std::string all;
      for (const std::string& t : toks) all += t;
      toks.assign(1, std::move(all));
    } else if (auto* st = std::get_if<dec_strip>(&step)) {
      for (std::string& t : toks) {
        for (std::size_t k = 0; k < st->start && starts_with(t, st->content); ++k)
          t.erase(0, st->content.size());
        for (std::size_t k = 0; k < st->stop && t.ends_with(st->content); ++k)
          t.resize(t.size() - st->content.size());
      }
    } else if (auto* m = std::get_if<dec_metaspace>(&step)) {
      for (std::size_t i = 0; i < toks.size(); ++i)
        replace_all(toks[i], m->replacement, i == 0 && m->strip_first ? "" : " ");
    }
  }
  std::string out;
  for (const std::string& t : toks) out += t;
  return unicode::to_valid_utf8(out);
}

}  // namespace detail

using detail::added_token;

result<std::vector<token_id>> tokenizer::encode(std::string_view text, bool add_special,
                                                bool parse_special) const {
  const detail::tokenizer_impl& im = *impl_;
  if (const std::size_t bad = unicode::find_invalid_utf8(text); bad != std::string_view::npos)
    return make_error(errc::invalid_argument, "tokenizer: input text is not valid UTF-8 (byte " +
                                                  std::to_string(bad) + ")");
  if (im.nfc) {
    char32_t cp = 0;
    for (std::size_t i = 0; i < text.size();) {
      i += unicode::decode_utf8(text, i, cp);  // valid: checked above
      if (unicode::may_change_under_nfc(cp)) {
        char hex[16];
        std::snprintf(hex, sizeof hex, "U+%04X", static_cast<unsigned>(cp));
        return make_error(errc::unsupported_op,
                          im.source + ": the text has " + hex +
                              ", which NFC normalization may change; only text already in "
                              "NFC is supported by this tokenizer's NFC normalizer");
      }
    }
  }
  auto skip = [&](const added_token& t) { return !parse_special && t.special; };
  std::vector<token_id> out(im.prefix_ids.begin(),
                            add_special ? im.prefix_ids.end() : im.prefix_ids.begin());
  for (const detail::segment& seg : detail::split_added(text, im, im.raw_index, skip)) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
      continue;
    }
    const std::string norm = im.normalize(text.substr(seg.start, seg.end - seg.start));
    for (const detail::segment& sub : detail::split_added(norm, im, im.norm_index, skip)) {
      if (sub.id >= 0) {
        out.push_back(sub.id);
      } else {
        im.encode_text(std::string_view(norm).substr(sub.start, sub.end - sub.start),
                       seg.start == 0 && sub.start == 0, out);
      }
    }
  }
  if (add_special) out.insert(out.end(), im.suffix_ids.begin(), im.suffix_ids.end());
  return out;
}

std::string tokenizer::decode(std::span<const token_id> ids, bool skip_special) const {
  const detail::tokenizer_impl& im = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (token_id id : ids) {
    if (id < 0 || static_cast<std::size_t>(id) >= im.id_to_text.size() ||
        !im.present[static_cast<std::size_t>(id)])
      continue;
    if (skip_special && im.special[static_cast<std::size_t>(id)]) continue;
    toks.push_back(im.id_to_text[static_cast<std::size_t>(id)]);
  }
  return im.decode_pieces(std::move(toks));
}

result<std::string> tokenizer::token_to_piece(token_id id) const {
  auto text = token_text(id);
  if (!text) return text;
  return impl_->token_bytes(id, false);
}

result<std::string> tokenizer::token_text(token_id id) const {
  const detail::tokenizer_impl& im = *impl_;
  if (id < 0 || static_cast<std::size_t>(id) >= im.id_to_text.size() ||
      !im.present[static_cast<std::size_t>(id)])
    return make_error(errc::invalid_argument,
                      im.source + ": no token has id " + std::to_string(id));
  return im.id_to_text[static_cast<std::size_t>(id)];
}

std::optional<token_id> tokenizer::token_to_id(std::string_view text) const {
  return detail::find_token(impl_->all_tokens, text);
}

std::size_t tokenizer::vocab_size() const {
  return impl_->id_to_text.size();
}
const special_token_ids& tokenizer::special_ids() const {
  return impl_->specials;
}

bool tokenizer::is_special(token_id id) const {
  return id >= 0 && static_cast<std::size_t>(id) < impl_->special.size() &&
         impl_->special[static_cast<std::size_t>(id)];
}

bool tokenizer::adds_bos() const {
  return impl_->specials.bos && !impl_->prefix_ids.empty() &&
         impl_->prefix_ids.front() == *impl_->specials.bos;
}

const std::string& tokenizer::chat_template_source() const {
  return impl_->chat_template;
}
std::string_view tokenizer::model_kind() const {
  return impl_->kind_name;
}

stream_decoder::stream_decoder(tokenizer tok, bool skip_special)
    : tok_(std::move(tok)),
      skip_special_(skip_special),
      strip_left_(tok_.impl().leading_strip().second) {}

std::string stream_decoder::push(token_id id) {
  const detail::tokenizer_impl& im = tok_.impl();
  if (id < 0 || static_cast<std::size_t>(id) >= im.id_to_text.size() ||
      !im.present[static_cast<std::size_t>(id)])
    return {};
  if (skip_special_ && im.special[static_cast<std::size_t>(id)]) return {};
  std::string bytes = im.token_bytes(id, first_);
  first_ = false;
  pending_ += bytes;
  const std::size_t tail = unicode::incomplete_utf8_tail(pending_);
  std::string ready = pending_.substr(0, pending_.size() - tail);
  pending_.erase(0, pending_.size() - tail);
  return emit(std::move(ready));
}

std::string stream_decoder::finish() {
  std::string out = emit(std::exchange(pending_, {}));
  first_ = true;
  strip_left_ = tok_.impl().leading_strip().second;
  return out;
}

std::string stream_decoder::emit(std::string bytes) {
  std::string out = unicode::to_valid_utf8(bytes);
  const std::string content = tok_.impl().leading_strip().first;
  while (strip_left_ > 0 && !out.empty()) {
    if (!content.empty() && out.starts_with(content)) {
      out.erase(0, content.size());
      --strip_left_;
    } else {
      strip_left_ = 0;
    }
  }
  return out;
}

}  // namespace troupe::models
