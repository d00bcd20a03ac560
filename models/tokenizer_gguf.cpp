// Loading a tokenizer from GGUF metadata (tokenizer.ggml.*), as llama.cpp reads it.
#include <cmath>

#include "models/tokenizer.hpp"
#include "models/tokenizer_impl.hpp"

namespace troupe::models {

namespace {

using detail::tokenizer_impl;

// llama.cpp's token types (llama_token_type).
enum gguf_token_type : std::int64_t {
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6
};

std::unexpected<error> bad(const tokenizer_impl& t, const std::string& key,
                           const std::string& what) {
  return make_error(errc::corrupt_data, t.source + ": " + key + " " + what);
}

result<const gguf_array*> array_of(const gguf_file& f, const tokenizer_impl& t,
                                   const std::string& key, gguf_type type, bool required) {
  const gguf_value* v = f.find(key);
  if (!v) {
    if (required) return bad(t, key, "is missing");
    return nullptr;
  }
  const gguf_array* a = v->as_array();
  if (!a) return bad(t, key, "must be an array");
  const bool ok = type == gguf_type::string ? a->type == gguf_type::string
                  : type == gguf_type::f32
                      ? (a->type == gguf_type::f32 || a->type == gguf_type::f64)
                      : (a->type != gguf_type::string && a->type != gguf_type::f32 &&
                         a->type != gguf_type::f64 && a->type != gguf_type::array);
  if (!ok) return bad(t, key, "has the wrong element type");
  return a;
}

result<std::optional<std::int64_t>> int_of(const gguf_file& f, const tokenizer_impl& t,
                                           const std::string& key) {
  const gguf_value* v = f.find(key);
  if (!v) return std::optional<std::int64_t>{};
  auto i = v->as_int();
  if (!i || v->type == gguf_type::boolean) return bad(t, key, "must be an integer");
  return std::optional<std::int64_t>{*i};
}

result<std::optional<bool>> bool_of(const gguf_file& f, const tokenizer_impl& t,
                                    const std::string& key) {
  const gguf_value* v = f.find(key);
  if (!v) return std::optional<bool>{};
  if (v->type != gguf_type::boolean) return bad(t, key, "must be a bool");
  return std::optional<bool>{*v->as_int() != 0};
}

}  // namespace

result<tokenizer> tokenizer::from_gguf(const gguf_file& f, const tokenizer_limits& limits) {
  auto t = std::make_shared<tokenizer_impl>();
  t->source = f.path();
  t->limits = limits;
  const gguf_value* model_v = f.find("tokenizer.ggml.model");
  if (!model_v || !model_v->as_string())
    return bad(*t, "tokenizer.ggml.model", "is missing (the file has no tokenizer)");
  const std::string model = *model_v->as_string();
  if (model != "llama" && model != "gpt2")
    return make_error(errc::unsupported_op, t->source + ": tokenizer.ggml.model \"" + model +
                                                "\" is not supported (llama, gpt2)");
  auto tokens = array_of(f, *t, "tokenizer.ggml.tokens", gguf_type::string, true);
  if (!tokens) return std::unexpected(tokens.error());
  const std::size_t n = (*tokens)->strings.size();
  if (n == 0) return bad(*t, "tokenizer.ggml.tokens", "is empty");
  if (n > limits.max_vocab)
    return bad(*t, "tokenizer.ggml.tokens",
               "has " + std::to_string(n) + " tokens, more than the limit");
  auto scores = array_of(f, *t, "tokenizer.ggml.scores", gguf_type::f32, false);
  if (!scores) return std::unexpected(scores.error());
  if (*scores && (*scores)->floats.size() != n)
    return bad(*t, "tokenizer.ggml.scores",
               "has " + std::to_string((*scores)->floats.size()) + " entries for " +
                   std::to_string(n) + " tokens");
  auto types = array_of(f, *t, "tokenizer.ggml.token_type", gguf_type::i32, false);
  if (!types) return std::unexpected(types.error());
  if (*types && (*types)->ints.size() != n)
    return bad(*t, "tokenizer.ggml.token_type",
               "has " + std::to_string((*types)->ints.size()) + " entries for " +
                   std::to_string(n) + " tokens");

  const bool spm = model == "llama";
  t->model = spm ? detail::model_type::spm_scores : detail::model_type::bpe;
  detail::vocab_map& vocab = spm ? t->spm.vocab : t->bpe.vocab;
  for (std::size_t i = 0; i < n; ++i) {
    const std::string& text = (*tokens)->strings[i];
    if (auto r = t->add_vocab_entry(text, static_cast<std::int64_t>(i)); !r)
      return std::unexpected(r.error());
    vocab.emplace(text, static_cast<token_id>(i));
    const std::int64_t type = *types ? (*types)->ints[i] : normal;
    if (type < 0 || type > byte)
      return bad(*t, "tokenizer.ggml.token_type",
                 "[" + std::to_string(i) + "] = " + std::to_string(type) + " is not a token type");
    if (type == control || type == unknown || type == user_defined)
      t->added.push_back(
          {text, static_cast<token_id>(i), type != user_defined, false, false, false, false});
  }
  if (spm) {
    t->spm.scores.assign(n, 0.0f);
    if (*scores)
      for (std::size_t i = 0; i < n; ++i) {
        const double s = (*scores)->floats[i];
        if (!std::isfinite(s))
          return bad(*t, "tokenizer.ggml.scores", "[" + std::to_string(i) + "] is not finite");
        t->spm.scores[i] = static_cast<float>(s);
      }
  }

  // Special tokens and what encode(add_special) adds.
  for (auto [key, out] : {std::pair{"tokenizer.ggml.bos_token_id", &t->specials.bos},
                          std::pair{"tokenizer.ggml.eos_token_id", &t->specials.eos},
                          std::pair{"tokenizer.ggml.unknown_token_id", &t->specials.unk},
                          std::pair{"tokenizer.ggml.padding_token_id", &t->specials.pad}}) {
    auto v = int_of(f, *t, key);
    if (!v) return std::unexpected(v.error());
    if (!*v) continue;
    if (**v < 0 || static_cast<std::uint64_t>(**v) >= n)
      return bad(*t, key,
                 "= " + std::to_string(**v) + " is outside the " + std::to_string(n) + " tokens");
    *out = static_cast<token_id>(**v);
  }
  auto add_bos = bool_of(f, *t, "tokenizer.ggml.add_bos_token");
  auto add_eos = bool_of(f, *t, "tokenizer.ggml.add_eos_token");
  auto add_space = bool_of(f, *t, "tokenizer.ggml.add_space_prefix");
  for (auto* r : {&add_bos, &add_eos, &add_space})
    if (!*r) return std::unexpected(r->error());

  if (spm) {
    t->spm.unk = t->specials.unk;
    const bool space_prefix = add_space->value_or(true);
    if (space_prefix) t->normalizers.emplace_back(detail::norm_prepend{"\xE2\x96\x81"});
    t->normalizers.emplace_back(detail::norm_replace{" ", "\xE2\x96\x81"});
    t->decoders = {detail::dec_replace{"\xE2\x96\x81", " "}, detail::dec_byte_fallback{},
                   detail::dec_fuse{}};
    if (space_prefix) t->decoders.emplace_back(detail::dec_strip{" ", 1, 0});
    t->kind_name = "SentencePiece (llama.cpp scores)";
  } else {
    unicode::split_pattern pattern = unicode::split_pattern::gpt2;
    bool llama3 = false;
    if (const gguf_value* pre = f.find("tokenizer.ggml.pre")) {
      const std::string* name = pre->as_string();
      if (!name) return bad(*t, "tokenizer.ggml.pre", "must be a string");
      if (*name == "llama-bpe" || *name == "llama3" || *name == "llama-v3") {
        pattern = unicode::split_pattern::llama3;
        llama3 = true;
      } else if (*name == "qwen2") {
        pattern = unicode::split_pattern::qwen2;
      } else if (*name != "gpt-2" && *name != "gpt2") {
        return make_error(errc::unsupported_op,
                          t->source + ": tokenizer.ggml.pre \"" + *name +
                              "\" is not supported (llama-bpe, qwen2, gpt-2)");
      }
    }
    t->bpe.ignore_merges = llama3;
    if (!add_bos->has_value()) *add_bos = llama3;
    t->pre_tokenizers = {detail::pre_split{pattern}, detail::pre_byte_level{false, false}};
    t->decoders = {detail::dec_byte_level{}};
    auto merges = array_of(f, *t, "tokenizer.ggml.merges", gguf_type::string, true);
    if (!merges) return std::unexpected(merges.error());
    if ((*merges)->strings.size() > limits.max_merges)
      return bad(*t, "tokenizer.ggml.merges", "has too many entries");
    std::int32_t rank = 0;
    for (const std::string& m : (*merges)->strings) {
      const auto sp = m.find(' ');
      const std::string where = "tokenizer.ggml.merges[" + std::to_string(rank) + "]";
      if (sp == std::string::npos || m.find(' ', sp + 1) != std::string::npos)
        return bad(*t, where, "\"" + m + "\" must be two tokens separated by one space");
      const std::string a = m.substr(0, sp), b = m.substr(sp + 1);
      auto ia = detail::find_token(vocab, a), ib = detail::find_token(vocab, b),
           ic = detail::find_token(vocab, a + b);
      if (!ia || !ib || !ic)
        return bad(*t, where, "\"" + m + "\" names a token that is not in the vocabulary");
      t->bpe.merges[detail::bpe_model::key(*ia, *ib)] = {rank++, *ic};
    }
    t->bpe.unk = t->specials.unk;
    t->kind_name = "byte-level BPE";
  }
  if (add_bos->value_or(false) && !t->specials.bos)
    return bad(*t, "tokenizer.ggml.add_bos_token", "is set but there is no bos_token_id");
  if (add_bos->value_or(spm) && t->specials.bos) t->prefix_ids = {*t->specials.bos};
  if (add_eos->value_or(false)) {
    if (!t->specials.eos)
      return bad(*t, "tokenizer.ggml.add_eos_token", "is set but there is no eos_token_id");
    t->suffix_ids = {*t->specials.eos};
  }
  if (const gguf_value* ct = f.find("tokenizer.chat_template")) {
    if (!ct->as_string()) return bad(*t, "tokenizer.chat_template", "must be a string");
    t->chat_template = *ct->as_string();
  }
  if (auto r = t->finish(); !r) return std::unexpected(r.error());
  return tokenizer(std::move(t));
}

}  // namespace troupe::models
