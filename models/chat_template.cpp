#include "models/chat_template.hpp"

#include <algorithm>
#include <array>

#include "models/tokenizer_unicode.hpp"

namespace troupe::models {

namespace {

constexpr std::array<std::string_view, 11> all_names = {
    "llama2", "llama3",  "chatml",     "qwen2", "llava",       "llava-1.5",
    "gemma",  "mistral", "mistral-v1", "phi3",  "phi3-2024-04"};
constexpr std::string_view qwen_system = "You are a helpful assistant.";

std::string choices() {
  return "llama2, llama3, chatml, qwen2, llava, gemma, mistral, mistral-v1, phi3, phi3-2024-04";
}

// Python's str.isspace(): White_Space plus the information separators.
bool py_space(char32_t c) {
  return unicode::is_whitespace(c) || (c >= 0x1C && c <= 0x1F);
}

// Python's str.strip() / Jinja's trim filter.
std::string strip(std::string_view s) {
  std::size_t b = 0, e = s.size();
  char32_t cp = 0;
  while (b < e) {
    const std::size_t len = unicode::decode_utf8(s, b, cp);
    if (len == 0 || !py_space(cp)) break;
    b += len;
  }
  while (e > b) {
    std::size_t i = e - 1;
    while (i > b && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
    const std::size_t len = unicode::decode_utf8(s, i, cp);
    if (len == 0 || i + len != e || !py_space(cp)) break;
    e = i;
  }
  return std::string(s.substr(b, e - b));
}

std::string upper_ascii(std::string_view s) {
  std::string out(s);
  for (char& c : out)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
  return out;
}

// The literal default system prompt of a Qwen-style ChatML template:
// '<|im_start|>system\nTEXT<|im_end|>' written as a Jinja string literal.
std::string chatml_default_system(std::string_view src) {
  constexpr std::string_view open = "<|im_start|>system";
  const auto at = src.find(open);
  if (at == std::string_view::npos) return {};
  std::size_t p = at + open.size();
  if (src.substr(p, 2) == "\\n") {
    p += 2;
  } else if (src.substr(p, 1) == "\n") {
    p += 1;
  } else {
    return {};
  }
  const auto end = src.find("<|im_end|>", p);
  if (end == std::string_view::npos) return {};
  const std::string_view text = src.substr(p, end - p);
  if (text.empty() || text.find_first_of("'\"{}") != std::string_view::npos) return {};
  return std::string(text);
}

}  // namespace

std::span<const std::string_view> chat_template::names() {
  return all_names;
}

std::string_view chat_template::name() const {
  switch (format_) {
    case chat_format::llama2:
      return "llama2";
    case chat_format::llama3:
      return "llama3";
    case chat_format::chatml:
      return default_system_.empty() ? "chatml" : "qwen2";
    case chat_format::llava:
      return "llava";
    case chat_format::gemma:
      return "gemma";
    case chat_format::mistral:
      return "mistral";
    case chat_format::mistral_v1:
      return "mistral-v1";
    case chat_format::phi3:
      return "phi3";
    case chat_format::phi3_legacy:
      return "phi3-2024-04";
  }
  return "";
}

result<chat_template> chat_template::from_name(std::string_view name) {
  if (name == "llama2") return chat_template(chat_format::llama2, "");
  if (name == "llama3") return chat_template(chat_format::llama3, "");
  if (name == "chatml") return chat_template(chat_format::chatml, "");
  if (name == "qwen2") return chat_template(chat_format::chatml, std::string(qwen_system));
  if (name == "llava" || name == "llava-1.5") return chat_template(chat_format::llava, "");
  if (name == "gemma") return chat_template(chat_format::gemma, "");
  if (name == "mistral") return chat_template(chat_format::mistral, "");
  if (name == "mistral-v1") return chat_template(chat_format::mistral_v1, "");
  if (name == "phi3") return chat_template(chat_format::phi3, "");
  if (name == "phi3-2024-04") return chat_template(chat_format::phi3_legacy, "");
  return make_error(errc::invalid_argument, "chat template \"" + std::string(name) +
                                                "\" is not built in (choose one of: " + choices() +
                                                ")");
}

result<chat_template> chat_template::detect(std::string_view src) {
  auto has = [&](std::string_view s) { return src.find(s) != std::string_view::npos; };
  if (src.empty())
    return make_error(
        errc::not_found,
        "the model has no chat template; pass --chat-template NAME (" + choices() + ")");
  if (has("<|start_header_id|>") && has("<|end_header_id|>"))
    return chat_template(chat_format::llama3, "");
  // The Mistral and Phi-3 variants differ in spaces and quoting only: match
  // on the source with Jinja's two quote characters made one.
  std::string single(src);
  std::replace(single.begin(), single.end(), '"', '\'');
  auto has1 = [&](std::string_view s) { return single.find(s) != std::string::npos; };
  if (has("<|user|>") && has("<|end|>") && has("<|assistant|>")) {
    if (has1("'<|end|>' + '\\n' + '<|assistant|>' + '\\n'"))
      return chat_template(chat_format::phi3_legacy, "");
    return chat_template(chat_format::phi3, "", !has1("'system' and message['content']"));
  }
  if (has1("'[INST] ' + message['content'] + '[/INST]'"))
    return chat_template(chat_format::mistral, "");
  if (has1("'[INST] ' + message['content'] + ' [/INST]'") && !has("<<SYS>>"))
    return chat_template(chat_format::mistral_v1, "");
  if (has("<|im_start|>") && has("<|im_end|>"))
    return chat_template(chat_format::chatml, chatml_default_system(src));
  if (has("[INST]") && has("<<SYS>>")) return chat_template(chat_format::llama2, "");
  if (has("<start_of_turn>") && has("<end_of_turn>")) return chat_template(chat_format::gemma, "");
  if (has("ASSISTANT:") && (has("<image>") || has("USER:") || has(".upper()")))
    return chat_template(chat_format::llava, "");
  return make_error(errc::unsupported_op,
                    "the model's chat template is not one troupe recognises (built in: " +
                        choices() + "); pass --chat-template NAME to choose one");
}

result<chat_template> chat_template::select(std::string_view src, std::string_view override_name) {
  return override_name.empty() ? detect(src) : from_name(override_name);
}

result<std::string> chat_template::render(std::span<const chat_message> messages,
                                          bool add_generation_prompt, std::string_view bos,
                                          std::string_view eos) const {
  for (const chat_message& m : messages) {
    if (m.role.empty()) return make_error(errc::invalid_argument, "chat message without a role");
    if (m.images < 0 || m.audios < 0 || m.videos < 0)
      return make_error(errc::invalid_argument, "chat message with a negative media count");
    if ((m.images > 0 || m.audios > 0 || m.videos > 0) && format_ != chat_format::llava)
      return make_error(errc::invalid_argument, "chat template " + std::string(name()) +
                                                    " has no image, video or audio placeholders "
                                                    "(use llava)");
  }
  std::string out;
  switch (format_) {
    case chat_format::llama2: {
      std::span<const chat_message> loop = messages;
      const chat_message* system = nullptr;
      if (!messages.empty() && messages[0].role == "system") {
        system = &messages[0];
        loop = messages.subspan(1);
      }
      for (std::size_t i = 0; i < loop.size(); ++i) {
        const chat_message& m = loop[i];
        if ((m.role == "user") != (i % 2 == 0))
          return make_error(errc::invalid_argument,
                            "llama2 chat template: conversation roles must alternate "
                            "user/assistant/user/assistant/...");
        std::string content = m.content;
        if (i == 0 && system)
          content = "<<SYS>>\n" + system->content + "\n<</SYS>>\n\n" + m.content;
        if (m.role == "user") {
          out += std::string(bos) + "[INST] " + strip(content) + " [/INST]";
        } else if (m.role == "assistant") {
          out += " " + strip(content) + " " + std::string(eos);
        }
      }
      break;
    }
    case chat_format::llama3:
      for (std::size_t i = 0; i < messages.size(); ++i) {
        if (i == 0) out += bos;
        out += "<|start_header_id|>" + messages[i].role + "<|end_header_id|>\n\n" +
               strip(messages[i].content) + "<|eot_id|>";
      }
      if (add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
      break;
    case chat_format::chatml:
      for (std::size_t i = 0; i < messages.size(); ++i) {
        if (i == 0 && !default_system_.empty() && messages[0].role != "system")
          out += "<|im_start|>system\n" + default_system_ + "<|im_end|>\n";
        out += "<|im_start|>" + messages[i].role + "\n" + messages[i].content + "<|im_end|>\n";
      }
      if (add_generation_prompt) out += "<|im_start|>assistant\n";
      break;
    case chat_format::llava:
      for (const chat_message& m : messages) {
        if (m.role != "system") out += upper_ascii(m.role) + ": ";
        for (int k = 0; k < m.images; ++k) out += "<image>\n";
        for (int k = 0; k < m.videos; ++k) out += "<video>\n";
        for (int k = 0; k < m.audios; ++k) out += "<audio>\n";
        out += m.content + " ";
      }
      if (add_generation_prompt) out += "ASSISTANT:";
      break;
    case chat_format::gemma: {
      // Gemma 3's template: BOS; a system message becomes a prefix of the
      // first user turn ("SYSTEM\n\n", not trimmed); roles alternate from
      // user; "assistant" is written "model"; contents trimmed.
      out += bos;
      std::span<const chat_message> loop = messages;
      std::string prefix;
      if (!messages.empty() && messages[0].role == "system") {
        prefix = messages[0].content + "\n\n";
        loop = messages.subspan(1);
      }
      for (std::size_t i = 0; i < loop.size(); ++i) {
        const chat_message& m = loop[i];
        if ((m.role == "user") != (i % 2 == 0))
          return make_error(errc::invalid_argument,
                            "gemma chat template: conversation roles must alternate "
                            "user/assistant/user/assistant/...");
        const std::string role = m.role == "assistant" ? "model" : m.role;
        out += "<start_of_turn>" + role + "\n" + (i == 0 ? prefix : std::string()) +
               strip(m.content) + "<end_of_turn>\n";
      }
      if (add_generation_prompt) out += "<start_of_turn>model\n";
      break;
    }
    case chat_format::mistral: {
      // v0.3: an optional first system message, written into the last turn
      // when that turn is the user's (and dropped otherwise); roles alternate
      // from user; answers trimmed. No generation prompt: a user turn ends
      // with [/INST].
      out += bos;
      std::span<const chat_message> loop = messages;
      const chat_message* system = nullptr;
      if (!messages.empty() && messages[0].role == "system") {
        system = &messages[0];
        loop = messages.subspan(1);
      }
      for (std::size_t i = 0; i < loop.size(); ++i) {
        const chat_message& m = loop[i];
        if ((m.role == "user") != (i % 2 == 0))
          return make_error(errc::invalid_argument,
                            "mistral chat template: after the optional system message, "
                            "conversation roles must alternate user/assistant/user/assistant/...");
        if (m.role == "user") {
          if (i + 1 == loop.size() && system)
            out += "[INST] " + system->content + "\n\n" + m.content + "[/INST]";
          else
            out += "[INST] " + m.content + "[/INST]";
        } else if (m.role == "assistant") {
          out += " " + strip(m.content) + std::string(eos);
        } else {
          return make_error(errc::invalid_argument,
                            "mistral chat template: only user and assistant roles are supported, "
                            "with the exception of an initial optional system message");
        }
      }
      break;
    }
    case chat_format::mistral_v1:
      out += bos;
      for (std::size_t i = 0; i < messages.size(); ++i) {
        const chat_message& m = messages[i];
        if ((m.role == "user") != (i % 2 == 0))
          return make_error(errc::invalid_argument,
                            "mistral-v1 chat template: conversation roles must alternate "
                            "user/assistant/user/assistant/...");
        if (m.role == "user")
          out += "[INST] " + m.content + " [/INST]";
        else if (m.role == "assistant")
          out += m.content + std::string(eos);
        else
          return make_error(
              errc::invalid_argument,
              "mistral-v1 chat template: only user and assistant roles are supported");
      }
      break;
    case chat_format::phi3:
      // Other roles are left out, as the template leaves them out.
      for (const chat_message& m : messages) {
        if (m.role == "system" && (keep_empty_system_ || !m.content.empty()))
          out += "<|system|>\n" + m.content + "<|end|>\n";
        else if (m.role == "user")
          out += "<|user|>\n" + m.content + "<|end|>\n";
        else if (m.role == "assistant")
          out += "<|assistant|>\n" + m.content + "<|end|>\n";
      }
      out += add_generation_prompt ? std::string("<|assistant|>\n") : std::string(eos);
      break;
    case chat_format::phi3_legacy:
      // No system role (a system message is left out) and no generation
      // prompt: each user turn already ends with <|assistant|>.
      out += bos;
      for (const chat_message& m : messages) {
        if (m.role == "user")
          out += "<|user|>\n" + m.content + "<|end|>\n<|assistant|>\n";
        else if (m.role == "assistant")
          out += m.content + "<|end|>\n";
      }
      break;
  }
  return out;
}

}  // namespace troupe::models
