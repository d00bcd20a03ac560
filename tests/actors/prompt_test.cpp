// The prompt setup of GGUF models: a Gemma 3 file (which carries no chat
// template) gets the built-in Gemma template and stops at <end_of_turn>.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "actors/prompt.hpp"

using namespace troupe;

namespace {

std::string gemma_file() {
  return std::string(TROUPE_FIXTURES_DIR) + "/gguf_quants/gemma3-q4_k_m.gguf";
}

}  // namespace

TEST(Prompt, GemmaGgufGetsTheBuiltInGemmaTemplate) {
  auto s = actors::load_prompt_setup(gemma_file());
  ASSERT_TRUE(s) << s.error().message;
  EXPECT_EQ(s->text.family, models::decoder_family::gemma3);
  EXPECT_TRUE(s->tok->chat_template_source().empty());
  const auto eot = s->tok->token_to_id("<end_of_turn>");
  ASSERT_TRUE(eot);
  EXPECT_NE(std::find(s->stop_ids.begin(), s->stop_ids.end(), *eot), s->stop_ids.end());
  const std::string prompt = " the sea ", system = "be a poet";
  actors::prompt_input in;
  in.prompt = prompt;
  in.system = system;
  in.chat = true;
  std::string text;
  auto ids = actors::render_prompt(*s, in, &text);
  ASSERT_TRUE(ids) << ids.error().message;
  EXPECT_EQ(text,
            "<bos><start_of_turn>user\nbe a poet\n\nthe sea<end_of_turn>\n<start_of_turn>model\n");
  // The turn markers are single special tokens; BOS comes from the text.
  ASSERT_GE(ids->size(), 3u);
  EXPECT_EQ((*ids)[0], *s->tok->special_ids().bos);
  EXPECT_EQ((*ids)[1], *s->tok->token_to_id("<start_of_turn>"));
  EXPECT_EQ(std::count(ids->begin(), ids->end(), *eot), 1);
  // A named template still wins.
  in.chat_template = "chatml";
  auto chatml = actors::render_prompt(*s, in, &text);
  ASSERT_TRUE(chatml) << chatml.error().message;
  EXPECT_NE(text.find("<|im_start|>user"), std::string::npos);
}
