// Pipeline stages: a decoder split into 2 and 3 stages (each stage its own
// model object holding a layer range, with its own context and its own KV
// cache of its own layers) gives bit-identical logits to the whole model over
// a scripted run (chunked prefill of several sequences of different lengths,
// then decode steps with mixed batches), with plain, sliding-window, f16 and
// int8 KV caches, on the random llama fixtures (HF and GGUF q4_0) and on the
// text model of the bundled tiny LLaVA. Also: a stage loads only its weights.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_device.hpp"
#include "models/llama.hpp"
#include "models/llava_config.hpp"
#include "step_script.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

std::string fixture(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/llama/" + name;
}
const std::string bundled = std::string(TROUPE_FIXTURES_DIR) + "/../../assets/tiny-llava-shapes";

/// Makes a model holding `range` in `ctx`.
using loader_fn =
    std::function<result<std::unique_ptr<llama_model>>(k::device&, const layer_range&)>;

loader_fn from_path(const std::string& path, const char* quant = nullptr) {
  return [path, quant](k::device& ctx, const layer_range& range) {
    quant_plan plan;
    if (quant) plan.default_format = *k::weight_format_from_string(quant);
    return llama_model::load(path, ctx, plan, range);
  };
}

// The decoder of a LLaVA folder, built as a plain llama (as llava_model does).
loader_fn llava_text(const std::string& dir) {
  return [dir](k::device& ctx, const layer_range& range) -> result<std::unique_ptr<llama_model>> {
    auto cfg = load_llava_config(dir + "/config.json");
    if (!cfg) return std::unexpected(cfg.error());
    auto src = weight_source::open(dir);
    if (!src) return std::unexpected(src.error());
    return llama_model::build(**src, cfg->text, ctx, {}, range);
  };
}

struct stage {
  std::unique_ptr<k::cpu::cpu_device> ctx;
  std::unique_ptr<llama_model> model;
  std::optional<kv_cache> cache;
};

// Stages holding [bounds[i], bounds[i+1]); one stage = the whole model.
std::vector<stage> make_stages(const loader_fn& load, const std::vector<int>& bounds,
                               const kv_options& kv) {
  std::vector<stage> out;
  for (std::size_t i = 0; i + 1 < bounds.size(); ++i) {
    stage s;
    s.ctx = k::cpu::cpu_device::with_threads(1);
    layer_range r;
    r.first = bounds[i];
    r.last = bounds[i + 1];
    r.embed = i == 0;
    r.head = i + 2 == bounds.size();
    auto m = load(*s.ctx, r);
    EXPECT_TRUE(m) << m.error().message;
    if (!m) return {};
    s.model = std::move(*m);
    auto c = s.model->make_cache(s.ctx->memory(), kv);
    EXPECT_TRUE(c) << c.error().message;
    if (!c) return {};
    s.cache.emplace(std::move(*c));
    out.push_back(std::move(s));
  }
  return out;
}

// The script's logits, step after step, through `stages` (embed on the
// first, run_layers on each, head on the last), or through forward when
// `use_forward` (one stage).
std::vector<float> run(std::vector<stage>& stages, const std::vector<test::scripted_sequence>& seqs,
                       const std::vector<test::scripted_step>& steps, bool use_forward) {
  std::vector<float> out;
  if (stages.empty()) return out;
  const auto H = stages[0].model->config().hidden_size;
  std::vector<std::vector<seq_id>> ids(stages.size());
  for (std::size_t s = 0; s < stages.size(); ++s)
    for (std::size_t i = 0; i < seqs.size(); ++i) ids[s].push_back(stages[s].cache->add_sequence());
  for (const auto& step : steps) {
    std::vector<std::vector<step_input>> in(stages.size());
    for (std::size_t s = 0; s < stages.size(); ++s)
      for (const auto& item : step)
        in[s].push_back(test::to_input(seqs[item.seq], item, ids[s][item.seq], H));
    result<k::tensor> logits = make_error(k::errc::internal, "not run");
    if (use_forward) {
      logits = stages[0].model->forward(*stages[0].ctx, *stages[0].cache, in[0]);
    } else {
      auto x = stages[0].model->embed(*stages[0].ctx, in[0]);
      EXPECT_TRUE(x) << x.error().message;
      if (!x) return {};
      for (std::size_t s = 0; s < stages.size(); ++s) {
        auto r = stages[s].model->run_layers(*stages[s].ctx, *stages[s].cache, in[s], *x);
        EXPECT_TRUE(r) << "stage " << s << ": " << r.error().message;
        if (!r) return {};
      }
      logits = stages.back().model->head(*stages.back().ctx, in.back(), *x);
    }
    EXPECT_TRUE(logits) << logits.error().message;
    if (!logits) return {};
    out.insert(out.end(), logits->data_as<float>(), logits->data_as<float>() + logits->numel());
    // Every stage's cache holds the same lengths.
    for (std::size_t s = 1; s < stages.size(); ++s)
      for (const auto& item : step)
        EXPECT_EQ(stages[s].cache->length(ids[s][item.seq]),
                  stages[0].cache->length(ids[0][item.seq]));
  }
  return out;
}

struct kv_case {
  const char* name;
  kv_options kv;
};

const std::vector<kv_case>& kv_cases() {
  static const std::vector<kv_case> cases{
      {"f32", kv_options{.block_size = 8, .capacity_tokens = 512}},
      {"f32 window 12 sinks 4",
       kv_options{.block_size = 4, .capacity_tokens = 512, .window = 12, .sinks = 4}},
      {"f16", kv_options{.block_size = 8, .type = k::dtype::f16, .capacity_tokens = 512}},
      {"i8", kv_options{.block_size = 8, .type = k::dtype::i8, .capacity_tokens = 512}},
      {"i8 window 10 sinks 3", kv_options{.block_size = 4,
                                          .type = k::dtype::i8,
                                          .capacity_tokens = 512,
                                          .window = 10,
                                          .sinks = 3}},
  };
  return cases;
}

// Every split in `splits` against the whole model, for every KV case.
void expect_splits_match(const loader_fn& load, int layers, std::int64_t vocab, std::int64_t hidden,
                         std::int32_t embed_token, const std::vector<std::vector<int>>& splits) {
  const auto seqs = test::make_sequences(vocab, hidden, {13, 29, 5, 41}, 6, embed_token, 7);
  const auto steps = test::make_schedule(seqs, 8);
  for (const auto& c : kv_cases()) {
    SCOPED_TRACE(c.name);
    auto whole = make_stages(load, {0, layers}, c.kv);
    ASSERT_EQ(whole.size(), 1u);
    const auto want = run(whole, seqs, steps, true);
    ASSERT_FALSE(want.empty());
    double mag = 0;
    for (float v : want) {
      ASSERT_TRUE(std::isfinite(v));
      mag += std::fabs(v);
    }
    ASSERT_GT(mag, 0.0);
    // The whole model run step by step through embed/run_layers/head.
    auto steps_whole = make_stages(load, {0, layers}, c.kv);
    const auto got_whole = run(steps_whole, seqs, steps, false);
    ASSERT_EQ(got_whole.size(), want.size());
    EXPECT_EQ(std::memcmp(got_whole.data(), want.data(), want.size() * sizeof(float)), 0);
    for (const auto& bounds : splits) {
      SCOPED_TRACE(::testing::PrintToString(bounds));
      auto stages = make_stages(load, bounds, c.kv);
      ASSERT_EQ(stages.size(), bounds.size() - 1);
      const auto got = run(stages, seqs, steps, false);
      ASSERT_EQ(got.size(), want.size());
      std::size_t first_diff = want.size();
      for (std::size_t i = 0; i < want.size() && first_diff == want.size(); ++i)
        if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) first_diff = i;
      EXPECT_EQ(first_diff, want.size()) << "first differing logit at " << first_diff;
    }
  }
}

}  // namespace

TEST(LlamaStages, OddFixtureSplitInTwo) {
  expect_splits_match(from_path(fixture("odd")), 2, 301, 120, 17, {{0, 1, 2}});
}

TEST(LlamaStages, Llama3FixtureTiedEmbeddingsSplitInTwoAndThree) {
  expect_splits_match(from_path(fixture("llama3")), 3, 257, 160, 5,
                      {{0, 1, 3}, {0, 2, 3}, {0, 1, 2, 3}});
}

TEST(LlamaStages, QuantizedGgufSplitInThree) {
  expect_splits_match(from_path(fixture("llama3") + "/model-q4_0.gguf"), 3, 257, 160, -1,
                      {{0, 1, 2, 3}});
}

TEST(LlamaStages, BundledLlavaTextModelSplitInTwoAndThree) {
  auto cfg = load_llava_config(bundled + "/config.json");
  ASSERT_TRUE(cfg) << cfg.error().message;
  const int layers = static_cast<int>(cfg->text.num_layers);
  ASSERT_GE(layers, 3);
  expect_splits_match(llava_text(bundled), layers, cfg->text.vocab_size, cfg->text.hidden_size,
                      static_cast<std::int32_t>(cfg->image_token_index),
                      {{0, layers / 2, layers}, {0, 1, layers - 1, layers}});
}

TEST(LlamaStages, StagesHoldOnlyTheirWeights) {
  // Untied (odd) and tied (llama3) embeddings: the stages' weights add up to
  // the whole model's, in pool bytes and in bytes read per token.
  for (const auto& [name, layers] : {std::pair<std::string, int>{"odd", 2}, {"llama3", 3}}) {
    SCOPED_TRACE(name);
    const auto load = from_path(fixture(name));
    auto whole_ctx = k::cpu::cpu_device::with_threads(1);
    auto whole = load(*whole_ctx, {});
    ASSERT_TRUE(whole) << whole.error().message;
    EXPECT_EQ((*whole)->range().first, 0);
    EXPECT_EQ((*whole)->range().last, layers);
    EXPECT_TRUE((*whole)->is_full());
    const std::vector<layer_range> parts{{0, 1, true, false}, {1, layers, false, true}};
    std::size_t bytes = 0, per_token = 0;
    for (const auto& r : parts) {
      auto ctx = k::cpu::cpu_device::with_threads(1);
      auto m = load(*ctx, r);
      ASSERT_TRUE(m) << m.error().message;
      EXPECT_FALSE((*m)->is_full());
      EXPECT_EQ((*m)->range().last, r.last);
      EXPECT_NE((*m)->describe().find("[" + std::to_string(r.first) + ", " +
                                      std::to_string(r.last) + ")"),
                std::string::npos)
          << (*m)->describe();
      EXPECT_EQ((*m)->describe().find("embed=") != std::string::npos, r.embed) << (*m)->describe();
      EXPECT_EQ((*m)->describe().find("lm_head=") != std::string::npos, r.head) << (*m)->describe();
      bytes += ctx->memory().snapshot().bytes_in_use;
      per_token += (*m)->bytes_per_token();
      auto cache = (*m)->make_cache(ctx->memory(), kv_options{.capacity_tokens = 64});
      ASSERT_TRUE(cache);
      EXPECT_EQ(cache->layers(), r.last - r.first);
    }
    EXPECT_EQ(bytes, whole_ctx->memory().snapshot().bytes_in_use);
    EXPECT_EQ(per_token, (*whole)->bytes_per_token());
  }
}
