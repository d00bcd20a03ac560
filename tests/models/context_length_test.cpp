// The context length a model is served with, and the check every entry
// point makes against it.
#include "models/context_length.hpp"

#include <gtest/gtest.h>

namespace troupe::models {
namespace {

TEST(ContextLength, TheModelsOwnUnlessTheOperatorSaysOtherwise) {
  EXPECT_EQ(serving_context_length(256, {}, "x").value(), 256);
  EXPECT_EQ(serving_context_length(256, {128, false}, "x").value(), 128);
  auto longer = serving_context_length(256, {512, false}, "--max-model-len");
  ASSERT_FALSE(longer);
  EXPECT_NE(longer.error().message.find("past the 256 positions"), std::string::npos)
      << longer.error().message;
  EXPECT_EQ(serving_context_length(256, {512, true}, "x").value(), 512);
  // The switch alone does nothing, so it is refused rather than ignored.
  auto alone = serving_context_length(256, {0, true}, "--allow-long-context");
  ASSERT_FALSE(alone);
  EXPECT_NE(alone.error().message.find("without a max_model_len"), std::string::npos)
      << alone.error().message;
  EXPECT_FALSE(serving_context_length(256, {-1, false}, "x"));
  EXPECT_FALSE(serving_context_length(0, {}, "x"));
}

TEST(ContextLength, OverflowSaysByHowMuch) {
  EXPECT_FALSE(context_overflow(256, 200, 56));
  EXPECT_FALSE(context_overflow(0, 1 << 20, 1)) << "0: no limit";
  auto over = context_overflow(256, 200, 57);
  ASSERT_TRUE(over);
  EXPECT_NE(over->find("needs 257 (200 in the prompt, 57 to generate)"), std::string::npos)
      << *over;
  auto full = context_overflow(256, 300, 1);
  ASSERT_TRUE(full);
  EXPECT_NE(full->find("the prompt alone holds 300"), std::string::npos) << *full;
}

}  // namespace
}  // namespace troupe::models
