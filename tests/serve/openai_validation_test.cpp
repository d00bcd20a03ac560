// The gateway's request parsing: bytes from the network, so every malformed
// body is a 400 (or 413) with OpenAI's error shape and the offending field,
// never a crash.
#include "serve/openai.hpp"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <tuple>

namespace {

using namespace troupe::serve;
using nlohmann::json;

// A 1x1-pixel PNG is not needed: the parser only checks the data URL; the
// head decodes the image.
const std::string png_b64 = "iVBORw0KGgo=";  // the 8-byte PNG signature

TEST(OpenAiParse, AChatWithTextAndAnImage) {
  json body{
      {"model", "m"},
      {"messages",
       json::array(
           {{{"role", "system"}, {"content", "Be brief."}},
            {{"role", "user"},
             {"content",
              json::array({{{"type", "text"}, {"text", "What is it?"}},
                           {{"type", "image_url"},
                            {"image_url", {{"url", "data:image/png;base64," + png_b64}}}}})}}})},
      {"max_tokens", 7},
      {"temperature", 0.5},
      {"top_p", 0.9},
      {"seed", 3},
      {"stop", "END"},
      {"stream", true},
      {"stream_options", {{"include_usage", true}}}};
  auto r = parse_chat_request(body.dump());
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(r->stream);
  EXPECT_TRUE(r->include_usage);
  EXPECT_EQ(r->model, "m");
  ASSERT_EQ(r->job.turns.size(), 2u);
  EXPECT_EQ(r->job.turns[0].role, "system");
  EXPECT_EQ(r->job.turns[1].content, "What is it?");
  EXPECT_EQ(r->job.turns[1].images, 1);
  ASSERT_EQ(r->job.images.size(), 1u);
  EXPECT_EQ(r->job.images[0].bytes,
            (std::vector<std::uint8_t>{0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'}));
  EXPECT_EQ(r->job.max_tokens, 7);
  EXPECT_TRUE(r->job.has_temperature);
  EXPECT_DOUBLE_EQ(r->job.temperature, 0.5);
  EXPECT_TRUE(r->job.has_top_p);
  EXPECT_EQ(r->job.seed, 3u);
  EXPECT_EQ(r->job.stop_strings, std::vector<std::string>{"END"});
}

TEST(OpenAiParse, EveryMistakeNamesItsField) {
  struct bad_case {
    std::string body;
    int status;
    std::string param;
  };
  const std::string user = R"({"role":"user","content":"hi"})";
  const std::vector<bad_case> cases{
      {"{", 400, ""},
      {"[]", 400, ""},
      {"{}", 400, "messages"},
      {R"({"messages":[]})", 400, "messages"},
      {R"({"messages":[3]})", 400, "messages[0]"},
      {R"({"messages":[{"role":"robot","content":"x"}]})", 400, "messages[0].role"},
      {R"({"messages":[{"role":"user"}]})", 400, "messages[0].content"},
      {R"({"messages":[{"role":"user","content":[{"type":"audio"}]}]})", 400,
       "messages[0].content[0].type"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"http://example.com/a.png"}}]}]})",
       400, "messages[0].content[0].image_url"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,@@@@"}}]}]})",
       400, "messages[0].content[0].image_url"},
      {R"({"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:text/plain;base64,aGk="}}]}]})",
       400, "messages[0].content[0].image_url"},
      {R"({"messages":[)" + user + R"(],"max_tokens":0})", 400, "max_tokens"},
      {R"({"messages":[)" + user + R"(],"max_tokens":"many"})", 400, "max_tokens"},
      {R"({"messages":[)" + user + R"(],"temperature":9})", 400, "temperature"},
      {R"({"messages":[)" + user + R"(],"top_p":0})", 400, "top_p"},
      {R"({"messages":[)" + user + R"(],"stop":[1]})", 400, "stop"},
      {R"({"messages":[)" + user + R"(],"stream":"yes"})", 400, "stream"},
      {R"({"messages":[)" + user + R"(],"n":99})", 400, "n"},
  };
  for (const auto& c : cases) {
    auto r = parse_chat_request(c.body);
    ASSERT_FALSE(r) << "accepted: " << c.body;
    EXPECT_EQ(r.error().status, c.status) << c.body;
    EXPECT_EQ(r.error().param, c.param) << c.body << ": " << r.error().message;
    auto j = json::parse(error_json(r.error()));
    EXPECT_EQ(j["error"]["message"], r.error().message);
  }
}

TEST(OpenAiParse, LimitsAreEnforced) {
  request_limits l;
  l.max_image_bytes = 4;
  json body{
      {"messages",
       json::array(
           {{{"role", "user"},
             {"content",
              json::array({{{"type", "image_url"},
                            {"image_url", {{"url", "data:image/png;base64," + png_b64}}}}})}}})}};
  auto r = parse_chat_request(body.dump(), l);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().status, 413);
  l = {};
  l.max_messages = 1;
  body["messages"].push_back(body["messages"][0]);
  r = parse_chat_request(body.dump(), l);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().param, "messages");
  auto c = parse_completion_request(R"({"prompt":""})");
  ASSERT_FALSE(c);
  EXPECT_EQ(c.error().param, "prompt");
  c = parse_completion_request(R"({"prompt":"Once","max_tokens":3})");
  ASSERT_TRUE(c);
  EXPECT_FALSE(c->chat);
  EXPECT_EQ(c->job.max_tokens, 3);
  // Without max_tokens a chat asks for the rest of the context (0: the head
  // decides from the prompt's length, bounded by the context length), as
  // OpenAI and vLLM default; a completion's default never passes the
  // server's limit (the gateway fuzzer found one defaulting past it).
  l = {};
  l.max_tokens = 64;
  auto d = parse_chat_request(R"({"messages":[{"role":"user","content":"hi"}]})", l);
  ASSERT_TRUE(d);
  EXPECT_EQ(d->job.max_tokens, 0);
  d = parse_chat_request(R"({"messages":[{"role":"user","content":"hi"}],"max_tokens":65})", l);
  ASSERT_FALSE(d);
  l.max_tokens = 8;
  c = parse_completion_request(R"({"prompt":"Once"})", l);
  ASSERT_TRUE(c);
  EXPECT_EQ(c->job.max_tokens, 8);
}

// The body's JSON is bounded while it is parsed: brackets nested past the
// depth limit, or more values than the limit, stop the parse with a 400
// that says which (a 40 MB body of nested brackets used to be built in
// full: 1.4 GB, 7 s). A real request's depth and size pass.
TEST(OpenAiParse, DeepOrHugeJsonIsRefusedWhileParsing) {
  const std::string deep =
      R"({"model":"m","messages":)" + std::string(200000, '[') + std::string(200000, ']') + "}";
  for (const auto& body :
       {deep, std::string(R"({"prompt":)") + std::string(100, '[') + std::string(100, ']') + "}"}) {
    auto r = parse_chat_request(body);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().status, 400);
    EXPECT_NE(r.error().message.find("nests deeper than 32 levels"), std::string::npos)
        << r.error().message;
    auto c = parse_completion_request(body);
    ASSERT_FALSE(c);
    EXPECT_NE(c.error().message.find("nests deeper than 32 levels"), std::string::npos);
  }
  // Exactly at the depth limit: parsed (and then refused for what it says).
  request_limits l;
  l.max_json_depth = 4;
  auto at = parse_completion_request(R"({"prompt":[[["a"]]]})", l);
  ASSERT_FALSE(at);
  EXPECT_EQ(at.error().message.find("nests deeper"), std::string::npos) << at.error().message;
  auto past = parse_completion_request(R"({"prompt":[[[["a"]]]]})", l);
  ASSERT_FALSE(past);
  EXPECT_NE(past.error().message.find("nests deeper than 4 levels"), std::string::npos);
  // Too many values, flat.
  l = {};
  l.max_json_values = 1000;
  std::string many = R"({"prompt":"Once","stop":[)";
  for (int i = 0; i < 2000; ++i) many += i ? ",0" : "0";
  many += "]}";
  auto m = parse_completion_request(many, l);
  ASSERT_FALSE(m);
  EXPECT_EQ(m.error().status, 400);
  EXPECT_NE(m.error().message.find("more than 1000 JSON values"), std::string::npos)
      << m.error().message;
  // The default limits leave a real chat request alone.
  json chat{
      {"model", "m"},
      {"messages",
       json::array({{{"role", "user"},
                     {"content",
                      json::array({{{"type", "image_url"},
                                    {"image_url", {{"url", "data:image/png;base64," + png_b64}}}},
                                   {{"type", "text"}, {"text", "What?"}}})}}})}};
  EXPECT_TRUE(parse_chat_request(chat.dump()));
  // Malformed JSON is still "not valid JSON".
  auto broken = parse_chat_request(R"({"messages":[)");
  ASSERT_FALSE(broken);
  EXPECT_NE(broken.error().message.find("not valid JSON"), std::string::npos);
}

TEST(OpenAiParse, DataUrls) {
  EXPECT_EQ(decode_data_url("data:image/png;base64,aGk=", 16).value(),
            (std::vector<std::uint8_t>{'h', 'i'}));
  EXPECT_EQ(decode_data_url("data:image/jpeg;base64,aGVsbG8=", 16).value().size(), 5u);
  EXPECT_FALSE(decode_data_url("data:image/png;base64,aGk", 16));      // not a multiple of 4
  EXPECT_FALSE(decode_data_url("data:image/png,aGk=", 16));            // not base64
  EXPECT_FALSE(decode_data_url("data:image/png;base64,", 16));         // empty
  EXPECT_FALSE(decode_data_url("data:image/png;base64,aGVsbG8=", 4));  // too large
  EXPECT_FALSE(decode_data_url("file:///etc/passwd", 16));
}

TEST(OpenAiParse, RemoteImageUrlsOnlyWhenAllowed) {
  json body{
      {"messages",
       json::array(
           {{{"role", "user"},
             {"content",
              json::array(
                  {{{"type", "text"}, {"text", "What?"}},
                   {{"type", "image_url"}, {"image_url", {{"url", "https://example.com/a.png"}}}},
                   {{"type", "image_url"},
                    {"image_url", {{"url", "data:image/png;base64," + png_b64}}}}})}}})}};
  auto off = parse_chat_request(body.dump());
  ASSERT_FALSE(off);
  EXPECT_EQ(off.error().status, 400);
  EXPECT_EQ(off.error().param, "messages[0].content[1].image_url");
  EXPECT_NE(off.error().message.find("--allow-remote-images"), std::string::npos)
      << off.error().message;
  request_limits l;
  l.remote_images = true;
  auto on = parse_chat_request(body.dump(), l);
  ASSERT_TRUE(on) << on.error().message;
  ASSERT_EQ(on->job.images.size(), 2u);
  ASSERT_EQ(on->remote_images.size(), 1u);
  EXPECT_EQ(on->remote_images[0].index, 0u);
  EXPECT_EQ(on->remote_images[0].url, "https://example.com/a.png");
  EXPECT_EQ(on->remote_images[0].param, "messages[0].content[1].image_url");
  EXPECT_TRUE(on->job.images[0].bytes.empty());  // the gateway fetches it
  EXPECT_EQ(on->job.images[1].bytes.size(), 8u);
  EXPECT_EQ(on->job.turns[0].images, 2);
  // Other schemes stay refused even when remote images are on.
  body["messages"][0]["content"][1]["image_url"]["url"] = "file:///etc/passwd";
  EXPECT_FALSE(parse_chat_request(body.dump(), l));
}

TEST(OpenAiResponses, ChunksAndCompletionsHaveOpenAisShape) {
  api_request r;
  r.chat = true;
  r.model = "m";
  troupe::actors::finish_event f;
  f.reason = troupe::actors::finish_reason::length;
  f.text = "ab";
  f.tokens = {1, 2};
  f.prompt_tokens = 5;
  f.cached_tokens = 4;
  auto j = json::parse(completion_json(r, "id1", 7, {{f, {}}}));
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 4);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "ab");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(j["usage"]["total_tokens"], 7);
  auto c = json::parse(chunk_json(r, "id1", 7, 0, "a", ""));
  EXPECT_EQ(c["choices"][0]["delta"]["content"], "a");
  EXPECT_TRUE(c["choices"][0]["finish_reason"].is_null());
  EXPECT_FALSE(c.contains("usage"));
  auto u = json::parse(usage_chunk_json(r, "id1", 7, {5, 2, 3}));
  EXPECT_EQ(u["usage"]["prompt_tokens_details"]["cached_tokens"], 3);
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["completion_tokens"], 2);
  EXPECT_EQ(u["usage"]["total_tokens"], 7);
  // continuous_usage_stats: a chunk carries the usage so far.
  const usage_counts so_far{5, 1, std::nullopt};
  auto cu = json::parse(chunk_json(r, "id1", 7, 1, "a", "", {}, &so_far));
  EXPECT_EQ(cu["usage"]["completion_tokens"], 1);
  EXPECT_FALSE(cu["usage"].contains("prompt_tokens_details")) << "not known mid-stream";
  EXPECT_EQ(cu["choices"][0]["index"], 1);
  // Invalid UTF-8 in a token's text does not break the JSON.
  EXPECT_NO_THROW(json::parse(chunk_json(r, "id1", 7, 0, std::string("\xff\xfe"), "")));
}

troupe::models::token_logprob lp_of(std::int32_t tok, float lp, std::string piece) {
  troupe::models::token_logprob x;
  x.token = tok;
  x.logprob = lp;
  x.piece = std::move(piece);
  x.top_ids = {tok, 9};
  x.top_logprobs = {lp, lp - 1.0f};
  x.top_pieces = {x.piece, "\xe2"};  // half a character: bytes stay exact
  return x;
}

TEST(OpenAiResponses, LogprobsAndChoicesHaveOpenAisShape) {
  api_request r;
  r.chat = true;
  r.model = "m";
  r.job.logprobs = 2;
  troupe::actors::finish_event f1, f2;
  f1.reason = troupe::actors::finish_reason::stop;
  f1.text = "hi";
  f1.tokens = {4, 5};
  f1.prompt_tokens = 3;
  f2 = f1;
  f2.text = "yo!";
  f2.tokens = {6, 7, 8};
  const std::vector<choice_output> choices{
      {f1, {lp_of(4, -0.5f, "h"), lp_of(5, -0.25f, "i")}},
      {f2, {lp_of(6, -1.0f, "y"), lp_of(7, -2.0f, "o"), lp_of(8, -3.0f, "!")}}};
  auto j = json::parse(completion_json(r, "id", 1, choices));
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["index"], 1);
  EXPECT_EQ(j["choices"][1]["message"]["content"], "yo!");
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);  // one prompt
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);
  const auto& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], "h");
  EXPECT_FLOAT_EQ(content[0]["logprob"].get<float>(), -0.5f);
  EXPECT_EQ(content[0]["bytes"], json::array({104}));
  ASSERT_EQ(content[1]["top_logprobs"].size(), 2u);
  EXPECT_EQ(content[1]["top_logprobs"][1]["bytes"], json::array({0xe2}));
  EXPECT_FLOAT_EQ(content[1]["top_logprobs"][1]["logprob"].get<float>(), -1.25f);

  // Completions: the legacy shape, offsets counted from the echoed prompt.
  r.chat = false;
  r.echo = "ab";
  auto c = json::parse(completion_json(r, "id", 1, {choices[1]}));
  const auto& l = c["choices"][0]["logprobs"];
  EXPECT_EQ(l["tokens"], json::array({"y", "o", "!"}));
  EXPECT_EQ(l["text_offset"], json::array({2, 3, 4}));
  EXPECT_FLOAT_EQ(l["token_logprobs"][2].get<float>(), -3.0f);
  EXPECT_FLOAT_EQ(l["top_logprobs"][0]["y"].get<float>(), -1.0f);
  EXPECT_EQ(c["choices"][0]["text"], "abyo!");
}

TEST(OpenAiRequests, LogprobsNAndTokenPromptsAreRead) {
  auto chat = parse_chat_request(
      R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":3,"n":4})");
  ASSERT_TRUE(chat) << chat.error().message;
  EXPECT_EQ(chat->job.logprobs, 3);
  EXPECT_EQ(chat->n, 4);
  auto plain =
      parse_chat_request(R"({"messages":[{"role":"user","content":"x"}],"logprobs":true})");
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->job.logprobs, 0);
  EXPECT_EQ(parse_chat_request(R"({"messages":[{"role":"user","content":"x"}]})")->job.logprobs,
            -1);
  // top_logprobs without logprobs, out of range, n out of range: refused by name.
  auto no_lp =
      parse_chat_request(R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})");
  ASSERT_FALSE(no_lp);
  EXPECT_EQ(no_lp.error().param, "top_logprobs");
  EXPECT_FALSE(parse_chat_request(
      R"({"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21})"));
  EXPECT_EQ(
      parse_chat_request(R"({"messages":[{"role":"user","content":"x"}],"n":17})").error().param,
      "n");
  EXPECT_FALSE(parse_chat_request(R"({"messages":[{"role":"user","content":"x"}],"n":0})"));

  auto comp = parse_completion_request(R"({"prompt":[1,15043,3186],"logprobs":5})");
  ASSERT_TRUE(comp) << comp.error().message;
  EXPECT_EQ(comp->job.prompt_ids, (std::vector<std::int32_t>{1, 15043, 3186}));
  EXPECT_TRUE(comp->job.prompt.empty());
  EXPECT_EQ(comp->job.logprobs, 5);
  auto one = parse_completion_request(R"({"prompt":["hello"]})");
  ASSERT_TRUE(one);
  EXPECT_EQ(one->job.prompt, "hello");
  auto nested = parse_completion_request(R"({"prompt":[[7,8]]})");
  ASSERT_TRUE(nested);
  EXPECT_EQ(nested->job.prompt_ids, (std::vector<std::int32_t>{7, 8}));
  EXPECT_EQ(parse_completion_request(R"({"prompt":["a","b"]})").error().param, "prompt");
  EXPECT_FALSE(parse_completion_request(R"({"prompt":[1,-2]})"));
  EXPECT_FALSE(parse_completion_request(R"({"prompt":[]})"));
  EXPECT_FALSE(parse_completion_request(R"({"prompt":[1.5]})"));
  EXPECT_EQ(parse_completion_request(R"({"prompt":[1,2],"echo":true})").error().param, "echo");
  EXPECT_EQ(parse_completion_request(R"({"prompt":"a","echo":true,"logprobs":1})").error().param,
            "echo");
  auto usage = parse_completion_request(
      R"({"prompt":"a","stream":true,"stream_options":{"continuous_usage_stats":true}})");
  ASSERT_TRUE(usage);
  EXPECT_TRUE(usage->continuous_usage);
}

}  // namespace

// A field a client sets either works or is refused by name: OpenAI's
// fields troupe does not implement yet are refused unless their value asks
// for nothing (a penalty of 0, no tools, ...), and unknown fields are
// refused, never ignored.
TEST(OpenAiParse, UnsupportedFieldsAreRefusedByNameNeverIgnored) {
  const json chat{{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}};
  const json completion{{"prompt", "Once"}};
  struct probe {
    bool chat;
    const char* key;
    json value;
    bool accepted;
  };
  const probe probes[] = {
      {true, "logprobs", true, true},
      {true, "logprobs", false, true},
      {true, "logprobs", 2, false},      // chat's is a boolean
      {true, "top_logprobs", 3, false},  // needs logprobs: true
      {false, "logprobs", 2, true},
      {false, "logprobs", true, false},  // completions' is a count
      {false, "logprobs", 21, false},
      {false, "logprobs", nullptr, true},
      {true, "n", 3, true},
      {false, "n", 2, true},
      {true, "response_format", {{"type", "json_object"}}, true},
      {true, "response_format", {{"type", "text"}}, true},
      {true, "response_format", {{"type", "xml"}}, false},
      {false, "response_format", {{"type", "json_schema"}, {"json_schema", json::object()}}, false},
      {false,
       "response_format",
       {{"type", "json_schema"}, {"json_schema", {{"schema", {{"type", "integer"}}}}}},
       true},
      {true,
       "response_format",
       {{"type", "json_schema"},
        {"json_schema", {{"schema", {{"type", "string"}, {"format", "email"}}}}}},
       false},
      {false, "guided_regex", "[a-z]+", true},
      {false, "guided_regex", "(", false},
      {true, "guided_choice", json::array({"a", "b"}), true},
      {true, "guided_choice", json::array(), false},
      {true, "guided_json", {{"type", "object"}}, true},
      {false, "grammar", "root ::= \"x\"", true},
      {false, "guided_grammar", "root ::= undefined", false},
      {true, "tools", json::array({{{"type", "function"}}}), false},
      {true, "tools", json::array(), true},
      {true, "tool_choice", "auto", false},
      {true, "tool_choice", "none", true},
      // Implemented: read, and refused only when malformed or out of range.
      {true, "frequency_penalty", 0.5, true},
      {true, "frequency_penalty", 2.5, false},
      {false, "presence_penalty", -1, true},
      {false, "presence_penalty", "high", false},
      {true, "repetition_penalty", 1.2, true},
      {true, "repetition_penalty", 0, false},
      {true, "logit_bias", {{"42", 5}}, true},
      {true, "logit_bias", {{"42", 101}}, false},
      {true, "logit_bias", {{"x", 1}}, false},
      {true, "logit_bias", json::object(), true},
      {true, "min_tokens", 3, true},
      {true, "min_tokens", -1, false},
      {false, "min_tokens", 17, false},  // past the completions default of 16 max_tokens
      {true, "stop_token_ids", json::array({2, 3}), true},
      {true, "stop_token_ids", json::array({"2"}), false},
      {false, "echo", true, true},
      {false, "echo", "yes", false},
      {true, "echo", true, false},  // completions only
      {false, "suffix", "end", false},
      {false, "best_of", 3, false},
      {false, "best_of", 1, true},
      {true, "priority", 1, true},
      {false, "priority", -5, true},
      {true, "priority", "high", false},
      {true, "priority", 1.5, false},
      {true, "priority", std::int64_t{1} << 40, false},
      {true, "cache_salt", "abc", true},
      {false, "cache_salt", "", false},
      {true, "cache_salt", 7, false},
      {true, "cache_salt", std::string(257, 's'), false},
      {true, "user", "someone", true},
      {true, "parallel_tool_calls", true, true},
      {true, "store", true, false},
      {true, "frobnicate", 1, false},             // unknown
      {false, "messages", json::array(), false},  // the other endpoint's field
      {false, "max_completion_tokens", 4, false},
      {true, "stream_options", {{"continuous_usage_stats", true}}, true},
      {true, "stream_options", {{"continuous_usage_stats", "yes"}}, false},
      {true, "stream_options", {{"include_usage", "yes"}}, false},
      {true, "ignore_eos", "yes", false},
  };
  for (const auto& p : probes) {
    json body = p.chat ? chat : completion;
    body[p.key] = p.value;
    SCOPED_TRACE(body.dump());
    auto r = p.chat ? parse_chat_request(body.dump()) : parse_completion_request(body.dump());
    EXPECT_EQ(r.has_value(), p.accepted);
    if (!r) {
      EXPECT_EQ(r.error().status, 400);
      EXPECT_EQ(r.error().param.substr(0, std::string(p.key).size()), p.key) << r.error().message;
      EXPECT_NE(r.error().message.find(p.key), std::string::npos) << r.error().message;
    }
  }
}

// The served name is the model's own (its folder or file), and a request
// naming another model is refused as OpenAI refuses it: 404
// model_not_found, never answered by whatever model is loaded.
TEST(OpenAiModels, TheServedNameIsTheModelsOwnAndOthersAre404) {
  EXPECT_EQ(default_served_name("/models/Llama-3-8B-Instruct/"), "Llama-3-8B-Instruct");
  EXPECT_EQ(default_served_name("assets/tiny-llava-shapes"), "tiny-llava-shapes");
  EXPECT_EQ(default_served_name("/tmp/gemma-3-270m-q4_k_m.gguf"), "gemma-3-270m-q4_k_m");
  EXPECT_EQ(default_served_name("model.gguf.part"), "model.gguf.part");
  EXPECT_FALSE(check_model("", "tiny"));
  EXPECT_FALSE(check_model("tiny", "tiny"));
  auto e = check_model("gpt-4o", "tiny");
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 404);
  EXPECT_EQ(e->code, "model_not_found");
  EXPECT_EQ(e->param, "model");
  EXPECT_NE(e->message.find("'gpt-4o' does not exist"), std::string::npos) << e->message;
  // A long name cut mid-character still gives valid JSON.
  auto cut = check_model(std::string(127, 'a') + "\xc3\xa9", "tiny");
  ASSERT_TRUE(cut);
  auto j = json::parse(error_json(*cut));
  EXPECT_EQ(j["error"]["code"], "model_not_found");
}

namespace {

const char* weather_tool = R"({"type": "function", "function": {"name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": false}}})";

}  // namespace

// Tools: described to the model in the system message, required or named
// calls constrained by a grammar, history with calls and tool answers in
// the Hermes form, and the model's <tool_call> blocks parsed back.
TEST(OpenAiTools, ToolsBecomeAPromptAGrammarAndToolCalls) {
  json body{{"messages", json::array({{{"role", "user"}, {"content", "Weather in Oslo?"}}})},
            {"tools", json::array({json::parse(weather_tool)})}};
  auto plain = parse_chat_request(body.dump());
  ASSERT_TRUE(plain) << plain.error().message;
  EXPECT_TRUE(plain->tools_active);  // auto by default
  EXPECT_TRUE(plain->job.grammar.empty());
  ASSERT_EQ(plain->job.turns.size(), 2u);
  EXPECT_EQ(plain->job.turns[0].role, "system");
  EXPECT_NE(plain->job.turns[0].content.find("get_weather"), std::string::npos);
  EXPECT_NE(plain->job.turns[0].content.find("<tool_call>"), std::string::npos);

  body["tool_choice"] = "required";
  auto required = parse_chat_request(body.dump());
  ASSERT_TRUE(required);
  ASSERT_FALSE(required->job.grammar.empty());
  auto g = troupe::models::grammar::parse(required->job.grammar);
  ASSERT_TRUE(g);
  troupe::models::grammar_state s(*g);
  EXPECT_TRUE(
      s.accept("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
               "\"Oslo\"}}\n</tool_call>"));
  EXPECT_TRUE(s.complete());
  troupe::models::grammar_state wrong(*g);
  EXPECT_FALSE(wrong.accept("<tool_call>\n{\"name\": \"get_time\""));

  body["tool_choice"] = {{"type", "function"}, {"function", {{"name", "nope"}}}};
  EXPECT_EQ(parse_chat_request(body.dump()).error().param, "tool_choice");
  body["tool_choice"] = "none";
  auto none = parse_chat_request(body.dump());
  ASSERT_TRUE(none);
  EXPECT_FALSE(none->tools_active);
  EXPECT_EQ(none->job.turns.size(), 1u);  // no tools prompt
  body["tool_choice"] = "required";
  body["response_format"] = {{"type", "json_object"}};
  EXPECT_EQ(parse_chat_request(body.dump()).error().param, "tool_choice");
  body.erase("response_format");
  auto bad_params = json::parse(weather_tool);
  bad_params["function"]["parameters"]["properties"]["city"]["format"] = "city";
  body["tools"] = json::array({bad_params});
  auto refused = parse_chat_request(body.dump());
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("format"), std::string::npos) << refused.error().message;

  // History: an assistant's call and the tool's answer.
  json history{
      {"messages",
       json::array({{{"role", "user"}, {"content", "Weather in Oslo?"}},
                    {{"role", "assistant"},
                     {"content", nullptr},
                     {"tool_calls", json::array({{{"id", "call_1"},
                                                  {"type", "function"},
                                                  {"function",
                                                   {{"name", "get_weather"},
                                                    {"arguments", "{\"city\": \"Oslo\"}"}}}}})}},
                    {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "sunny, 4 C"}}})},
      {"tools", json::array({json::parse(weather_tool)})}};
  auto h = parse_chat_request(history.dump());
  ASSERT_TRUE(h) << h.error().message;
  ASSERT_EQ(h->job.turns.size(), 4u);
  EXPECT_NE(h->job.turns[2].content.find("<tool_call>"), std::string::npos);
  EXPECT_NE(h->job.turns[2].content.find("\"city\":\"Oslo\""), std::string::npos)
      << h->job.turns[2].content;
  EXPECT_EQ(h->job.turns[3].role, "user");
  EXPECT_EQ(h->job.turns[3].content, "<tool_response>\nsunny, 4 C\n</tool_response>");

  // Output: calls of known tools become tool_calls, the rest stays text.
  const std::vector<troupe::models::tool_spec> tools{{"get_weather", "", ""}};
  auto t = parse_tool_calls(
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
      "\"Oslo\"}}\n</tool_call>\n<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>",
      tools);
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].first, "get_weather");
  EXPECT_EQ(json::parse(t.calls[0].second), json({{"city", "Oslo"}}));
  ASSERT_TRUE(t.content);
  EXPECT_NE(t.content->find("Let me check."), std::string::npos);
  EXPECT_NE(t.content->find("unknown"), std::string::npos);
  auto only = parse_tool_calls(
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"X\"}}\n</tool_call>",
      tools);
  EXPECT_FALSE(only.content);  // OpenAI's null content
  EXPECT_EQ(parse_tool_calls("just text", tools).content, "just text");

  api_request r;
  r.chat = true;
  r.model = "m";
  r.tools = tools;
  r.tools_active = true;
  troupe::actors::finish_event f;
  f.reason = troupe::actors::finish_reason::stop;
  f.text =
      "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"X\"}}\n</tool_call>";
  auto j = json::parse(completion_json(r, "chatcmpl-9", 1, {{f, {}}}));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls");
  EXPECT_TRUE(j["choices"][0]["message"]["content"].is_null());
  const auto& call = j["choices"][0]["message"]["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(call["function"]["arguments"].get<std::string>())["city"], "X");
  EXPECT_EQ(call["id"], "call_9_0_0");
  // parallel_tool_calls false: one call, also when the model wrote two.
  f.text += "\n" + f.text;
  EXPECT_EQ(json::parse(completion_json(r, "chatcmpl-9", 1,
                                        {{f, {}}}))["choices"][0]["message"]["tool_calls"]
                .size(),
            2u);
  r.parallel_tool_calls = false;
  EXPECT_EQ(json::parse(completion_json(r, "chatcmpl-9", 1,
                                        {{f, {}}}))["choices"][0]["message"]["tool_calls"]
                .size(),
            1u);
}

TEST(OpenAiParse, InputAudioPartsBecomeClipsOfTheirTurn) {
  const std::string wav_b64 = "UklGRgAAAABXQVZF";  // "RIFF", a length, "WAVE"
  auto chat = [&](const json& audio_part) {
    return json{
        {"messages",
         json::array(
             {{{"role", "user"},
               {"content", json::array({{{"type", "text"}, {"text", "What?"}}, audio_part})}}})}};
  };
  json part{{"type", "input_audio"}, {"input_audio", {{"data", wav_b64}, {"format", "wav"}}}};
  auto r = parse_chat_request(chat(part).dump());
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->job.audios.size(), 1u);
  EXPECT_EQ(r->job.audios[0].kind, troupe::actors::media_kind::audio);
  EXPECT_EQ(r->job.audios[0].bytes,
            (std::vector<std::uint8_t>{'R', 'I', 'F', 'F', 0, 0, 0, 0, 'W', 'A', 'V', 'E'}));
  EXPECT_EQ(r->job.turns[0].audios, 1);
  EXPECT_EQ(r->job.turns[0].images, 0);
  EXPECT_TRUE(r->job.images.empty());
  // Mistakes name their field.
  auto refused = [&](json p, const std::string& param, const std::string& needle,
                     request_limits limits = {}) {
    auto e = parse_chat_request(chat(p).dump(), limits);
    ASSERT_FALSE(e) << p.dump();
    EXPECT_EQ(e.error().param, param) << e.error().message;
    EXPECT_NE(e.error().message.find(needle), std::string::npos) << e.error().message;
  };
  auto with = [&](const char* key, json v) {
    json p = part;
    p["input_audio"][key] = std::move(v);
    return p;
  };
  refused(with("format", "ogg"), "messages[0].content[1].input_audio.format", "\"wav\"");
  refused(with("format", "mp3"), "messages[0].content[1].input_audio.data", "not mp3 audio");
  refused(with("data", "@@@@"), "messages[0].content[1].input_audio.data", "base64");
  refused(with("data", 5), "messages[0].content[1].input_audio", "base64 string");
  request_limits none;
  none.max_audios = 0;
  refused(part, "messages[0].content[1]", "at most 0 audio clips", none);
  request_limits tiny;
  tiny.max_audio_bytes = 4;
  auto big = parse_chat_request(chat(part).dump(), tiny);
  ASSERT_FALSE(big);
  EXPECT_EQ(big.error().status, 413);
}

TEST(OpenAiParse, VideoUrlPartsBecomeVideosOfTheirTurnWithTheirSampling) {
  const std::string mp4_b64 = "AAAAGGZ0eXBtcDQy";  // a box size, "ftyp", "mp42"
  auto chat = [&](const json& video_part, json extra = json::object()) {
    json j{{"messages",
            json::array({{{"role", "user"},
                          {"content", json::array({{{"type", "text"}, {"text", "What moves?"}},
                                                   video_part,
                                                   video_part})}}})}};
    j.update(extra);
    return j;
  };
  json part{{"type", "video_url"}, {"video_url", {{"url", "data:video/mp4;base64," + mp4_b64}}}};
  auto r = parse_chat_request(
      chat(part, {{"media_io_kwargs", {{"video", {{"num_frames", 12}, {"fps", 1.5}}}}}}).dump());
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->job.videos.size(), 2u);
  EXPECT_EQ(r->job.turns[0].videos, 2);
  EXPECT_EQ(r->job.turns[0].images, 0);
  for (const auto& v : r->job.videos) {
    EXPECT_EQ(v.kind, troupe::actors::media_kind::video);
    EXPECT_EQ(v.bytes,
              (std::vector<std::uint8_t>{0, 0, 0, 0x18, 'f', 't', 'y', 'p', 'm', 'p', '4', '2'}));
    EXPECT_EQ(v.num_frames, 12);
    EXPECT_EQ(v.fps, 1.5);
  }
  // Without media_io_kwargs: the server's default sampling.
  auto plain = parse_chat_request(chat(part).dump());
  ASSERT_TRUE(plain);
  EXPECT_EQ(plain->job.videos[0].num_frames, 0);
  // Mistakes name their field.
  auto refused = [&](json body, const std::string& param, const std::string& needle,
                     request_limits limits = {}) {
    auto e = parse_chat_request(body.dump(), limits);
    ASSERT_FALSE(e) << body.dump();
    EXPECT_EQ(e.error().param, param) << e.error().message;
    EXPECT_NE(e.error().message.find(needle), std::string::npos) << e.error().message;
  };
  json image_url = part;
  image_url["video_url"]["url"] = "data:image/png;base64," + mp4_b64;
  refused(chat(image_url), "messages[0].content[1].video_url", "not a video");
  json remote = part;
  remote["video_url"]["url"] = "https://example.com/a.mp4";
  refused(chat(remote), "messages[0].content[1].video_url", "--allow-remote-images");
  json no_url{{"type", "video_url"}, {"video_url", 5}};
  refused(chat(no_url), "messages[0].content[1].video_url", "must be a string");
  refused(chat(part, {{"media_io_kwargs", {{"video", {{"num_frames", 65}}}}}}),
          "media_io_kwargs.video.num_frames", "from 1 to 64");
  refused(chat(part, {{"media_io_kwargs", {{"video", {{"fps", -1}}}}}}),
          "media_io_kwargs.video.fps", "from 0 to 240");
  refused(chat(part, {{"media_io_kwargs", {{"video", {{"backend", "x"}}}}}}),
          "media_io_kwargs.video.backend", "not supported");
  refused(chat(part, {{"media_io_kwargs", {{"image", {{"size", 4}}}}}}), "media_io_kwargs.image",
          "video only");
  request_limits one;
  one.max_videos = 1;
  refused(chat(part), "messages[0].content[2]", "at most 1 videos", one);
  request_limits tiny;
  tiny.max_video_bytes = 4;
  auto big = parse_chat_request(chat(part).dump(), tiny);
  ASSERT_FALSE(big);
  EXPECT_EQ(big.error().status, 413);
  // vLLM's mm_processor_kwargs.use_audio_in_video: every video's track too.
  auto heard = parse_chat_request(
      chat(part, {{"mm_processor_kwargs", {{"use_audio_in_video", true}}}}).dump());
  ASSERT_TRUE(heard) << heard.error().message;
  for (const auto& v : heard->job.videos) EXPECT_TRUE(v.audio);
  EXPECT_FALSE(plain->job.videos[0].audio);
  refused(chat(part, {{"mm_processor_kwargs", {{"use_audio_in_video", 1}}}}),
          "mm_processor_kwargs.use_audio_in_video", "must be a boolean");
  refused(chat(part, {{"mm_processor_kwargs", {{"num_crops", 4}}}}),
          "mm_processor_kwargs.num_crops", "use_audio_in_video only");
  // A text-only turn asking for frames has no video to sample.
  json text_only{{"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})},
                 {"media_io_kwargs", {{"video", {{"num_frames", 4}}}}}};
  refused(text_only, "media_io_kwargs", "has no video");
}

// A multipart/form-data body of (name, filename, value) parts.
std::string form(const std::string& boundary,
                 const std::vector<std::tuple<std::string, std::string, std::string>>& parts) {
  std::string out;
  for (const auto& [name, filename, value] : parts) {
    out += "--" + boundary + "\r\nContent-Disposition: form-data; name=\"" + name + "\"";
    if (!filename.empty()) out += "; filename=\"" + filename + "\"\r\nContent-Type: audio/wav";
    out += "\r\n\r\n" + value + "\r\n";
  }
  return out + "--" + boundary + "--\r\n";
}

TEST(OpenAiTranscriptions, AnUploadBecomesAChatTurnWithItsClip) {
  const std::string wav("RIFF\0\0\0\0WAVE\r\n--not-the-boundary", 31);
  const std::string type = "multipart/form-data; boundary=\"xyz\"";
  auto r = parse_transcription_request(type, form("xyz", {{"file", "q.wav", wav},
                                                          {"model", "", "whisper-1"},
                                                          {"response_format", "", "srt"},
                                                          {"temperature", "", "0.25"},
                                                          {"language", "", "en"}}));
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->model, "whisper-1");
  EXPECT_EQ(r->transcription_format, "srt");
  ASSERT_EQ(r->job.audios.size(), 1u);
  EXPECT_EQ(std::string(r->job.audios[0].bytes.begin(), r->job.audios[0].bytes.end()), wav);
  EXPECT_EQ(r->job.audios[0].name, "q.wav");
  ASSERT_EQ(r->job.turns.size(), 1u);
  EXPECT_EQ(r->job.turns[0].audios, 1);
  EXPECT_EQ(r->job.turns[0].content, "Transcribe the audio.");
  EXPECT_TRUE(r->job.has_temperature);
  EXPECT_DOUBLE_EQ(r->job.temperature, 0.25);
  EXPECT_FALSE(r->stream);
  // The answer in each format.
  troupe::actors::finish_event f;
  f.text = " the red circle";
  f.tokens = {5, 6, 7};
  f.prompt_tokens = 30;
  auto [srt, srt_type] = transcription_body(*r, f, 3.3);
  EXPECT_EQ(srt, "1\n00:00:00,000 --> 00:00:03,300\nthe red circle\n\n");
  r->transcription_format = "vtt";
  EXPECT_EQ(transcription_body(*r, f, 61.25).first,
            "WEBVTT\n\n00:00:00.000 --> 00:01:01.250\nthe red circle\n\n");
  r->transcription_format = "text";
  EXPECT_EQ(transcription_body(*r, f, 1).first, "the red circle\n");
  r->transcription_format = "verbose_json";
  auto v = json::parse(transcription_body(*r, f, 3.3).first);
  EXPECT_EQ(v["text"], "the red circle");
  EXPECT_EQ(v["language"], "english");
  EXPECT_DOUBLE_EQ(v["duration"].get<double>(), 3.3);
  EXPECT_EQ(v["segments"][0]["tokens"], json::array({5, 6, 7}));
  EXPECT_EQ(v["usage"]["output_tokens"], 3);
  r->transcription_format = "json";
  EXPECT_EQ(json::parse(transcription_body(*r, f, 0).first)["text"], "the red circle");
}

TEST(OpenAiTranscriptions, WhatCannotBeHonouredIsRefusedByName) {
  const std::string type = "multipart/form-data; boundary=b";
  auto refused = [&](const std::string& body, const std::string& param, const std::string& needle,
                     const std::string& content_type = "multipart/form-data; boundary=b") {
    auto e = parse_transcription_request(content_type, body);
    ASSERT_FALSE(e) << body;
    EXPECT_EQ(e.error().param, param) << e.error().message;
    EXPECT_NE(e.error().message.find(needle), std::string::npos) << e.error().message;
    EXPECT_GE(e.error().status, 400);
    EXPECT_LT(e.error().status, 500);
  };
  const std::tuple<std::string, std::string, std::string> file{"file", "a.wav", "RIFF"};
  refused(form("b", {{"model", "", "m"}}), "file", "missing");
  refused(form("b", {file, {"prompt", "", "Hello"}}), "prompt", "not supported");
  refused(form("b", {file, {"stream", "", "true"}}), "stream", "not supported");
  refused(form("b", {file, {"language", "", "fr"}}), "language", "English");
  refused(form("b", {file, {"response_format", "", "xml"}}), "response_format", "srt");
  refused(form("b", {file, {"temperature", "", "hot"}}), "temperature", "[0, 2]");
  refused(form("b", {file, {"timestamp_granularities[]", "", "word"}}), "timestamp_granularities[]",
          "segment only");
  refused(form("b", {file, {"beam_size", "", "5"}}), "beam_size", "unrecognized");
  refused(form("b", {file, file}), "file", "twice");
  refused(form("b", {file}), "", "multipart/form-data", "application/json");
  refused(form("b", {file}), "", "boundary", "multipart/form-data");
  // Malformed bodies: cut short, headers that never end, no name.
  const auto whole = form("b", {file});
  refused(whole.substr(0, whole.size() - 12), "", "never ends");
  refused("--b\r\nContent-Disposition: form-data; name=\"file\"", "", "8 KiB");
  refused("--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--", "", "without a name");
  request_limits tiny;
  tiny.max_audio_bytes = 2;
  auto big = parse_transcription_request(type, form("b", {file}), tiny);
  ASSERT_FALSE(big);
  EXPECT_EQ(big.error().status, 413);
  // Many parts are bounded.
  std::vector<std::tuple<std::string, std::string, std::string>> many(
      40, {"timestamp_granularities[]", "", "segment"});
  refused(form("b", many), "", "more than 32 parts");
}
