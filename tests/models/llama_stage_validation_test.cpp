// Pipeline stages refuse what they cannot do, with clear errors and without
// changing any cache: layer ranges that do not fit the model, a stage asked
// to embed without the embedding table (or to produce logits without the
// head, or to run a whole forward), a cache of the wrong layer count, hidden
// states of the wrong shape or type, and steps the cache cannot hold.
// (Runs under ASan+UBSan in CI.)
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../temp_path.hpp"
#include "../tiny_model.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/llama.hpp"
#include "models/random_model.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

constexpr int vocab = 300;

class LlamaStageValidation : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = new std::string(troupe::test::temp_path("tiny_llama_stages.gguf"));
    random_model_spec spec;
    spec.config = troupe::test::tiny_llama_config(vocab, 96);  // 2 layers, hidden 64
    spec.format = k::weight_format::f32;
    spec.stddev = 0.08f;
    spec.seed = 5;
    ASSERT_TRUE(write_random_gguf(*path_, spec));
  }
  static void TearDownTestSuite() { delete path_; }
  static std::string* path_;
};
std::string* LlamaStageValidation::path_ = nullptr;

}  // namespace

TEST_F(LlamaStageValidation, RangesThatDoNotFitAreErrors) {
  auto ctx = k::cpu::cpu_device::with_threads(1);
  const std::vector<std::pair<const char*, layer_range>> bad{
      {"negative first", {-1, -1, true, true}},
      {"last beyond the layers", {0, 3, true, true}},
      {"empty", {1, 1, false, true}},
      {"reversed", {2, 1, false, false}},
      {"last below -1", {0, -2, true, true}},
      {"embedding on a later stage", {1, 2, true, true}},
      {"head on an earlier stage", {0, 1, true, true}},
      {"first at the end", {2, -1, false, true}},
  };
  for (const auto& [what, r] : bad) {
    SCOPED_TRACE(what);
    auto m = llama_model::load(*path_, *ctx, {}, r);
    ASSERT_FALSE(m);
    EXPECT_EQ(m.error().code, k::errc::invalid_argument);
    EXPECT_NE(m.error().message.find("layer range"), std::string::npos) << m.error().message;
  }
  // Every fitting range loads.
  for (const layer_range r : {layer_range{0, 1, true, false}, layer_range{1, 2, false, true},
                              layer_range{0, 2, false, false}, layer_range{0, -1, true, false},
                              layer_range{1, -1, false, false}})
    EXPECT_TRUE(llama_model::load(*path_, *ctx, {}, r));
}

TEST_F(LlamaStageValidation, StagesRefuseWhatTheyDoNotHold) {
  auto ctx = k::cpu::cpu_device::with_threads(1);
  auto first = llama_model::load(*path_, *ctx, {}, {0, 1, true, false});
  auto last = llama_model::load(*path_, *ctx, {}, {1, 2, false, true});
  auto whole = llama_model::load(*path_, *ctx);
  ASSERT_TRUE(first && last && whole);
  auto c_first =
      (*first)->make_cache(ctx->memory(), kv_options{.block_size = 4, .capacity_tokens = 32});
  auto c_last =
      (*last)->make_cache(ctx->memory(), kv_options{.block_size = 4, .capacity_tokens = 32});
  auto c_whole =
      (*whole)->make_cache(ctx->memory(), kv_options{.block_size = 4, .capacity_tokens = 32});
  ASSERT_TRUE(c_first && c_last && c_whole);
  EXPECT_EQ(c_first->layers(), 1);
  EXPECT_EQ(c_whole->layers(), 2);
  const seq_id a = c_first->add_sequence(), b = c_last->add_sequence(), w = c_whole->add_sequence();
  ASSERT_EQ(a, b);
  ASSERT_EQ(a, w);
  const std::vector<std::int32_t> toks{5, 6, 7};
  const std::vector<step_input> in{{a, toks, false}};

  auto no_embed = (*last)->embed(*ctx, in);
  ASSERT_FALSE(no_embed);
  EXPECT_NE(no_embed.error().message.find("embedding"), std::string::npos)
      << no_embed.error().message;
  auto x = (*first)->embed(*ctx, in);
  ASSERT_TRUE(x) << x.error().message;
  EXPECT_EQ(x->dim(0), 3);
  EXPECT_EQ(x->dim(1), 64);
  EXPECT_FALSE((*first)->head(*ctx, in, *x));
  EXPECT_FALSE((*first)->forward(*ctx, *c_first, in));
  EXPECT_FALSE((*last)->forward(*ctx, *c_last, in));
  EXPECT_EQ(c_first->length(a), 0);
  // A cache with another layer count.
  EXPECT_FALSE((*first)->run_layers(*ctx, *c_whole, in, *x));
  EXPECT_FALSE((*whole)->forward(*ctx, *c_first, in));
  EXPECT_FALSE((*whole)->run_layers(*ctx, *c_first, in, *x));
  EXPECT_EQ(c_whole->length(w), 0);
  EXPECT_EQ(c_first->length(a), 0);
  // Then the stages run, and the whole model agrees.
  ASSERT_TRUE((*first)->run_layers(*ctx, *c_first, in, *x));
  ASSERT_TRUE((*last)->run_layers(*ctx, *c_last, in, *x));
  auto logits = (*last)->head(*ctx, in, *x);
  ASSERT_TRUE(logits) << logits.error().message;
  auto want = (*whole)->forward(*ctx, *c_whole, in);
  ASSERT_TRUE(want);
  ASSERT_EQ(logits->nbytes(), want->nbytes());
  EXPECT_EQ(std::memcmp(logits->data(), want->data(), want->nbytes()), 0);
  EXPECT_EQ(c_first->length(a), 3);
  EXPECT_EQ(c_last->length(b), 3);
}

TEST_F(LlamaStageValidation, BadHiddenStatesAndStepsChangeNoCache) {
  auto ctx = k::cpu::cpu_device::with_threads(1);
  auto first = llama_model::load(*path_, *ctx, {}, {0, 1, true, false});
  auto last = llama_model::load(*path_, *ctx, {}, {1, 2, false, true});
  ASSERT_TRUE(first && last);
  auto cache =
      (*last)->make_cache(ctx->memory(), kv_options{.block_size = 4, .capacity_tokens = 8});
  ASSERT_TRUE(cache);
  const seq_id s = cache->add_sequence();
  const std::vector<std::int32_t> toks{5, 6, 7};
  const std::vector<step_input> in{{s, toks, false}};
  auto& pool = ctx->memory();
  auto check_shape = [&](k::tensor t, const char* what) {
    SCOPED_TRACE(what);
    auto r = (*last)->run_layers(*ctx, *cache, in, t);
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code, k::errc::shape_mismatch) << r.error().message;
    EXPECT_FALSE((*last)->head(*ctx, in, t));
    EXPECT_EQ(cache->length(s), 0);
    EXPECT_EQ(cache->free_blocks(), cache->total_blocks());
  };
  check_shape(*k::tensor::zeros(pool, k::dtype::f32, {4, 64}), "one row too many");
  check_shape(*k::tensor::zeros(pool, k::dtype::f32, {2, 64}), "one row short");
  check_shape(*k::tensor::zeros(pool, k::dtype::f32, {3, 63}), "hidden too small");
  check_shape(*k::tensor::zeros(pool, k::dtype::f16, {3, 64}), "f16");
  check_shape(*k::tensor::zeros(pool, k::dtype::f32, {3 * 64}), "1-D");
  check_shape(*k::tensor::zeros(pool, k::dtype::f32, {1, 3, 64}), "3-D");
  check_shape(k::tensor{}, "empty");

  auto x = k::tensor::zeros(pool, k::dtype::f32, {3, 64});
  ASSERT_TRUE(x);
  // Tokens still count and must be valid on a later stage.
  const std::vector<std::int32_t> bad_tok{5, vocab, 7};
  EXPECT_FALSE((*last)->run_layers(*ctx, *cache, std::vector<step_input>{{s, bad_tok, false}}, *x));
  EXPECT_FALSE(
      (*last)->run_layers(*ctx, *cache, std::vector<step_input>{{s + 9, toks, false}}, *x));
  EXPECT_FALSE((*last)->run_layers(*ctx, *cache, std::vector<step_input>{}, *x));
  EXPECT_FALSE((*last)->head(*ctx, std::vector<step_input>{}, *x));
  EXPECT_FALSE((*first)->embed(*ctx, std::vector<step_input>{}));
  EXPECT_FALSE((*first)->embed(*ctx, std::vector<step_input>{{s, bad_tok, false}}));
  EXPECT_FALSE((*first)->embed(*ctx, std::vector<step_input>{{s, {}, false}}));
  // Embeddings that do not match the embed tokens.
  step_input with_embeds{s, toks, false};
  with_embeds.embed_token = 6;
  const std::vector<float> rows(63, 0.5f);
  with_embeds.embeddings = rows;
  EXPECT_FALSE((*first)->embed(*ctx, std::vector<step_input>{with_embeds}));
  with_embeds.embed_token = -1;
  EXPECT_FALSE((*first)->embed(*ctx, std::vector<step_input>{with_embeds}));
  EXPECT_EQ(cache->length(s), 0);
  // More tokens than the cache holds: out_of_memory, nothing committed.
  const std::vector<std::int32_t> many(9, 3);
  auto big = k::tensor::zeros(pool, k::dtype::f32, {9, 64});
  ASSERT_TRUE(big);
  auto full = (*last)->run_layers(*ctx, *cache, std::vector<step_input>{{s, many, false}}, *big);
  ASSERT_FALSE(full);
  EXPECT_EQ(full.error().code, k::errc::out_of_memory);
  EXPECT_EQ(cache->length(s), 0);
  // A good step still runs afterwards.
  EXPECT_TRUE((*last)->run_layers(*ctx, *cache, in, *x));
  EXPECT_EQ(cache->length(s), 3);
}
