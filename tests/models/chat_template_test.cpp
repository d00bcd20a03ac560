// Chat templates against transformers' renderings (render_jinja_template, what
// apply_chat_template calls; transformers 5.25) of the models' published Jinja
// templates (tools/make_tokenizer_fixtures.py, chat_templates.json).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "models/chat_template.hpp"

using namespace troupe::models;
using json = nlohmann::json;

namespace {

json load_fixture() {
  std::ifstream in(std::string(TROUPE_FIXTURES_DIR) + "/tokenizers/chat_templates.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return json::parse(ss.str());
}

std::vector<chat_message> messages_of(const json& j) {
  std::vector<chat_message> out;
  for (const json& m : j) out.push_back({m["role"], m["content"], m["images"]});
  return out;
}

}  // namespace

TEST(ChatTemplate, RecognisesPublishedTemplates) {
  const json doc = load_fixture();
  for (auto it = doc["templates"].begin(); it != doc["templates"].end(); ++it) {
    auto t = chat_template::detect(it.value().get<std::string>());
    ASSERT_TRUE(t) << it.key() << ": " << t.error().message;
    EXPECT_EQ(t->name(), it.key());
  }
  auto qwen = chat_template::detect(doc["templates"]["qwen2"].get<std::string>());
  EXPECT_EQ(qwen->default_system(), "You are a helpful assistant.");
}

TEST(ChatTemplate, RendersLikeJinja) {
  const json doc = load_fixture();
  int rendered = 0, refused = 0;
  for (const json& c : doc["cases"]) {
    auto t = chat_template::detect(
        doc["templates"][c["template"].get<std::string>()].get<std::string>());
    ASSERT_TRUE(t);
    const auto msgs = messages_of(c["messages"]);
    auto out = t->render(msgs, c["add_generation_prompt"], c["bos_token"].get<std::string>(),
                         c["eos_token"].get<std::string>());
    SCOPED_TRACE(c.dump());
    if (c["expected"].is_null()) {  // jinja raised (roles) or the format has no images
      EXPECT_FALSE(out);
      ++refused;
    } else {
      ASSERT_TRUE(out) << out.error().message;
      EXPECT_EQ(*out, c["expected"].get<std::string>());
      ++rendered;
    }
  }
  EXPECT_GE(rendered, 40);
  EXPECT_GE(refused, 5);
}

TEST(ChatTemplate, OverrideAndUnknown) {
  auto unknown = chat_template::detect("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}");
  ASSERT_FALSE(unknown);
  for (std::string_view name : {"llama2", "llama3", "chatml", "llava"})
    EXPECT_NE(unknown.error().message.find(name), std::string::npos) << unknown.error().message;
  EXPECT_NE(unknown.error().message.find("--chat-template"), std::string::npos);
  EXPECT_FALSE(chat_template::detect(""));

  auto forced = chat_template::select("{{ weird }}", "llama3");
  ASSERT_TRUE(forced);
  EXPECT_EQ(forced->format(), chat_format::llama3);
  EXPECT_FALSE(chat_template::select("", "mistral-v7"));
  // Mistral Nemo's "tekken" variant (no space after [INST]) is not one of the built-in ones.
  EXPECT_FALSE(
      chat_template::detect("{{ bos_token }}{% for message in messages %}{{ \"[INST]\" + "
                            "message[\"content\"] + \"[/INST]\" }}{% endfor %}"));
  for (std::string_view name : chat_template::names())
    EXPECT_TRUE(chat_template::from_name(name)) << name;

  const std::vector<chat_message> bad_role{{"", "hi", 0}};
  EXPECT_FALSE(forced->render(bad_role, true, "", ""));
}
