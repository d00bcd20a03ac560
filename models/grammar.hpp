#pragma once

// Constrained decoding: a context-free grammar in llama.cpp's GBNF, the
// state of a generation inside it, and the set of tokens that may come
// next. Compilers turn JSON Schema (OpenAI's structured outputs) and
// regular expressions into GBNF; the scheduler keeps one grammar_state per
// constrained request and sends the last stage each step's allowed tokens.
//
// The matcher follows llama.cpp's: a set of stacks of positions in the
// grammar's rules, advanced one Unicode code point at a time. A token is
// allowed when its bytes, fed after the state's pending partial UTF-8
// character, leave at least one stack alive; a trie of the vocabulary
// shares the work between tokens with a common prefix.

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "models/mapped_file.hpp"

namespace troupe::models {

struct grammar_limits {
  std::size_t max_bytes = 256u << 10;  ///< GBNF text
  std::size_t max_rules = 4096;
  std::size_t max_elements = 1u << 18;  ///< after repetitions are expanded
  std::size_t max_stacks = 4096;        ///< alive at once while matching (else: refused)
  std::size_t max_repeat = 1000;        ///< m and n of x{m,n}
};

/// A parsed grammar. Rules are flattened: each alternative is a run of
/// elements closed by an `end` element.
class grammar {
 public:
  struct element {
    enum kind_t : std::uint8_t { end, chars, rule } kind = end;
    bool negated = false;
    std::int32_t ref = -1;                                     ///< rule: its index
    std::vector<std::pair<std::uint32_t, std::uint32_t>> set;  ///< chars: inclusive ranges
    bool matches(std::uint32_t cp) const;
  };

  /// Parses GBNF; the start rule is `root`. Left recursion, undefined
  /// rules and oversized grammars are errors.
  static result<std::shared_ptr<const grammar>> parse(std::string_view gbnf,
                                                      const grammar_limits& limits = {});

  const std::vector<element>& elements() const { return elems_; }
  /// Where each alternative of rule r starts in elements().
  const std::vector<std::int32_t>& alternatives(std::int32_t r) const {
    return alts_[static_cast<std::size_t>(r)];
  }
  std::int32_t root() const { return root_; }
  const grammar_limits& limits() const { return limits_; }

 private:
  friend class gbnf_parser;
  std::vector<element> elems_;
  std::vector<std::vector<std::int32_t>> alts_;
  std::vector<std::string> names_;
  std::int32_t root_ = -1;
  grammar_limits limits_;
};

/// The vocabulary as the matcher sees it: each token's bytes, in a trie.
class token_trie {
 public:
  /// `pieces[id]`: the token's bytes; an empty piece (special and control
  /// tokens) is never allowed by its bytes.
  explicit token_trie(const std::vector<std::string>& pieces);
  std::size_t vocab() const { return vocab_; }

  struct node {
    std::vector<std::pair<std::uint8_t, std::int32_t>> next;  ///< byte -> child, sorted
    std::vector<std::int32_t> tokens;                         ///< tokens whose bytes end here
  };
  const std::vector<node>& nodes() const { return nodes_; }
  const std::string& piece(std::int32_t id) const { return pieces_[static_cast<std::size_t>(id)]; }

 private:
  std::size_t vocab_ = 0;
  std::vector<node> nodes_;
  std::vector<std::string> pieces_;
};

/// Where a generation stands in a grammar.
class grammar_state {
 public:
  explicit grammar_state(std::shared_ptr<const grammar> g);

  /// Feeds a generated token's bytes; false (the state unchanged) when the
  /// grammar does not allow them.
  bool accept(std::string_view bytes);
  /// The grammar may end here (a stack is empty and no character is pending).
  bool complete() const;
  /// Nothing but the end may follow (complete, and no stack goes on).
  bool finished() const;
  /// Part of a UTF-8 character is pending (the last token ended inside it).
  bool pending() const { return !partial_.empty(); }
  /// The tokens allowed next, as a bit set over the vocabulary (64 tokens
  /// a word): tokens whose bytes the grammar accepts, and `ends` (the
  /// tokens that end a generation) when complete.
  std::vector<std::uint64_t> allowed(const token_trie& trie,
                                     const std::vector<std::int64_t>& ends) const;

 private:
  using stack = std::vector<std::int32_t>;
  std::shared_ptr<const grammar> g_;
  std::vector<stack> stacks_;
  std::string partial_;  ///< bytes of a UTF-8 character not yet whole
  bool overflow_ = false;
};

/// JSON Schema (the subset OpenAI's strict structured outputs accept, and
/// optional properties) as GBNF. Keywords it cannot enforce are refused by
/// name. `schema` is JSON text.
result<std::string> json_schema_to_gbnf(std::string_view schema);
/// A function a model may call: its name and its parameters' JSON Schema
/// (empty: any JSON object).
struct tool_spec {
  std::string name;
  std::string parameters;
  std::string description;  ///< for the prompt only
};
/// Hermes-style tool calls, one (or with `parallel` one or more, a newline
/// apart) of `<tool_call>\n{"name": "N", "arguments": {...}}\n</tool_call>`,
/// the arguments following the tool's schema.
result<std::string> tool_calls_gbnf(const std::vector<tool_spec>& tools, bool parallel);
/// Any JSON object (response_format json_object).
std::string json_object_gbnf();
/// A regular expression (the common subset: literals, classes, ., groups,
/// |, *, +, ?, {m,n}, \d \w \s and escapes; ^ and $ only at its ends) as GBNF.
result<std::string> regex_to_gbnf(std::string_view regex);
/// One of the given strings exactly (vLLM's guided_choice).
std::string choice_gbnf(const std::vector<std::string>& choices);

}  // namespace troupe::models
