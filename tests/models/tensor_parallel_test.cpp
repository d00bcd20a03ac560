// Tensor parallelism of the decoder: two ranks (threads here, each with its
// own context) hold half the heads and half the FFN of every layer and sum
// their partial projections with the ring all-reduce of transport/ over
// real engines. Every rank gets the same logits, within 1e-4 x range of the
// one-process model (sums split differently, so not bitwise), and greedy
// decoding picks the same tokens.
#include <gtest/gtest.h>

#include <future>

#include "../temp_path.hpp"
#include "../tiny_model.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/llama.hpp"
#include "models/llava_config.hpp"
#include "models/random_model.hpp"
#include "transport/collectives.hpp"
#include "transport/inproc_engine.hpp"

namespace troupe::models {
namespace {

using kernels::tensor;
namespace tr = transport;
using namespace std::chrono_literals;

// Two ranks joined by in-process engines; each rank's all-reduce numbers
// its collectives in call order (the same on both ranks).
struct two_ranks {
  tr::inproc_engine e0{10000ms}, e1{10000ms};
  tr::ring r0, r1;
  std::uint64_t id0 = 1, id1 = 1;
  two_ranks() {
    r0.engine = &e0;
    r1.engine = &e1;
    r0.size = r1.size = 2;
    r1.rank = 1;
    r0.next = *e0.connect(e1.address());
    r1.next = *e1.connect(e0.address());
  }
  tensor_split split(int rank) {
    tensor_split s;
    s.rank = rank;
    s.size = 2;
    s.all_reduce = [this, rank](tensor& t) -> result<void> {
      auto& r = rank == 0 ? r0 : r1;
      auto& id = rank == 0 ? id0 : id1;
      return tr::ring_allreduce_sum(r, t.data_as<float>(), static_cast<std::size_t>(t.numel()),
                                    id++);
    };
    return s;
  }
};

std::vector<std::int32_t> tokens(int n, int salt, std::int64_t vocab) {
  std::vector<std::int32_t> t;
  for (int i = 0; i < n; ++i)
    t.push_back(static_cast<std::int32_t>((i * 37 + salt * 11 + 5) % vocab));
  return t;
}

// Logits of two sequences (all tokens) from a model.
result<tensor> logits_of(const llama_model& m, kernels::device& ctx,
                         const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b) {
  auto cache = m.make_cache(ctx.memory(), kv_options{});
  if (!cache) return std::unexpected(cache.error());
  const auto s0 = cache->add_sequence(), s1 = cache->add_sequence();
  std::vector<step_input> in(2);
  in[0].seq = s0;
  in[0].tokens = a;
  in[0].all_logits = true;
  in[1].seq = s1;
  in[1].tokens = b;
  in[1].all_logits = true;
  return m.forward(ctx, *cache, in);
}

void compare_with_one_process(const std::string& path, const quant_plan& plan, std::int64_t vocab) {
  auto ctx = kernels::cpu::cpu_device::with_threads(1);
  auto full = llama_model::load(path, *ctx, plan);
  ASSERT_TRUE(full) << full.error().message;
  const auto a = tokens(9, 1, vocab), b = tokens(4, 2, vocab);
  auto want = logits_of(**full, *ctx, a, b);
  ASSERT_TRUE(want) << want.error().message;

  two_ranks g;
  std::vector<std::shared_ptr<kernels::cpu::cpu_device>> ctxs{
      kernels::cpu::cpu_device::with_threads(1), kernels::cpu::cpu_device::with_threads(1)};
  std::vector<std::unique_ptr<llama_model>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto m = llama_model::load(path, *ctxs[static_cast<std::size_t>(r)], plan, {}, g.split(r));
    ASSERT_TRUE(m) << m.error().message;
    EXPECT_NE((*m)->describe().find("tensor slice " + std::to_string(r) + "/2"), std::string::npos);
    ranks.push_back(std::move(*m));
  }
  auto f0 = std::async(std::launch::async, [&] { return logits_of(*ranks[0], *ctxs[0], a, b); });
  auto f1 = std::async(std::launch::async, [&] { return logits_of(*ranks[1], *ctxs[1], a, b); });
  auto got0 = f0.get(), got1 = f1.get();
  ASSERT_TRUE(got0) << got0.error().message;
  ASSERT_TRUE(got1) << got1.error().message;
  ASSERT_EQ(got0->numel(), want->numel());
  const float* w = want->data_as<float>();
  const float* x0 = got0->data_as<float>();
  const float* x1 = got1->data_as<float>();
  float lo = w[0], hi = w[0], err = 0;
  for (std::int64_t i = 0; i < want->numel(); ++i) {
    lo = std::min(lo, w[i]);
    hi = std::max(hi, w[i]);
    err = std::max(err, std::abs(x0[i] - w[i]));
    ASSERT_EQ(x0[i], x1[i]) << "ranks disagree at " << i;
  }
  std::printf("%s: max |tp - one process| = %.3g, %.3g x the logit range %.3g\n", path.c_str(), err,
              err / (hi - lo), hi - lo);
  EXPECT_LE(err, 1e-4f * (hi - lo));
}

TEST(TensorParallel, TwoRanksMatchOneProcessF32) {
  random_model_spec spec;
  spec.config = test::tiny_llama_config(300, 128);
  spec.format = kernels::weight_format::f32;
  spec.stddev = 0.2f;
  const auto path = test::temp_path("tp_f32.gguf");
  ASSERT_TRUE(write_random_gguf(path, spec));
  compare_with_one_process(path, {}, 300);
}

// The families with per-rank pieces of their own: Qwen2's q/k/v biases
// (this rank's rows), Phi-3's fused qkv and gate_up matrices (this rank's
// rows of each part), from safetensors and GGUF (tests/fixtures/arch,
// tools/make_arch_fixtures.py; the other families' fixtures have one KV head).
TEST(TensorParallel, TwoRanksMatchOneProcessForEachFamily) {
  quant_plan f32;
  f32.default_format = kernels::weight_format::f32;
  const std::string root = std::string(TROUPE_FIXTURES_DIR) + "/arch/";
  for (const char* path : {"qwen2", "qwen2/model.gguf", "phi3", "phi3/model.gguf"}) {
    SCOPED_TRACE(path);
    compare_with_one_process(root + path, f32, 300);
  }
}

TEST(TensorParallel, TwoRanksMatchOneProcessQ8_0AndQ4_0) {
  for (auto f : {kernels::weight_format::q8_0, kernels::weight_format::q4_0}) {
    random_model_spec spec;
    spec.config = test::tiny_llama_config(300, 128);
    spec.config.hidden_size = 128;  // o_proj/down slices of 64 columns: whole 32-blocks
    spec.config.head_dim = 32;
    spec.format = f;
    spec.stddev = 0.2f;
    const auto path = test::temp_path("tp_q.gguf");
    ASSERT_TRUE(write_random_gguf(path, spec));
    compare_with_one_process(path, {}, 300);
  }
}

TEST(TensorParallel, BundledModelGreedyTokensAreTheSame) {
  // The bundled LLaVA's decoder on a text prompt: 20 greedy tokens.
  const std::string dir = TROUPE_BUNDLED_MODEL;
  auto greedy = [&](const llama_model& m,
                    kernels::device& ctx) -> result<std::vector<std::int32_t>> {
    auto cache = m.make_cache(ctx.memory(), kv_options{});
    if (!cache) return std::unexpected(cache.error());
    const auto s = cache->add_sequence();
    std::vector<std::int32_t> seq{365, 29, 224, 3, 202, 262, 387, 17, 371, 29}, out;
    std::vector<std::int32_t> next = seq;
    for (int i = 0; i < 20; ++i) {
      step_input in;
      in.seq = s;
      in.tokens = next;
      auto l = m.forward(ctx, *cache, std::span(&in, 1));
      if (!l) return std::unexpected(l.error());
      const float* row = l->data_as<float>();
      const auto best = static_cast<std::int32_t>(std::max_element(row, row + l->dim(1)) - row);
      out.push_back(best);
      next = {best};
    }
    return out;
  };
  auto src = weight_source::open(dir);
  ASSERT_TRUE(src) << src.error().message;
  auto text = read_text_file(dir + "/config.json");
  ASSERT_TRUE(text);
  auto cfg = parse_llava_config(*text, dir + "/config.json");
  ASSERT_TRUE(cfg) << cfg.error().message;
  auto ctx = kernels::cpu::cpu_device::with_threads(1);
  auto full = llama_model::build(**src, cfg->text, *ctx, {});
  ASSERT_TRUE(full) << full.error().message;
  auto want = greedy(**full, *ctx);
  ASSERT_TRUE(want) << want.error().message;

  two_ranks g;
  std::vector<std::shared_ptr<kernels::cpu::cpu_device>> ctxs{
      kernels::cpu::cpu_device::with_threads(1), kernels::cpu::cpu_device::with_threads(1)};
  std::vector<std::unique_ptr<llama_model>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto m = llama_model::build(**src, cfg->text, *ctxs[static_cast<std::size_t>(r)], {}, {},
                                g.split(r));
    ASSERT_TRUE(m) << m.error().message;
    ranks.push_back(std::move(*m));
  }
  auto f0 = std::async(std::launch::async, [&] { return greedy(*ranks[0], *ctxs[0]); });
  auto f1 = std::async(std::launch::async, [&] { return greedy(*ranks[1], *ctxs[1]); });
  auto t0 = f0.get(), t1 = f1.get();
  ASSERT_TRUE(t0) << t0.error().message;
  ASSERT_TRUE(t1) << t1.error().message;
  EXPECT_EQ(*t0, *want);
  EXPECT_EQ(*t1, *want);
}

TEST(TensorParallel, SplitsThatDoNotDivideAreRefused) {
  random_model_spec spec;
  spec.config = test::tiny_llama_config(300, 128);
  spec.format = kernels::weight_format::f32;
  const auto path = test::temp_path("tp_bad.gguf");
  ASSERT_TRUE(write_random_gguf(path, spec));
  auto ctx = kernels::cpu::cpu_device::with_threads(1);
  tensor_split s;
  s.size = 3;  // 4 heads, 2 KV heads
  s.all_reduce = [](tensor&) -> result<void> { return {}; };
  auto m = llama_model::load(path, *ctx, {}, {}, s);
  ASSERT_FALSE(m);
  EXPECT_NE(m.error().message.find("must divide evenly"), std::string::npos) << m.error().message;
  s.size = 2;
  s.rank = 2;
  EXPECT_FALSE(llama_model::load(path, *ctx, {}, {}, s));
  s.rank = 0;
  s.all_reduce = nullptr;
  m = llama_model::load(path, *ctx, {}, {}, s);
  ASSERT_FALSE(m);
  EXPECT_NE(m.error().message.find("without an all-reduce"), std::string::npos);
}

}  // namespace
}  // namespace troupe::models
