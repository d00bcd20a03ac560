// Grammars: GBNF parsing and its refusals, the matcher (code points split
// over tokens), the trie's token mask against a token-by-token check, and
// the JSON Schema and regex compilers, judged by independent checkers:
// nlohmann's JSON parser and std::regex.
#include "models/grammar.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "models/tokenizer.hpp"

namespace {

using namespace troupe::models;
using nlohmann::json;

std::shared_ptr<const grammar> parse_ok(const std::string& text) {
  auto g = grammar::parse(text);
  EXPECT_TRUE(g) << (g ? "" : g.error().message) << "\n" << text;
  return g ? *g : nullptr;
}

bool accepts(const std::shared_ptr<const grammar>& g, const std::vector<std::string>& tokens) {
  grammar_state s(g);
  for (const auto& t : tokens)
    if (!s.accept(t)) return false;
  return s.complete();
}

bool allowed(const std::vector<std::uint64_t>& bits, std::int32_t id) {
  return (bits[static_cast<std::size_t>(id) / 64] >> (id % 64)) & 1;
}

// The bundled model's vocabulary, every token's bytes.
struct vocabulary {
  std::vector<std::string> pieces;
  std::vector<std::int64_t> ends;
};
const vocabulary& bundled_vocabulary() {
  static const vocabulary v = [] {
    vocabulary out;
    auto t = tokenizer::load(std::string(TROUPE_FIXTURES_DIR) +
                             "/../../assets/tiny-llava-shapes/tokenizer.json");
    EXPECT_TRUE(t);
    if (!t) return out;
    for (std::size_t id = 0; id < t->vocab_size(); ++id) {
      const auto tid = static_cast<std::int32_t>(id);
      auto p = t->is_special(tid) ? std::string() : t->token_to_piece(tid).value_or("");
      out.pieces.push_back(p);
    }
    out.ends = {t->special_ids().eos.value_or(1)};
    return out;
  }();
  return v;
}

// Walks a grammar with random allowed tokens until it may end (then ends
// with probability 1/2, or surely past `max_tokens`); returns the text,
// or nullopt when it ran out of tokens first.
std::optional<std::string> random_walk(const std::shared_ptr<const grammar>& g,
                                       const token_trie& trie, std::mt19937& rng,
                                       int max_tokens = 400) {
  const auto& ends = bundled_vocabulary().ends;
  grammar_state s(g);
  std::string text;
  for (int step = 0; step < max_tokens; ++step) {
    const auto bits = s.allowed(trie, ends);
    std::vector<std::int32_t> choices;
    for (std::size_t id = 0; id < trie.vocab(); ++id)
      if (allowed(bits, static_cast<std::int32_t>(id)))
        choices.push_back(static_cast<std::int32_t>(id));
    EXPECT_FALSE(choices.empty()) << "a dead end after " << text;
    if (choices.empty()) return std::nullopt;
    const auto pick =
        choices[std::uniform_int_distribution<std::size_t>(0, choices.size() - 1)(rng)];
    const bool is_end = std::find(ends.begin(), ends.end(), pick) != ends.end();
    if (is_end || (s.complete() && rng() % 2 == 0)) {
      EXPECT_TRUE(s.complete());
      return text;
    }
    EXPECT_TRUE(s.accept(trie.piece(pick))) << "the mask allowed a token the grammar refuses";
    text += trie.piece(pick);
  }
  return std::nullopt;
}

TEST(Grammar, ParsesGbnfAndRefusesWhatWouldBreakTheMatcher) {
  auto g = parse_ok(R"(root ::= "a" digit+ ("x" | "y")? tail
digit ::= [0-9]
# a comment
tail ::= ( "!" | ) # an empty alternative
)");
  ASSERT_TRUE(g);
  EXPECT_TRUE(accepts(g, {"a", "1", "2x"}));
  EXPECT_TRUE(accepts(g, {"a12!"}));
  EXPECT_FALSE(accepts(g, {"a"}));         // needs a digit
  EXPECT_FALSE(accepts(g, {"a1", "xy"}));  // one of x and y
  for (const char* bad : {
           "root ::= undefined",
           "root ::= root \"a\" | \"b\"",  // left recursion
           "root ::= x\nx ::= y? root",    // through a nullable prefix
           "start ::= \"a\"",              // no root
           "root ::= \"abc",               // unterminated
           "root ::= [z-a]",               // backwards
           "root ::= \"a\"{5,2}", "root ::= \"a\"{5000}",
           "root ::= \"a\"\nroot ::= \"b\"",  // defined twice
       }) {
    auto r = grammar::parse(bad);
    EXPECT_FALSE(r) << bad;
  }
  // Rules the parser makes for groups never collide with the user's names.
  auto named = parse_ok("root ::= x x-1\nx ::= (\"a\" | \"b\")+\nx-1 ::= (\"c\")?");
  EXPECT_TRUE(accepts(named, {"abac"}));
  // x{2,4}: between two and four.
  auto rep = parse_ok("root ::= \"ab\"{2,4}");
  EXPECT_FALSE(accepts(rep, {"ab"}));
  EXPECT_TRUE(accepts(rep, {"abab"}));
  EXPECT_TRUE(accepts(rep, {"ababab", "ab"}));
  EXPECT_FALSE(accepts(rep, {"ababababab"}));
}

TEST(Grammar, CodePointsMaySpanTokens) {
  auto g = parse_ok("root ::= \"\xC3\xA9\" [\xCE\xB1-\xCF\x89]+ [^a]");
  ASSERT_TRUE(g);
  // é, then α β split across tokens, then any character but 'a'.
  EXPECT_TRUE(accepts(g, {"\xC3", "\xA9\xCE", "\xB1\xCE\xB2", "z"}));
  EXPECT_FALSE(accepts(g, {"\xC3\xA9\xCE\xB1", "a"}));
  grammar_state s(g);
  EXPECT_TRUE(s.accept("\xC3"));
  EXPECT_FALSE(s.complete());      // half a character
  EXPECT_FALSE(s.accept("\xA8"));  // è, not é
  EXPECT_FALSE(s.accept("\xFF"));  // never UTF-8
}

// The trie's mask equals asking the grammar about every token alone.
TEST(Grammar, TheMaskIsTheTokensTheGrammarAccepts) {
  const auto& v = bundled_vocabulary();
  ASSERT_GT(v.pieces.size(), 300u);
  token_trie trie(v.pieces);
  auto g = parse_ok(json_object_gbnf());
  std::mt19937 rng(3);
  grammar_state s(g);
  for (int step = 0; step < 40; ++step) {
    const auto bits = s.allowed(trie, v.ends);
    std::vector<std::int32_t> ok;
    for (std::size_t id = 0; id < v.pieces.size(); ++id) {
      const auto tid = static_cast<std::int32_t>(id);
      auto copy = s;
      bool want = !v.pieces[id].empty() && copy.accept(v.pieces[id]);
      // A token that stops inside a character needs one that finishes it.
      if (want && copy.pending()) {
        want = false;
        for (const auto& next : v.pieces) {
          auto again = copy;
          if (!next.empty() && again.accept(next) && !again.pending()) {
            want = true;
            break;
          }
        }
      }
      const bool end = tid == v.ends[0] && s.complete();
      EXPECT_EQ(allowed(bits, tid), want || end) << "token " << id << " at step " << step;
      if (want) ok.push_back(tid);
    }
    if (ok.empty()) break;
    ASSERT_TRUE(s.accept(v.pieces[static_cast<std::size_t>(ok[rng() % ok.size()])]));
  }
}

TEST(JsonSchema, GeneratedObjectsParseAndFollowTheSchema) {
  const auto& v = bundled_vocabulary();
  token_trie trie(v.pieces);
  const json schema = json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "maxLength": 6},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["red", "blue", 3]}, "minItems": 1, "maxItems": 3},
      "ok": {"type": ["boolean", "null"]},
      "pet": {"$ref": "#/$defs/pet"},
      "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}
    },
    "required": ["name", "age", "tags", "code"],
    "additionalProperties": false,
    "$defs": {"pet": {"type": "object", "properties": {"kind": {"const": "cat"}},
                      "required": ["kind"], "additionalProperties": false}}
  })");
  auto text = json_schema_to_gbnf(schema.dump());
  ASSERT_TRUE(text) << text.error().message;
  auto g = parse_ok(*text);
  ASSERT_TRUE(g);
  std::mt19937 rng(11);
  int finished = 0;
  std::set<std::string> keysets;
  for (int i = 0; i < 60; ++i) {
    auto out = random_walk(g, trie, rng);
    if (!out) continue;
    ++finished;
    auto j = json::parse(*out, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << *out;
    ASSERT_TRUE(j.is_object()) << *out;
    std::string keys;
    for (const auto& [k, x] : j.items()) keys += k + ",";
    keysets.insert(keys);
    ASSERT_TRUE(j["name"].is_string()) << *out;
    EXPECT_LE(j["name"].get<std::string>().size(), 6u * 6) << *out;  // 6 characters, escapes
    EXPECT_TRUE(j["age"].is_number_integer()) << *out;
    ASSERT_TRUE(j["tags"].is_array()) << *out;
    EXPECT_GE(j["tags"].size(), 1u);
    EXPECT_LE(j["tags"].size(), 3u);
    for (const auto& t : j["tags"]) EXPECT_TRUE(t == "red" || t == "blue" || t == 3) << *out;
    if (j.contains("ok")) {
      EXPECT_TRUE(j["ok"].is_boolean() || j["ok"].is_null()) << *out;
    }
    if (j.contains("pet")) {
      EXPECT_EQ(j["pet"], json({{"kind", "cat"}})) << *out;
    }
    EXPECT_TRUE(std::regex_match(j["code"].get<std::string>(), std::regex("[A-Z]{2}-[0-9]{3}")))
        << *out;
    for (const auto& [k, x] : j.items())
      EXPECT_TRUE(schema["properties"].contains(k)) << "an extra key " << k;
  }
  EXPECT_GE(finished, 40);
  EXPECT_GE(keysets.size(), 2u);  // optional keys come and go
}

TEST(JsonSchema, KeywordsItCannotEnforceAreRefusedByName) {
  for (const char* s :
       {R"({"type": "number", "minimum": 3})", R"({"type": "string", "format": "date"})",
        R"({"oneOf": [{"type": "string"}]})",
        R"({"type": "object", "properties": {"a": {"type": "integer"}},
                            "required": ["b"]})",
        R"({"$ref": "http://example.com/schema"})", R"({"type": "frob"})", "not json"}) {
    auto r = json_schema_to_gbnf(s);
    EXPECT_FALSE(r) << s;
  }
  auto r = json_schema_to_gbnf(R"({"type": "number", "minimum": 3})");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("minimum"), std::string::npos) << r.error().message;
  // A recursive schema is fine (its rule refers to itself).
  auto tree = json_schema_to_gbnf(R"({"$ref": "#/$defs/node", "$defs": {"node": {
      "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"},
      "maxItems": 2}}, "required": ["kids"], "additionalProperties": false}}})");
  ASSERT_TRUE(tree) << tree.error().message;
  EXPECT_TRUE(parse_ok(*tree));
}

// UTF-8 to UTF-32 (std::wregex counts characters; std::regex counts bytes).
std::wstring wide(const std::string& s) {
  std::wstring out;
  for (std::size_t i = 0; i < s.size();) {
    const auto b = static_cast<unsigned char>(s[i]);
    const int n = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    std::uint32_t cp = n == 1 ? b : b & (0xFF >> (n + 1));
    for (int k = 1; k < n && i + static_cast<std::size_t>(k) < s.size(); ++k)
      cp = (cp << 6) | (static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]) & 0x3F);
    out += static_cast<wchar_t>(cp);
    i += static_cast<std::size_t>(n);
  }
  return out;
}

TEST(Regex, GeneratedStringsMatchStdRegex) {
  const auto& v = bundled_vocabulary();
  token_trie trie(v.pieces);
  std::mt19937 rng(5);
  for (const char* re :
       {"[a-c]{2}\\d+", "(cat|dog)s?", "x(?:ab)*y", "[^0-9 ]{1,3}\\.", "\\w+@\\w+"}) {
    auto text = regex_to_gbnf(re);
    ASSERT_TRUE(text) << re << ": " << text.error().message;
    auto g = parse_ok(*text);
    ASSERT_TRUE(g);
    int matched = 0;
    for (int i = 0; i < 20; ++i) {
      auto out = random_walk(g, trie, rng, 400);
      if (!out) continue;
      const std::string pattern = re;
      EXPECT_TRUE(std::regex_match(wide(*out), std::wregex(wide(pattern))))
          << re << " gave " << *out;
      ++matched;
    }
    EXPECT_GE(matched, 10) << re;
  }
  for (const char* bad : {"(a", "a{2", "*a", "(?=a)", "\\1", "[b-a]"})
    EXPECT_FALSE(regex_to_gbnf(bad)) << bad;
  auto choice = parse_ok(choice_gbnf({"yes", "no", "a \"quoted\" one"}));
  EXPECT_TRUE(accepts(choice, {"a \"quo", "ted\" one"}));
  EXPECT_FALSE(accepts(choice, {"ye"}));
}

}  // namespace
