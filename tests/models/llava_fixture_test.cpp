// Fidelity: troupe's LLaVA (CLIP tower, projector, LLaMA with image
// embeddings) against transformers 4.46 (float64, teacher-forced) on two
// random checkpoints written by tools/make_llava_fixtures.py: vision
// features, projector output and logits of prompts holding 1-2 images;
// batch and chunking invariance; greedy generation; mixed precision.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "../kernels/fixture_reader.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "logit_agreement.hpp"
#include "models/generate.hpp"
#include "models/llava.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::test::relative_error;
namespace k = troupe::kernels;

namespace {

std::string dir(const std::string& name) {
  return std::string(TROUPE_FIXTURES_DIR) + "/llava/" + name;
}

struct prompt_ref {
  std::vector<std::int32_t> ids, expanded, greedy;
  std::vector<std::int64_t> images;
  std::vector<float> logits, greedy_gap;
};

struct reference {
  std::vector<float> pixels, vision_features, image_features;
  std::vector<std::int64_t> pixel_dims;
  std::int64_t tokens_per_image = 0, vocab = 0;
  std::vector<prompt_ref> prompts;
};

std::vector<std::int32_t> ints(const test::fixture_array& a) {
  const auto v = a.as<std::int64_t>();
  return {v.begin(), v.end()};
}

reference load_reference(const std::string& name) {
  const auto f = test::load_fixture(dir(name) + "/reference.bin");
  reference r;
  r.pixels = f.at("pixel_values").as<float>();
  r.pixel_dims = f.at("pixel_values").dims;
  r.vision_features = f.at("vision_features").as<float>();
  r.image_features = f.at("image_features").as<float>();
  r.tokens_per_image = f.at("tokens_per_image").as<std::int64_t>()[0];
  const auto n = f.at("n_prompts").as<std::int64_t>()[0];
  for (std::int64_t p = 0; p < n; ++p) {
    const std::string k = "prompt." + std::to_string(p) + ".";
    prompt_ref pr;
    pr.ids = ints(f.at(k + "ids"));
    pr.expanded = ints(f.at(k + "expanded"));
    pr.greedy = ints(f.at(k + "greedy"));
    pr.images = f.at(k + "images").as<std::int64_t>();
    pr.logits = f.at(k + "logits").as<float>();
    pr.greedy_gap = f.at(k + "greedy_gap").as<float>();
    r.vocab = f.at(k + "logits").dims[1];
    r.prompts.push_back(std::move(pr));
  }
  return r;
}

// pixel_values of the chosen reference images, as a tensor [n, 3, S, S].
k::tensor pixels_of(k::device& ctx, const reference& ref, const std::vector<std::int64_t>& which) {
  const std::int64_t C = ref.pixel_dims[1], H = ref.pixel_dims[2], W = ref.pixel_dims[3];
  const std::int64_t per = C * H * W;
  auto t = k::tensor::empty(ctx.memory(), k::dtype::f32,
                            {static_cast<std::int64_t>(which.size()), C, H, W});
  EXPECT_TRUE(t);
  for (std::size_t i = 0; i < which.size(); ++i)
    std::copy_n(ref.pixels.data() + which[i] * per, per,
                t->data_as<float>() + static_cast<std::int64_t>(i) * per);
  return *t;
}

std::vector<float> values(const k::tensor& t) {
  return {t.data_as<float>(), t.data_as<float>() + t.numel()};
}

// Worst per-position relative error of logits [L, vocab].
double logits_error(const std::vector<float>& got, const std::vector<float>& want,
                    std::int64_t vocab) {
  EXPECT_EQ(got.size(), want.size());
  if (got.size() != want.size()) return 1e9;
  double worst = 0;
  const auto V = static_cast<std::size_t>(vocab);
  for (std::size_t p = 0; p * V < want.size(); ++p) {
    const std::vector<float> w(want.begin() + static_cast<std::ptrdiff_t>(p * V),
                               want.begin() + static_cast<std::ptrdiff_t>((p + 1) * V));
    const std::vector<float> g(got.begin() + static_cast<std::ptrdiff_t>(p * V),
                               got.begin() + static_cast<std::ptrdiff_t>((p + 1) * V));
    worst = std::max(worst, relative_error(g, w));
  }
  return worst;
}

// Teacher-forced logits of a prepared prompt, fed in chunks of `chunk`.
std::vector<float> run(k::device& ctx, const llava_model& m, const llava_prompt& p,
                       std::size_t chunk = 1 << 20) {
  const auto& lm = m.language_model();
  auto cache = lm.make_cache(ctx.memory(), kv_options{.block_size = 16, .capacity_tokens = 512});
  EXPECT_TRUE(cache);
  const seq_id s = cache->add_sequence();
  const auto H = static_cast<std::size_t>(lm.config().hidden_size);
  std::vector<float> out;
  std::size_t used = 0;
  for (std::size_t pos = 0; pos < p.tokens.size(); pos += chunk) {
    const auto toks = std::span(p.tokens).subspan(pos, std::min(chunk, p.tokens.size() - pos));
    const auto rows = static_cast<std::size_t>(std::count(toks.begin(), toks.end(), p.image_token));
    step_input in{s, toks, true};
    in.embed_token = p.image_token;
    in.embeddings = std::span(p.image_embeds).subspan(used * H, rows * H);
    used += rows;
    auto logits = lm.forward(ctx, *cache, std::vector<step_input>{in});
    EXPECT_TRUE(logits) << logits.error().message;
    if (!logits) return {};
    const auto v = values(*logits);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

std::unique_ptr<llava_model> load(k::device& ctx, const std::string& name,
                                  const quant_plan& plan = {}) {
  // "bundled": the committed tiny LLaVA (assets/), references made by
  // tools/make_llava_fixtures.py --model assets/tiny-llava-shapes.
  const std::string path =
      name == "bundled" ? std::string(TROUPE_FIXTURES_DIR) + "/../../assets/tiny-llava-shapes"
                        : dir(name);
  auto m = llava_model::load(path, ctx, plan);
  EXPECT_TRUE(m) << name << ": " << m.error().message;
  return m ? std::move(*m) : nullptr;
}

quant_plan mixed_plan(k::weight_format text) {
  quant_plan plan;
  plan.default_format = text;  // the decoder
  EXPECT_TRUE(plan.add_override("vision.*=int8"));
  EXPECT_TRUE(plan.add_override("projector.*=f16"));
  return plan;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

class LlavaFidelity : public ::testing::TestWithParam<std::string> {};

TEST_P(LlavaFidelity, VisionFeaturesAndProjectorMatchTransformers) {
  const auto ref = load_reference(GetParam());
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = load(*ctx, GetParam());
  ASSERT_TRUE(m);
  EXPECT_EQ(m->tokens_per_image(), ref.tokens_per_image);
  const auto px = pixels_of(*ctx, ref, {0, 1});
  auto feats = m->vision_features(*ctx, px);
  ASSERT_TRUE(feats) << feats.error().message;
  auto proj = m->encode_images(*ctx, px);
  ASSERT_TRUE(proj) << proj.error().message;
  const double ef = relative_error(values(*feats), ref.vision_features);
  const double ep = relative_error(values(*proj), ref.image_features);
  std::printf("[%s] vision features %.2e, projector %.2e x range (f32 vs transformers float64)\n",
              GetParam().c_str(), ef, ep);
  EXPECT_LT(ef, 1e-4);
  EXPECT_LT(ep, 1e-4);
  clip_options onednn;
  onednn.onednn_patch_embedding = true;  // the kernels' oneDNN convolution instead of the matmul
  auto conv = m->vision_features(*ctx, px, onednn);
  ASSERT_TRUE(conv) << conv.error().message;
  const double ec = relative_error(values(*conv), ref.vision_features);
  std::printf("[%s] vision features with the oneDNN patch embedding %.2e x range\n",
              GetParam().c_str(), ec);
  EXPECT_LT(ec, 1e-4);
}

TEST_P(LlavaFidelity, LogitsMatchTransformers) {
  const auto ref = load_reference(GetParam());
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = load(*ctx, GetParam());
  ASSERT_TRUE(m);
  for (std::size_t p = 0; p < ref.prompts.size(); ++p) {
    const auto& pr = ref.prompts[p];
    auto prompt = m->prepare(*ctx, pr.ids, pixels_of(*ctx, ref, pr.images));
    ASSERT_TRUE(prompt) << prompt.error().message;
    EXPECT_EQ(prompt->tokens, pr.expanded);  // troupe's expansion == what transformers was fed
    const double e = logits_error(run(*ctx, *m, *prompt), pr.logits, ref.vocab);
    std::printf("[%s] prompt %zu (%zu images, %zu tokens): logits %.2e x range\n",
                GetParam().c_str(), p, pr.images.size(), pr.expanded.size(), e);
    EXPECT_LT(e, 1e-4);
  }
}

TEST_P(LlavaFidelity, ImagesBatchedOrAloneAndAnyThreadCountAreBitIdentical) {
  const auto ref = load_reference(GetParam());
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto ctx1 = k::cpu::cpu_device::with_threads(1);
  auto m = load(*ctx, GetParam());
  ASSERT_TRUE(m);
  auto both = m->encode_images(*ctx, pixels_of(*ctx, ref, {0, 1}));
  auto swapped = m->encode_images(*ctx, pixels_of(*ctx, ref, {1, 0, 1}));
  ASSERT_TRUE(both && swapped);
  const auto rows = static_cast<std::size_t>(m->tokens_per_image() * m->config().text.hidden_size);
  const auto b = values(*both), s = values(*swapped);
  for (std::int64_t i : {0, 1}) {
    auto alone = m->encode_images(*ctx, pixels_of(*ctx, ref, {i}));
    auto one_thread = m->encode_images(*ctx1, pixels_of(*ctx1, ref, {i}));
    ASSERT_TRUE(alone && one_thread);
    const auto a = values(*alone), t = values(*one_thread);
    const auto off = static_cast<std::ptrdiff_t>(static_cast<std::size_t>(i) * rows);
    EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin() + off)) << "image " << i;
    EXPECT_EQ(a, t) << "image " << i << " with 1 thread";
    const auto soff = static_cast<std::ptrdiff_t>((i == 0 ? 1 : 0) * rows);
    EXPECT_TRUE(std::equal(a.begin(), a.end(), s.begin() + soff)) << "image " << i;
  }
  EXPECT_TRUE(std::equal(b.begin() + static_cast<std::ptrdiff_t>(rows), b.end(),
                         s.begin() + static_cast<std::ptrdiff_t>(2 * rows)));
}

TEST_P(LlavaFidelity, ChunkBoundariesInsideImageTokensChangeNothing) {
  const auto ref = load_reference(GetParam());
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = load(*ctx, GetParam());
  ASSERT_TRUE(m);
  const auto& pr = ref.prompts[0];
  auto prompt = m->prepare(*ctx, pr.ids, pixels_of(*ctx, ref, pr.images));
  ASSERT_TRUE(prompt);
  const auto whole = run(*ctx, *m, *prompt);
  ASSERT_FALSE(whole.empty());
  for (std::size_t chunk : {1u, 5u, 7u, 16u})
    EXPECT_EQ(run(*ctx, *m, *prompt, chunk), whole) << "chunk " << chunk;
}

TEST_P(LlavaFidelity, ImagePromptsInOneStepMatchAlone) {
  const auto ref = load_reference(GetParam());
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = load(*ctx, GetParam());
  ASSERT_TRUE(m);
  std::vector<llava_prompt> prompts;
  for (const auto& pr : ref.prompts) {
    auto p = m->prepare(*ctx, pr.ids, pixels_of(*ctx, ref, pr.images));
    ASSERT_TRUE(p);
    prompts.push_back(std::move(*p));
  }
  const auto& lm = m->language_model();
  auto cache = lm.make_cache(ctx->memory(), kv_options{.block_size = 16, .capacity_tokens = 512});
  ASSERT_TRUE(cache);
  std::vector<step_input> in;
  for (const auto& p : prompts) {
    step_input s{cache->add_sequence(), p.tokens, true};
    s.embed_token = p.image_token;
    s.embeddings = p.image_embeds;
    in.push_back(s);
  }
  auto logits = lm.forward(*ctx, *cache, in);
  ASSERT_TRUE(logits) << logits.error().message;
  const auto all = values(*logits);
  std::size_t off = 0;
  for (const auto& p : prompts) {
    const auto alone = run(*ctx, *m, p);
    EXPECT_TRUE(
        std::equal(alone.begin(), alone.end(), all.begin() + static_cast<std::ptrdiff_t>(off)));
    off += alone.size();
  }
}

TEST_P(LlavaFidelity, GreedyGenerationMatchesTransformers) {
  const auto ref = load_reference(GetParam());
  auto ctx = k::cpu::cpu_device::with_threads(2);
  auto m = load(*ctx, GetParam());
  ASSERT_TRUE(m);
  std::vector<generation_request> reqs;
  for (const auto& pr : ref.prompts) {
    auto p = m->prepare(*ctx, pr.ids, pixels_of(*ctx, ref, pr.images));
    ASSERT_TRUE(p);
    generation_request r;
    r.prompt = p->tokens;
    r.image_token = p->image_token;
    r.image_embeds = p->image_embeds;
    r.params.temperature = 0;
    r.params.max_tokens = static_cast<std::int64_t>(pr.greedy.size());
    reqs.push_back(std::move(r));
  }
  // The f32 error (~1e-6 x range) is far below every reference top-2 gap.
  for (const auto& pr : ref.prompts)
    ASSERT_GT(*std::min_element(pr.greedy_gap.begin(), pr.greedy_gap.end()), 1e-3f);
  for (std::int64_t chunk : {512, 6}) {  // 6: chunk boundaries inside the image tokens
    std::vector<piece_fn> pieces(reqs.size(), [](std::int32_t) { return std::string(); });
    generate_options opts;
    opts.prefill_chunk = chunk;
    auto out = generate_batch(*ctx, m->language_model(), reqs, pieces, nullptr, opts);
    ASSERT_TRUE(out) << out.error().message;
    for (std::size_t i = 0; i < reqs.size(); ++i)
      EXPECT_EQ((*out)[i].tokens, ref.prompts[i].greedy) << "prompt " << i << " chunk " << chunk;
  }
}

using test::agreement;

// Vision int8, projector f16, decoder q4_0 ("full"; "odd"'s 48 columns do not
// split into 32-blocks, so its decoder is int8): loads with the component
// patterns and runs.
//
// Sharp check, against transformers on the same weights dequantized
// (reference-mixed.bin): what is left is troupe's int8 quantization of the
// activations in the integer matmuls (per 32 values, step max|x|/127), so
// the argmax must agree wherever the reference top-2 gap exceeds 0.05
// logits; the error bounds are the measured values (printed: image features
// ~2.6e-3, logits ~1.3e-2 x range, mean KL ~7e-5) with ~2x headroom.
// Loose check, against the f32 reference: the weight rounding itself. These
// random toys have logit ranges of ~5 and many near-ties, so 4-bit weight
// noise (~8% per weight) moves the argmax often: the bounds are the measured
// values (printed) with ~2x headroom, as in llama_fixture_test.
TEST_P(LlavaFidelity, MixedPrecisionComponentsMatchDequantizedReference) {
  if (GetParam() == "bundled")
    GTEST_SKIP() << "mixed precision is checked on the random-weight fixtures";
  const auto ref = load_reference(GetParam());
  const auto mixed = test::load_fixture(dir(GetParam()) + "/reference-mixed.bin");
  auto ctx = k::cpu::cpu_device::with_threads(2);
  const bool q4 = GetParam() == "full";
  auto m =
      load(*ctx, GetParam(), mixed_plan(q4 ? k::weight_format::q4_0 : k::weight_format::int8_sym));
  ASSERT_TRUE(m);
  const auto d = m->describe();
  EXPECT_NE(
      d.find("vision layers=" + std::to_string(m->vision_tower().layers()) + " matrices: int8x"),
      std::string::npos)
      << d;
  EXPECT_NE(d.find("projector f16/f16"), std::string::npos) << d;
  EXPECT_NE(d.find(q4 ? "text layers=2 matrices: q4_0x14 embed=q4_0 lm_head=q4_0"
                      : "text layers=3 matrices: int8x21 embed=int8 lm_head=int8"),
            std::string::npos)
      << d;
  auto proj = m->encode_images(*ctx, pixels_of(*ctx, ref, {0, 1}));
  ASSERT_TRUE(proj);
  const double ep = relative_error(values(*proj), mixed.at("image_features").as<float>());
  const double ep32 = relative_error(values(*proj), ref.image_features);
  double worst = 0, worst32 = 0;
  agreement sharp, loose;
  std::size_t positions = 0;
  for (std::size_t p = 0; p < ref.prompts.size(); ++p) {
    const auto& pr = ref.prompts[p];
    auto prompt = m->prepare(*ctx, pr.ids, pixels_of(*ctx, ref, pr.images));
    ASSERT_TRUE(prompt);
    const auto got = run(*ctx, *m, *prompt);
    const auto want = mixed.at("prompt." + std::to_string(p) + ".logits").as<float>();
    worst = std::max(worst, logits_error(got, want, ref.vocab));
    worst32 = std::max(worst32, logits_error(got, pr.logits, ref.vocab));
    const std::size_t n = pr.expanded.size();
    for (auto [out, w, margin] :
         {std::tuple{&sharp, &want, 0.05}, std::tuple{&loose, &pr.logits, 0.5}}) {
      const auto a = test::compare_logits(got, *w, ref.vocab, margin);
      out->mean_kl += a.mean_kl * double(n);
      out->top1_agree += a.top1_agree;
      out->top1_checked += a.top1_checked;
    }
    positions += n;
  }
  sharp.mean_kl /= double(positions);
  loose.mean_kl /= double(positions);
  std::printf(
      "[%s] mixed (vision int8, projector f16, decoder %s)\n"
      "  vs dequantized reference: image features %.2e, logits %.2e x range, mean KL %.2e, "
      "top-1 %d/%d\n"
      "  vs f32 reference:         image features %.2e, logits %.2e x range, mean KL %.2e, "
      "top-1 %d/%d\n",
      GetParam().c_str(), q4 ? "q4_0" : "int8", ep, worst, sharp.mean_kl, sharp.top1_agree,
      sharp.top1_checked, ep32, worst32, loose.mean_kl, loose.top1_agree, loose.top1_checked);
  EXPECT_LT(ep, 6e-3);
  EXPECT_LT(worst, 2.5e-2);
  EXPECT_LT(sharp.mean_kl, 2e-4);
  EXPECT_EQ(sharp.top1_agree, sharp.top1_checked);
  EXPECT_GE(sharp.top1_checked, 40);
  EXPECT_LT(loose.mean_kl, q4 ? 0.04 : 3e-4);
  EXPECT_GE(loose.top1_agree * 10, loose.top1_checked * 8);
}

// Encoding is deterministic run to run (pools reused, primitives cached);
// prints the median time of 20 encodes of both images.
TEST_P(LlavaFidelity, RepeatedEncodesAreIdentical) {
  const auto ref = load_reference(GetParam());
  for (const bool onednn : {false, true})
    for (int threads : {1, 2}) {
      auto ctx = k::cpu::cpu_device::with_threads(threads);
      auto m = load(*ctx, GetParam());
      ASSERT_TRUE(m);
      clip_options opts;
      opts.onednn_patch_embedding = onednn;
      const auto px = pixels_of(*ctx, ref, {0, 1});
      auto first = m->encode_images(*ctx, px, opts);
      ASSERT_TRUE(first);
      const auto want = values(*first);
      std::vector<double> t;
      for (int i = 0; i < 20; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        auto again = m->encode_images(*ctx, px, opts);
        t.push_back(seconds_since(t0));
        ASSERT_TRUE(again);
        ASSERT_EQ(values(*again), want);
      }
      std::sort(t.begin(), t.end());
      std::printf(
          "[%s] encode 2 images (%lldx%lld), patch embedding %s, %d thread(s): median %.3f ms\n",
          GetParam().c_str(), static_cast<long long>(ref.pixel_dims[2]),
          static_cast<long long>(ref.pixel_dims[3]), onednn ? "oneDNN" : "matmul", threads,
          t[t.size() / 2] * 1e3);
    }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LlavaFidelity, ::testing::Values("odd", "full", "bundled"));
