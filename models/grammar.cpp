#include "models/grammar.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

namespace troupe::models {

namespace {

using range = std::pair<std::uint32_t, std::uint32_t>;
constexpr std::uint32_t max_code_point = 0x10FFFF;

// -- UTF-8 -----------------------------------------------------------------------------------

// The length of a UTF-8 sequence from its first byte (0: not a first byte).
int utf8_length(unsigned char b) {
  if (b < 0x80) return 1;
  if ((b & 0xE0) == 0xC0) return b >= 0xC2 ? 2 : 0;
  if ((b & 0xF0) == 0xE0) return 3;
  if ((b & 0xF8) == 0xF0) return b <= 0xF4 ? 4 : 0;
  return 0;
}

// Decodes a whole sequence (its length checked by the caller); -1 when
// malformed (overlong, surrogate, past U+10FFFF).
std::int64_t utf8_decode(std::string_view s) {
  const auto b0 = static_cast<unsigned char>(s[0]);
  if (s.size() == 1) return b0;
  std::uint32_t cp = b0 & (0xFF >> (s.size() + 1));
  for (std::size_t i = 1; i < s.size(); ++i) {
    const auto b = static_cast<unsigned char>(s[i]);
    if ((b & 0xC0) != 0x80) return -1;
    cp = (cp << 6) | (b & 0x3F);
  }
  static constexpr std::uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < least[s.size()] || cp > max_code_point || (cp >= 0xD800 && cp <= 0xDFFF)) return -1;
  return cp;
}

// The code points a partial sequence can still become: [lo, hi].
std::optional<range> utf8_span(std::string_view partial) {
  const int n = utf8_length(static_cast<unsigned char>(partial[0]));
  if (n <= 1 || static_cast<int>(partial.size()) >= n) return std::nullopt;
  std::uint32_t cp = static_cast<unsigned char>(partial[0]) & (0xFF >> (n + 1));
  for (std::size_t i = 1; i < partial.size(); ++i) {
    const auto b = static_cast<unsigned char>(partial[i]);
    if ((b & 0xC0) != 0x80) return std::nullopt;
    cp = (cp << 6) | (b & 0x3F);
  }
  const int left = n - static_cast<int>(partial.size());
  const std::uint32_t lo = cp << (6 * left);
  const std::uint32_t hi = lo | ((1u << (6 * left)) - 1);
  return range{lo, std::min(hi, max_code_point)};
}

// A backslash escape's character, for GBNF and regexes alike: \n \t \r \f
// \v, else the character itself.
std::uint32_t unescape(char e) {
  switch (e) {
    case 'n':
      return '\n';
    case 't':
      return '\t';
    case 'r':
      return '\r';
    case 'f':
      return '\f';
    case 'v':
      return '\v';
    default:
      return static_cast<unsigned char>(e);
  }
}

}  // namespace

bool grammar::element::matches(std::uint32_t cp) const {
  bool in = false;
  for (const auto& [lo, hi] : set)
    if (cp >= lo && cp <= hi) {
      in = true;
      break;
    }
  return in != negated;
}

// -- GBNF ------------------------------------------------------------------------------------

class gbnf_parser {
 public:
  gbnf_parser(std::string_view src, const grammar_limits& limits) : s_(src), lim_(limits) {}

  result<std::shared_ptr<const grammar>> run() {
    if (s_.size() > lim_.max_bytes)
      return fail("the grammar is larger than " + std::to_string(lim_.max_bytes) + " bytes");
    skip_space(true);
    while (pos_ < s_.size() && error_.empty()) {
      parse_rule();
      skip_space(true);
    }
    if (!error_.empty()) return make_error(errc::invalid_argument, "grammar: " + error_);
    for (std::size_t r = 0; r < defined_.size(); ++r)
      if (!defined_[r])
        return make_error(errc::invalid_argument,
                          "grammar: rule '" + names_[r] + "' is used but not defined");
    auto it = ids_.find("root");
    if (it == ids_.end()) return make_error(errc::invalid_argument, "grammar: no 'root' rule");
    // Flatten.
    auto g = std::make_shared<grammar>();
    g->limits_ = lim_;
    g->names_ = names_;
    g->root_ = it->second;
    g->alts_.resize(rules_.size());
    std::size_t total = 0;
    for (const auto& alts : rules_)
      for (const auto& seq : alts) total += seq.size() + 1;
    if (total > lim_.max_elements)
      return make_error(errc::invalid_argument,
                        "grammar: more than " + std::to_string(lim_.max_elements) + " elements");
    for (std::size_t r = 0; r < rules_.size(); ++r)
      for (const auto& seq : rules_[r]) {
        g->alts_[r].push_back(static_cast<std::int32_t>(g->elems_.size()));
        for (const auto& e : seq) g->elems_.push_back(e);
        g->elems_.push_back(grammar::element{});
      }
    if (auto why = left_recursion(*g); !why.empty())
      return make_error(errc::invalid_argument, "grammar: " + why);
    return std::shared_ptr<const grammar>(std::move(g));
  }

 private:
  using element = grammar::element;
  using sequence = std::vector<element>;

  result<std::shared_ptr<const grammar>> fail(std::string why) {
    return make_error(errc::invalid_argument, "grammar: " + why);
  }
  void error(std::string why) {
    if (error_.empty()) error_ = why + " (at byte " + std::to_string(pos_) + ")";
  }

  std::int32_t rule_id(const std::string& name) {
    auto [it, fresh] = ids_.emplace(name, static_cast<std::int32_t>(names_.size()));
    if (fresh) {
      names_.push_back(name);
      rules_.emplace_back();
      defined_.push_back(false);
    }
    return it->second;
  }
  std::int32_t fresh_rule(const std::string& base) {
    std::string name;
    do name = base + "/" + std::to_string(++generated_);  // "/": never a user rule
    while (ids_.count(name));
    const auto id = rule_id(name);
    defined_[static_cast<std::size_t>(id)] = true;
    return id;
  }
  bool too_big() {
    if (rules_.size() > lim_.max_rules) {
      error("more than " + std::to_string(lim_.max_rules) + " rules");
      return true;
    }
    if (count_ > lim_.max_elements) {
      error("more than " + std::to_string(lim_.max_elements) + " elements");
      return true;
    }
    return false;
  }

  void skip_space(bool newlines) {
    while (pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == '#') {
        while (pos_ < s_.size() && s_[pos_] != '\n') ++pos_;
      } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n')) {
        ++pos_;
      } else {
        break;
      }
    }
  }
  static bool name_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '_';
  }
  std::string parse_name() {
    const auto start = pos_;
    while (pos_ < s_.size() && name_char(s_[pos_])) ++pos_;
    if (pos_ == start) error("a rule name was expected");
    return std::string(s_.substr(start, pos_ - start));
  }

  void parse_rule() {
    const auto name = parse_name();
    if (!error_.empty()) return;
    skip_space(false);
    if (s_.substr(pos_, 3) != "::=") return error("'::=' was expected after '" + name + "'");
    pos_ += 3;
    const auto id = rule_id(name);
    if (defined_[static_cast<std::size_t>(id)])
      return error("rule '" + name + "' is defined twice");
    defined_[static_cast<std::size_t>(id)] = true;
    auto alts = parse_alternatives(name, false);
    rules_[static_cast<std::size_t>(id)] = std::move(alts);
    skip_space(false);
    if (pos_ < s_.size() && s_[pos_] != '\n' && error_.empty())
      error("unexpected '" + std::string(1, s_[pos_]) + "'");
  }

  std::vector<sequence> parse_alternatives(const std::string& rule, bool nested) {
    std::vector<sequence> alts;
    alts.push_back(parse_sequence(rule, nested));
    while (error_.empty()) {
      skip_space(nested);
      if (pos_ < s_.size() && s_[pos_] == '|') {
        ++pos_;
        skip_space(true);
        alts.push_back(parse_sequence(rule, nested));
      } else {
        break;
      }
    }
    return alts;
  }

  // A code point of a literal or class, with escapes.
  std::uint32_t parse_char() {
    if (pos_ >= s_.size()) {
      error("unexpected end");
      return 0;
    }
    if (s_[pos_] == '\\') {
      ++pos_;
      if (pos_ >= s_.size()) {
        error("unexpected end after '\\'");
        return 0;
      }
      const char c = s_[pos_++];
      auto hex = [&](int n) -> std::uint32_t {
        std::uint32_t v = 0;
        for (int i = 0; i < n; ++i) {
          if (pos_ >= s_.size() || !std::isxdigit(static_cast<unsigned char>(s_[pos_]))) {
            error("a hex digit was expected");
            return 0;
          }
          const char h = s_[pos_++];
          v = v * 16 + static_cast<std::uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                      ? h - '0'
                                                      : (std::tolower(h) - 'a' + 10));
        }
        if (v > max_code_point) error("a code point past U+10FFFF");
        return v;
      };
      if (c == 'x') return hex(2);
      if (c == 'u') return hex(4);
      if (c == 'U') return hex(8);
      return unescape(c);  // \n \t ..., or the character itself (\\ \" \[ \] \-)
    }
    const int n = utf8_length(static_cast<unsigned char>(s_[pos_]));
    if (n == 0 || pos_ + static_cast<std::size_t>(n) > s_.size()) {
      error("invalid UTF-8");
      return 0;
    }
    const auto cp = utf8_decode(s_.substr(pos_, static_cast<std::size_t>(n)));
    if (cp < 0) {
      error("invalid UTF-8");
      return 0;
    }
    pos_ += static_cast<std::size_t>(n);
    return static_cast<std::uint32_t>(cp);
  }

  sequence parse_sequence(const std::string& rule, bool nested) {
    sequence seq;
    while (error_.empty() && !too_big()) {
      skip_space(nested);
      if (pos_ >= s_.size()) break;
      const char c = s_[pos_];
      const auto last = seq.size();
      if (c == '"') {
        ++pos_;
        while (error_.empty() && pos_ < s_.size() && s_[pos_] != '"') {
          const auto cp = parse_char();
          element e;
          e.kind = element::chars;
          e.set = {{cp, cp}};
          seq.push_back(std::move(e));
          ++count_;
        }
        if (pos_ >= s_.size()) return error("an unterminated literal"), seq;
        ++pos_;
        if (seq.size() - last > 1 && peek_repeat()) {
          // A repetition applies to the whole literal: make it one rule.
          sequence lit(seq.begin() + static_cast<std::ptrdiff_t>(last), seq.end());
          seq.resize(last);
          const auto id = fresh_rule(rule);
          rules_[static_cast<std::size_t>(id)] = {std::move(lit)};
          seq.push_back(ref(id));
        }
      } else if (c == '[') {
        ++pos_;
        element e;
        e.kind = element::chars;
        if (pos_ < s_.size() && s_[pos_] == '^') {
          e.negated = true;
          ++pos_;
        }
        while (error_.empty() && pos_ < s_.size() && s_[pos_] != ']') {
          const auto lo = parse_char();
          auto hi = lo;
          if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
            ++pos_;
            hi = parse_char();
          }
          if (hi < lo) return error("a character range runs backwards"), seq;
          e.set.emplace_back(lo, hi);
        }
        if (pos_ >= s_.size()) return error("an unterminated character class"), seq;
        ++pos_;
        seq.push_back(std::move(e));
        ++count_;
      } else if (c == '.') {
        ++pos_;
        element e;
        e.kind = element::chars;
        e.set = {{0, max_code_point}};
        seq.push_back(std::move(e));
        ++count_;
      } else if (c == '(') {
        ++pos_;
        skip_space(true);
        auto alts = parse_alternatives(rule, true);
        skip_space(true);
        if (pos_ >= s_.size() || s_[pos_] != ')') return error("')' was expected"), seq;
        ++pos_;
        const auto id = fresh_rule(rule);
        rules_[static_cast<std::size_t>(id)] = std::move(alts);
        seq.push_back(ref(id));
        ++count_;
      } else if (name_char(c)) {
        const auto save = pos_;
        const auto name = parse_name();
        skip_space(false);
        if (s_.substr(pos_, 3) == "::=") {  // the next rule starts (no newline between)
          pos_ = save;
          return error("a newline was expected before rule '" + name + "'"), seq;
        }
        pos_ = save + name.size();
        seq.push_back(ref(rule_id(name)));
        ++count_;
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (seq.empty()) return error("a repetition with nothing before it"), seq;
        element x = seq.back();
        seq.pop_back();
        std::size_t lo = 0, hi = 0;
        bool bounded = true;
        if (c == '{') {
          ++pos_;
          lo = parse_count();
          hi = lo;
          if (pos_ < s_.size() && s_[pos_] == ',') {
            ++pos_;
            if (pos_ < s_.size() && s_[pos_] == '}')
              bounded = false;
            else
              hi = parse_count();
          }
          if (pos_ >= s_.size() || s_[pos_] != '}') return error("'}' was expected"), seq;
          ++pos_;
          if (bounded && hi < lo) return error("{m,n} with n < m"), seq;
        } else {
          ++pos_;
          lo = c == '+' ? 1 : 0;
          hi = c == '?' ? 1 : 0;
          bounded = c == '?';
        }
        if (!error_.empty()) return seq;
        repeat(rule, seq, x, lo, hi, bounded);
      } else if (c == '|' || c == ')' || c == '\n') {
        break;
      } else {
        return error("unexpected '" + std::string(1, c) + "'"), seq;
      }
    }
    return seq;
  }

  bool peek_repeat() const {
    return pos_ < s_.size() &&
           (s_[pos_] == '*' || s_[pos_] == '+' || s_[pos_] == '?' || s_[pos_] == '{');
  }
  std::size_t parse_count() {
    std::size_t v = 0;
    const auto start = pos_;
    while (pos_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[pos_])) &&
           v <= lim_.max_repeat)
      v = v * 10 + static_cast<std::size_t>(s_[pos_++] - '0');
    if (pos_ == start) error("a count was expected");
    if (v > lim_.max_repeat) error("a repetition count past " + std::to_string(lim_.max_repeat));
    return v;
  }
  static element ref(std::int32_t id) {
    element e;
    e.kind = element::rule;
    e.ref = id;
    return e;
  }

  // x{lo,hi} (hi unbounded when !bounded) into `seq`: lo copies, then
  // either x* (a right-recursive rule) or hi - lo nested optionals.
  void repeat(const std::string& rule, sequence& seq, const element& x, std::size_t lo,
              std::size_t hi, bool bounded) {
    for (std::size_t i = 0; i < lo; ++i) seq.push_back(x);
    count_ += lo;
    if (!bounded) {
      const auto star = fresh_rule(rule);
      rules_[static_cast<std::size_t>(star)] = {{x, ref(star)}, {}};
      seq.push_back(ref(star));
      ++count_;
      return;
    }
    if (hi == lo) return;
    // opt_k ::= x opt_{k+1} | (empty), built from the innermost out.
    std::int32_t inner = -1;
    for (std::size_t k = 0; k < hi - lo && !too_big(); ++k) {
      const auto id = fresh_rule(rule);
      sequence more{x};
      if (inner >= 0) more.push_back(ref(inner));
      rules_[static_cast<std::size_t>(id)] = {std::move(more), {}};
      inner = id;
      count_ += 2;
    }
    seq.push_back(ref(inner));
  }

  // Left recursion (a rule that can reach itself before consuming a
  // character) would make the matcher loop: refused.
  static std::string left_recursion(const grammar& g) {
    const auto n = g.alts_.size();
    std::vector<bool> nullable(n, false);
    for (bool changed = true; changed;) {
      changed = false;
      for (std::size_t r = 0; r < n; ++r) {
        if (nullable[r]) continue;
        for (auto start : g.alts_[r]) {
          bool all = true;
          for (auto p = static_cast<std::size_t>(start); g.elems_[p].kind != element::end; ++p)
            if (g.elems_[p].kind == element::chars ||
                !nullable[static_cast<std::size_t>(g.elems_[p].ref)]) {
              all = false;
              break;
            }
          if (all) {
            nullable[r] = true;
            changed = true;
            break;
          }
        }
      }
    }
    // Edges r -> s where s can come first in r.
    std::vector<std::vector<std::int32_t>> first(n);
    for (std::size_t r = 0; r < n; ++r)
      for (auto start : g.alts_[r])
        for (auto p = static_cast<std::size_t>(start); g.elems_[p].kind == element::rule; ++p) {
          first[r].push_back(g.elems_[p].ref);
          if (!nullable[static_cast<std::size_t>(g.elems_[p].ref)]) break;
        }
    std::vector<int> mark(n, 0);  // 0 new, 1 on the path, 2 done
    std::string found;
    std::function<void(std::size_t)> visit = [&](std::size_t r) {
      mark[r] = 1;
      for (auto s : first[r]) {
        if (!found.empty()) return;
        const auto u = static_cast<std::size_t>(s);
        if (mark[u] == 1) found = "rule '" + g.names_[u] + "' is left-recursive";
        if (mark[u] == 0) visit(u);
      }
      mark[r] = 2;
    };
    for (std::size_t r = 0; r < n && found.empty(); ++r)
      if (mark[r] == 0) visit(r);
    return found;
  }

  std::string_view s_;
  grammar_limits lim_;
  std::size_t pos_ = 0;
  std::size_t count_ = 0;
  int generated_ = 0;
  std::string error_;
  std::map<std::string, std::int32_t> ids_;
  std::vector<std::string> names_;
  std::vector<std::vector<sequence>> rules_;
  std::vector<bool> defined_;
};

result<std::shared_ptr<const grammar>> grammar::parse(std::string_view gbnf,
                                                      const grammar_limits& limits) {
  return gbnf_parser(gbnf, limits).run();
}

// -- the vocabulary's trie -------------------------------------------------------------------

token_trie::token_trie(const std::vector<std::string>& pieces)
    : vocab_(pieces.size()), pieces_(pieces) {
  std::vector<std::map<std::uint8_t, std::int32_t>> kids(1);
  nodes_.emplace_back();
  for (std::size_t id = 0; id < pieces.size(); ++id) {
    const auto& p = pieces[id];
    if (p.empty()) continue;
    std::int32_t at = 0;
    for (unsigned char b : p) {
      auto& m = kids[static_cast<std::size_t>(at)];
      auto it = m.find(b);
      if (it == m.end()) {
        const auto fresh = static_cast<std::int32_t>(nodes_.size());
        nodes_.emplace_back();
        kids.emplace_back();
        kids[static_cast<std::size_t>(at)][b] = fresh;
        at = fresh;
      } else {
        at = it->second;
      }
    }
    nodes_[static_cast<std::size_t>(at)].tokens.push_back(static_cast<std::int32_t>(id));
  }
  for (std::size_t i = 0; i < nodes_.size(); ++i)
    nodes_[i].next.assign(kids[i].begin(), kids[i].end());
}

// -- matching --------------------------------------------------------------------------------

namespace {

using stack = std::vector<std::int32_t>;

// Every stack `s` can become with a character element (or nothing) on top:
// rule references are expanded, finished alternatives return.
void expand(const grammar& g, stack s, std::vector<stack>& out, std::set<stack>& seen,
            bool& overflow) {
  if (overflow) return;
  while (!s.empty() &&
         g.elements()[static_cast<std::size_t>(s.back())].kind == grammar::element::end) {
    s.pop_back();  // the alternative is done: back to where the rule was used
  }
  if (!s.empty()) {
    const auto& e = g.elements()[static_cast<std::size_t>(s.back())];
    if (e.kind == grammar::element::rule) {
      auto base = s;
      base.back() += 1;  // after the reference, once the rule is done
      for (auto start : g.alternatives(e.ref)) {
        auto t = base;
        t.push_back(start);
        expand(g, std::move(t), out, seen, overflow);
      }
      return;
    }
  }
  if (seen.insert(s).second) {
    if (out.size() >= g.limits().max_stacks) {
      overflow = true;
      return;
    }
    out.push_back(std::move(s));
  }
}

std::vector<stack> advance(const grammar& g, const std::vector<stack>& stacks, std::uint32_t cp,
                           bool& overflow) {
  std::vector<stack> out;
  std::set<stack> seen;
  for (const auto& s : stacks) {
    if (s.empty()) continue;
    const auto& e = g.elements()[static_cast<std::size_t>(s.back())];
    if (!e.matches(cp)) continue;
    auto t = s;
    t.back() += 1;
    expand(g, std::move(t), out, seen, overflow);
  }
  return out;
}

// Whether a character in [lo, hi] may come next in some stack.
bool may_continue(const grammar& g, const std::vector<stack>& stacks, range span) {
  for (const auto& s : stacks) {
    if (s.empty()) continue;
    const auto& e = g.elements()[static_cast<std::size_t>(s.back())];
    if (e.negated) return true;  // a negated set leaves almost every range open
    for (const auto& [lo, hi] : e.set)
      if (lo <= span.second && hi >= span.first) return true;
  }
  return false;
}

// Feeds bytes to (stacks, partial); false when they leave no stack.
bool feed(const grammar& g, std::vector<stack>& stacks, std::string& partial,
          std::string_view bytes, bool& overflow) {
  for (char ch : bytes) {
    partial.push_back(ch);
    const int n = utf8_length(static_cast<unsigned char>(partial[0]));
    if (n == 0) return false;
    if (static_cast<int>(partial.size()) < n) {
      const auto span = utf8_span(partial);
      if (!span || !may_continue(g, stacks, *span)) return false;
      continue;
    }
    const auto cp = utf8_decode(partial);
    partial.clear();
    if (cp < 0) return false;
    stacks = advance(g, stacks, static_cast<std::uint32_t>(cp), overflow);
    if (stacks.empty() || overflow) return false;
  }
  return true;
}

}  // namespace

grammar_state::grammar_state(std::shared_ptr<const grammar> g) : g_(std::move(g)) {
  std::set<stack> seen;
  for (auto start : g_->alternatives(g_->root()))
    expand(*g_, stack{start}, stacks_, seen, overflow_);
}

bool grammar_state::accept(std::string_view bytes) {
  auto stacks = stacks_;
  auto partial = partial_;
  bool overflow = false;
  if (!feed(*g_, stacks, partial, bytes, overflow)) return false;
  stacks_ = std::move(stacks);
  partial_ = std::move(partial);
  return true;
}

bool grammar_state::complete() const {
  if (!partial_.empty()) return false;
  return std::any_of(stacks_.begin(), stacks_.end(), [](const stack& s) { return s.empty(); });
}

bool grammar_state::finished() const {
  return complete() &&
         std::all_of(stacks_.begin(), stacks_.end(), [](const stack& s) { return s.empty(); });
}

std::vector<std::uint64_t> grammar_state::allowed(const token_trie& trie,
                                                  const std::vector<std::int64_t>& ends) const {
  std::vector<std::uint64_t> bits((trie.vocab() + 63) / 64, 0);
  auto allow = [&](std::int32_t id) {
    bits[static_cast<std::size_t>(id) / 64] |= std::uint64_t{1} << (static_cast<unsigned>(id) % 64);
  };
  if (complete())
    for (auto id : ends)
      if (id >= 0 && static_cast<std::size_t>(id) < trie.vocab())
        allow(static_cast<std::int32_t>(id));
  // Depth first over the trie, each node's state derived from its parent's.
  struct frame {
    std::int32_t node;
    std::vector<stack> stacks;
    std::string partial;
  };
  std::vector<frame> todo;
  todo.push_back({0, stacks_, partial_});
  const auto& nodes = trie.nodes();
  // A token that ends inside a character is allowed only when some token
  // finishes that character (a small vocabulary may lack the bytes: the
  // generation would reach a dead end).
  auto finishes = [&](const std::vector<stack>& stacks, const std::string& partial) {
    std::vector<frame> look;
    look.push_back({0, stacks, partial});
    for (int budget = 4096; !look.empty() && budget > 0; --budget) {
      auto f = std::move(look.back());
      look.pop_back();
      const auto& nd = nodes[static_cast<std::size_t>(f.node)];
      if (f.node != 0 && f.partial.empty() && !nd.tokens.empty()) return true;
      for (const auto& [byte, child] : nd.next) {
        auto st = f.stacks;
        auto pa = f.partial;
        bool overflow = false;
        const char b = static_cast<char>(byte);
        if (feed(*g_, st, pa, std::string_view(&b, 1), overflow))
          look.push_back({child, std::move(st), std::move(pa)});
      }
    }
    return false;
  };
  while (!todo.empty()) {
    auto f = std::move(todo.back());
    todo.pop_back();
    const auto& nd = nodes[static_cast<std::size_t>(f.node)];
    if (f.node != 0 && !nd.tokens.empty() && (f.partial.empty() || finishes(f.stacks, f.partial)))
      for (auto id : nd.tokens) allow(id);
    for (const auto& [byte, child] : nd.next) {
      auto stacks = f.stacks;
      auto partial = f.partial;
      bool overflow = false;
      const char b = static_cast<char>(byte);
      if (!feed(*g_, stacks, partial, std::string_view(&b, 1), overflow)) continue;
      todo.push_back({child, std::move(stacks), std::move(partial)});
    }
  }
  return bits;
}

// -- compilers -------------------------------------------------------------------------------

namespace {

// A GBNF literal for `s`.
std::string literal(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      static const char* hex = "0123456789ABCDEF";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

constexpr const char* json_primitives = R"(ws ::= [ ]?
json-string ::= "\"" json-char* "\""
json-char ::= [^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" json-hex4)
json-hex4 ::= [0-9a-cA-CeEfF] [0-9a-fA-F]{3} | [dD] [0-7] [0-9a-fA-F]{2}
json-integer ::= "-"? ("0" | [1-9] [0-9]{0,15})
json-number ::= json-integer ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?
json-boolean ::= "true" | "false"
json-null ::= "null"
json-value ::= json-object | json-array | json-string | json-number | json-boolean | json-null
json-object ::= "{" ws ( json-string ws ":" ws json-value ( ws "," ws json-string ws ":" ws json-value )* ws )? "}"
json-array ::= "[" ws ( json-value ( ws "," ws json-value )* ws )? "]"
)";

// -- regular expressions -----------------------------------------------------------------------

// A regex as GBNF: its root expression and its group rules (named
// prefix + N). In JSON mode the regex describes a JSON string's content:
// quotes, backslashes and control characters are never produced raw
// (classes lose them; literal ones are written escaped).
class regex_compiler {
 public:
  regex_compiler(std::string_view re, std::string prefix, bool json)
      : s_(re), prefix_(std::move(prefix)), json_(json) {}

  struct output {
    std::string root;
    std::vector<std::pair<std::string, std::string>> rules;
  };

  result<output> run() {
    if (s_.size() > 4096)
      return make_error(errc::invalid_argument, "regex: longer than 4096 bytes");
    if (!s_.empty() && s_.front() == '^') ++pos_;
    auto body = alternation();
    if (error_.empty() && pos_ < s_.size())
      error_ = "unexpected '" + std::string(1, s_[pos_]) + "'";
    if (!error_.empty()) return make_error(errc::invalid_argument, "regex: " + error_);
    output out;
    out.root = body.empty() ? std::string("\"\"") : body;
    for (std::size_t i = 0; i < rules_.size(); ++i)
      out.rules.emplace_back(prefix_ + std::to_string(i), rules_[i]);
    return out;
  }

 private:
  std::string alternation() {
    std::string out = sequence();
    while (error_.empty() && pos_ < s_.size() && s_[pos_] == '|') {
      ++pos_;
      auto x = sequence();
      out = (out.empty() ? "\"\"" : out) + " | " + (x.empty() ? std::string("\"\"") : x);
    }
    return out;
  }
  std::string sequence() {
    std::string out;
    while (error_.empty() && pos_ < s_.size()) {
      const char c = s_[pos_];
      if (c == '|' || c == ')') break;
      if (c == '$' && pos_ + 1 == s_.size()) {
        ++pos_;
        break;
      }
      std::string a = atom();
      if (!error_.empty()) break;
      if (pos_ < s_.size()) {
        const char q = s_[pos_];
        if (q == '*' || q == '+' || q == '?') {
          a = "(" + a + ")" + q;
          ++pos_;
        } else if (q == '{') {
          const auto close = s_.find('}', pos_);
          if (close == std::string_view::npos) {
            error_ = "an unterminated {m,n}";
            break;
          }
          const auto inner = s_.substr(pos_ + 1, close - pos_ - 1);
          bool ok = !inner.empty() && inner.front() != ',';
          for (char d : inner) ok = ok && (std::isdigit(static_cast<unsigned char>(d)) || d == ',');
          if (!ok) {
            error_ = "a malformed {m,n}";
            break;
          }
          a = "(" + a + "){" + std::string(inner) + "}";
          pos_ = close + 1;
        }
        if (pos_ < s_.size() && (s_[pos_] == '?' || s_[pos_] == '+'))  // lazy, possessive
          ++pos_;
      }
      out += (out.empty() ? "" : " ") + a;
    }
    return out;
  }

  static void add_shorthand(char c, std::vector<range>& set) {
    switch (c) {
      case 'd':
        set.push_back({'0', '9'});
        break;
      case 'w':
        set.insert(set.end(), {{'a', 'z'}, {'A', 'Z'}, {'0', '9'}, {'_', '_'}});
        break;
      case 's':
        set.insert(set.end(), {{' ', ' '}, {'\t', '\r'}});
        break;
      default:
        break;
    }
  }
  // A set as a GBNF class; in JSON mode without ", \ and controls.
  std::string render(std::vector<range> set, bool negated) const {
    if (json_) {
      if (negated) {
        set.insert(set.end(), {{0, 0x1F}, {'"', '"'}, {'\\', '\\'}});
      } else {
        std::vector<range> kept;
        for (auto [lo, hi] : set) {
          lo = std::max<std::uint32_t>(lo, 0x20);
          for (std::uint32_t cut : {std::uint32_t{'"'}, std::uint32_t{'\\'}}) {
            if (lo < cut && hi >= cut) {
              kept.push_back({lo, cut - 1});
              lo = cut + 1;
            } else if (lo == cut) {
              lo = cut + 1;
            }
          }
          if (lo <= hi) kept.push_back({lo, hi});
        }
        if (kept.empty()) return "";
        set = std::move(kept);
      }
    }
    std::string out = negated ? "[^" : "[";
    for (auto [lo, hi] : set) {
      out += class_char(lo);
      if (hi != lo) out += "-" + class_char(hi);
    }
    return out + "]";
  }
  static std::string class_char(std::uint32_t c) {
    if (c < 0x20 || c == 0x7F || c == ']' || c == '[' || c == '\\' || c == '-' || c == '^' ||
        c == '"') {
      static const char* hex = "0123456789ABCDEF";
      return std::string("\\x") + hex[(c >> 4) & 15] + hex[c & 15];
    }
    return utf8(c);
  }
  static std::string utf8(std::uint32_t c) {
    std::string out;
    if (c < 0x80) {
      out += static_cast<char>(c);
    } else if (c < 0x800) {
      out += static_cast<char>(0xC0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      out += static_cast<char>(0xE0 | (c >> 12));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (c >> 18));
      out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (c & 0x3F));
    }
    return out;
  }
  // One code point of the pattern (UTF-8).
  std::uint32_t next_char() {
    const int n = utf8_length(static_cast<unsigned char>(s_[pos_]));
    if (n == 0 || pos_ + static_cast<std::size_t>(n) > s_.size()) {
      error_ = "invalid UTF-8";
      ++pos_;
      return 0;
    }
    const auto cp = utf8_decode(s_.substr(pos_, static_cast<std::size_t>(n)));
    pos_ += static_cast<std::size_t>(n);
    if (cp < 0) error_ = "invalid UTF-8";
    return cp < 0 ? 0 : static_cast<std::uint32_t>(cp);
  }
  std::string char_literal(std::uint32_t c) const {
    if (json_) {
      if (c == '"') return literal("\\\"");
      if (c == '\\') return literal("\\\\");
      if (c == '\n') return literal("\\n");
      if (c == '\t') return literal("\\t");
      if (c == '\r') return literal("\\r");
      if (c < 0x20) {
        static const char* hex = "0123456789abcdef";
        return literal(std::string("\\u00") + hex[c >> 4] + hex[c & 15]);
      }
    }
    return literal(utf8(c));
  }
  std::string nonempty(std::string cls) {
    if (cls.empty()) error_ = "a class that matches nothing a JSON string may hold raw";
    return cls;
  }

  std::string atom() {
    const char c = s_[pos_];
    if (c == '(') {
      ++pos_;
      if (s_.substr(pos_, 2) == "?:") {
        pos_ += 2;
      } else if (pos_ < s_.size() && s_[pos_] == '?') {
        error_ = "lookarounds and named groups are not supported";
        return "";
      }
      auto inner = alternation();
      if (pos_ >= s_.size() || s_[pos_] != ')') {
        error_ = "')' was expected";
        return "";
      }
      ++pos_;
      if (rules_.size() >= 1024) {
        error_ = "more than 1024 groups";
        return "";
      }
      rules_.push_back(inner.empty() ? "\"\"" : inner);
      return prefix_ + std::to_string(rules_.size() - 1);
    }
    if (c == '[') {
      ++pos_;
      bool neg = false;
      if (pos_ < s_.size() && s_[pos_] == '^') {
        neg = true;
        ++pos_;
      }
      std::vector<range> set;
      bool first = true;
      while (error_.empty() && pos_ < s_.size() && (s_[pos_] != ']' || first)) {
        first = false;
        std::uint32_t lo = 0;
        if (s_[pos_] == '\\' && pos_ + 1 < s_.size()) {
          const char e = s_[pos_ + 1];
          pos_ += 2;
          if (e == 'd' || e == 'w' || e == 's') {
            add_shorthand(e, set);
            continue;
          }
          lo = unescape(e);
        } else {
          lo = next_char();
        }
        auto hi = lo;
        if (pos_ + 1 < s_.size() && s_[pos_] == '-' && s_[pos_ + 1] != ']') {
          ++pos_;
          if (s_[pos_] == '\\' && pos_ + 1 < s_.size()) {
            hi = unescape(s_[pos_ + 1]);
            pos_ += 2;
          } else {
            hi = next_char();
          }
          if (hi < lo) error_ = "a class range runs backwards";
        }
        set.push_back({lo, hi});
      }
      if (pos_ >= s_.size()) {
        error_ = "an unterminated class";
        return "";
      }
      ++pos_;
      return nonempty(render(std::move(set), neg));
    }
    if (c == '.') {
      ++pos_;
      return render({{'\n', '\n'}}, true);
    }
    if (c == '\\') {
      if (pos_ + 1 >= s_.size()) {
        error_ = "a trailing '\\'";
        return "";
      }
      const char e = s_[pos_ + 1];
      pos_ += 2;
      std::vector<range> set;
      const char lower = static_cast<char>(std::tolower(static_cast<unsigned char>(e)));
      if (lower == 'd' || lower == 'w' || lower == 's') {
        add_shorthand(lower, set);
        return nonempty(render(std::move(set), e != lower));
      }
      if (e == 'b' || e == 'B' || std::isdigit(static_cast<unsigned char>(e))) {
        error_ = "word boundaries and back-references are not supported";
        return "";
      }
      return char_literal(unescape(e));
    }
    if (c == '*' || c == '+' || c == '?' || c == '{') {
      error_ = "a repetition with nothing before it";
      return "";
    }
    return char_literal(next_char());
  }

  std::string_view s_;
  std::string prefix_;
  bool json_;
  std::size_t pos_ = 0;
  std::string error_;
  std::vector<std::string> rules_;
};

class schema_compiler {
 public:
  /// `prefix` starts every rule it makes (several schemas in one grammar).
  explicit schema_compiler(const nlohmann::ordered_json& root, std::string prefix = "")
      : root_(root), prefix_(std::move(prefix)) {}

  /// The schema's expression and the rules it uses (the JSON primitives
  /// left out).
  result<std::pair<std::string, std::string>> parts() {
    auto r = rule_for(root_, "root");
    if (!error_.empty()) return make_error(errc::invalid_argument, "json_schema: " + error_);
    std::string rules;
    for (const auto& [name, body] : rules_) rules += name + " ::= " + body + "\n";
    return std::pair{r, rules};
  }

  result<std::string> run() {
    auto r = rule_for(root_, "root");
    if (!error_.empty()) return make_error(errc::invalid_argument, "json_schema: " + error_);
    std::string out = "root ::= " + r + "\n";
    for (const auto& [name, body] : rules_) out += name + " ::= " + body + "\n";
    return out + json_primitives;
  }

 private:
  using json = nlohmann::ordered_json;

  void fail(const std::string& why, const std::string& where) {
    if (error_.empty()) error_ = where + ": " + why;
  }
  std::string add(const std::string& hint, std::string body) {
    std::string name;
    for (char c : hint) name += (std::isalnum(static_cast<unsigned char>(c)) ? c : '-');
    if (name.empty() || name.size() > 40) name = "s";
    name = prefix_ + name;
    std::string unique = name;
    for (int i = 1;
         rules_.count(unique) || unique == "root" || unique.starts_with("json-") || unique == "ws";
         ++i)
      unique = name + "-" + std::to_string(i);
    rules_[unique] = std::move(body);
    return unique;
  }

  // An expression matching the schema `s`.
  std::string rule_for(const json& s, const std::string& where) {
    if (!error_.empty()) return "\"\"";
    if (++depth_ > 64) {
      fail("the schema nests deeper than 64", where);
      return "\"\"";
    }
    struct leave {
      int& d;
      ~leave() { --d; }
    } left{depth_};
    if (s.is_boolean()) {
      if (s.get<bool>()) return "json-value";
      fail("false matches nothing", where);
      return "\"\"";
    }
    if (!s.is_object()) {
      fail("a schema must be an object", where);
      return "\"\"";
    }
    static const std::set<std::string> known = {
        "type",      "properties", "required",    "additionalProperties",
        "items",     "enum",       "const",       "anyOf",
        "$ref",      "$defs",      "definitions", "description",
        "title",     "default",    "examples",    "$schema",
        "$id",       "$comment",   "minItems",    "maxItems",
        "minLength", "maxLength",  "pattern",     "nullable",
        "strict",    "name"};
    for (const auto& [k, v] : s.items())
      if (!known.count(k)) {
        fail("the keyword '" + k.substr(0, 64) +
                 "' is not supported (troupe enforces type, properties, required, "
                 "additionalProperties, items, minItems, maxItems, enum, const, anyOf, $ref, "
                 "$defs, minLength, maxLength and pattern)",
             where);
        return "\"\"";
      }
    if (auto r = s.find("$ref"); r != s.end()) return ref(*r, where);
    if (auto e = s.find("const"); e != s.end()) return literal(e->dump());
    if (auto e = s.find("enum"); e != s.end()) {
      if (!e->is_array() || e->empty()) {
        fail("enum must be a non-empty array", where);
        return "\"\"";
      }
      std::string alts;
      for (const auto& v : *e) alts += (alts.empty() ? "" : " | ") + literal(v.dump());
      return "(" + alts + ")";
    }
    if (auto a = s.find("anyOf"); a != s.end()) {
      if (!a->is_array() || a->empty()) {
        fail("anyOf must be a non-empty array", where);
        return "\"\"";
      }
      std::string alts;
      for (std::size_t i = 0; i < a->size(); ++i)
        alts += (i ? " | " : "") + rule_for((*a)[i], where + ".anyOf[" + std::to_string(i) + "]");
      return "(" + alts + ")";
    }
    auto t = s.find("type");
    if (t == s.end()) return "json-value";  // no constraint
    if (t->is_array()) {
      std::string alts;
      for (const auto& one : *t) {
        auto copy = s;
        copy["type"] = one;
        alts += (alts.empty() ? "" : " | ") + rule_for(copy, where);
      }
      return alts.empty() ? "json-value" : "(" + alts + ")";
    }
    if (!t->is_string()) {
      fail("type must be a string or an array of strings", where);
      return "\"\"";
    }
    const auto type = t->get<std::string>();
    if (type == "string") return string_rule(s, where);
    if (type == "integer") return "json-integer";
    if (type == "number") return "json-number";
    if (type == "boolean") return "json-boolean";
    if (type == "null") return "json-null";
    if (type == "array") return array_rule(s, where);
    if (type == "object") return object_rule(s, where);
    fail("unknown type '" + type.substr(0, 32) + "'", where);
    return "\"\"";
  }

  std::string ref(const json& r, const std::string& where) {
    if (!r.is_string()) {
      fail("$ref must be a string", where);
      return "\"\"";
    }
    const auto path = r.get<std::string>();
    const json* target = nullptr;
    for (const char* prefix : {"#/$defs/", "#/definitions/"}) {
      const std::string p = prefix;
      if (path.rfind(p, 0) != 0) continue;
      const auto key = path.substr(p.size());
      const auto defs = p == "#/$defs/" ? "$defs" : "definitions";
      if (root_.contains(defs) && root_[defs].is_object() && root_[defs].contains(key))
        target = &root_[defs][key];
    }
    if (path == "#") target = &root_;
    if (!target) {
      fail("$ref '" + path.substr(0, 64) + "' is not a local #/$defs/ name", where);
      return "\"\"";
    }
    if (auto it = refs_.find(path); it != refs_.end()) return it->second;
    // Named first, so that a recursive schema refers to itself.
    const auto name = add("ref-" + path.substr(path.rfind('/') + 1), "\"\"");
    refs_[path] = name;
    rules_[name] = rule_for(*target, path);
    return name;
  }

  std::string string_rule(const json& s, const std::string& where) {
    auto count = [&](const char* key, std::size_t fallback) -> std::size_t {
      auto it = s.find(key);
      if (it == s.end()) return fallback;
      if (!it->is_number_unsigned() || it->get<std::size_t>() > 1000) {
        fail(std::string(key) + " must be an integer in [0, 1000]", where);
        return fallback;
      }
      return it->get<std::size_t>();
    };
    if (auto p = s.find("pattern"); p != s.end()) {
      if (s.contains("minLength") || s.contains("maxLength")) {
        fail("pattern with minLength or maxLength is not supported", where);
        return "\"\"";
      }
      if (!p->is_string()) {
        fail("pattern must be a string", where);
        return "\"\"";
      }
      auto re = regex_compiler(p->get<std::string>(),
                               prefix_ + "re" + std::to_string(++regexes_) + "-", true)
                    .run();
      if (!re) {
        fail(re.error().message, where + ".pattern");
        return "\"\"";
      }
      for (auto& [name, body] : re->rules) rules_[name] = body;
      // The pattern describes the string's content, between its quotes.
      return "\"\\\"\" (" + re->root + ") \"\\\"\"";
    }
    const auto lo = count("minLength", 0);
    const bool bounded = s.contains("maxLength");
    const auto hi = count("maxLength", 0);
    if (bounded && hi < lo) {
      fail("maxLength < minLength", where);
      return "\"\"";
    }
    if (!bounded && lo == 0) return "json-string";
    return "\"\\\"\" json-char{" + std::to_string(lo) + "," + (bounded ? std::to_string(hi) : "") +
           "} \"\\\"\"";
  }

  std::string array_rule(const json& s, const std::string& where) {
    std::string item = "json-value";
    if (auto it = s.find("items"); it != s.end()) item = rule_for(*it, where + ".items");
    std::size_t lo = 0, hi = 0;
    bool bounded = false;
    if (auto m = s.find("minItems"); m != s.end()) {
      if (!m->is_number_unsigned() || m->get<std::size_t>() > 100)
        fail("minItems must be an integer in [0, 100]", where);
      else
        lo = m->get<std::size_t>();
    }
    if (auto m = s.find("maxItems"); m != s.end()) {
      if (!m->is_number_unsigned() || m->get<std::size_t>() > 100)
        fail("maxItems must be an integer in [0, 100]", where);
      else
        hi = m->get<std::size_t>(), bounded = true;
    }
    if (bounded && hi < lo) fail("maxItems < minItems", where);
    if (!error_.empty()) return "\"\"";
    const auto name = add("item", item);
    const std::string more = "( ws \",\" ws " + name + " )";
    if (bounded && hi == 0) return "\"[\" ws \"]\"";
    std::string list;
    if (lo == 0) {
      list = "( " + name + " " + more +
             (bounded ? "{0," + std::to_string(hi - 1) + "}" : std::string("*")) + " )?";
    } else {
      list = name + " " + more + "{" + std::to_string(lo - 1) + "," +
             (bounded ? std::to_string(hi - 1) : "") + "}";
    }
    return "\"[\" ws " + list + " ws \"]\"";
  }

  std::string object_rule(const json& s, const std::string& where) {
    if (auto a = s.find("additionalProperties"); a != s.end() &&
                                                 !(a->is_boolean() && !a->get<bool>()) &&
                                                 !s.contains("properties") && !(a->is_boolean())) {
      fail("additionalProperties other than false is not supported", where);
      return "\"\"";
    }
    auto props = s.find("properties");
    if (props == s.end() || props->empty()) {
      if (s.contains("additionalProperties") && s["additionalProperties"] == false)
        return "\"{\" ws \"}\"";
      return "json-object";
    }
    if (!props->is_object()) {
      fail("properties must be an object", where);
      return "\"\"";
    }
    std::set<std::string> required;
    if (auto r = s.find("required"); r != s.end()) {
      if (!r->is_array()) {
        fail("required must be an array of names", where);
        return "\"\"";
      }
      for (const auto& n : *r) {
        if (!n.is_string() || !props->contains(n.get<std::string>())) {
          fail("required names a property it does not define", where);
          return "\"\"";
        }
        required.insert(n.get<std::string>());
      }
    }
    // Properties in their declared order; an optional one may be left out.
    std::vector<std::pair<std::string, bool>> kv;  // (rule of `"key": value`, required)
    for (const auto& [key, sub] : props->items()) {
      const auto value = rule_for(sub, where + ".properties." + key.substr(0, 64));
      kv.emplace_back(
          add("kv-" + key, literal(nlohmann::json(key).dump()) + " ws \":\" ws " + value),
          required.count(key) > 0);
    }
    // tail_i: the properties from i on, each after a comma.
    std::vector<std::string> tail(kv.size() + 1);
    tail[kv.size()] = "";
    for (std::size_t i = kv.size(); i-- > 0;) {
      const std::string one = "ws \",\" ws " + kv[i].first;
      const std::string rest = tail[i + 1].empty() ? "" : " " + tail[i + 1];
      tail[i] = add("tail", (kv[i].second ? one : "( " + one + " )?") + rest);
    }
    // The first property present may be any up to the first required one.
    std::string firsts;
    bool all_optional = true;
    for (std::size_t i = 0; i < kv.size(); ++i) {
      firsts += std::string(firsts.empty() ? "" : " | ") + kv[i].first +
                (i + 1 < kv.size() ? " " + tail[i + 1] : "");
      if (kv[i].second) {
        all_optional = false;
        break;
      }
    }
    return "\"{\" ws (" + firsts + ")" + (all_optional ? "?" : "") + " ws \"}\"";
  }

  const json& root_;
  std::string prefix_;
  std::map<std::string, std::string> rules_;
  std::map<std::string, std::string> refs_;
  std::string error_;
  int depth_ = 0;
  int regexes_ = 0;
};

}  // namespace

result<std::string> json_schema_to_gbnf(std::string_view schema) {
  // Ordered: properties are generated in the order the schema declares them.
  auto j = nlohmann::ordered_json::parse(schema, nullptr, false);
  if (j.is_discarded()) return make_error(errc::invalid_argument, "json_schema: not valid JSON");
  return schema_compiler(j).run();
}

result<std::string> tool_calls_gbnf(const std::vector<tool_spec>& tools, bool parallel) {
  if (tools.empty()) return make_error(errc::invalid_argument, "no tools");
  std::string calls, rules;
  for (std::size_t i = 0; i < tools.size(); ++i) {
    std::string args = "json-object";
    if (!tools[i].parameters.empty()) {
      auto j = nlohmann::ordered_json::parse(tools[i].parameters, nullptr, false);
      if (j.is_discarded())
        return make_error(errc::invalid_argument, tools[i].name + ": parameters: not valid JSON");
      auto p = schema_compiler(j, "t" + std::to_string(i) + "-").parts();
      if (!p) return make_error(errc::invalid_argument, tools[i].name + ": " + p.error().message);
      args = p->first;
      rules += p->second;
    }
    // Hermes-style: <tool_call>{"name": ..., "arguments": ...}</tool_call>.
    const auto name = nlohmann::json(tools[i].name).dump();
    calls += std::string(calls.empty() ? "" : " | ") + "\"{\\\"name\\\": \" " + literal(name) +
             " \", \\\"arguments\\\": \" " + args + " \"}\"";
  }
  std::string out = "root ::= call" + std::string(parallel ? " (\"\\n\" call)*" : "") + "\n";
  out += "call ::= \"<tool_call>\\n\" (" + calls + ") \"\\n</tool_call>\"\n";
  return out + rules + json_primitives;
}

std::string json_object_gbnf() {
  return std::string("root ::= json-object\n") + json_primitives;
}

result<std::string> regex_to_gbnf(std::string_view regex) {
  auto r = regex_compiler(regex, "re-", false).run();
  if (!r) return std::unexpected(r.error());
  std::string out = "root ::= " + r->root + "\n";
  for (const auto& [name, body] : r->rules) out += name + " ::= " + body + "\n";
  return out;
}

std::string choice_gbnf(const std::vector<std::string>& choices) {
  std::string alts;
  for (const auto& c : choices) alts += (alts.empty() ? "" : " | ") + literal(c);
  return "root ::= " + (alts.empty() ? std::string("\"\"") : alts) + "\n";
}

}  // namespace troupe::models
