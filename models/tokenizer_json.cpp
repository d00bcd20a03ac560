// Loading a tokenizer from Hugging Face's tokenizer.json (+ tokenizer_config.json).
#include <sys/stat.h>
#include <nlohmann/json.hpp>

#include "models/llama_config.hpp"
#include "models/tokenizer.hpp"
#include "models/tokenizer_impl.hpp"

namespace troupe::models {

namespace {

using json = nlohmann::json;
using detail::tokenizer_impl;

// nlohmann's parser recurses per nesting level: refuse deep nesting first.
bool nesting_ok(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return false;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return true;
}

result<json> parse_json(std::string_view text, const std::string& src, std::size_t max_bytes) {
  if (text.size() > max_bytes) return make_error(errc::corrupt_data, src + ": file too large");
  if (!nesting_ok(text, 64))
    return make_error(errc::corrupt_data, src + ": JSON nested too deeply");
  json root = json::parse(text.begin(), text.end(), nullptr, false);
  if (root.is_discarded() || !root.is_object())
    return make_error(errc::corrupt_data, src + ": not a JSON object");
  return root;
}

std::unexpected<error> bad(const std::string& src, const std::string& field,
                           const std::string& what) {
  return make_error(errc::corrupt_data, src + ": " + field + " " + what);
}

const json* member(const json& j, const char* key) {
  if (!j.is_object()) return nullptr;
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? nullptr : &*it;
}

result<bool> get_bool(const json& j, const char* key, bool def, const std::string& src,
                      const std::string& where) {
  const json* v = member(j, key);
  if (!v) return def;
  if (!v->is_boolean()) return bad(src, where + "." + key, "must be true or false");
  return v->get<bool>();
}

result<std::string> get_string(const json& j, const char* key, const std::string& src,
                               const std::string& where) {
  const json* v = member(j, key);
  if (!v || !v->is_string()) return bad(src, where + "." + key, "must be a string");
  return v->get<std::string>();
}

// {"String": s} patterns only (Regex patterns in normalizers/decoders are not supported).
result<std::string> string_pattern(const json& j, const std::string& src,
                                   const std::string& where) {
  const json* p = member(j, "pattern");
  if (p && p->is_object() && p->contains("String") && (*p)["String"].is_string())
    return (*p)["String"].get<std::string>();
  return make_error(
      errc::unsupported_op,
      src + ": " + where + ".pattern must be {\"String\": ...} (regex patterns are not supported)");
}

std::string type_of(const json& j) {
  const json* t = member(j, "type");
  return t && t->is_string() ? t->get<std::string>() : std::string("(no type)");
}

std::unexpected<error> unsupported(const std::string& src, const std::string& where,
                                   const std::string& type, const char* supported) {
  return make_error(errc::unsupported_op, src + ": " + where + " type \"" + type +
                                              "\" is not supported (supported: " + supported + ")");
}

result<void> parse_normalizer(const json& j, tokenizer_impl& t, const std::string& where) {
  const std::string type = type_of(j);
  if (type == "Sequence") {
    const json* list = member(j, "normalizers");
    if (!list || !list->is_array()) return bad(t.source, where + ".normalizers", "must be a list");
    for (const json& e : *list)
      if (auto r = parse_normalizer(e, t, where + "[]"); !r) return r;
    return {};
  }
  if (type == "Prepend") {
    auto s = get_string(j, "prepend", t.source, where);
    if (!s) return std::unexpected(s.error());
    t.normalizers.emplace_back(detail::norm_prepend{*s});
    return {};
  }
  if (type == "Replace") {
    auto from = string_pattern(j, t.source, where);
    if (!from) return std::unexpected(from.error());
    auto to = get_string(j, "content", t.source, where);
    if (!to) return std::unexpected(to.error());
    t.normalizers.emplace_back(detail::norm_replace{*from, *to});
    return {};
  }
  if (type == "NFC") {
    t.nfc = true;
    return {};
  }
  return unsupported(t.source, where, type, "Sequence, Prepend, Replace, NFC");
}

result<detail::pre_metaspace::scheme> prepend_scheme(const json& j, const std::string& src,
                                                     const std::string& where) {
  using scheme = detail::pre_metaspace::scheme;
  if (const json* s = member(j, "prepend_scheme")) {
    const std::string v = s->is_string() ? s->get<std::string>() : "";
    if (v == "always") return scheme::always;
    if (v == "first") return scheme::first;
    if (v == "never") return scheme::never;
    return bad(src, where + ".prepend_scheme", "must be \"always\", \"first\" or \"never\"");
  }
  auto add = get_bool(j, "add_prefix_space", true, src, where);
  if (!add) return std::unexpected(add.error());
  return *add ? scheme::always : scheme::never;
}

result<void> parse_pre_tokenizer(const json& j, tokenizer_impl& t, const std::string& where) {
  const std::string type = type_of(j);
  if (type == "Sequence") {
    const json* list = member(j, "pretokenizers");
    if (!list || !list->is_array())
      return bad(t.source, where + ".pretokenizers", "must be a list");
    for (const json& e : *list)
      if (auto r = parse_pre_tokenizer(e, t, where + "[]"); !r) return r;
    return {};
  }
  if (type == "Split") {
    const json* p = member(j, "pattern");
    if (!p || !p->is_object() || !p->contains("Regex") || !(*p)["Regex"].is_string())
      return make_error(errc::unsupported_op,
                        t.source + ": " + where + ".pattern must be {\"Regex\": ...}");
    const std::string re = (*p)["Regex"].get<std::string>();
    auto known = unicode::recognise_split_pattern(re);
    if (!known)
      return make_error(errc::unsupported_op,
                        t.source + ": " + where +
                            " regex is not one of the known pre-tokenizer patterns (GPT-2, " +
                            "LLaMA-3, Qwen2): " + re.substr(0, 200));
    const json* behavior = member(j, "behavior");
    if (!behavior || !behavior->is_string() || behavior->get<std::string>() != "Isolated")
      return make_error(errc::unsupported_op,
                        t.source + ": " + where + ".behavior must be \"Isolated\"");
    auto invert = get_bool(j, "invert", false, t.source, where);
    if (!invert) return std::unexpected(invert.error());
    if (*invert)
      return make_error(errc::unsupported_op, t.source + ": " + where + ".invert must be false");
    t.pre_tokenizers.emplace_back(detail::pre_split{*known});
    return {};
  }
  if (type == "ByteLevel") {
    auto prefix = get_bool(j, "add_prefix_space", true, t.source, where);
    auto regex = get_bool(j, "use_regex", true, t.source, where);
    if (!prefix) return std::unexpected(prefix.error());
    if (!regex) return std::unexpected(regex.error());
    t.pre_tokenizers.emplace_back(detail::pre_byte_level{*prefix, *regex});
    return {};
  }
  if (type == "Metaspace") {
    detail::pre_metaspace m;
    auto rep = get_string(j, "replacement", t.source, where);
    if (!rep || rep->empty())
      return bad(t.source, where + ".replacement", "must be a non-empty string");
    m.replacement = *rep;
    auto scheme = prepend_scheme(j, t.source, where);
    if (!scheme) return std::unexpected(scheme.error());
    m.prepend = *scheme;
    auto split = get_bool(j, "split", true, t.source, where);
    if (!split) return std::unexpected(split.error());
    m.split = *split;
    t.pre_tokenizers.emplace_back(std::move(m));
    return {};
  }
  return unsupported(t.source, where, type, "Sequence, Split, ByteLevel, Metaspace");
}

result<void> parse_decoder(const json& j, tokenizer_impl& t, const std::string& where) {
  const std::string type = type_of(j);
  if (type == "Sequence") {
    const json* list = member(j, "decoders");
    if (!list || !list->is_array()) return bad(t.source, where + ".decoders", "must be a list");
    for (const json& e : *list)
      if (auto r = parse_decoder(e, t, where + "[]"); !r) return r;
    return {};
  }
  if (type == "ByteLevel") {
    t.decoders.emplace_back(detail::dec_byte_level{});
  } else if (type == "ByteFallback") {
    t.decoders.emplace_back(detail::dec_byte_fallback{});
  } else if (type == "Fuse") {
    t.decoders.emplace_back(detail::dec_fuse{});
  } else if (type == "Replace") {
    auto from = string_pattern(j, t.source, where);
    if (!from) return std::unexpected(from.error());
    auto to = get_string(j, "content", t.source, where);
    if (!to) return std::unexpected(to.error());
    t.decoders.emplace_back(detail::dec_replace{*from, *to});
  } else if (type == "Strip") {
    auto content = get_string(j, "content", t.source, where);
    if (!content || content->empty())
      return bad(t.source, where + ".content", "must be a character");
    const json* start = member(j, "start");
    const json* stop = member(j, "stop");
    if (!start || !start->is_number_unsigned() || !stop || !stop->is_number_unsigned() ||
        start->get<std::uint64_t>() > 1024 || stop->get<std::uint64_t>() > 1024)
      return bad(t.source, where, "start and stop must be small non-negative integers");
    t.decoders.emplace_back(
        detail::dec_strip{*content, static_cast<std::size_t>(start->get<std::uint64_t>()),
                          static_cast<std::size_t>(stop->get<std::uint64_t>())});
  } else if (type == "Metaspace") {
    auto rep = get_string(j, "replacement", t.source, where);
    if (!rep || rep->empty())
      return bad(t.source, where + ".replacement", "must be a non-empty string");
    auto scheme = prepend_scheme(j, t.source, where);
    if (!scheme) return std::unexpected(scheme.error());
    t.decoders.emplace_back(
        detail::dec_metaspace{*rep, *scheme != detail::pre_metaspace::scheme::never});
  } else {
    return unsupported(t.source, where, type,
                       "Sequence, ByteLevel, ByteFallback, Fuse, Replace, Strip, Metaspace");
  }
  return {};
}

// Special-token references in a post-processor: a name, resolved by lookup.
result<token_id> token_ref(const tokenizer_impl& t, const json& name, const std::string& where) {
  if (!name.is_string()) return bad(t.source, where, "must name a token");
  auto id = detail::find_token(t.all_tokens, name.get<std::string>());
  if (!id)
    return bad(t.source, where, "names \"" + name.get<std::string>() + "\", which is not a token");
  return *id;
}

result<void> parse_post_processor(const json& j, tokenizer_impl& t, const std::string& where) {
  const std::string type = type_of(j);
  if (type == "Sequence") {
    const json* list = member(j, "processors");
    if (!list || !list->is_array()) return bad(t.source, where + ".processors", "must be a list");
    for (const json& e : *list)
      if (auto r = parse_post_processor(e, t, where + "[]"); !r) return r;
    return {};
  }
  if (type == "ByteLevel") return {};  // offsets only
  if (type == "TemplateProcessing") {
    const json* single = member(j, "single");
    const json* specials = member(j, "special_tokens");
    if (!single || !single->is_array()) return bad(t.source, where + ".single", "must be a list");
    t.prefix_ids.clear();
    t.suffix_ids.clear();
    bool seen_sequence = false;
    for (const json& item : *single) {
      if (member(item, "Sequence")) {
        seen_sequence = true;
        continue;
      }
      const json* sp = member(item, "SpecialToken");
      const json* id = sp ? member(*sp, "id") : nullptr;
      if (!id || !id->is_string())
        return bad(t.source, where + ".single", "items must be Sequence or SpecialToken");
      const json* entry = specials ? member(*specials, id->get<std::string>().c_str()) : nullptr;
      const json* ids = entry ? member(*entry, "ids") : nullptr;
      if (!ids || !ids->is_array())
        return bad(t.source, where + ".special_tokens",
                   "has no ids for \"" + id->get<std::string>() + "\"");
      for (const json& v : *ids) {
        if (!v.is_number_integer() || v.get<std::int64_t>() < 0 ||
            v.get<std::int64_t>() > INT32_MAX)
          return bad(t.source, where + ".special_tokens", "ids must be non-negative integers");
        (seen_sequence ? t.suffix_ids : t.prefix_ids)
            .push_back(static_cast<token_id>(v.get<std::int64_t>()));
      }
    }
    return {};
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    const json* cls = member(j, "cls");
    const json* sep = member(j, "sep");
    if (!cls || !sep || !cls->is_array() || !sep->is_array() || cls->size() != 2 ||
        sep->size() != 2)
      return bad(t.source, where, "needs cls and sep as [token, id]");
    auto c = token_ref(t, (*cls)[0], where + ".cls");
    auto s = token_ref(t, (*sep)[0], where + ".sep");
    if (!c) return std::unexpected(c.error());
    if (!s) return std::unexpected(s.error());
    t.prefix_ids = {*c};
    t.suffix_ids = {*s};
    return {};
  }
  return unsupported(t.source, where, type,
                     "Sequence, ByteLevel, TemplateProcessing, RobertaProcessing, BertProcessing");
}

result<void> parse_bpe(const json& model, tokenizer_impl& t) {
  const std::string& src = t.source;
  const json* vocab = member(model, "vocab");
  if (!vocab || !vocab->is_object())
    return bad(src, "model.vocab", "must be an object of token -> id");
  if (vocab->size() > t.limits.max_vocab)
    return bad(src, "model.vocab",
               "has " + std::to_string(vocab->size()) + " tokens, more than the limit");
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it.value().is_number_integer())
      return bad(src, "model.vocab[\"" + it.key() + "\"]", "must be an integer id");
    if (auto r = t.add_vocab_entry(it.key(), it.value().get<std::int64_t>()); !r) return r;
    t.bpe.vocab.emplace(it.key(), static_cast<token_id>(it.value().get<std::int64_t>()));
  }
  if (const json* d = member(model, "dropout"); d && !(d->is_number() && d->get<double>() == 0.0))
    return make_error(errc::unsupported_op, src + ": model.dropout (BPE dropout) is not supported");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const json* v = member(model, key); v && !(v->is_string() && v->get<std::string>().empty()))
      return make_error(errc::unsupported_op, src + ": model." + key + " is not supported");
  for (auto [key, out] :
       {std::pair{"fuse_unk", &t.bpe.fuse_unk}, std::pair{"byte_fallback", &t.bpe.byte_fallback},
        std::pair{"ignore_merges", &t.bpe.ignore_merges}}) {
    auto v = get_bool(model, key, false, src, "model");
    if (!v) return std::unexpected(v.error());
    *out = *v;
  }
  if (const json* unk = member(model, "unk_token")) {
    if (!unk->is_string()) return bad(src, "model.unk_token", "must be a string");
    auto id = detail::find_token(t.bpe.vocab, unk->get<std::string>());
    if (!id)
      return bad(src, "model.unk_token",
                 "\"" + unk->get<std::string>() + "\" is not in the vocabulary");
    t.bpe.unk = *id;
  }
  const json* merges = member(model, "merges");
  if (merges && !merges->is_array()) return bad(src, "model.merges", "must be a list");
  if (merges && merges->size() > t.limits.max_merges)
    return bad(src, "model.merges", "has too many entries");
  std::int32_t rank = 0;
  for (const json& m : merges ? *merges : json::array()) {
    std::string a, b;
    const std::string where = "model.merges[" + std::to_string(rank) + "]";
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const auto sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
        return bad(src, where, "\"" + s + "\" must be two tokens separated by one space");
      a = s.substr(0, sp), b = s.substr(sp + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      a = m[0].get<std::string>(), b = m[1].get<std::string>();
    } else {
      return bad(src, where, "must be \"a b\" or [\"a\", \"b\"]");
    }
    auto ia = detail::find_token(t.bpe.vocab, a), ib = detail::find_token(t.bpe.vocab, b);
    auto ic = detail::find_token(t.bpe.vocab, a + b);
    if (!ia || !ib || !ic)
      return bad(src, where,
                 "(\"" + a + "\", \"" + b + "\") names a token that is not in the vocabulary");
    t.bpe.merges[detail::bpe_model::key(*ia, *ib)] = {rank, *ic};
    ++rank;
  }
  return {};
}

result<void> parse_added_tokens(const json& root, tokenizer_impl& t) {
  const json* list = member(root, "added_tokens");
  if (!list) return {};
  if (!list->is_array()) return bad(t.source, "added_tokens", "must be a list");
  if (list->size() > t.limits.max_vocab)
    return bad(t.source, "added_tokens", "has too many entries");
  for (const json& e : *list) {
    detail::added_token a;
    const json* id = member(e, "id");
    auto content = get_string(e, "content", t.source, "added_tokens[]");
    if (!content) return std::unexpected(content.error());
    if (!id || !id->is_number_integer())
      return bad(t.source, "added_tokens[].id", "must be an integer");
    a.content = *content;
    for (auto [key, out] :
         {std::pair{"special", &a.special}, std::pair{"lstrip", &a.lstrip},
          std::pair{"rstrip", &a.rstrip}, std::pair{"single_word", &a.single_word},
          std::pair{"normalized", &a.normalized}}) {
      auto v = get_bool(e, key, false, t.source, "added_tokens[\"" + a.content + "\"]");
      if (!v) return std::unexpected(v.error());
      *out = *v;
    }
    if (auto r = t.add_vocab_entry(a.content, id->get<std::int64_t>()); !r) return r;
    a.id = static_cast<token_id>(id->get<std::int64_t>());
    t.added.push_back(std::move(a));
  }
  return {};
}

// A token named in tokenizer_config.json: a string or {"content": ...}.
result<std::optional<token_id>> config_token(const json& cfg, const char* key,
                                             const tokenizer_impl& t) {
  const json* v = member(cfg, key);
  if (!v) return std::optional<token_id>{};
  if (v->is_object()) v = member(*v, "content");
  if (!v || !v->is_string())
    return bad(t.source, std::string("tokenizer_config.") + key, "must be a token string");
  auto id = detail::find_token(t.all_tokens, v->get<std::string>());
  if (!id)
    return bad(t.source, std::string("tokenizer_config.") + key,
               "\"" + v->get<std::string>() + "\" is not a token");
  return std::optional<token_id>{*id};
}

result<void> apply_config(const json& cfg, tokenizer_impl& t) {
  for (auto [key, out] :
       {std::pair{"bos_token", &t.specials.bos}, std::pair{"eos_token", &t.specials.eos},
        std::pair{"pad_token", &t.specials.pad}, std::pair{"unk_token", &t.specials.unk}}) {
    auto id = config_token(cfg, key, t);
    if (!id) return std::unexpected(id.error());
    if (*id) *out = **id;
  }
  const json* add_bos = member(cfg, "add_bos_token");
  const json* add_eos = member(cfg, "add_eos_token");
  if ((add_bos && !add_bos->is_boolean()) || (add_eos && !add_eos->is_boolean()))
    return bad(t.source, "tokenizer_config.add_bos_token/add_eos_token", "must be true or false");
  if (add_bos) {
    if (add_bos->get<bool>() && !t.specials.bos)
      return bad(t.source, "tokenizer_config.add_bos_token", "set without a bos_token");
    t.prefix_ids.clear();
    if (add_bos->get<bool>()) t.prefix_ids.push_back(*t.specials.bos);
  }
  if (add_eos) {
    if (add_eos->get<bool>() && !t.specials.eos)
      return bad(t.source, "tokenizer_config.add_eos_token", "set without an eos_token");
    t.suffix_ids.clear();
    if (add_eos->get<bool>()) t.suffix_ids.push_back(*t.specials.eos);
  }
  if (const json* ct = member(cfg, "chat_template")) {
    if (ct->is_string()) {
      t.chat_template = ct->get<std::string>();
    } else if (ct->is_array()) {  // [{"name": "default", "template": ...}, ...]
      for (const json& e : *ct) {
        const json* name = member(e, "name");
        const json* tmpl = member(e, "template");
        if (name && tmpl && name->is_string() && tmpl->is_string() &&
            name->get<std::string>() == "default")
          t.chat_template = tmpl->get<std::string>();
      }
    } else {
      return bad(t.source, "tokenizer_config.chat_template",
                 "must be a string or a list of named templates");
    }
  }
  return {};
}

}  // namespace

result<tokenizer> tokenizer::from_json(std::string_view text, std::string_view config_text,
                                       const std::string& src, const tokenizer_limits& limits) {
  auto root = parse_json(text, src, limits.max_json_bytes);
  if (!root) return std::unexpected(root.error());
  auto t = std::make_shared<tokenizer_impl>();
  t->source = src;
  t->limits = limits;
  try {
    const json* model = member(*root, "model");
    if (!model || !model->is_object()) return bad(src, "model", "is missing");
    const std::string type = type_of(*model);
    if (type != "BPE" && !(type == "(no type)" && model->contains("merges")))
      return make_error(errc::unsupported_op,
                        src + ": model type \"" + type + "\" is not supported (BPE)");
    if (auto r = parse_bpe(*model, *t); !r) return std::unexpected(r.error());
    if (auto r = parse_added_tokens(*root, *t); !r) return std::unexpected(r.error());
    if (const json* n = member(*root, "normalizer"))
      if (auto r = parse_normalizer(*n, *t, "normalizer"); !r) return std::unexpected(r.error());
    if (const json* p = member(*root, "pre_tokenizer"))
      if (auto r = parse_pre_tokenizer(*p, *t, "pre_tokenizer"); !r)
        return std::unexpected(r.error());
    if (const json* p = member(*root, "post_processor"))
      if (auto r = parse_post_processor(*p, *t, "post_processor"); !r)
        return std::unexpected(r.error());
    const json* d = member(*root, "decoder");
    t->has_decoder = d != nullptr;
    if (d)
      if (auto r = parse_decoder(*d, *t, "decoder"); !r) return std::unexpected(r.error());

    t->specials.unk = t->bpe.unk;
    if (!t->prefix_ids.empty()) t->specials.bos = t->prefix_ids.front();
    if (!config_text.empty()) {
      auto cfg = parse_json(config_text, src + " (tokenizer_config.json)", limits.max_json_bytes);
      if (!cfg) return std::unexpected(cfg.error());
      if (auto r = apply_config(*cfg, *t); !r) return std::unexpected(r.error());
    } else {
      // No config: the usual end-of-text names among the special tokens.
      for (const char* name :
           {"</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>"})
        if (auto id = detail::find_token(t->all_tokens, name); id && !t->specials.eos)
          t->specials.eos = *id;
    }
  } catch (const json::exception& e) {  // a type check missed above: report, never throw
    return make_error(errc::corrupt_data, src + ": " + e.what());
  }
  bool byte_level = false, metaspace = false;
  for (const auto& p : t->pre_tokenizers)
    byte_level = byte_level || std::holds_alternative<detail::pre_byte_level>(p);
  for (const auto& p : t->pre_tokenizers)
    metaspace = metaspace || std::holds_alternative<detail::pre_metaspace>(p);
  t->kind_name = byte_level                            ? "byte-level BPE"
                 : (metaspace || t->bpe.byte_fallback) ? "SentencePiece BPE"
                                                       : "BPE";
  if (auto r = t->finish(); !r) return std::unexpected(r.error());
  return tokenizer(std::move(t));
}

result<tokenizer> tokenizer::load(const std::string& path, const tokenizer_limits& limits) {
  struct stat st {};
  std::string file = path, config;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    file = path + "/tokenizer.json";
    config = path + "/tokenizer_config.json";
  } else {
    const auto slash = path.rfind('/');
    config = (slash == std::string::npos ? std::string() : path.substr(0, slash + 1)) +
             "tokenizer_config.json";
  }
  auto text = read_text_file(file, limits.max_json_bytes);
  if (!text) return std::unexpected(text.error());
  std::string cfg;
  if (::stat(config.c_str(), &st) == 0) {
    auto c = read_text_file(config, limits.max_json_bytes);
    if (!c) return std::unexpected(c.error());
    cfg = std::move(*c);
  }
  return from_json(*text, cfg, file, limits);
}

}  // namespace troupe::models
