// Malformed tokenizer files and inputs: clear errors, never a crash (this
// file also runs under ASan+UBSan).
#include <gtest/gtest.h>

#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "models/tokenizer.hpp"
#include "models/tokenizer_unicode.hpp"

using namespace troupe::models;

namespace {

// A tiny valid byte-level BPE: a, b, c, ab, abc and merges (a b), (ab c).
std::string tiny(const std::string& vocab_extra = "",
                 const std::string& merges = R"(["a b", ["ab", "c"]])",
                 const std::string& rest = "") {
  return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4)" +
         vocab_extra + R"(}, "merges": )" + merges + "}" + rest + "}";
}

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void expect_error(std::string_view json, std::string_view config, const std::string& needle) {
  auto t = tokenizer::from_json(json, config, "t.json");
  ASSERT_FALSE(t) << "accepted: " << json.substr(0, 300);
  EXPECT_NE(t.error().message.find(needle), std::string::npos) << "message: " << t.error().message;
  EXPECT_NE(t.error().message.find("t.json"), std::string::npos) << t.error().message;
}

struct temp_file {
  std::string path;
  temp_file() {
    char name[] = "/tmp/troupe_tok_XXXXXX";
    const int fd = mkstemp(name);
    if (fd >= 0) close(fd);
    path = name;
  }
  ~temp_file() { std::remove(path.c_str()); }
};

// A GGUF "llama" vocabulary written by the project's writer, edited by `edit`.
template <class Edit>
result<tokenizer> gguf_tokenizer(Edit edit) {
  gguf_writer w;
  w.set_string("general.architecture", "llama");
  w.set_string("tokenizer.ggml.model", "llama");
  std::vector<std::string> tokens = {"<unk>",
                                     "<s>",
                                     "</s>",
                                     "\xE2\x96\x81",
                                     "a",
                                     "b",
                                     "\xE2\x96\x81"
                                     "a"};
  w.set_strings("tokenizer.ggml.tokens", tokens);
  w.set_f32s("tokenizer.ggml.scores", {0, 0, 0, -1, -2, -3, -4});
  w.set_i32s("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 1, 1});
  w.set_u32("tokenizer.ggml.bos_token_id", 1);
  w.set_u32("tokenizer.ggml.eos_token_id", 2);
  edit(w);
  temp_file f;
  if (auto r = w.write(f.path); !r) return std::unexpected(r.error());
  auto g = gguf_file::open(f.path);
  if (!g) return std::unexpected(g.error());
  return tokenizer::from_gguf(*g);
}

// A tokenizer read from GGUF file bytes: the file's or the tokenizer's error.
result<tokenizer> tokenizer_of_gguf_bytes(const std::string& bytes, const std::string& path) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
  auto g = gguf_file::open(path);
  if (!g) return std::unexpected(g.error());
  return tokenizer::from_gguf(*g);
}

// Where the GGUF-encoded string `s` (u64 length, then its bytes) ends in
// `bytes`: the offset of the field that follows it; npos when absent.
std::size_t after_gguf_string(const std::string& bytes, const std::string& s) {
  std::string enc(8, '\0');
  const std::uint64_t n = s.size();
  std::memcpy(enc.data(), &n, 8);
  enc += s;
  const std::size_t at = bytes.find(enc);
  return at == std::string::npos ? at : at + enc.size();
}

// `text` with its only occurrence of `from` replaced by `to`.
std::string replaced(std::string text, const std::string& from, const std::string& to) {
  const std::size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  EXPECT_EQ(text.find(from, at + 1), std::string::npos) << from << " occurs twice";
  if (at != std::string::npos) text.replace(at, from.size(), to);
  return text;
}

// What a tokenizer that loaded must do whatever its file said: encode valid
// UTF-8 into ids inside its vocabulary (or fail with a message), and stream
// the same text decode() gives at once.
void expect_usable(const tokenizer& t) {
  auto ids = t.encode("Hello world \xF0\x9F\x98\x80 \xE4\xB8\xAD\xE6\x96\x87", true);
  if (!ids) {
    EXPECT_FALSE(ids.error().message.empty());
    return;
  }
  for (token_id id : *ids) {
    EXPECT_GE(id, 0);
    EXPECT_LT(static_cast<std::size_t>(id), t.vocab_size());
  }
  const std::string text = t.decode(*ids);
  if (unicode::find_invalid_utf8(text) != std::string::npos) return;
  stream_decoder d(t);
  std::string streamed;
  for (token_id id : *ids) streamed += d.push(id);
  streamed += d.finish();
  EXPECT_EQ(streamed, text);
}

// One ASCII letter or digit of `text` (chosen by `rng`) replaced by another:
// mostly still well-formed, so it reaches the checks past the syntax.
template <class Rng>
void swap_alnum(std::string& text, Rng& rng) {
  static const std::string alnum = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  for (int tries = 0; tries < 1000; ++tries) {
    char& c = text[rng() % text.size()];
    if (alnum.find(c) == std::string::npos) continue;
    c = alnum[rng() % alnum.size()];
    return;
  }
}

}  // namespace

TEST(TokenizerValidation, TinyFileLoads) {
  auto t = tokenizer::from_json(tiny(), "", "t.json");
  ASSERT_TRUE(t) << t.error().message;
  EXPECT_EQ(*t->encode("abcab", false), (std::vector<token_id>{4, 3}));
  auto g = gguf_tokenizer([](gguf_writer&) {});
  ASSERT_TRUE(g) << g.error().message;
  EXPECT_EQ(*g->encode("a b", true), (std::vector<token_id>{1, 6, 3, 5}));
}

TEST(TokenizerValidation, MalformedTokenizerJson) {
  expect_error("not json", "", "not a JSON object");
  expect_error("[1, 2]", "", "not a JSON object");
  expect_error("{}", "", "model");
  expect_error(R"({"model": {"type": "WordPiece", "vocab": {}}})", "", "WordPiece");
  expect_error(R"({"model": {"type": "Unigram", "vocab": []}})", "", "Unigram");
  expect_error(R"({"model": {"type": "BPE", "vocab": [1, 2]}})", "", "model.vocab");
  expect_error(R"({"model": {"type": "BPE", "vocab": {}}})", "", "empty");
  // Only added tokens (the report's file: it loaded and printed nothing).
  expect_error(R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
      "added_tokens": [{"id": 0, "content": "<s>", "special": true}]})",
               "", "the model's vocabulary is empty");
  expect_error(tiny(R"(, "d": "5")"), "", "integer id");
  expect_error(tiny(R"(, "d": -1)"), "", "outside");
  expect_error(tiny(R"(, "d": 4294967296)"), "", "outside");
  expect_error(tiny(R"(, "d": 1099511627776)"), "", "outside");
  expect_error(tiny(R"(, "d": 2)"), "", "two tokens");  // duplicate id
  expect_error(tiny("", R"(["a x"])"), "", "not in the vocabulary");
  expect_error(tiny("", R"(["b c"])"), "", "not in the vocabulary");  // "bc" missing
  expect_error(tiny("", R"(["abc"])"), "", "separated by one space");
  expect_error(tiny("", R"(["a b c"])"), "", "separated by one space");
  expect_error(tiny("", R"([["a"]])"), "", "model.merges[0]");
  expect_error(tiny("", R"("a b")"), "", "model.merges");
  expect_error(R"({"model": {"type": "BPE", "unk_token": "<unk>", "vocab": {"a": 0}}})", "",
               "unk_token");
  expect_error(
      tiny("", R"([])", R"(, "added_tokens": [{"id": 9, "content": "a", "special": true}])"), "",
      "two ids");
  expect_error(tiny("", R"([])", R"(, "added_tokens": [{"id": 3, "content": "zz"}])"), "",
               "two tokens");
  expect_error(tiny("", R"([])", R"(, "added_tokens": [{"id": 7, "content": 5}])"), "", "content");
  expect_error(tiny("", R"([])", R"(, "added_tokens": [{"id": 7, "content": ""}])"), "", "empty");
  expect_error(tiny("", R"([])", R"(, "normalizer": {"type": "NFKC"})"), "", "NFKC");
  expect_error(tiny("", R"([])", R"(, "pre_tokenizer": {"type": "Whitespace"})"), "", "Whitespace");
  expect_error(
      tiny("", R"([])", R"(, "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\w+"},
      "behavior": "Isolated", "invert": false})"),
      "", "known pre-tokenizer patterns");
  expect_error(tiny("", R"([])", R"(, "decoder": {"type": "WordPiece"})"), "", "WordPiece");
  expect_error(tiny("", R"([])",
                    R"(, "decoder": {"type": "Strip", "content": " ", "start": -1, "stop": 0})"),
               "", "start and stop");
  expect_error(tiny("", R"([])", R"(, "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}], "special_tokens": {"<s>": {"ids": [999]}}})"),
               "", "999");
  expect_error(tiny("", R"([])", R"(, "post_processor": {"type": "Whatever"})"), "", "Whatever");
  expect_error(R"({"model": {"type": "BPE", "dropout": 0.1, "vocab": {"a": 0}}})", "", "dropout");
  expect_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "byte_fallback": "yes"}})", "",
               "byte_fallback");
  expect_error(tiny(), R"({"bos_token": "<s>"})", "bos_token");
  expect_error(tiny(), R"({"eos_token": {"content": 3}})", "eos_token");
  expect_error(tiny(), R"({"add_bos_token": true})", "add_bos_token");
  expect_error(tiny(), "{", "tokenizer_config");
  expect_error(std::string(100000, '[') + std::string(100000, ']'), "", "nested too deeply");
}

TEST(TokenizerValidation, HugeVocabularyClaims) {
  tokenizer_limits small;
  small.max_vocab = 4;
  auto t = tokenizer::from_json(tiny(), "", "t.json", small);
  ASSERT_FALSE(t);
  EXPECT_NE(t.error().message.find("limit"), std::string::npos) << t.error().message;
  tokenizer_limits tiny_tokens;
  tiny_tokens.max_token_bytes = 2;
  EXPECT_FALSE(tokenizer::from_json(tiny(), "", "t.json", tiny_tokens));
  EXPECT_FALSE(tokenizer::load("/nonexistent/tokenizer.json"));
}

TEST(TokenizerValidation, MalformedGgufMetadata) {
  struct bad_case {
    const char* what;
    void (*edit)(gguf_writer&);
    const char* needle;
  };
  const bad_case cases[] = {
      {"scores length",
       [](gguf_writer& w) {
         w.set_f32s("tokenizer.ggml.scores", {0, 0});
       },
       "tokenizer.ggml.scores"},
      {"types length", [](gguf_writer& w) { w.set_i32s("tokenizer.ggml.token_type", {1}); },
       "tokenizer.ggml.token_type"},
      {"type value",
       [](gguf_writer& w) {
         w.set_i32s("tokenizer.ggml.token_type", {2, 3, 3, 1, 1, 1, 9});
       },
       "not a token type"},
      {"bos range", [](gguf_writer& w) { w.set_u32("tokenizer.ggml.bos_token_id", 70000); },
       "bos_token_id"},
      {"eos type", [](gguf_writer& w) { w.set_string("tokenizer.ggml.eos_token_id", "2"); },
       "eos_token_id"},
      {"model", [](gguf_writer& w) { w.set_string("tokenizer.ggml.model", "bert"); }, "bert"},
      {"tokens type",
       [](gguf_writer& w) {
         w.set_i32s("tokenizer.ggml.tokens", {1, 2});
       },
       "tokenizer.ggml.tokens"},
      {"empty tokens", [](gguf_writer& w) { w.set_strings("tokenizer.ggml.tokens", {}); }, "empty"},
      {"duplicate tokens",
       [](gguf_writer& w) {
         w.set_strings("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a", "a", "b", "c"});
       },
       "two ids"},
      {"bad utf8",
       [](gguf_writer& w) {
         w.set_strings("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "\xFF", "a", "b", "c"});
       },
       "UTF-8"},
      {"nan score",
       [](gguf_writer& w) {
         w.set_f32s("tokenizer.ggml.scores", {0, 0, 0, 0, 0, 0, NAN});
       },
       "finite"},
      {"gpt2 merges missing", [](gguf_writer& w) { w.set_string("tokenizer.ggml.model", "gpt2"); },
       "merges"},
      {"gpt2 merge unknown",
       [](gguf_writer& w) {
         w.set_string("tokenizer.ggml.model", "gpt2");
         w.set_strings("tokenizer.ggml.merges", {"a zz"});
       },
       "not in the vocabulary"},
      {"gpt2 pre unknown",
       [](gguf_writer& w) {
         w.set_string("tokenizer.ggml.model", "gpt2");
         w.set_string("tokenizer.ggml.pre", "deepseek-coder");
         w.set_strings("tokenizer.ggml.merges", {});
       },
       "deepseek-coder"},
      {"eos out of range",
       [](gguf_writer& w) {
         w.set_strings("tokenizer.ggml.tokens", {"<unk>"});
         w.set_f32s("tokenizer.ggml.scores", {0});
         w.set_i32s("tokenizer.ggml.token_type", {2});
         w.set_u32("tokenizer.ggml.bos_token_id", 0);
         w.set_u32("tokenizer.ggml.eos_token_id", 3);
       },
       "eos_token_id"},
  };
  for (const bad_case& c : cases) {
    auto t = gguf_tokenizer(c.edit);
    ASSERT_FALSE(t) << c.what;
    EXPECT_NE(t.error().message.find(c.needle), std::string::npos)
        << c.what << ": " << t.error().message;
  }
}

TEST(TokenizerValidation, InvalidInputsHaveDefinedBehaviour) {
  auto t = tokenizer::from_json(
      read(std::string(TROUPE_FIXTURES_DIR) + "/tokenizers/llama3_bpe.tokenizer.json"), "",
      "llama3");
  ASSERT_TRUE(t) << t.error().message;
  for (std::string bad : {std::string("abc\xFF"), std::string("\xC3"), std::string("\xED\xA0\x80"),
                          std::string("ok \xF0\x9F\x98")}) {
    auto r = t->encode(bad);
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message.find("UTF-8"), std::string::npos);
  }
  // Embedded NUL is valid UTF-8 and round-trips.
  const std::string nul("a\0b", 3);
  auto ids = t->encode(nul, false);
  ASSERT_TRUE(ids);
  EXPECT_EQ(t->decode(*ids), nul);
  // Unknown ids decode to nothing (tokenizers skips them); the stream too.
  const std::vector<token_id> weird{-5, 1 << 30, static_cast<token_id>(t->vocab_size())};
  EXPECT_EQ(t->decode(weird), "");
  stream_decoder d(*t);
  for (token_id id : weird) EXPECT_EQ(d.push(id), "");
  EXPECT_EQ(d.finish(), "");
  // A long input (merge queues, no recursion).
  const std::string long_text(200000, 'a');
  auto many = t->encode(long_text, false);
  ASSERT_TRUE(many);
  EXPECT_EQ(t->decode(*many), long_text);
}

// Targeted corruptions of real tokenizer files: each is rejected, and the
// message names the file, the field and what is wrong with it.
TEST(TokenizerValidation, CorruptedFieldsOfRealFilesAreNamed) {
  const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/tokenizers/";
  const std::string json = read(dir + "spm_bpe.tokenizer.json");
  ASSERT_GT(json.size(), 1000u) << "missing " << dir << "spm_bpe.tokenizer.json";
  ASSERT_TRUE(tokenizer::from_json(json, "", "t.json"));
  expect_error(json.substr(0, json.size() / 2), "", "not a JSON object");
  expect_error(replaced(json, R"("type":"BPE")", R"("type":"BPX")"), "",
               R"(model type "BPX" is not supported)");
  expect_error(replaced(json, R"("byte_fallback":true)", R"("byte_fallback":"true")"), "",
               "model.byte_fallback must be true or false");
  expect_error(replaced(json, R"("unk_token":"<unk>")", R"("unk_token":"<unq>")"), "",
               R"(model.unk_token "<unq>" is not in the vocabulary)");
  expect_error(replaced(json, R"("M":300)", R"("M":301)"), "", "two tokens");
  expect_error(replaced(json, R"("merges":[[)", R"("merges":[["zq","xj"],[)"), "",
               "not in the vocabulary");
  expect_error(replaced(json, R"("ids":[1])", R"("ids":[99999])"), "", "99999");
  expect_error(replaced(json, R"("start":1)", R"("start":-1)"), "", "start and stop");

  const std::string gguf = read(dir + "llama3_bpe.gguf");
  ASSERT_GT(gguf.size(), 1000u) << "missing " << dir << "llama3_bpe.gguf";
  temp_file f;
  const auto expect_gguf_error = [&](const std::string& what, const std::string& bytes,
                                     const std::vector<std::string>& needles) {
    auto t = tokenizer_of_gguf_bytes(bytes, f.path);
    ASSERT_FALSE(t) << what << " was accepted";
    const std::string& m = t.error().message;
    EXPECT_EQ(m.rfind(f.path + ": ", 0), 0u) << what << ": " << m;
    for (const auto& n : needles) EXPECT_NE(m.find(n), std::string::npos) << what << ": " << m;
  };
  ASSERT_TRUE(tokenizer_of_gguf_bytes(gguf, f.path));
  std::string b = gguf;
  b[0] = 'X';
  expect_gguf_error("bad magic", b, {"bad magic"});
  const std::size_t tokens = after_gguf_string(gguf, "tokenizer.ggml.tokens");
  ASSERT_NE(tokens, std::string::npos);
  expect_gguf_error("cut in the tokens", gguf.substr(0, tokens + 1000),
                    {"tokenizer.ggml.tokens", "past the end of the file"});
  // Values after their key: a u32 type, then the value (an array: u32
  // element type, u64 count, elements).
  b = gguf;
  const std::uint64_t too_many = 1'000'000;
  std::memcpy(b.data() + tokens + 8, &too_many, 8);
  expect_gguf_error("token count past the end", b,
                    {"tokenizer.ggml.tokens", "past the end of the file"});
  const std::size_t bos = after_gguf_string(gguf, "tokenizer.ggml.bos_token_id");
  ASSERT_NE(bos, std::string::npos);
  b = gguf;
  const std::uint32_t big_id = 70000;
  std::memcpy(b.data() + bos + 4, &big_id, 4);
  expect_gguf_error("bos id out of range", b, {"tokenizer.ggml.bos_token_id", "70000"});
  const std::size_t types = after_gguf_string(gguf, "tokenizer.ggml.token_type");
  ASSERT_NE(types, std::string::npos);
  b = gguf;
  const std::int32_t type_9 = 9;
  std::memcpy(b.data() + types + 4 + 4 + 8, &type_9, 4);
  expect_gguf_error("token type 9", b, {"tokenizer.ggml.token_type", "not a token type"});
  expect_gguf_error("unknown model", replaced(gguf, "gpt2", "gpx2"), {"\"gpx2\""});
}

// Random corruptions of a real tokenizer.json and GGUF, of the syntax (any
// byte, cuts, punctuation) and of the contents (a letter or digit swapped):
// each is rejected with a message that names the file, or loads a
// tokenizer that still encodes into its vocabulary and streams what it
// decodes. Both outcomes occur, so both are checked.
TEST(TokenizerValidation, MutatedFilesNeverCrash) {
  const std::string dir = std::string(TROUPE_FIXTURES_DIR) + "/tokenizers/";
  const std::string json = read(dir + "spm_bpe.tokenizer.json");
  const std::string gguf = read(dir + "llama3_bpe.gguf");
  ASSERT_GT(json.size(), 1000u) << "missing " << dir << "spm_bpe.tokenizer.json";
  ASSERT_GT(gguf.size(), 1000u) << "missing " << dir << "llama3_bpe.gguf";
  std::mt19937 rng(7);
  int json_loaded = 0, json_rejected = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string m = json;
    for (int k = 0; k < 1 + trial % 4; ++k) {
      if (trial % 2) {
        swap_alnum(m, rng);
        continue;
      }
      const std::size_t at = rng() % m.size();
      switch (rng() % 3) {
        case 0:
          m[at] = static_cast<char>(rng() % 128);
          break;
        case 1:
          m.erase(at, 1 + rng() % 8);
          break;
        default:
          m.insert(at, std::string(1 + rng() % 3, "{}[]\",:0"[rng() % 8]));
          break;
      }
    }
    SCOPED_TRACE("JSON trial " + std::to_string(trial));
    auto t = tokenizer::from_json(m, "", "mutated.json");
    if (t) {
      ++json_loaded;
      expect_usable(*t);
    } else {
      ++json_rejected;
      EXPECT_EQ(t.error().message.rfind("mutated.json: ", 0), 0u) << t.error().message;
      EXPECT_GT(t.error().message.size(), 20u) << t.error().message;
    }
  }
  int gguf_loaded = 0, gguf_rejected = 0;
  temp_file f;
  for (int trial = 0; trial < 120; ++trial) {
    std::string m = gguf;
    for (int k = 0; k < 1 + trial % 3; ++k) {
      if (trial % 2)
        swap_alnum(m, rng);
      else
        m[rng() % m.size()] = static_cast<char>(rng());
    }
    SCOPED_TRACE("GGUF trial " + std::to_string(trial));
    auto t = tokenizer_of_gguf_bytes(m, f.path);
    if (m.compare(0, 4, gguf, 0, 4) != 0) {
      ASSERT_FALSE(t) << "a file without the GGUF magic was accepted";
      EXPECT_NE(t.error().message.find("bad magic"), std::string::npos) << t.error().message;
    }
    if (t) {
      ++gguf_loaded;
      expect_usable(*t);
    } else {
      ++gguf_rejected;
      EXPECT_EQ(t.error().message.rfind(f.path + ": ", 0), 0u) << t.error().message;
    }
  }
  std::printf("mutated tokenizer.json: %d loaded, %d rejected; GGUF: %d loaded, %d rejected\n",
              json_loaded, json_rejected, gguf_loaded, gguf_rejected);
  EXPECT_GT(json_loaded, 0);
  EXPECT_GT(json_rejected, 0);
  EXPECT_GT(gguf_loaded, 0);
  EXPECT_GT(gguf_rejected, 0);
}
