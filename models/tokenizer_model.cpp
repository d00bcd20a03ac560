#include "models/tokenizer_model.hpp"

#include <queue>

#include "models/tokenizer_unicode.hpp"

namespace troupe::models::detail {

namespace {

struct symbol {
  token_id id;
  std::int32_t prev;
  std::int32_t next;
  std::size_t len;  // bytes covered; 0 = merged away
};

struct bpe_merge {
  std::int32_t rank;
  std::int32_t pos;
  token_id new_id;
  // std::priority_queue is a max-heap: "less" means lower priority.
  bool operator<(const bpe_merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
};

}  // namespace

void bpe_model::encode_word(std::string_view word, std::vector<token_id>& out) const {
  if (word.empty()) return;
  if (ignore_merges) {
    if (auto id = find_token(vocab, word)) {
      out.push_back(*id);
      return;
    }
  }
  std::vector<symbol> syms;
  syms.reserve(word.size());
  auto add = [&](token_id id, std::size_t len) {
    const auto n = static_cast<std::int32_t>(syms.size());
    syms.push_back({id, n - 1, n + 1, len});
  };
  std::optional<std::pair<token_id, std::size_t>> pending_unk;
  auto flush_unk = [&] {
    if (pending_unk) add(pending_unk->first, pending_unk->second);
    pending_unk.reset();
  };
  char32_t cp = 0;
  for (std::size_t i = 0; i < word.size();) {
    std::size_t len = unicode::decode_utf8(word, i, cp);
    if (len == 0) len = 1;  // inputs are validated; keep going on a stray byte
    const std::string_view ch = word.substr(i, len);
    i += len;
    if (auto id = find_token(vocab, ch)) {
      flush_unk();
      add(*id, len);
      continue;
    }
    if (byte_fallback) {
      bool all = true;
      for (char c : ch) all = all && byte_tokens[static_cast<unsigned char>(c)] >= 0;
      if (all) {
        flush_unk();  // (tokenizers emits a pending unk after the bytes; we keep text order)
        for (char c : ch) add(byte_tokens[static_cast<unsigned char>(c)], 1);
        continue;
      }
    }
    if (!unk) continue;  // no unknown token: the character is dropped, as tokenizers does
    if (pending_unk && fuse_unk) {
      pending_unk->second += len;
    } else {
      flush_unk();
      pending_unk = std::make_pair(*unk, len);
    }
  }
  flush_unk();
  if (syms.empty()) return;
  syms.back().next = -1;

  std::priority_queue<bpe_merge> queue;
  auto lookup = [&](std::size_t a, std::size_t b) -> const std::pair<std::int32_t, token_id>* {
    auto it = merges.find(key(syms[a].id, syms[b].id));
    return it == merges.end() ? nullptr : &it->second;
  };
  for (std::size_t i = 0; i + 1 < syms.size(); ++i)
    if (auto m = lookup(i, i + 1)) queue.push({m->first, static_cast<std::int32_t>(i), m->second});
  while (!queue.empty()) {
    const bpe_merge top = queue.top();
    queue.pop();
    symbol& cur = syms[static_cast<std::size_t>(top.pos)];
    if (cur.len == 0 || cur.next < 0) continue;
    const auto next_pos = static_cast<std::size_t>(cur.next);
    const auto* m = lookup(static_cast<std::size_t>(top.pos), next_pos);
    if (m == nullptr || m->second != top.new_id) continue;  // stale entry
    cur.id = top.new_id;
    cur.len += syms[next_pos].len;
    cur.next = syms[next_pos].next;
    syms[next_pos].len = 0;
    if (cur.next >= 0) syms[static_cast<std::size_t>(cur.next)].prev = top.pos;
    if (cur.prev >= 0)
      if (auto pm = lookup(static_cast<std::size_t>(cur.prev), static_cast<std::size_t>(top.pos)))
        queue.push({pm->first, cur.prev, pm->second});
    if (cur.next >= 0)
      if (auto nm = lookup(static_cast<std::size_t>(top.pos), static_cast<std::size_t>(cur.next)))
        queue.push({nm->first, top.pos, nm->second});
  }
  for (const symbol& s : syms)
    if (s.len > 0) out.push_back(s.id);
}

namespace {

struct spm_symbol {
  std::size_t start;
  std::size_t len;  // 0 = merged away
  std::int32_t prev;
  std::int32_t next;
};

struct spm_bigram {
  float score;
  std::int32_t left;
  std::int32_t right;
  std::size_t size;
  bool operator<(const spm_bigram& o) const {
    return score != o.score ? score < o.score : left > o.left;
  }
};

}  // namespace

void spm_model::encode(std::string_view text, std::vector<token_id>& out) const {
  if (text.empty()) return;
  std::vector<spm_symbol> syms;
  char32_t cp = 0;
  for (std::size_t i = 0; i < text.size();) {
    std::size_t len = unicode::decode_utf8(text, i, cp);
    if (len == 0) len = 1;
    const auto n = static_cast<std::int32_t>(syms.size());
    syms.push_back({i, len, n - 1, n + 1});
    i += len;
  }
  syms.back().next = -1;
  std::priority_queue<spm_bigram> queue;
  auto try_add = [&](std::int32_t left, std::int32_t right) {
    if (left < 0 || right < 0) return;
    const spm_symbol& l = syms[static_cast<std::size_t>(left)];
    const spm_symbol& r = syms[static_cast<std::size_t>(right)];
    const std::string_view piece = text.substr(l.start, l.len + r.len);
    auto id = find_token(vocab, piece);
    if (!id || static_cast<std::size_t>(*id) >= scores.size()) return;
    queue.push({scores[static_cast<std::size_t>(*id)], left, right, piece.size()});
  };
  for (std::size_t i = 1; i < syms.size(); ++i)
    try_add(static_cast<std::int32_t>(i - 1), static_cast<std::int32_t>(i));
  while (!queue.empty()) {
    const spm_bigram b = queue.top();
    queue.pop();
    spm_symbol& l = syms[static_cast<std::size_t>(b.left)];
    spm_symbol& r = syms[static_cast<std::size_t>(b.right)];
    if (l.len == 0 || r.len == 0 || l.len + r.len != b.size) continue;
    l.len += r.len;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[static_cast<std::size_t>(r.next)].prev = b.left;
    try_add(l.prev, b.left);
    try_add(b.left, l.next);
  }
  for (std::int32_t i = 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next) {
    const spm_symbol& s = syms[static_cast<std::size_t>(i)];
    const std::string_view piece = text.substr(s.start, s.len);
    if (auto id = find_token(vocab, piece)) {
      out.push_back(*id);
      continue;
    }
    for (char c : piece) {
      const token_id b = byte_tokens[static_cast<unsigned char>(c)];
      if (b >= 0) {
        out.push_back(b);
      } else if (unk) {
        out.push_back(*unk);
      }
    }
  }
}

}  // namespace troupe::models::detail
