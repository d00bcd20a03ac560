// The cost model: units, proportionality and accounting.
#include "placement/cost.hpp"

#include <gtest/gtest.h>

#include "synthetic.hpp"

namespace {

using namespace troupe::placement;
using namespace troupe::placement::testing;

shard all_layers(const model_profile& m, precision p) {
  shard s;
  s.layer_begin = 0;
  s.layer_end = m.layer_count();
  s.layer_precision.assign(static_cast<std::size_t>(m.layer_count()), p);
  s.has_embedding = true;
  s.has_lm_head = true;
  s.head_precision = p;
  return s;
}

TEST(Profile, LlamaSevenBillionParameters) {
  // LLaMA-2-7B has 6,738,415,616 parameters (Hugging Face model card).
  const auto m = llama7b();
  EXPECT_DOUBLE_EQ(m.total_params(), 6738415616.0);
  EXPECT_TRUE(m.layers.front().sensitive);
  EXPECT_TRUE(m.layers.back().sensitive);
  EXPECT_FALSE(m.layers[1].sensitive);
  // KV: k and v, 32 heads × 128, f16.
  EXPECT_DOUBLE_EQ(m.layers[0].kv_bytes_per_token, 2.0 * 32 * 128 * 2);
  EXPECT_DOUBLE_EQ(m.activation_bytes_per_token(), 4096.0 * 4);
}

TEST(Profile, PrecisionBytesAndOrder) {
  EXPECT_DOUBLE_EQ(bytes_per_weight(precision::f32), 4);
  EXPECT_DOUBLE_EQ(bytes_per_weight(precision::q4_0), 18.0 / 32);
  EXPECT_TRUE(at_least(precision::f16, precision::q8_0));
  EXPECT_FALSE(at_least(precision::q4_0, precision::q8_0));
  EXPECT_EQ(lower(precision::f16), precision::q8_0);
  EXPECT_EQ(lower(precision::q4_0), std::nullopt);
  for (auto p : all_precisions) EXPECT_EQ(precision_from_string(to_string(p)), p);
  EXPECT_EQ(projector_precision(precision::q4_0), precision::f16);
  EXPECT_EQ(projector_precision(precision::f32), precision::f32);
  const auto layer = llama7b().layers[3];
  EXPECT_DOUBLE_EQ(layer.bytes(precision::q8_0) / layer.bytes(precision::f16), 17.0 / 32);
}

TEST(Profile, BuildersRejectBadDimensions) {
  EXPECT_FALSE(llama_profile(0, 4096, 11008, 32, 32, 128, 32000, false));
  auto bad = llama_profile(32, 4096, 11008, 32, 5, 128, 32000, false);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("kv_heads"), std::string::npos) << bad.error();
  EXPECT_FALSE(clip_profile(24, -1, 4096, 576));
  auto clip = clip_profile(24, 1024, 4096, 576);
  ASSERT_TRUE(clip);
  auto llava = with_vision(llama7b(), *clip);
  ASSERT_TRUE(llava);
  ASSERT_TRUE(llava->vision);
  // CLIP ViT-L/14 has about 303M parameters; the LLaVA projector 1024×4096 + 4096×4096.
  EXPECT_NEAR(llava->vision->params, 303e6, 3e6);
  EXPECT_DOUBLE_EQ(llava->vision->projector_params, 1024.0 * 4096 + 4096.0 * 4096 + 2 * 4096);
}

TEST(Cost, TwiceTheBandwidthHalvesComputeTime) {
  const auto m = llama7b();
  workload w;
  w.batch = 4;
  w.context_tokens = 2048;
  auto slow = device("a", "n", 500, 1e6, 80);  // GEMM so fast that decode is bandwidth-bound
  auto fast = device("b", "n", 1000, 1e6, 80);
  const auto s = all_layers(m, precision::f16);
  const auto cs = stage_compute(rates_of(slow), m, w, s);
  const auto cf = stage_compute(rates_of(fast), m, w, s);
  EXPECT_GT(cs.weights_s, cs.gemm_s);
  EXPECT_GT(cs.kv_s, 0);
  EXPECT_NEAR(cf.total_s(), cs.total_s() / 2, 1e-12 * cs.total_s());
  // Weight streaming is bytes / bandwidth.
  EXPECT_NEAR(cs.weights_s, (weight_bytes(m, s) - m.embedding_params * 2) / (500 * GB), 1e-9);
  // Load 0.5 leaves half the device: twice the time.
  slow.load = 0.5;
  EXPECT_NEAR(stage_compute(rates_of(slow), m, w, s).total_s(), 2 * cs.total_s(),
              1e-12 * cs.total_s());
  // q4_0 streams 18/64 of the f16 bytes.
  const auto q4 = all_layers(m, precision::q4_0);
  EXPECT_NEAR(stage_compute(rates_of(fast), m, w, q4).weights_s, cf.weights_s * 18.0 / 64, 1e-12);
  // A fully loaded device never finishes.
  slow.load = 1;
  EXPECT_TRUE(std::isinf(stage_compute(rates_of(slow), m, w, s).total_s()));
}

TEST(Cost, ComputeBoundWhenTheBatchIsLarge) {
  const auto m = llama7b();
  workload w;
  w.batch = 512;
  w.context_tokens = 0;
  const auto d = device("a", "n", 1000, 100, 80);
  const auto s = all_layers(m, precision::f16);
  const auto c = stage_compute(rates_of(d), m, w, s);
  EXPECT_GT(c.gemm_s, c.weights_s);
  EXPECT_DOUBLE_EQ(c.total_s(), c.gemm_s);
  auto d2 = d;
  d2.gemm_flop_per_s *= 2;
  EXPECT_NEAR(stage_compute(rates_of(d2), m, w, s).total_s(), c.total_s() / 2, 1e-12);
}

TEST(Cost, TensorParallelAddsAllReduces) {
  const auto m = llama7b();
  workload w;
  w.batch = 8;
  const auto a = device("a", "n", 1000, 1e6, 80), b = device("b", "n", 1000, 1e6, 80);
  const auto l = link("n", "n", 50, 10e-6);
  const device_profile* group[] = {&a, &b};
  shard s = all_layers(m, precision::f16);
  s.has_embedding = s.has_lm_head = false;
  const auto one = stage_compute(rates_of(a), m, w, s);
  const auto two = stage_compute(rates_of(group, l), m, w, s);
  EXPECT_EQ(one.allreduce_s, 0);
  const double ar = allreduce_s(8 * m.activation_bytes_per_token(), 2, l);
  EXPECT_GT(ar, 0);
  EXPECT_NEAR(two.allreduce_s, 2.0 * m.layer_count() * ar, 1e-15);
  EXPECT_NEAR(two.total_s(), one.total_s() / 2 + two.allreduce_s, 1e-12);
  // Ring all-reduce: 2 (k-1)/k × bytes / bandwidth + 2 (k-1) × latency.
  EXPECT_DOUBLE_EQ(allreduce_s(1e6, 1, l), 0);
  EXPECT_NEAR(allreduce_s(1e6, 4, l), 2 * 3.0 / 4 * 1e6 / l.bandwidth_bytes_per_s + 6 * l.latency_s,
              1e-15);
  EXPECT_GT(allreduce_s(1e6, 8, l), allreduce_s(1e6, 4, l));
  // A group runs at its slowest member's pace.
  auto slow = b;
  slow.load = 0.5;
  const device_profile* mixed[] = {&a, &slow};
  EXPECT_NEAR(stage_compute(rates_of(mixed, l), m, w, s).total_s() - two.allreduce_s, one.total_s(),
              1e-12);
}

TEST(Cost, MemoryAccounting) {
  const auto m = llama7b();
  workload w;
  w.batch = 2;
  w.context_tokens = 1000;
  w.overhead_bytes = 1e9;
  shard s;
  s.layer_begin = 4;
  s.layer_end = 8;
  s.layer_precision = {precision::f16, precision::q8_0, precision::q4_0, precision::f16};
  const double p = m.layers[4].params;
  EXPECT_NEAR(weight_bytes(m, s), p * (2 + 34.0 / 32 + 18.0 / 32 + 2), 1);
  EXPECT_DOUBLE_EQ(kv_bytes(m, w, s), 2.0 * 1000 * 4 * m.layers[4].kv_bytes_per_token);
  EXPECT_DOUBLE_EQ(memory_per_device_bytes(m, w, s, 1),
                   weight_bytes(m, s) + kv_bytes(m, w, s) + 1e9);
  EXPECT_DOUBLE_EQ(memory_per_device_bytes(m, w, s, 2),
                   (weight_bytes(m, s) + kv_bytes(m, w, s)) / 2 + 1e9);
  // Embedding with the first stage, LM head with the last; tied: once.
  s.has_embedding = true;
  EXPECT_NEAR(weight_bytes(m, s), p * (2 + 34.0 / 32 + 18.0 / 32 + 2) + m.embedding_params * 2, 1);
  auto tied = *llama_profile(32, 4096, 11008, 32, 32, 128, 32000, true);
  shard whole = all_layers(tied, precision::f16);
  shard untied_whole = all_layers(m, precision::f16);
  EXPECT_NEAR(weight_bytes(m, untied_whole) - weight_bytes(tied, whole), m.embedding_params * 2, 1);
}

TEST(Cost, TransferAndPipeline) {
  const auto m = llama7b();
  workload w;
  w.batch = 16;
  const auto l = link("a", "b", 1, 1e-3);
  EXPECT_DOUBLE_EQ(transfer_s(l, m, w), 1e-3 + 16 * 4096 * 4 / 1e9);
  const stage_time st[] = {{0.010, 0.002}, {0.015, 0.001}, {0.008, 0.5}};
  const auto t = pipeline(st);
  EXPECT_DOUBLE_EQ(t.step_s, 0.016);  // the last stage sends nothing
  EXPECT_DOUBLE_EQ(t.latency_s, 0.010 + 0.002 + 0.015 + 0.001 + 0.008);
}

TEST(Cost, WorkloadValidation) {
  workload w;
  EXPECT_TRUE(validate(w));
  w.batch = 0;
  auto bad = validate(w);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().find("batch"), std::string::npos);
  w = {};
  w.overhead_bytes = -1;
  EXPECT_FALSE(validate(w));
}

}  // namespace
