// The LLaMA decoder on a small random model written as GGUF: batch
// invariance (alone, in a batch, in prefill chunks, 1 or 2 threads, all
// bit-identical), generation through the batch loop, and error paths.
#include <gtest/gtest.h>

#include "../remote_memory_device.hpp"
#include "../temp_path.hpp"
#include "../tiny_model.hpp"
#include "kernels/cpu/cpu_device.hpp"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "models/generate.hpp"
#include "models/llama.hpp"
#include "models/random_model.hpp"

using namespace troupe;
using namespace troupe::models;
namespace k = troupe::kernels;

namespace {

constexpr int vocab = 300;

// A random-weight llama GGUF (F32) small enough for unit tests.
void write_tiny_gguf(const std::string& path) {
  random_model_spec spec;
  spec.config = troupe::test::tiny_llama_config(vocab, 96);
  spec.format = k::weight_format::f32;
  spec.stddev = 0.08f;
  spec.seed = 11;
  ASSERT_TRUE(write_random_gguf(path, spec));
}

std::vector<std::int32_t> tokens(int n, int seed, int vocab) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<std::size_t>(i)] = (seed * 31 + i * 17) % vocab;
  return t;
}

// Logits of `seq` (last token of each chunk) when fed in chunks of `chunk`,
// optionally with a companion sequence in every step.
std::vector<std::vector<float>> run(k::device& ctx, const llama_model& m,
                                    const std::vector<std::int32_t>& seq, int chunk,
                                    bool companion) {
  auto cache = m.make_cache(ctx, kv_options{.block_size = 8, .capacity_tokens = 512});
  EXPECT_TRUE(cache);
  const seq_id a = cache->add_sequence(), b = cache->add_sequence();
  const auto other = tokens(23, 5, vocab);
  std::vector<std::vector<float>> out;
  std::size_t pos = 0, opos = 0;
  while (pos < seq.size()) {
    const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(chunk), seq.size() - pos);
    std::vector<step_input> in{{a, std::span(seq).subspan(pos, n), true}};
    if (companion && opos < other.size()) {
      const std::size_t on = std::min<std::size_t>(3, other.size() - opos);
      in.insert(in.begin(), step_input{b, std::span(other).subspan(opos, on), false});
      opos += on;
    }
    auto logits = m.forward(ctx, *cache, in);
    EXPECT_TRUE(logits) << logits.error().message;
    const std::int64_t first_row = companion && in.size() == 2 ? 1 : 0;
    // Through the device: its memory may not be the host's.
    std::vector<float> all(static_cast<std::size_t>(logits->numel()));
    EXPECT_TRUE(ctx.read(*logits, std::as_writable_bytes(std::span<float>(all))));
    const auto V = static_cast<std::size_t>(m.config().vocab_size);
    for (std::size_t j = 0; j < n; ++j) {
      const float* r = all.data() + (static_cast<std::size_t>(first_row) + j) * V;
      out.emplace_back(r, r + V);
    }
    pos += n;
  }
  return out;
}

class LlamaTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    path_ = new std::string(troupe::test::temp_path("tiny_llama.gguf"));
    write_tiny_gguf(*path_);
  }
  static void TearDownTestSuite() { delete path_; }
  static std::string* path_;
};
std::string* LlamaTest::path_ = nullptr;

}  // namespace

TEST_F(LlamaTest, LoadsAndDescribes) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llama_model::load(*path_, *ctx);
  ASSERT_TRUE(m) << m.error().message;
  EXPECT_EQ((*m)->config().num_layers, 2);
  EXPECT_EQ((*m)->config().head_dim, 16);
  EXPECT_NE((*m)->describe().find("f32x14"), std::string::npos) << (*m)->describe();
  EXPECT_GT((*m)->bytes_per_token(), 0u);
}

TEST_F(LlamaTest, LogitsAreBatchChunkAndThreadInvariant) {
  for (const char* quant : {"f32", "q8_0", "q4_0", "int8", "f16"}) {
    SCOPED_TRACE(quant);
    auto ctx2 = k::cpu::cpu_device::with_threads(2);
    auto ctx1 = k::cpu::cpu_device::with_threads(1);
    quant_plan plan;
    plan.default_format = *k::weight_format_from_string(quant);
    auto m = llama_model::load(*path_, *ctx2, plan);
    ASSERT_TRUE(m) << m.error().message;
    const auto seq = tokens(70, 3, vocab);
    const auto ref = run(*ctx2, **m, seq, 70, false);
    ASSERT_EQ(ref.size(), seq.size());
    for (int chunk : {1, 16, 64}) {
      const auto got = run(*ctx2, **m, seq, chunk, true);
      ASSERT_EQ(got.size(), ref.size());
      for (std::size_t i = 0; i < ref.size(); ++i)
        ASSERT_EQ(std::memcmp(got[i].data(), ref[i].data(), ref[i].size() * sizeof(float)), 0)
            << "chunk " << chunk << " position " << i;
    }
    const auto one = run(*ctx1, **m, seq, 16, false);
    for (std::size_t i = 0; i < ref.size(); ++i)
      ASSERT_EQ(std::memcmp(one[i].data(), ref[i].data(), ref[i].size() * sizeof(float)), 0)
          << "1 thread, position " << i;
    // Not all zero or NaN.
    double mag = 0;
    for (float v : ref.back()) {
      ASSERT_TRUE(std::isfinite(v));
      mag += std::fabs(v);
    }
    EXPECT_GT(mag, 0.1);
  }
}

// The model on a device whose memory host code cannot touch (as a GPU's):
// everything it does goes through the seam, and the bits are the CPU's.
TEST_F(LlamaTest, OnADeviceWhoseMemoryIsNotTheHostsTheBitsAreTheCpus) {
  for (const char* quant : {"f32", "q8_0", "q4_0"}) {
    SCOPED_TRACE(quant);
    auto cpu = k::cpu::cpu_device::with_threads(2);
    troupe::test::remote_memory_device remote(2);
    quant_plan plan;
    plan.default_format = *k::weight_format_from_string(quant);
    auto on_cpu = llama_model::load(*path_, *cpu, plan);
    auto on_remote = llama_model::load(*path_, remote, plan);
    ASSERT_TRUE(on_cpu) << on_cpu.error().message;
    ASSERT_TRUE(on_remote) << on_remote.error().message;
    const auto seq = tokens(40, 4, vocab);
    const auto ref = run(*cpu, **on_cpu, seq, 16, true);
    const auto got = run(remote, **on_remote, seq, 16, true);
    ASSERT_EQ(got.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i)
      ASSERT_EQ(std::memcmp(got[i].data(), ref[i].data(), ref[i].size() * sizeof(float)), 0)
          << "position " << i;
  }
}

TEST_F(LlamaTest, SlidingWindowCacheFreesBlocksAndMatchesWindowedAttention) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llama_model::load(*path_, *ctx);
  ASSERT_TRUE(m);
  const auto seq = tokens(60, 9, vocab);
  // Reference: a full cache, window applied by attention only.
  auto full = (*m)->make_cache(ctx->memory(), kv_options{.block_size = 4, .capacity_tokens = 256});
  auto windowed = (*m)->make_cache(
      ctx->memory(), kv_options{.block_size = 4, .capacity_tokens = 256, .window = 12, .sinks = 4});
  ASSERT_TRUE(full && windowed);
  const seq_id a = full->add_sequence(), b = windowed->add_sequence();
  k::attention_options win;
  win.window = 12;
  win.sinks = 4;
  for (std::size_t i = 0; i < seq.size(); ++i) {
    std::vector<std::int32_t> t{seq[i]};
    auto x = (*m)->forward(*ctx, *full, std::vector<step_input>{{a, t, false}}, win);
    auto y = (*m)->forward(*ctx, *windowed, std::vector<step_input>{{b, t, false}});
    ASSERT_TRUE(x && y);
    ASSERT_EQ(std::memcmp(x->data(), y->data(), x->nbytes()), 0) << "position " << i;
  }
  // The windowed cache holds the sink block plus the window's blocks only.
  const auto table = windowed->block_table(b);
  int live = 0;
  for (auto id : table) live += id != 0;
  EXPECT_LE(live, 1 + 12 / 4 + 1);
  EXPECT_GT(windowed->free_blocks(), full->free_blocks());
}

TEST_F(LlamaTest, BatchedGenerationEqualsSingleRequests) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llama_model::load(*path_, *ctx);
  ASSERT_TRUE(m);
  troupe::test::remote_memory_device remote(2);
  auto on_remote = llama_model::load(*path_, remote);
  ASSERT_TRUE(on_remote) << on_remote.error().message;
  std::vector<generation_request> reqs;
  for (int i = 0; i < 4; ++i) {
    generation_request r;
    r.prompt = tokens(5 + 7 * i, i, vocab);
    r.params.max_tokens = 8 + i;
    r.params.temperature = i == 0 ? 0.0 : 0.8;
    r.params.top_k = i == 2 ? 5 : 0;
    r.params.seed = static_cast<std::uint64_t>(100 + i);
    reqs.push_back(r);
  }
  auto piece = [](std::int32_t t) {
    std::string s = std::to_string(t);
    s.push_back(' ');
    return s;
  };
  generate_options opts;
  opts.prefill_chunk = 4;
  auto together =
      generate_batch(*ctx, **m, reqs, std::vector<piece_fn>(reqs.size(), piece), nullptr, opts);
  ASSERT_TRUE(together) << together.error().message;
  for (std::size_t i = 0; i < reqs.size(); ++i) {
    opts.prefill_chunk = 64;
    auto alone = generate_batch(*ctx, **m, {reqs[i]}, {piece}, nullptr, opts);
    ASSERT_TRUE(alone);
    EXPECT_EQ((*alone)[0].tokens, (*together)[i].tokens) << "request " << i;
    EXPECT_EQ((*together)[i].tokens.size(), static_cast<std::size_t>(reqs[i].params.max_tokens));
    EXPECT_EQ((*together)[i].reason, stop_reason::max_tokens);
  }
  // The same generation where host code cannot touch the device's memory
  // (the logits are read through it): the same tokens.
  opts.prefill_chunk = 4;
  auto remote_run = generate_batch(remote, **on_remote, reqs,
                                   std::vector<piece_fn>(reqs.size(), piece), nullptr, opts);
  ASSERT_TRUE(remote_run) << remote_run.error().message;
  for (std::size_t i = 0; i < reqs.size(); ++i)
    EXPECT_EQ((*remote_run)[i].tokens, (*together)[i].tokens) << "request " << i;
}

TEST_F(LlamaTest, BadStepsAreErrorsAndChangeNothing) {
  auto ctx = k::cpu::cpu_device::with_threads(1);
  auto m = llama_model::load(*path_, *ctx);
  ASSERT_TRUE(m);
  auto cache = (*m)->make_cache(ctx->memory(), kv_options{.block_size = 8, .capacity_tokens = 16});
  ASSERT_TRUE(cache);
  const seq_id s = cache->add_sequence();
  std::vector<std::int32_t> bad{1, vocab};
  EXPECT_FALSE((*m)->forward(*ctx, *cache, std::vector<step_input>{{s, bad, false}}));
  EXPECT_FALSE((*m)->forward(*ctx, *cache, std::vector<step_input>{{s + 100, bad, false}}));
  EXPECT_FALSE((*m)->forward(*ctx, *cache, std::vector<step_input>{{s, {}, false}}));
  EXPECT_FALSE((*m)->forward(*ctx, *cache, std::vector<step_input>{}));
  EXPECT_EQ(cache->length(s), 0);
  const auto long_prompt = tokens(40, 1, vocab);
  auto full = (*m)->forward(*ctx, *cache, std::vector<step_input>{{s, long_prompt, false}});
  ASSERT_FALSE(full);
  EXPECT_EQ(full.error().code, k::errc::out_of_memory);
  EXPECT_EQ(cache->length(s), 0);
  EXPECT_FALSE(llama_model::load("/nonexistent/model.gguf", *ctx));
  quant_plan plan;
  EXPECT_FALSE(plan.add_override("layers.0.*"));
  EXPECT_FALSE(plan.add_override("layers.0.*=q5_k_x"));
  EXPECT_FALSE(plan.add_override("layers.0.*=q4_k_m"));  // a file type, not a format
  EXPECT_TRUE(plan.add_override("layers.0.*=f16"));
}

TEST_F(LlamaTest, F16AndInt8KvStayCloseToF32) {
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = llama_model::load(*path_, *ctx);
  ASSERT_TRUE(m);
  const auto seq = tokens(40, 4, vocab);
  auto logits_with = [&](k::dtype kv) {
    auto cache = (*m)->make_cache(ctx->memory(),
                                  kv_options{.block_size = 8, .type = kv, .capacity_tokens = 64});
    EXPECT_TRUE(cache);
    const seq_id s = cache->add_sequence();
    auto l = (*m)->forward(*ctx, *cache, std::vector<step_input>{{s, seq, true}});
    EXPECT_TRUE(l);
    return std::vector<float>(l->data_as<float>(), l->data_as<float>() + l->numel());
  };
  const auto f32 = logits_with(k::dtype::f32);
  for (auto [kv, tol] : {std::pair{k::dtype::f16, 2e-3}, std::pair{k::dtype::i8, 3e-2}}) {
    const auto got = logits_with(kv);
    double worst = 0, range = 0;
    for (std::size_t i = 0; i < f32.size(); ++i) {
      worst = std::max(worst, std::fabs(double(got[i]) - double(f32[i])));
      range = std::max(range, std::fabs(double(f32[i])));
    }
    EXPECT_LE(worst, tol * range) << k::to_string(kv);
    EXPECT_GT(worst, 0.0) << k::to_string(kv) << " identical to f32: the KV type was not applied";
  }
}

// One set of bits on every instruction set (issue 24): the whole model's
// logits, in every weight format and KV type, are the same bytes on CPU
// devices capped at each ISA level this machine has as on the scalar path,
// so a sequence moved between an AVX2 node and an AVX-512 node goes on
// token-identically.
TEST_F(LlamaTest, EveryIsaLevelGivesTheScalarPathsLogitBits) {
  const auto seq = tokens(40, 4, vocab);
  const auto top = k::cpu::cpu_device::with_threads(1)->ctx().hardware_level();
  for (const char* quant : {"f32", "f16", "q8_0", "q4_0"})
    for (const auto kv : {k::dtype::f32, k::dtype::f16, k::dtype::i8}) {
      SCOPED_TRACE(std::string(quant) + " weights, " + std::string(k::to_string(kv)) + " KV");
      quant_plan plan;
      plan.default_format = *k::weight_format_from_string(quant);
      auto logits_at = [&](k::cpu::isa level, bool wide) {
        auto dev = k::cpu::cpu_device::with_threads(2);
        dev->ctx().set_level(level);
        dev->ctx().set_wide_float_matmul(wide);
        auto m = llama_model::load(*path_, *dev, plan);
        EXPECT_TRUE(m) << m.error().message;
        auto cache =
            (*m)->make_cache(*dev, kv_options{.block_size = 8, .type = kv, .capacity_tokens = 512});
        EXPECT_TRUE(cache);
        const seq_id s = cache->add_sequence();
        std::vector<float> out;
        for (std::size_t pos = 0; pos < seq.size(); pos += 16) {  // prefill chunks, then on
          const auto n = std::min<std::size_t>(16, seq.size() - pos);
          std::vector<step_input> in{{s, std::span(seq).subspan(pos, n), true}};
          auto l = (*m)->forward(*dev, *cache, in);
          EXPECT_TRUE(l) << l.error().message;
          out.insert(out.end(), l->data_as<float>(), l->data_as<float>() + l->numel());
        }
        return out;
      };
      const auto want = logits_at(k::cpu::isa::scalar, false);
      for (auto level = k::cpu::isa::avx2; level <= top;
           level = static_cast<k::cpu::isa>(static_cast<int>(level) + 1))
        for (const bool wide : {false, true}) {  // float matmuls on ymm and on zmm
          if (wide && level < k::cpu::isa::avx512) continue;
          const auto got = logits_at(level, wide);
          ASSERT_EQ(got.size(), want.size());
          std::size_t differ = 0;
          float worst = 0;
          for (std::size_t i = 0; i < got.size(); ++i)
            if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
              ++differ;
              worst = std::max(worst, std::abs(got[i] - want[i]));
            }
          EXPECT_EQ(differ, 0u) << k::cpu::to_string(level) << (wide ? " (zmm float matmul)" : "")
                                << ": " << differ << " of " << got.size()
                                << " logits differ from the scalar path's, by up to " << worst;
        }
    }
}
