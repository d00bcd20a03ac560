#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "models/mapped_file.hpp"

namespace troupe::models {

/// The chat prompt formats troupe renders (no general Jinja engine: a
/// model's template is recognised by its distinctive markers).
enum class chat_format : std::uint8_t {
  llama2,      ///< <s>[INST] <<SYS>>\n...\n<</SYS>>\n\n... [/INST] answer </s>
  llama3,      ///< <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>
  chatml,      ///< <|im_start|>role\n...<|im_end|>\n (optionally a default system prompt, Qwen2)
  llava,       ///< LLaVA-1.5: "USER: <image>\n... ASSISTANT: ..."
  gemma,       ///< <start_of_turn>user\n...<end_of_turn>\n (system folded into the first user turn)
  mistral,     ///< Mistral-7B-Instruct-v0.3: [INST] ...[/INST] answer</s>, system in the last turn
  mistral_v1,  ///< Mistral-7B-Instruct-v0.1/v0.2: [INST] ... [/INST]answer</s>, no system
  phi3,        ///< Phi-3.5 / Phi-3 (updated): <|user|>\n...<|end|>\n, <|assistant|>\n to answer
  phi3_legacy,  ///< Phi-3-mini as first published: no system, <|assistant|>\n after each user turn
};

/// One chat turn: role ("system", "user", "assistant"), text, and how many
/// images and audio clips the turn carries (rendered as placeholders where
/// the format has them: the turn's images, then its clips, then its text).
struct chat_message {
  std::string role;
  std::string content;
  int images = 0;
  int audios = 0;
  int videos = 0;
};

/// A chat template: renders messages into the prompt text the model was
/// trained on, exactly as transformers' Jinja rendering of the model's
/// published template does.
class chat_template {
 public:
  /// A built-in format by name: "llama2", "llama3", "chatml", "qwen2"
  /// (ChatML with Qwen's default system prompt), "llava" (alias "llava-1.5"),
  /// "gemma" (Gemma 2 and 3; GGUF files of Gemma carry no template, so the
  /// prompt code picks it by architecture, as llama.cpp does), "mistral"
  /// (Mistral-7B-Instruct-v0.3), "mistral-v1" (v0.1, v0.2), "phi3"
  /// (Phi-3.5-mini and the updated Phi-3), "phi3-2024-04" (the first Phi-3-mini).
  /// This is what `--chat-template NAME` passes.
  static result<chat_template> from_name(std::string_view name);
  /// Recognises a Jinja `chat_template` (tokenizer_config.json or GGUF
  /// tokenizer.chat_template); an unknown one is an error naming the choices.
  static result<chat_template> detect(std::string_view jinja_source);
  /// `override_name` when not empty, else detect(jinja_source).
  static result<chat_template> select(std::string_view jinja_source,
                                      std::string_view override_name);
  /// The names from_name accepts.
  static std::span<const std::string_view> names();

  chat_format format() const { return format_; }
  std::string_view name() const;
  /// System prompt the template inserts when the chat has none ("" if none).
  const std::string& default_system() const { return default_system_; }

  /// The prompt text. `bos_token`/`eos_token` are the tokenizer's texts
  /// (e.g. "<s>", "</s>"). Errors: images in a format without placeholders,
  /// roles that LLaMA-2 requires to alternate, an empty role.
  result<std::string> render(std::span<const chat_message> messages, bool add_generation_prompt,
                             std::string_view bos_token, std::string_view eos_token) const;

 private:
  chat_template(chat_format f, std::string default_system, bool keep_empty_system = false)
      : format_(f),
        default_system_(std::move(default_system)),
        keep_empty_system_(keep_empty_system) {}
  chat_format format_;
  std::string default_system_;
  /// phi3: a system message with empty content is still written (the
  /// updated Phi-3-mini's template; Phi-3.5's skips it).
  bool keep_empty_system_ = false;
};

}  // namespace troupe::models
