#include "serve/openai.hpp"

#include <charconv>

#include <openssl/evp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>

#include "models/grammar.hpp"

namespace troupe::serve {

using nlohmann::json;

namespace {

api_error bad(const std::string& message, const std::string& param = "") {
  api_error e;
  e.status = 400;
  e.message = message;
  e.param = param;
  return e;
}

// Structured output: OpenAI's response_format, vLLM's guided_* fields and
// llama-server's grammar, compiled to the GBNF the head constrains the
// output with (one of them per request).
std::optional<api_error> read_structured(const json& j, api_request& r) {
  std::string grammar, from;
  auto set = [&](const std::string& field, std::string text) -> std::optional<api_error> {
    if (!from.empty())
      return bad("'" + field + "' and '" + from + "' both constrain the output: give one", field);
    from = field;
    grammar = std::move(text);
    return std::nullopt;
  };
  auto compiled = [&](const std::string& field,
                      models::result<std::string> text) -> std::optional<api_error> {
    if (!text) return bad("'" + field + "': " + text.error().message, field);
    return set(field, std::move(*text));
  };
  if (auto it = j.find("response_format"); it != j.end() && !it->is_null()) {
    auto type = it->is_object() ? it->find("type") : it->end();
    if (!it->is_object() || type == it->end() || !type->is_string())
      return bad("'response_format' must be an object with a 'type'", "response_format");
    const auto t = type->get<std::string>();
    if (t == "json_object") {
      if (auto e = set("response_format", models::json_object_gbnf())) return e;
    } else if (t == "json_schema") {
      auto js = it->find("json_schema");
      if (js == it->end() || !js->is_object() || !js->contains("schema"))
        return bad("'response_format.json_schema' must be an object with a 'schema'",
                   "response_format.json_schema");
      for (const auto& [k, v] : js->items())
        if (k != "name" && k != "schema" && k != "strict" && k != "description")
          return bad("'response_format.json_schema." + k.substr(0, 64) + "' is not supported",
                     "response_format.json_schema");
      if (auto e = compiled("response_format", models::json_schema_to_gbnf((*js)["schema"].dump())))
        return e;
    } else if (t != "text") {
      return bad("'response_format.type' must be text, json_object or json_schema",
                 "response_format");
    }
  }
  if (auto it = j.find("guided_json"); it != j.end() && !it->is_null()) {
    const auto schema = it->is_string() ? it->get<std::string>() : it->dump();
    if (auto e = compiled("guided_json", models::json_schema_to_gbnf(schema))) return e;
  }
  if (auto it = j.find("guided_regex"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) return bad("'guided_regex' must be a string", "guided_regex");
    if (auto e = compiled("guided_regex", models::regex_to_gbnf(it->get<std::string>()))) return e;
  }
  if (auto it = j.find("guided_choice"); it != j.end() && !it->is_null()) {
    std::vector<std::string> choices;
    if (it->is_array() && !it->empty() && it->size() <= 1024)
      for (const auto& c : *it)
        if (c.is_string() && !c.get<std::string>().empty()) choices.push_back(c.get<std::string>());
    if (choices.empty() || choices.size() != it->size())
      return bad("'guided_choice' must be an array of 1 to 1024 non-empty strings",
                 "guided_choice");
    if (auto e = set("guided_choice", models::choice_gbnf(choices))) return e;
  }
  for (const char* key : {"guided_grammar", "grammar"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_string()) return bad(std::string("'") + key + "' must be a string", key);
    if (auto e = set(key, it->get<std::string>())) return e;
  }
  if (grammar.empty()) return std::nullopt;
  // Checked here for a clear 400 (the head checks it again).
  if (auto g = models::grammar::parse(grammar); !g)
    return bad("'" + from + "': " + g.error().message, from);
  r.job.grammar = std::move(grammar);
  return std::nullopt;
}

// The words that tell a model without tools in its chat template which
// functions it may call and how (the Hermes format of <tool_call> tags,
// which troupe parses back into OpenAI's tool_calls).
std::string tools_prompt(const std::vector<models::tool_spec>& tools) {
  std::string out =
      "You can call functions to help answer. Each is described below as JSON, between <tools> "
      "and </tools>:\n<tools>\n";
  for (const auto& t : tools) {
    json d{{"type", "function"}, {"function", {{"name", t.name}}}};
    if (!t.description.empty()) d["function"]["description"] = t.description;
    if (!t.parameters.empty()) d["function"]["parameters"] = json::parse(t.parameters);
    out += d.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  }
  return out +
         "</tools>\nTo call one, answer with a JSON object holding its name and arguments, between "
         "<tool_call> and </tool_call>:\n<tool_call>\n{\"name\": \"the function's name\", "
         "\"arguments\": {\"a parameter\": \"its value\"}}\n</tool_call>";
}

// OpenAI's tools and tool_choice (chat): the tools are described to the
// model in a system message; "required" or a named function constrain the
// output to tool calls (a grammar); "auto" lets the model choose, and its
// <tool_call> blocks become tool_calls.
std::optional<api_error> read_tools(const json& j, api_request& r) {
  auto tools = j.find("tools");
  const bool has = tools != j.end() && !tools->is_null();
  if (has && (!tools->is_array() || tools->size() > 128))
    return bad("'tools' must be an array of at most 128 tools", "tools");
  std::set<std::string> names;
  for (std::size_t i = 0; has && i < tools->size(); ++i) {
    const auto& t = (*tools)[i];
    const std::string where = "tools[" + std::to_string(i) + "]";
    auto fn = t.is_object() ? t.find("function") : t.end();
    if (!t.is_object() || !t.contains("type") || t["type"] != "function" || fn == t.end() ||
        !fn->is_object())
      return bad(where + " must be {\"type\": \"function\", \"function\": {...}}", where);
    for (const auto& [k, v] : fn->items())
      if (k != "name" && k != "description" && k != "parameters" && k != "strict")
        return bad(where + ".function." + k.substr(0, 64) + " is not supported", where);
    auto name = fn->find("name");
    if (name == fn->end() || !name->is_string() || name->get<std::string>().empty() ||
        name->get<std::string>().size() > 64)
      return bad(where + ".function.name must be a string of 1 to 64 characters", where);
    models::tool_spec spec;
    spec.name = name->get<std::string>();
    for (unsigned char c : spec.name)
      if (!std::isalnum(c) && c != '_' && c != '-')
        return bad(where + ".function.name may hold only letters, digits, _ and -", where);
    if (!names.insert(spec.name).second)
      return bad(where + ": a second tool named " + spec.name, where);
    if (auto d = fn->find("description"); d != fn->end() && d->is_string())
      spec.description = d->get<std::string>();
    if (auto p = fn->find("parameters"); p != fn->end() && !p->is_null()) {
      if (!p->is_object()) return bad(where + ".function.parameters must be a JSON Schema", where);
      spec.parameters = p->dump();
      // Checked now: a schema troupe cannot enforce is refused by name.
      if (auto g = models::json_schema_to_gbnf(spec.parameters); !g)
        return bad(where + ".function.parameters: " + g.error().message, where);
    }
    r.tools.push_back(std::move(spec));
  }
  std::string choice = has && !r.tools.empty() ? "auto" : "none";
  std::string named;
  if (auto c = j.find("tool_choice"); c != j.end() && !c->is_null()) {
    if (c->is_string()) {
      choice = c->get<std::string>();
      if (choice != "none" && choice != "auto" && choice != "required")
        return bad("'tool_choice' must be none, auto, required or a function", "tool_choice");
    } else if (c->is_object() && c->contains("function") && (*c)["function"].is_object() &&
               (*c)["function"].contains("name") && (*c)["function"]["name"].is_string()) {
      choice = "named";
      named = (*c)["function"]["name"].get<std::string>();
      if (!names.count(named))
        return bad("'tool_choice' names a function not in 'tools'", "tool_choice");
    } else {
      return bad(
          "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
          "\"function\": {\"name\": ...}}",
          "tool_choice");
    }
    if (choice != "none" && r.tools.empty())
      return bad("'tool_choice' other than none needs 'tools'", "tool_choice");
  }
  bool parallel = true;
  if (auto p = j.find("parallel_tool_calls"); p != j.end() && !p->is_null()) {
    if (!p->is_boolean())
      return bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls");
    parallel = p->get<bool>();
  }
  r.parallel_tool_calls = parallel;
  if (choice == "none") {
    r.tools.clear();
    return std::nullopt;
  }
  if (!r.job.grammar.empty())
    return bad("'tool_choice' and a structured output field both constrain the output",
               "tool_choice");
  r.tools_active = true;
  // The tools go first, in (or as) the system message.
  auto& turns = r.job.turns;
  const auto text = tools_prompt(r.tools);
  if (!turns.empty() && turns.front().role == "system")
    turns.front().content += "\n\n" + text;
  else
    turns.insert(turns.begin(), actors::chat_turn{"system", text, 0, 0});
  if (choice == "required" || choice == "named") {
    std::vector<models::tool_spec> allowed;
    for (const auto& t : r.tools)
      if (choice == "required" || t.name == named) allowed.push_back(t);
    auto g = models::tool_calls_gbnf(allowed, parallel && choice == "required");
    if (!g) return bad("'tools': " + g.error().message, "tools");
    r.job.grammar = std::move(*g);
  }
  return std::nullopt;
}

// Reads the sampling fields both endpoints share.
std::optional<api_error> read_common(const json& j, api_request& r, const request_limits& limits) {
  if (auto it = j.find("model"); it != j.end()) {
    if (!it->is_string()) return bad("'model' must be a string", "model");
    r.model = it->get<std::string>().substr(0, 256);
  }
  if (auto it = j.find("stream"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return bad("'stream' must be a boolean", "stream");
    r.stream = it->get<bool>();
  }
  if (auto it = j.find("stream_options"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return bad("'stream_options' must be an object", "stream_options");
    for (const auto& [k, v] : it->items()) {
      if (k == "include_usage") {
        if (!v.is_boolean())
          return bad("'stream_options.include_usage' must be a boolean",
                     "stream_options.include_usage");
        r.include_usage = v.get<bool>();
      } else if (k == "continuous_usage_stats") {
        if (!v.is_null() && !v.is_boolean())
          return bad("'stream_options.continuous_usage_stats' must be a boolean",
                     "stream_options.continuous_usage_stats");
        r.continuous_usage = v.is_boolean() && v.get<bool>();
      } else {
        return bad("'stream_options." + k.substr(0, 64) + "' is not supported",
                   "stream_options." + k.substr(0, 64));
      }
    }
  }
  auto& job = r.job;
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_number_integer()) return bad(std::string("'") + key + "' must be an integer", key);
    const auto n = it->get<std::int64_t>();
    if (n < 1 || n > limits.max_tokens)
      return bad(
          std::string("'") + key + "' must be in [1, " + std::to_string(limits.max_tokens) + "]",
          key);
    job.max_tokens = n;
  }
  // Not given: the default, but never past the server's limit.
  job.max_tokens = std::min(job.max_tokens, limits.max_tokens);
  auto number = [&](const char* key, double lo, double hi, double& out,
                    bool& set) -> std::optional<api_error> {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_number()) return bad(std::string("'") + key + "' must be a number", key);
    const double v = it->get<double>();
    if (!std::isfinite(v) || v < lo || v > hi)
      return bad(std::string("'") + key + "' must be in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]",
                 key);
    out = v;
    set = true;
    return std::nullopt;
  };
  if (auto e = number("temperature", 0.0, 2.0, job.temperature, job.has_temperature)) return e;
  if (auto e = number("top_p", 0.0, 1.0, job.top_p, job.has_top_p)) return e;
  if (job.has_top_p && job.top_p <= 0.0) return bad("'top_p' must be greater than 0", "top_p");
  if (auto it = j.find("seed"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer()) return bad("'seed' must be an integer", "seed");
    job.seed = static_cast<std::uint64_t>(it->get<std::int64_t>());
  }
  // check_fields saw to its shape.
  if (auto it = j.find("cache_salt"); it != j.end() && it->is_string())
    job.cache_salt = it->get<std::string>();
  if (auto it = j.find("priority"); it != j.end() && !it->is_null()) {
    using lim = std::numeric_limits<std::int32_t>;
    if (!it->is_number_integer() || it->get<std::int64_t>() < lim::min() ||
        it->get<std::int64_t>() > lim::max())
      return bad("'priority' must be an integer (a lower value is served first)", "priority");
    job.priority = static_cast<std::int32_t>(it->get<std::int64_t>());
  }
  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    std::vector<std::string> stops;
    if (it->is_string()) {
      stops.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      for (const auto& s : *it) {
        if (!s.is_string()) return bad("'stop' must be a string or an array of strings", "stop");
        stops.push_back(s.get<std::string>());
      }
    } else {
      return bad("'stop' must be a string or an array of strings", "stop");
    }
    if (stops.size() > limits.max_stops)
      return bad("at most " + std::to_string(limits.max_stops) + " stop strings", "stop");
    for (const auto& s : stops)
      if (s.empty() || s.size() > 256) return bad("a stop string must have 1 to 256 bytes", "stop");
    job.stop_strings = std::move(stops);
  }
  bool set = false;
  if (auto e = number("presence_penalty", -2.0, 2.0, job.presence_penalty, set)) return e;
  if (auto e = number("frequency_penalty", -2.0, 2.0, job.frequency_penalty, set)) return e;
  // vLLM's and transformers' rule (divide a positive logit, multiply a
  // negative one) over prompt and generated tokens.
  if (auto e = number("repetition_penalty", 0.0, 10.0, job.repetition_penalty,
                      job.has_repetition_penalty))
    return e;
  if (job.has_repetition_penalty && job.repetition_penalty <= 0.0)
    return bad("'repetition_penalty' must be greater than 0", "repetition_penalty");
  if (auto it = j.find("logit_bias"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) return bad("'logit_bias' must map token ids to numbers", "logit_bias");
    if (it->size() > 1024) return bad("'logit_bias' holds more than 1024 tokens", "logit_bias");
    for (const auto& [k, v] : it->items()) {
      std::int64_t id = -1;
      const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), id);
      if (ec != std::errc{} || end != k.data() + k.size() || id < 0)
        return bad("'logit_bias' keys must be token ids (non-negative integers)", "logit_bias");
      if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < -100 ||
          v.get<double>() > 100)
        return bad("'logit_bias' values must be numbers in [-100, 100]", "logit_bias");
      job.logit_bias_ids.push_back(id);
      job.logit_bias_values.push_back(v.get<double>());
    }
  }
  if (auto it = j.find("min_tokens"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 0)
      return bad("'min_tokens' must be a non-negative integer", "min_tokens");
    job.min_tokens = it->get<std::int64_t>();
    if (job.max_tokens > 0 && job.min_tokens > job.max_tokens)
      return bad("'min_tokens' must not exceed max_tokens", "min_tokens");
  }
  if (auto it = j.find("stop_token_ids"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || it->size() > limits.max_stops)
      return bad("'stop_token_ids' must be an array of at most " +
                     std::to_string(limits.max_stops) + " token ids",
                 "stop_token_ids");
    for (const auto& v : *it) {
      if (!v.is_number_integer() || v.get<std::int64_t>() < 0)
        return bad("'stop_token_ids' must hold token ids (non-negative integers)",
                   "stop_token_ids");
      job.stop_token_ids.push_back(v.get<std::int64_t>());
    }
  }
  if (auto it = j.find("ignore_eos"); it != j.end() && !it->is_null()) {
    if (!it->is_boolean()) return bad("'ignore_eos' must be a boolean", "ignore_eos");
    job.ignore_eos = it->get<bool>();
  }
  if (auto it = j.find("n"); it != j.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1 ||
        it->get<std::int64_t>() > limits.max_n)
      return bad("'n' must be an integer in [1, " + std::to_string(limits.max_n) + "]", "n");
    r.n = it->get<std::int64_t>();
  }
  if (auto e = read_structured(j, r)) return e;
  // Logprobs: chat asks with `logprobs: true` and `top_logprobs: k`;
  // completions with `logprobs: k`.
  const auto most = models::sampling_params::max_top_logprobs;
  const std::string range = "an integer in [0, " + std::to_string(most) + "]";
  auto lp = j.find("logprobs");
  const bool has_lp = lp != j.end() && !lp->is_null();
  if (r.chat) {
    if (has_lp && !lp->is_boolean()) return bad("'logprobs' must be a boolean", "logprobs");
    const bool on = has_lp && lp->get<bool>();
    std::int64_t top = 0;
    if (auto t = j.find("top_logprobs"); t != j.end() && !t->is_null()) {
      if (!t->is_number_integer() || t->get<std::int64_t>() < 0 || t->get<std::int64_t>() > most)
        return bad("'top_logprobs' must be " + range, "top_logprobs");
      top = t->get<std::int64_t>();
      if (!on) return bad("'top_logprobs' needs 'logprobs' set to true", "top_logprobs");
    }
    if (on) job.logprobs = static_cast<std::int32_t>(top);
  } else if (has_lp) {
    if (!lp->is_number_integer() || lp->get<std::int64_t>() < 0 || lp->get<std::int64_t>() > most)
      return bad("'logprobs' must be " + range, "logprobs");
    job.logprobs = static_cast<std::int32_t>(lp->get<std::int64_t>());
    if (!r.echo.empty())
      return bad("'echo' with 'logprobs' is not supported (no prompt logprobs)", "echo");
  }
  return std::nullopt;
}

// Every top-level field of a request is read, accepted as a no-op where
// its value asks for nothing (OpenAI's defaults: a penalty of 0, `echo`
// false, no tools, ...), or refused by name: a field a client sets is never
// ignored. The fields read elsewhere (messages / prompt and read_common's)
// are listed with `read`.
struct field_rule {
  const char* name;
  bool chat, completions;      ///< which endpoints know it
  bool (*no_op)(const json&);  ///< nullptr: read by the parser
  const char* why;             ///< the refusal when not a no-op
};

bool is_null(const json& v) {
  return v.is_null();
}
bool is_one(const json& v) {
  return v.is_null() || (v.is_number() && v.get<double>() == 1.0);
}
bool is_false(const json& v) {
  return v.is_null() || (v.is_boolean() && !v.get<bool>());
}
bool is_empty(const json& v) {
  return v.is_null() || ((v.is_object() || v.is_array() || v.is_string()) && v.empty());
}
bool is_no_tool(const json& v) {
  return v.is_null() || (v.is_string() && v.get<std::string>() == "none");
}
bool is_text_only(const json& v) {
  return v.is_null() ||
         (v.is_array() && v.size() == 1 && v[0].is_string() && v[0].get<std::string>() == "text");
}
bool is_default_tier(const json& v) {
  return v.is_null() ||
         (v.is_string() && (v.get<std::string>() == "auto" || v.get<std::string>() == "default"));
}
bool is_string_map(const json& v) {  // `metadata`: tags with no effect on generation
  if (v.is_null()) return true;
  if (!v.is_object() || v.size() > 16) return false;
  for (const auto& [k, x] : v.items())
    if (k.size() > 64 || !x.is_string() || x.get<std::string>().size() > 512) return false;
  return true;
}
bool is_salt(const json& v) {  // prefix caching's tenant separation
  return v.is_null() ||
         (v.is_string() && !v.get<std::string>().empty() && v.get<std::string>().size() <= 256);
}
bool is_short_string(const json& v) {  // `user`: an end-user id, metadata
  return v.is_null() || (v.is_string() && v.get<std::string>().size() <= 256);
}

constexpr const char* later_api = "is not supported yet (docs/serve.md lists what is)";
const field_rule field_rules[] = {
    {"model", true, true, nullptr, nullptr},
    {"messages", true, false, nullptr, nullptr},
    {"prompt", false, true, nullptr, nullptr},
    {"stream", true, true, nullptr, nullptr},
    {"stream_options", true, true, nullptr, nullptr},
    {"max_tokens", true, true, nullptr, nullptr},
    {"max_completion_tokens", true, false, nullptr, nullptr},
    {"temperature", true, true, nullptr, nullptr},
    {"top_p", true, true, nullptr, nullptr},
    {"seed", true, true, nullptr, nullptr},
    {"stop", true, true, nullptr, nullptr},
    {"ignore_eos", true, true, nullptr, nullptr},
    {"n", true, true, nullptr, nullptr},
    {"user", true, true, is_short_string, "must be a string of at most 256 bytes"},
    {"metadata", true, true, is_string_map,
     "must map at most 16 keys of up to 64 bytes to strings of up to 512 bytes"},
    {"store", true, false, is_false, "true is not supported (troupe stores no completions)"},
    {"service_tier", true, true, is_default_tier, "other than \"auto\" is not supported"},
    {"frequency_penalty", true, true, nullptr, nullptr},
    {"presence_penalty", true, true, nullptr, nullptr},
    {"repetition_penalty", true, true, nullptr, nullptr},
    {"logit_bias", true, true, nullptr, nullptr},
    {"stop_token_ids", true, true, nullptr, nullptr},
    {"logprobs", true, true, nullptr, nullptr},
    {"top_logprobs", true, false, nullptr, nullptr},
    {"echo", false, true, nullptr, nullptr},
    {"suffix", false, true, is_empty, later_api},
    {"best_of", false, true, is_one, "other than 1 is not supported"},
    {"min_tokens", true, true, nullptr, nullptr},
    {"response_format", true, true, nullptr, nullptr},
    {"guided_json", true, true, nullptr, nullptr},
    {"guided_regex", true, true, nullptr, nullptr},
    {"guided_choice", true, true, nullptr, nullptr},
    {"guided_grammar", true, true, nullptr, nullptr},
    {"grammar", true, true, nullptr, nullptr},
    {"tools", true, false, nullptr, nullptr},
    {"tool_choice", true, false, nullptr, nullptr},
    {"parallel_tool_calls", true, false, nullptr, nullptr},
    {"functions", true, false, is_empty, "(deprecated by OpenAI) are not supported"},
    {"function_call", true, false, is_no_tool, "(deprecated by OpenAI) is not supported"},
    {"modalities", true, false, is_text_only, "other than [\"text\"] is not supported"},
    {"audio", true, false, is_null, "output is not supported"},
    {"prediction", true, false, is_null, later_api},
    {"reasoning_effort", true, false, is_null, "is not supported (no reasoning models)"},
    {"web_search_options", true, false, is_null, "is not supported"},
    {"priority", true, true, nullptr, nullptr},
    {"cache_salt", true, true, is_salt, "must be a non-empty string of at most 256 bytes"},
    {"media_io_kwargs", true, false, nullptr, nullptr},
    {"mm_processor_kwargs", true, false, nullptr, nullptr},
};

// vLLM's media_io_kwargs: {"video": {"num_frames": N, "fps": F}}, for every
// video of the request.
std::optional<api_error> read_media_io(const json& j, api_request& r,
                                       const request_limits& limits) {
  auto it = j.find("media_io_kwargs");
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_object()) return bad("'media_io_kwargs' must be an object", "media_io_kwargs");
  std::int32_t frames = 0;
  double fps = 0;
  for (const auto& [k, v] : it->items()) {
    const std::string at = "media_io_kwargs." + k.substr(0, 64);
    if (k != "video") return bad("'" + at + "' is not supported (video only)", at);
    if (v.is_null()) continue;
    if (!v.is_object()) return bad("'" + at + "' must be an object", at);
    for (const auto& [kk, vv] : v.items()) {
      const std::string field = at + "." + kk.substr(0, 64);
      if (kk == "num_frames") {
        if (!vv.is_number_integer() || vv.get<std::int64_t>() < 1 ||
            vv.get<std::int64_t>() > limits.max_video_frames)
          return bad("'" + field + "' must be an integer from 1 to " +
                         std::to_string(limits.max_video_frames),
                     field);
        frames = static_cast<std::int32_t>(vv.get<std::int64_t>());
      } else if (kk == "fps") {
        if (!vv.is_number() || !(vv.get<double>() >= 0) || vv.get<double>() > 240)
          return bad("'" + field + "' must be a number from 0 to 240", field);
        fps = vv.get<double>();
      } else {
        return bad("'" + field + "' is not supported (num_frames, fps)", field);
      }
    }
  }
  if (r.job.videos.empty() && (frames > 0 || fps > 0))
    return bad("'media_io_kwargs.video' is given but the request has no video", "media_io_kwargs");
  for (auto& v : r.job.videos) {
    v.num_frames = frames;
    v.fps = fps;
  }
  return std::nullopt;
}

// vLLM's mm_processor_kwargs: {"use_audio_in_video": true} (Qwen2.5-Omni's
// name): every video's audio track is heard too.
std::optional<api_error> read_mm_processor(const json& j, api_request& r) {
  auto it = j.find("mm_processor_kwargs");
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_object())
    return bad("'mm_processor_kwargs' must be an object", "mm_processor_kwargs");
  for (const auto& [k, v] : it->items()) {
    const std::string at = "mm_processor_kwargs." + k.substr(0, 64);
    if (k != "use_audio_in_video")
      return bad("'" + at + "' is not supported (use_audio_in_video only)", at);
    if (!v.is_boolean()) return bad("'" + at + "' must be a boolean", at);
    if (v.get<bool>() && r.job.videos.empty())
      return bad("'" + at + "' is true but the request has no video", at);
    for (auto& video : r.job.videos) video.audio = v.get<bool>();
  }
  return std::nullopt;
}

std::optional<api_error> check_fields(const json& j, bool chat) {
  for (const auto& [key, value] : j.items()) {
    const field_rule* rule = nullptr;
    for (const auto& r : field_rules)
      if (key == r.name && (chat ? r.chat : r.completions)) rule = &r;
    const std::string shown = key.substr(0, 64);
    if (!rule)
      return bad("unrecognized request argument '" + shown + "' for " +
                     (chat ? "/v1/chat/completions" : "/v1/completions"),
                 shown);
    if (rule->no_op && !rule->no_op(value)) return bad("'" + shown + "' " + rule->why, shown);
  }
  return std::nullopt;
}

/// nlohmann's DOM builder behind a gate: the parse stops, before the value
/// is built, once arrays and objects nest deeper than `max_depth` or the
/// body holds more than `max_values` values (a 40 MB body of nested
/// brackets would otherwise cost gigabytes).
class bounded_dom final : public nlohmann::json_sax<json> {
 public:
  bounded_dom(json& out, std::size_t max_depth, std::size_t max_values)
      : dom_(out, false), max_depth_(max_depth), max_values_(max_values) {}
  /// Why the parse stopped early ("" when it did not).
  const std::string& over() const { return over_; }

  bool null() override { return value() && dom_.null(); }
  bool boolean(bool v) override { return value() && dom_.boolean(v); }
  bool number_integer(number_integer_t v) override { return value() && dom_.number_integer(v); }
  bool number_unsigned(number_unsigned_t v) override { return value() && dom_.number_unsigned(v); }
  bool number_float(number_float_t v, const string_t& s) override {
    return value() && dom_.number_float(v, s);
  }
  bool string(string_t& v) override { return value() && dom_.string(v); }
  bool binary(binary_t& v) override { return value() && dom_.binary(v); }
  bool start_object(std::size_t n) override { return enter() && dom_.start_object(n); }
  bool key(string_t& k) override { return dom_.key(k); }
  bool end_object() override {
    --depth_;
    return dom_.end_object();
  }
  bool start_array(std::size_t n) override { return enter() && dom_.start_array(n); }
  bool end_array() override {
    --depth_;
    return dom_.end_array();
  }
  bool parse_error(std::size_t at, const std::string& token,
                   const nlohmann::detail::exception& e) override {
    return dom_.parse_error(at, token, e);
  }

 private:
  bool value() {
    if (++values_ <= max_values_) return true;
    over_ = "the body holds more than " + std::to_string(max_values_) + " JSON values";
    return false;
  }
  bool enter() {
    if (!value()) return false;
    if (++depth_ <= max_depth_) return true;
    over_ = "the body's JSON nests deeper than " + std::to_string(max_depth_) + " levels";
    return false;
  }
  nlohmann::detail::json_sax_dom_parser<json> dom_;
  std::size_t depth_ = 0, values_ = 0;
  std::size_t max_depth_, max_values_;
  std::string over_;
};

std::expected<json, api_error> parse_json(std::string_view body, const request_limits& limits) {
  json j;
  bounded_dom sax(j, limits.max_json_depth, limits.max_json_values);
  const bool ok = json::sax_parse(body.begin(), body.end(), &sax);
  if (!sax.over().empty()) return std::unexpected(bad(sax.over()));
  if (!ok || j.is_discarded()) return std::unexpected(bad("the body is not valid JSON"));
  if (!j.is_object()) return std::unexpected(bad("the body must be a JSON object"));
  return j;
}

}  // namespace

std::string default_served_name(std::string_view model_path) {
  while (model_path.size() > 1 && model_path.back() == '/') model_path.remove_suffix(1);
  if (auto slash = model_path.rfind('/'); slash != std::string_view::npos)
    model_path.remove_prefix(slash + 1);
  constexpr std::string_view gguf = ".gguf";
  if (model_path.size() > gguf.size() && model_path.ends_with(gguf))
    model_path.remove_suffix(gguf.size());
  return std::string(model_path);
}

std::optional<api_error> check_model(const std::string& requested, const std::string& served) {
  if (requested.empty() || requested == served) return std::nullopt;
  api_error e;
  e.status = 404;
  e.code = "model_not_found";
  e.param = "model";
  // A name from a client is shown cut short: it is echoed into a log line
  // and a response.
  e.message = "the model '" + requested.substr(0, 128) + "' does not exist; this server serves '" +
              served + "'";
  return e;
}

std::string error_json(const api_error& e) {
  json j{{"error",
          {{"message", e.message},
           {"type", e.type},
           {"param", e.param.empty() ? json(nullptr) : json(e.param)},
           {"code", e.code.empty() ? json(nullptr) : json(e.code)}}}};
  // A message may quote a client's field cut short, mid-character: such
  // bytes become U+FFFD instead of an exception.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::expected<std::vector<std::uint8_t>, std::string> decode_data_url(std::string_view url,
                                                                      std::size_t max_bytes,
                                                                      std::string_view media) {
  constexpr std::string_view prefix = "data:";
  const bool video = media == "video/";
  if (url.substr(0, prefix.size()) != prefix)
    return std::unexpected(std::string("only base64 data: URLs are accepted (fetching remote ") +
                           (video ? "videos" : "images") +
                           " is off; troupe serve --allow-remote-images)");
  const auto comma = url.find(',');
  if (comma == std::string_view::npos) return std::unexpected("a data: URL without a comma");
  const auto meta = url.substr(prefix.size(), comma - prefix.size());
  if (meta.size() < 7 || meta.substr(meta.size() - 7) != ";base64")
    return std::unexpected("the data: URL is not base64");
  if (meta.substr(0, media.size()) != media)
    return std::unexpected(video ? "the data: URL is not a video"
                                 : "the data: URL is not an image");
  return decode_base64(url.substr(comma + 1), max_bytes, video ? "a video" : "an image");
}

std::expected<std::vector<std::uint8_t>, std::string> decode_base64(std::string_view b64,
                                                                    std::size_t max_bytes,
                                                                    std::string_view what) {
  if (b64.size() % 4 != 0)
    return std::unexpected("base64 data whose length is not a multiple of 4");
  if (b64.size() / 4 * 3 > max_bytes)
    return std::unexpected(std::string(what) + " of more than " + std::to_string(max_bytes >> 20) +
                           " MiB");
  for (char c : b64)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '='))
      return std::unexpected("invalid base64 data");
  std::vector<std::uint8_t> out(b64.size() / 4 * 3);
  if (b64.empty()) return std::unexpected(std::string(what) + " with no bytes");
  const int n = EVP_DecodeBlock(out.data(), reinterpret_cast<const unsigned char*>(b64.data()),
                                static_cast<int>(b64.size()));
  if (n < 0) return std::unexpected("invalid base64 data");
  std::size_t pad = 0;
  if (b64.back() == '=') ++pad;
  if (b64.size() >= 2 && b64[b64.size() - 2] == '=') ++pad;
  out.resize(static_cast<std::size_t>(n) - pad);
  return out;
}

void add_streamed_clip(api_request& r) {
  actors::media_data clip;
  clip.name = "the streamed audio clip";
  clip.kind = actors::media_kind::audio;
  clip.stream = true;
  r.job.audios.push_back(std::move(clip));
  if (!r.job.turns.empty()) r.job.turns.back().audios += 1;
}

std::expected<api_request, api_error> parse_chat_request(std::string_view body,
                                                         const request_limits& limits) {
  auto j = parse_json(body, limits);
  if (!j) return std::unexpected(j.error());
  if (auto e = check_fields(*j, true)) return std::unexpected(*e);
  api_request r;
  r.chat = true;
  // OpenAI's and vLLM's chat default: as many tokens as the context leaves
  // (the head decides, from the prompt's length).
  r.job.max_tokens = 0;
  auto msgs = j->find("messages");
  if (msgs == j->end() || !msgs->is_array() || msgs->empty())
    return std::unexpected(bad("'messages' must be a non-empty array", "messages"));
  if (msgs->size() > limits.max_messages)
    return std::unexpected(
        bad("at most " + std::to_string(limits.max_messages) + " messages", "messages"));
  std::size_t text_bytes = 0;
  for (std::size_t i = 0; i < msgs->size(); ++i) {
    const auto& m = (*msgs)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return std::unexpected(bad(where + " must be an object", where));
    auto role = m.find("role");
    if (role == m.end() || !role->is_string())
      return std::unexpected(bad(where + ".role must be a string", where + ".role"));
    actors::chat_turn t;
    t.role = role->get<std::string>();
    if (t.role != "system" && t.role != "user" && t.role != "assistant" && t.role != "developer" &&
        t.role != "tool")
      return std::unexpected(bad(
          where + ".role: '" + t.role.substr(0, 32) + "' is not system, user, assistant or tool",
          where + ".role"));
    if (t.role == "developer") t.role = "system";
    // An assistant's earlier tool calls, in the Hermes form the model is
    // asked to answer in.
    std::string calls;
    if (auto tc = m.find("tool_calls"); tc != m.end() && !tc->is_null()) {
      if (t.role != "assistant" || !tc->is_array())
        return std::unexpected(bad(where + ".tool_calls must be an assistant's array of calls",
                                   where + ".tool_calls"));
      for (const auto& call : *tc) {
        auto fn = call.is_object() ? call.find("function") : call.end();
        if (fn == call.end() || !fn->is_object() || !fn->contains("name") ||
            !(*fn)["name"].is_string())
          return std::unexpected(
              bad(where + ".tool_calls[]: a call needs function.name", where + ".tool_calls"));
        json args = json::object();
        if (auto a = fn->find("arguments"); a != fn->end() && a->is_string()) {
          args = json::parse(a->get<std::string>(), nullptr, false);
          if (args.is_discarded())
            return std::unexpected(bad(where + ".tool_calls[]: arguments must be a JSON string",
                                       where + ".tool_calls"));
        }
        calls += "<tool_call>\n" +
                 json{{"name", (*fn)["name"]}, {"arguments", args}}.dump(
                     -1, ' ', false, json::error_handler_t::replace) +
                 "\n</tool_call>";
      }
    }
    auto content = m.find("content");
    if ((content == m.end() || content->is_null()) && !calls.empty()) {
      t.content = calls;
    } else if (content == m.end() || content->is_null()) {
      return std::unexpected(bad(where + ".content is missing", where + ".content"));
    } else if (content->is_string()) {
      t.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (std::size_t k = 0; k < content->size(); ++k) {
        const auto& part = (*content)[k];
        const std::string pw = where + ".content[" + std::to_string(k) + "]";
        auto type = part.is_object() ? part.find("type") : part.end();
        if (!part.is_object() || type == part.end() || !type->is_string())
          return std::unexpected(bad(pw + " must be an object with a 'type'", pw));
        const auto ty = type->get<std::string>();
        if (ty == "text") {
          auto tx = part.find("text");
          if (tx == part.end() || !tx->is_string())
            return std::unexpected(bad(pw + ".text must be a string", pw + ".text"));
          if (!t.content.empty()) t.content += "\n";
          t.content += tx->get<std::string>();
        } else if (ty == "image_url") {
          auto iu = part.find("image_url");
          std::string url;
          if (iu != part.end() && iu->is_string())
            url = iu->get<std::string>();
          else if (iu != part.end() && iu->is_object() && iu->contains("url") &&
                   (*iu)["url"].is_string())
            url = (*iu)["url"].get<std::string>();
          else
            return std::unexpected(bad(pw + ".image_url.url must be a string", pw + ".image_url"));
          if (r.job.images.size() >= limits.max_images)
            return std::unexpected(
                bad("at most " + std::to_string(limits.max_images) + " images per request", pw));
          const bool remote = url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0;
          if (remote && limits.remote_images) {
            r.remote_images.push_back({r.job.images.size(), url, pw + ".image_url"});
            actors::media_data img;
            img.name = "image " + std::to_string(r.job.images.size() + 1);
            r.job.images.push_back(std::move(img));
            ++t.images;
            continue;
          }
          auto bytes = decode_data_url(url, limits.max_image_bytes);
          if (!bytes) {
            auto e = bad(pw + ": " + bytes.error(), pw + ".image_url");
            if (bytes.error().find("MiB") != std::string::npos) e.status = 413;
            return std::unexpected(e);
          }
          actors::media_data img;
          img.name = "image " + std::to_string(r.job.images.size() + 1);
          img.bytes = std::move(*bytes);
          r.job.images.push_back(std::move(img));
          ++t.images;
        } else if (ty == "input_audio") {
          // OpenAI's: {"input_audio": {"data": base64, "format": "wav" | "mp3"}}
          // (and FLAC, which the decoder also reads).
          auto ia = part.find("input_audio");
          if (ia == part.end() || !ia->is_object() || !ia->contains("data") ||
              !(*ia)["data"].is_string())
            return std::unexpected(
                bad(pw + ".input_audio.data must be a base64 string", pw + ".input_audio"));
          std::string format;
          if (auto f = ia->find("format"); f != ia->end() && f->is_string())
            format = f->get<std::string>();
          if (format != "wav" && format != "mp3" && format != "flac")
            return std::unexpected(bad(pw + ".input_audio.format must be \"wav\", \"mp3\" or "
                                            "\"flac\"",
                                       pw + ".input_audio.format"));
          if (r.job.audios.size() >= limits.max_audios)
            return std::unexpected(bad(
                "at most " + std::to_string(limits.max_audios) + " audio clips per request", pw));
          auto bytes = decode_base64((*ia)["data"].get_ref<const std::string&>(),
                                     limits.max_audio_bytes, "an audio clip");
          if (!bytes) {
            auto e = bad(pw + ": " + bytes.error(), pw + ".input_audio.data");
            if (bytes.error().find("MiB") != std::string::npos) e.status = 413;
            return std::unexpected(e);
          }
          // The format named must be the data's (its first bytes).
          const auto& b = *bytes;
          auto starts = [&](std::string_view m) {
            return b.size() >= m.size() && std::equal(m.begin(), m.end(), b.begin());
          };
          const bool matches =
              format == "wav" ? (starts("RIFF") || starts("RF64"))
              : format == "flac"
                  ? starts("fLaC")
                  : (starts("ID3") || (b.size() >= 2 && b[0] == 0xff && (b[1] & 0xe0) == 0xe0));
          if (!matches)
            return std::unexpected(
                bad(pw + ": the data is not " + format + " audio", pw + ".input_audio.data"));
          actors::media_data clip;
          clip.name = "audio clip " + std::to_string(r.job.audios.size() + 1);
          clip.bytes = std::move(*bytes);
          clip.kind = actors::media_kind::audio;
          r.job.audios.push_back(std::move(clip));
          ++t.audios;
        } else if (ty == "video_url") {
          // vLLM's: {"video_url": {"url": data URL or http(s)}}; the
          // frames sampled per media_io_kwargs.video (below).
          auto vu = part.find("video_url");
          std::string url;
          if (vu != part.end() && vu->is_string())
            url = vu->get<std::string>();
          else if (vu != part.end() && vu->is_object() && vu->contains("url") &&
                   (*vu)["url"].is_string())
            url = (*vu)["url"].get<std::string>();
          else
            return std::unexpected(bad(pw + ".video_url.url must be a string", pw + ".video_url"));
          if (r.job.videos.size() >= limits.max_videos)
            return std::unexpected(
                bad("at most " + std::to_string(limits.max_videos) + " videos per request", pw));
          actors::media_data v;
          v.name = "video " + std::to_string(r.job.videos.size() + 1);
          v.kind = actors::media_kind::video;
          const bool remote = url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0;
          if (remote && limits.remote_images) {
            r.remote_images.push_back({r.job.videos.size(), url, pw + ".video_url", true});
          } else {
            auto bytes = decode_data_url(url, limits.max_video_bytes, "video/");
            if (!bytes) {
              auto e = bad(pw + ": " + bytes.error(), pw + ".video_url");
              if (bytes.error().find("MiB") != std::string::npos) e.status = 413;
              return std::unexpected(e);
            }
            v.bytes = std::move(*bytes);
          }
          r.job.videos.push_back(std::move(v));
          ++t.videos;
        } else {
          return std::unexpected(
              bad(pw + ": content type '" + ty.substr(0, 32) +
                      "' is not supported (text, image_url, input_audio, video_url)",
                  pw + ".type"));
        }
      }
    } else {
      return std::unexpected(
          bad(where + ".content must be a string or an array of parts", where + ".content"));
    }
    if (!calls.empty() && content != m.end() && !content->is_null())
      t.content += (t.content.empty() ? "" : "\n") + calls;
    if (t.role == "tool") {  // a function's answer, for the model to read
      if (t.images > 0 || t.audios > 0 || t.videos > 0)
        return std::unexpected(bad(where + ": a tool's content is text", where + ".content"));
      t.role = "user";
      t.content = "<tool_response>\n" + t.content + "\n</tool_response>";
    }
    text_bytes += t.content.size();
    r.job.turns.push_back(std::move(t));
  }
  if (text_bytes > limits.max_text_bytes)
    return std::unexpected(bad(
        "the messages hold more than " + std::to_string(limits.max_text_bytes) + " bytes of text",
        "messages"));
  if (auto e = read_common(*j, r, limits)) return std::unexpected(*e);
  if (auto e = read_tools(*j, r)) return std::unexpected(*e);
  if (auto e = read_media_io(*j, r, limits)) return std::unexpected(*e);
  if (auto e = read_mm_processor(*j, r)) return std::unexpected(*e);
  return r;
}

std::expected<api_request, api_error> parse_completion_request(std::string_view body,
                                                               const request_limits& limits) {
  auto j = parse_json(body, limits);
  if (!j) return std::unexpected(j.error());
  if (auto e = check_fields(*j, false)) return std::unexpected(*e);
  api_request r;
  r.chat = false;
  r.job.max_tokens = 16;  // OpenAI's default for completions
  // A string, token ids, or an array of one of either (OpenAI's batch of
  // prompts: one here, several choices come from `n`).
  const char* shape = "'prompt' must be a string or an array of token ids";
  auto p = j->find("prompt");
  if (p == j->end()) return std::unexpected(bad(shape, "prompt"));
  const json* one = &*p;
  if (p->is_array() && p->size() == 1 && ((*p)[0].is_string() || (*p)[0].is_array()))
    one = &(*p)[0];
  else if (p->is_array() && !p->empty() && ((*p)[0].is_string() || (*p)[0].is_array()))
    return std::unexpected(bad("one prompt per request ('n' asks for several choices)", "prompt"));
  if (one->is_string()) {
    r.job.prompt = one->get<std::string>();
    if (r.job.prompt.empty()) return std::unexpected(bad("'prompt' is empty", "prompt"));
  } else if (one->is_array()) {
    if (one->empty()) return std::unexpected(bad("'prompt' is empty", "prompt"));
    if (one->size() > limits.max_text_bytes)
      return std::unexpected(
          bad("'prompt' holds more than " + std::to_string(limits.max_text_bytes) + " token ids",
              "prompt"));
    for (const auto& v : *one) {
      if (!v.is_number_integer() || v.get<std::int64_t>() < 0 ||
          v.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max())
        return std::unexpected(bad(shape, "prompt"));
      r.job.prompt_ids.push_back(static_cast<std::int32_t>(v.get<std::int64_t>()));
    }
  } else {
    return std::unexpected(bad(shape, "prompt"));
  }
  if (auto e = j->find("echo"); e != j->end() && !e->is_null()) {
    if (!e->is_boolean()) return std::unexpected(bad("'echo' must be a boolean", "echo"));
    if (e->get<bool>() && !r.job.prompt_ids.empty())
      return std::unexpected(bad("'echo' with a prompt of token ids is not supported", "echo"));
    if (e->get<bool>()) r.echo = r.job.prompt;
  }
  if (r.job.prompt.size() > limits.max_text_bytes)
    return std::unexpected(bad(
        "'prompt' holds more than " + std::to_string(limits.max_text_bytes) + " bytes", "prompt"));
  if (auto e = read_common(*j, r, limits)) return std::unexpected(*e);
  return r;
}

std::expected<api_request, api_error> parse_tokenize_request(std::string_view body,
                                                             const request_limits& limits) {
  auto j = parse_json(body, limits);
  if (!j) return std::unexpected(j.error());
  for (const auto& [key, v] : j->items()) {
    const std::string shown = key.substr(0, 64);
    if (key == "model" || key == "prompt" || key == "messages") continue;
    if (key == "add_special_tokens" || key == "add_generation_prompt") {
      // troupe renders prompts as it generates them: BOS added, and a
      // chat ends with the assistant's turn opened.
      if (v.is_null() || v == true) continue;
      return std::unexpected(bad("'" + shown + "' other than true is not supported", shown));
    }
    return std::unexpected(
        bad("unrecognized request argument '" + shown + "' for /tokenize", shown));
  }
  const bool has_prompt = j->contains("prompt"), has_messages = j->contains("messages");
  if (has_prompt == has_messages)
    return std::unexpected(
        bad("give either 'prompt' or 'messages'", has_prompt ? "messages" : "prompt"));
  api_request r;
  if (has_messages) {
    json chat{{"messages", (*j)["messages"]}};
    auto c = parse_chat_request(chat.dump(), limits);
    if (!c) return std::unexpected(c.error());
    if (!c->job.images.empty() || !c->job.audios.empty() || !c->job.videos.empty() ||
        !c->remote_images.empty())
      return std::unexpected(
          bad("/tokenize counts text only: images, audio and video are not supported", "messages"));
    r = std::move(*c);
  } else {
    const auto& p = (*j)["prompt"];
    if (!p.is_string() || p.get<std::string>().empty())
      return std::unexpected(bad("'prompt' must be a non-empty string", "prompt"));
    if (p.get<std::string>().size() > limits.max_text_bytes)
      return std::unexpected(
          bad("'prompt' holds more than " + std::to_string(limits.max_text_bytes) + " bytes",
              "prompt"));
    r.chat = false;
    r.job.prompt = p.get<std::string>();
  }
  r.model.clear();
  if (auto m = j->find("model"); m != j->end() && !m->is_null()) {
    if (!m->is_string()) return std::unexpected(bad("'model' must be a string", "model"));
    r.model = m->get<std::string>().substr(0, 256);
  }
  return r;
}

std::expected<detokenize_request, api_error> parse_detokenize_request(
    std::string_view body, const request_limits& limits) {
  auto j = parse_json(body, limits);
  if (!j) return std::unexpected(j.error());
  detokenize_request r;
  for (const auto& [key, v] : j->items()) {
    const std::string shown = key.substr(0, 64);
    if (key == "model") {
      if (!v.is_null() && !v.is_string())
        return std::unexpected(bad("'model' must be a string", "model"));
      if (v.is_string()) r.model = v.get<std::string>().substr(0, 256);
    } else if (key == "tokens") {
      if (!v.is_array() || v.size() > limits.max_text_bytes)
        return std::unexpected(bad("'tokens' must be an array of token ids", "tokens"));
      for (const auto& t : v) {
        if (!t.is_number_integer() || t.get<std::int64_t>() < 0 ||
            t.get<std::int64_t>() > std::numeric_limits<std::int32_t>::max())
          return std::unexpected(bad("'tokens' must be an array of token ids", "tokens"));
        r.tokens.push_back(static_cast<std::int32_t>(t.get<std::int64_t>()));
      }
    } else {
      return std::unexpected(
          bad("unrecognized request argument '" + shown + "' for /detokenize", shown));
    }
  }
  if (!j->contains("tokens")) return std::unexpected(bad("'tokens' is missing", "tokens"));
  return r;
}

std::string finish_reason(actors::finish_reason r) {
  // "stop" and "length" are OpenAI's words too; cancelled, deadline and
  // error have none and keep troupe's.
  return actors::to_string(r);
}

namespace {
json usage_of(const usage_counts& u) {
  json j{{"prompt_tokens", u.prompt},
         {"completion_tokens", u.completion},
         {"total_tokens", u.prompt + u.completion}};
  if (u.cached) j["prompt_tokens_details"] = {{"cached_tokens", *u.cached}};
  return j;
}

// A token's bytes as OpenAI gives them (a piece may be part of a UTF-8
// character: `token` then shows U+FFFD where `bytes` are exact).
json bytes_of(const std::string& piece) {
  json b = json::array();
  for (unsigned char c : piece) b.push_back(static_cast<int>(c));
  return b;
}

json logprobs_object(bool chat, std::span<const models::token_logprob> lps,
                     std::int64_t text_offset) {
  if (chat) {
    json content = json::array();
    for (const auto& t : lps) {
      json top = json::array();
      for (std::size_t k = 0; k < t.top_ids.size(); ++k) {
        const auto& piece = k < t.top_pieces.size() ? t.top_pieces[k] : std::string{};
        top.push_back(
            {{"token", piece}, {"logprob", t.top_logprobs[k]}, {"bytes", bytes_of(piece)}});
      }
      content.push_back({{"token", t.piece},
                         {"logprob", t.logprob},
                         {"bytes", bytes_of(t.piece)},
                         {"top_logprobs", std::move(top)}});
    }
    return {{"content", std::move(content)}};
  }
  json tokens = json::array(), token_lps = json::array(), tops = json::array(),
       offsets = json::array();
  for (const auto& t : lps) {
    tokens.push_back(t.piece);
    token_lps.push_back(t.logprob);
    json top = json::object();
    for (std::size_t k = 0; k < t.top_ids.size(); ++k)
      top[k < t.top_pieces.size() ? t.top_pieces[k] : std::string{}] = t.top_logprobs[k];
    tops.push_back(std::move(top));
    offsets.push_back(text_offset);
    text_offset += static_cast<std::int64_t>(t.piece.size());
  }
  return {{"tokens", std::move(tokens)},
          {"token_logprobs", std::move(token_lps)},
          {"top_logprobs", std::move(tops)},
          {"text_offset", std::move(offsets)}};
}

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

// The tool calls in a reply; without parallel_tool_calls the first only
// (under "auto" the model is free to write more).
tool_reply reply_of(const api_request& r, const std::string& text) {
  auto t = parse_tool_calls(text, r.tools);
  if (!r.parallel_tool_calls && t.calls.size() > 1) t.calls.resize(1);
  return t;
}

// A stream chunk of `r`'s kind holding `choices`.
json chunk_of(const api_request& r, const std::string& id, std::int64_t created, json choices) {
  return {{"id", id},
          {"object", r.chat ? "chat.completion.chunk" : "text_completion"},
          {"created", created},
          {"model", r.model},
          {"choices", std::move(choices)}};
}

// OpenAI's tool_calls: ids unique within the response (its id, the
// choice, the call); a stream's carry their index.
json calls_json(const tool_reply& t, const std::string& id, std::size_t choice, bool indexed) {
  json calls = json::array();
  for (std::size_t k = 0; k < t.calls.size(); ++k) {
    const auto dash = id.find('-');
    json c{{"id", "call_" + (dash == std::string::npos ? id : id.substr(dash + 1)) + "_" +
                      std::to_string(choice) + "_" + std::to_string(k)},
           {"type", "function"},
           {"function", {{"name", t.calls[k].first}, {"arguments", t.calls[k].second}}}};
    if (indexed) c["index"] = k;
    calls.push_back(std::move(c));
  }
  return calls;
}
}  // namespace

tool_reply parse_tool_calls(const std::string& text, const std::vector<models::tool_spec>& tools) {
  static const std::string open = "<tool_call>", close = "</tool_call>";
  tool_reply out;
  std::string rest;
  std::size_t at = 0;
  while (at < text.size()) {
    const auto b = text.find(open, at);
    if (b == std::string::npos) break;
    const auto e = text.find(close, b + open.size());
    if (e == std::string::npos) break;
    rest += text.substr(at, b - at);
    const auto body = text.substr(b + open.size(), e - b - open.size());
    auto j = json::parse(body, nullptr, false);
    bool known = false;
    if (j.is_object() && j.contains("name") && j["name"].is_string() && j.contains("arguments") &&
        j["arguments"].is_object())
      for (const auto& t : tools) known = known || t.name == j["name"].get<std::string>();
    if (known)
      out.calls.emplace_back(j["name"].get<std::string>(), dump(j["arguments"]));
    else
      rest += text.substr(b, e + close.size() - b);  // not a call: it stays text
    at = e + close.size();
  }
  rest += text.substr(std::min(at, text.size()));
  // With calls, blank text around them is no content (OpenAI's null).
  const bool blank = rest.find_first_not_of(" \t\r\n") == std::string::npos;
  if (out.calls.empty() || !blank) out.content = rest;
  return out;
}

std::string tools_chunk_json(const api_request& r, const std::string& id, std::int64_t created,
                             std::int64_t index, const std::string& text, bool& calls) {
  const auto t = reply_of(r, text);
  calls = !t.calls.empty();
  json delta = json::object();
  if (t.content) delta["content"] = *t.content;
  if (calls) delta["tool_calls"] = calls_json(t, id, static_cast<std::size_t>(index), true);
  json choice{
      {"index", index}, {"delta", delta}, {"finish_reason", nullptr}, {"logprobs", nullptr}};
  return dump(chunk_of(r, id, created, json::array({choice})));
}

std::string completion_json(const api_request& r, const std::string& id, std::int64_t created,
                            const std::vector<choice_output>& choices) {
  json list = json::array();
  usage_counts usage;
  for (std::size_t i = 0; i < choices.size(); ++i) {
    const auto& f = choices[i].done;
    const bool lp = r.job.logprobs >= 0;
    json choice{{"index", i},
                {"finish_reason", finish_reason(f.reason)},
                {"logprobs", lp ? logprobs_object(r.chat, choices[i].logprobs,
                                                  static_cast<std::int64_t>(r.echo.size()))
                                : json(nullptr)}};
    if (r.chat && r.tools_active) {
      const auto t = reply_of(r, f.text);
      choice["message"] = {{"role", "assistant"},
                           {"content", t.content ? json(*t.content) : json(nullptr)}};
      if (!t.calls.empty()) {
        choice["message"]["tool_calls"] = calls_json(t, id, i, false);
        if (f.reason == actors::finish_reason::stop) choice["finish_reason"] = "tool_calls";
      }
    } else if (r.chat) {
      choice["message"] = {{"role", "assistant"}, {"content", f.text}};
    } else {
      choice["text"] = r.echo + f.text;  // echo: the prompt first
    }
    list.push_back(std::move(choice));
    usage.prompt = f.prompt_tokens;  // the same prompt in every choice
    usage.cached = std::max(usage.cached.value_or(0), f.cached_tokens);
    usage.completion += static_cast<std::int64_t>(f.tokens.size());
  }
  json j{{"id", id},
         {"object", r.chat ? "chat.completion" : "text_completion"},
         {"created", created},
         {"model", r.model},
         {"choices", std::move(list)},
         {"usage", usage_of(usage)}};
  return dump(j);
}

std::string role_chunk_json(const api_request& r, const std::string& id, std::int64_t created,
                            std::int64_t index) {
  json choice{{"index", index},
              {"delta", {{"role", "assistant"}, {"content", ""}}},
              {"finish_reason", nullptr},
              {"logprobs", nullptr}};
  return dump(chunk_of(r, id, created, json::array({choice})));
}

std::string chunk_json(const api_request& r, const std::string& id, std::int64_t created,
                       std::int64_t index, const std::string& text, const std::string& finish,
                       std::span<const models::token_logprob> logprobs, const usage_counts* usage,
                       std::int64_t text_offset) {
  json choice{{"index", index},
              {"finish_reason", finish.empty() ? json(nullptr) : json(finish)},
              {"logprobs", r.job.logprobs >= 0 && !logprobs.empty()
                               ? logprobs_object(r.chat, logprobs, text_offset)
                               : json(nullptr)}};
  if (r.chat)
    choice["delta"] = text.empty() && !finish.empty() ? json::object() : json{{"content", text}};
  else
    choice["text"] = text;
  auto j = chunk_of(r, id, created, json::array({choice}));
  if (usage) j["usage"] = usage_of(*usage);
  return dump(j);
}

std::string usage_chunk_json(const api_request& r, const std::string& id, std::int64_t created,
                             const usage_counts& usage) {
  auto j = chunk_of(r, id, created, json::array());
  j["usage"] = usage_of(usage);
  return dump(j);
}

namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) ==
                  std::tolower(static_cast<unsigned char>(y));
         });
}

/// A header value's parameter (`boundary`, `name`, `filename`): quoted or
/// not; empty when absent.
std::optional<std::string> header_param(std::string_view value, std::string_view key) {
  std::size_t at = value.find(';');
  while (at != std::string_view::npos) {
    auto rest = value.substr(at + 1);
    const auto eq = rest.find('=');
    if (eq == std::string_view::npos) return std::nullopt;
    const auto k = trim(rest.substr(0, eq));
    rest = rest.substr(eq + 1);
    std::string v;
    std::size_t used = 0;
    const auto lead = rest.find_first_not_of(" \t");
    if (lead != std::string_view::npos && rest[lead] == '"') {
      std::size_t i = lead + 1;
      for (; i < rest.size() && rest[i] != '"'; ++i) {
        if (rest[i] == '\\' && i + 1 < rest.size()) ++i;
        v += rest[i];
      }
      if (i >= rest.size()) return std::nullopt;  // unterminated
      used = i + 1;
    } else {
      used = std::min(rest.find(';'), rest.size());
      v = std::string(trim(rest.substr(0, used)));
    }
    if (iequals(k, key)) return v;
    const auto next = rest.find(';', used);
    at = next == std::string_view::npos ? next : (value.size() - rest.size()) + next;
  }
  return std::nullopt;
}

}  // namespace

std::expected<std::vector<form_part>, std::string> parse_form_data(std::string_view content_type,
                                                                   std::string_view body,
                                                                   std::size_t max_parts) {
  const auto semi = content_type.find(';');
  if (!iequals(trim(content_type.substr(0, semi)), "multipart/form-data"))
    return std::unexpected("the body must be multipart/form-data");
  const auto boundary = header_param(content_type, "boundary");
  if (!boundary || boundary->empty() || boundary->size() > 200)
    return std::unexpected("multipart/form-data without a boundary (1-200 characters)");
  const std::string dash = "--" + *boundary;
  const std::string delimiter = "\r\n" + dash;
  // The first boundary line (a preamble before it is ignored).
  std::size_t at = body.starts_with(dash) ? 0 : body.find(delimiter);
  if (at == std::string_view::npos) return std::unexpected("the body holds no part");
  at += body.starts_with(dash) && at == 0 ? dash.size() : delimiter.size();
  std::vector<form_part> parts;
  for (;;) {
    if (body.substr(at, 2) == "--") return parts;  // the closing boundary
    if (body.substr(at, 2) != "\r\n") return std::unexpected("a malformed boundary line");
    at += 2;
    if (parts.size() == max_parts)
      return std::unexpected("more than " + std::to_string(max_parts) + " parts");
    const auto head_end = body.find("\r\n\r\n", at);
    if (head_end == std::string_view::npos || head_end - at > 8192)
      return std::unexpected("a part whose headers do not end within 8 KiB");
    form_part p;
    bool disposition = false;
    for (auto headers = body.substr(at, head_end - at); !headers.empty();) {
      const auto eol = std::min(headers.find("\r\n"), headers.size());
      const auto line = headers.substr(0, eol);
      headers = headers.substr(std::min(eol + 2, headers.size()));
      const auto colon = line.find(':');
      if (colon == std::string_view::npos) return std::unexpected("a malformed part header");
      const auto key = trim(line.substr(0, colon));
      const auto value = trim(line.substr(colon + 1));
      if (iequals(key, "Content-Disposition")) {
        if (!iequals(trim(value.substr(0, value.find(';'))), "form-data"))
          return std::unexpected("a part that is not form-data");
        auto name = header_param(value, "name");
        if (!name || name->empty()) return std::unexpected("a part without a name");
        p.name = std::move(*name);
        if (auto f = header_param(value, "filename")) p.filename = std::move(*f);
        disposition = true;
      } else if (iequals(key, "Content-Type")) {
        p.content_type = std::string(value);
      }
    }
    if (!disposition) return std::unexpected("a part without Content-Disposition");
    const auto data_at = head_end + 4;
    const auto end = body.find(delimiter, data_at);
    if (end == std::string_view::npos) return std::unexpected("a part that never ends");
    p.data = body.substr(data_at, end - data_at);
    parts.push_back(std::move(p));
    at = end + delimiter.size();
  }
}

std::expected<api_request, api_error> parse_transcription_request(std::string_view content_type,
                                                                  std::string_view body,
                                                                  const request_limits& limits) {
  auto parts = parse_form_data(content_type, body);
  if (!parts) return std::unexpected(bad(parts.error()));
  api_request r;
  r.chat = true;
  r.transcription_format = "json";
  r.transcription_language = "english";
  r.job.max_tokens = 0;  // as many as the context leaves
  std::set<std::string> seen;
  bool file = false;
  for (const auto& p : *parts) {
    const std::string name = p.name.substr(0, 64);
    const auto value = std::string(p.data.substr(0, 256));
    if (name != "timestamp_granularities[]" && !seen.insert(name).second)
      return std::unexpected(bad("the field '" + name + "' is given twice", name));
    if (name == "file") {
      if (p.data.size() > limits.max_audio_bytes) {
        auto e = bad("file: an audio clip of more than " +
                         std::to_string(limits.max_audio_bytes >> 20) + " MiB",
                     "file");
        e.status = 413;
        return std::unexpected(e);
      }
      if (p.data.empty()) return std::unexpected(bad("file: an empty file", "file"));
      actors::media_data clip;
      clip.name = p.filename.empty() ? "file" : p.filename.substr(0, 128);
      clip.bytes.assign(p.data.begin(), p.data.end());
      clip.kind = actors::media_kind::audio;
      r.job.audios.push_back(std::move(clip));
      file = true;
    } else if (name == "model") {
      r.model = value;
    } else if (name == "response_format") {
      if (value != "json" && value != "text" && value != "verbose_json" && value != "srt" &&
          value != "vtt")
        return std::unexpected(
            bad("response_format must be json, text, verbose_json, srt or vtt", "response_format"));
      r.transcription_format = value;
    } else if (name == "temperature") {
      // (strtod: libc++ has no floating-point from_chars; a form field is
      // short and ASCII, and troupe runs in the "C" locale.)
      char* end = nullptr;
      const double t = value.empty() ? -1 : std::strtod(value.c_str(), &end);
      if (value.empty() || end != value.c_str() + value.size() || !(t >= 0) || t > 2)
        return std::unexpected(bad("temperature must be a number in [0, 2]", "temperature"));
      r.job.has_temperature = true;
      r.job.temperature = t;
    } else if (name == "max_tokens") {
      std::int64_t n = 0;
      const auto res = std::from_chars(value.data(), value.data() + value.size(), n);
      if (res.ec != std::errc{} || res.ptr != value.data() + value.size() || n < 1 ||
          n > limits.max_tokens)
        return std::unexpected(
            bad("max_tokens must be an integer in [1, " + std::to_string(limits.max_tokens) + "]",
                "max_tokens"));
      r.job.max_tokens = n;
    } else if (name == "language") {
      if (value != "en" && value != "english")
        return std::unexpected(bad("language '" + value +
                                       "' is not supported: troupe's models transcribe English "
                                       "(en) only",
                                   "language"));
    } else if (name == "timestamp_granularities[]") {
      if (value != "segment")
        return std::unexpected(bad("timestamp_granularities '" + value +
                                       "' is not supported (segment only: one segment per clip)",
                                   "timestamp_granularities[]"));
    } else if (name == "prompt" || name == "stream" || name == "chunking_strategy" ||
               name == "include[]") {
      return std::unexpected(bad(name + " is not supported for transcriptions by troupe", name));
    } else {
      return std::unexpected(bad(
          "unrecognized request argument '" + name + "' for " + "/v1/audio/transcriptions", name));
    }
  }
  if (!file) return std::unexpected(bad("the file to transcribe is missing", "file"));
  r.job.turns.push_back({"user", "Transcribe the audio.", 0, 1});
  return r;
}

namespace {

std::string clock_text(double seconds, char decimal) {
  const auto ms = static_cast<long long>(std::llround(std::max(0.0, seconds) * 1000));
  char buf[32];
  std::snprintf(buf, sizeof buf, "%02lld:%02lld:%02lld%c%03lld", ms / 3600000, ms / 60000 % 60,
                ms / 1000 % 60, decimal, ms % 1000);
  return buf;
}

}  // namespace

std::pair<std::string, std::string> transcription_body(const api_request& r,
                                                       const actors::finish_event& f,
                                                       double seconds) {
  // The text without the leading space a tokenizer's first piece may carry.
  std::string_view text = f.text;
  while (!text.empty() && text.front() == ' ') text.remove_prefix(1);
  const auto& fmt = r.transcription_format;
  if (fmt == "text") return {std::string(text) + "\n", "text/plain; charset=utf-8"};
  if (fmt == "srt")
    return {"1\n" + clock_text(0, ',') + " --> " + clock_text(seconds, ',') + "\n" +
                std::string(text) + "\n\n",
            "text/plain; charset=utf-8"};
  if (fmt == "vtt")
    return {"WEBVTT\n\n" + clock_text(0, '.') + " --> " + clock_text(seconds, '.') + "\n" +
                std::string(text) + "\n\n",
            "text/vtt; charset=utf-8"};
  const json usage{{"type", "tokens"},
                   {"input_tokens", f.prompt_tokens},
                   {"output_tokens", static_cast<std::int64_t>(f.tokens.size())},
                   {"total_tokens", f.prompt_tokens + static_cast<std::int64_t>(f.tokens.size())}};
  json out{{"text", text}};
  if (fmt == "verbose_json") {
    out = json{{"task", "transcribe"},
               {"language", r.transcription_language},
               {"duration", seconds},
               {"text", text},
               {"segments",
                json::array({{{"id", 0},
                              {"seek", 0},
                              {"start", 0.0},
                              {"end", seconds},
                              {"text", text},
                              {"tokens", f.tokens},
                              {"temperature", r.job.has_temperature ? r.job.temperature : 0.0}}})}};
  }
  out["usage"] = usage;
  return {out.dump(-1, ' ', false, json::error_handler_t::replace), "application/json"};
}

}  // namespace troupe::serve
