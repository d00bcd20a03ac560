// The planner against brute force, and the behaviours the design asks for:
// slow devices and links left out, precision lowered only where needed,
// tensor parallelism when it pays, the vision encoder placed, clear errors,
// and speed on a large cluster.
#include "placement/planner.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <set>

#include "synthetic.hpp"

namespace {

using namespace troupe::placement;
using namespace troupe::placement::testing;

double log_uniform(std::mt19937& rng, double lo, double hi) {
  return std::exp(std::uniform_real_distribution<double>(std::log(lo), std::log(hi))(rng));
}

/// A small heterogeneous cluster: speeds, memories, loads and links drawn
/// from wide ranges.
cluster_profile random_cluster(std::mt19937& rng, int devices, int nodes) {
  cluster_profile c;
  for (int d = 0; d < devices; ++d) {
    const std::string node =
        "n" + std::to_string(std::uniform_int_distribution<int>(0, nodes - 1)(rng));
    auto dev =
        device(node + ":d" + std::to_string(d), node, log_uniform(rng, 50, 3000),
               log_uniform(rng, 2, 400), std::uniform_real_distribution<double>(0.15, 1.3)(rng));
    if (std::bernoulli_distribution(0.4)(rng))
      dev.load = std::uniform_real_distribution<double>(0, 0.7)(rng);
    c.devices.push_back(dev);
  }
  for (int a = 0; a < nodes; ++a)
    for (int b = a + 1; b < nodes; ++b)
      c.links.push_back(link("n" + std::to_string(a), "n" + std::to_string(b),
                             log_uniform(rng, 0.05, 50), log_uniform(rng, 1e-6, 1e-3)));
  // Nodes without devices cannot have links.
  std::erase_if(c.links, [&](const link_profile& l) {
    auto has = [&](const std::string& n) {
      return std::any_of(c.devices.begin(), c.devices.end(),
                         [&](const auto& d) { return d.node == n; });
    };
    return !has(l.node_a) || !has(l.node_b);
  });
  return c;
}

std::vector<std::string> used_devices(const plan& p) {
  std::vector<std::string> out;
  for (const auto& s : p.stages) out.insert(out.end(), s.devices.begin(), s.devices.end());
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Planner, MatchesExhaustiveOnRandomSmallClusters) {
  planner_options opt;
  opt.allow_tensor_parallel = false;
  opt.min_precision = opt.preferred;  // exhaustive_plan keeps every layer at `preferred`
  int compared = 0, both_infeasible = 0, exact = 0;
  double worst = 1;
  for (unsigned seed = 1; seed <= 200; ++seed) {
    std::mt19937 rng(seed);
    const int devices = std::uniform_int_distribution<int>(1, 5)(rng);
    const int nodes = std::uniform_int_distribution<int>(1, 3)(rng);
    const int layers = std::uniform_int_distribution<int>(3, 8)(rng);
    const auto c = random_cluster(rng, devices, nodes);
    const auto m = small_llama(layers);
    workload w;
    w.batch = std::uniform_int_distribution<int>(1, 32)(rng);
    w.context_tokens = std::uniform_int_distribution<int>(0, 4096)(rng);
    w.overhead_bytes = 50e6;
    const auto ref = exhaustive_plan(c, m, w, opt);
    const auto got = make_plan(c, m, w, opt);
    if (!ref) {
      EXPECT_FALSE(got) << "seed " << seed << ": the planner found a plan brute force did not:\n"
                        << got->describe();
      ++both_infeasible;
      continue;
    }
    ASSERT_TRUE(got) << "seed " << seed << ": " << got.error() << "\nbrute force found:\n"
                     << ref->describe();
    const double ratio = got->step_s / ref->step_s;
    EXPECT_LE(ratio, 1.05) << "seed " << seed << "\nplanner:\n"
                           << got->describe() << "brute force:\n"
                           << ref->describe();
    EXPECT_GE(ratio, 1 - 1e-9) << "seed " << seed << ": brute force is not optimal?";
    worst = std::max(worst, ratio);
    // Tensor-parallel groups only add options.
    planner_options tp = opt;
    tp.allow_tensor_parallel = true;
    const auto with_tp = make_plan(c, m, w, tp);
    ASSERT_TRUE(with_tp) << "seed " << seed << ": " << with_tp.error();
    EXPECT_LE(with_tp->step_s, got->step_s * (1 + 1e-12)) << "seed " << seed;
    exact += ratio <= 1 + 1e-9;
    ++compared;
  }
  std::printf("compared %d clusters (%d infeasible for both): %d exact, worst ratio %.4f\n",
              compared, both_infeasible, exact, worst);
  EXPECT_GE(compared, 100);
}

TEST(Planner, PlanIsConsistentWithTheCostModel) {
  std::mt19937 rng(7);
  const auto c = random_cluster(rng, 12, 3);
  const auto m = small_llama(24);
  workload w;
  w.batch = 8;
  w.overhead_bytes = 50e6;
  const auto p = make_plan(c, m, w);
  ASSERT_TRUE(p) << p.error();
  const auto again = evaluate(*p, c, m, w);
  ASSERT_TRUE(again) << again.error();
  EXPECT_NEAR(again->step_s, p->step_s, 1e-12);
  EXPECT_NEAR(again->latency_s, p->latency_s, 1e-12);
  double slowest = 0;
  for (const auto& s : p->stages) slowest = std::max(slowest, s.compute_s + s.transfer_s);
  EXPECT_NEAR(p->step_s, slowest, 1e-15);
  for (const auto& [id, bytes] : p->memory_bytes)
    EXPECT_LE(bytes, c.find(id)->memory_bytes * (1 + 1e-9)) << id;
  EXPECT_EQ(p->stages.front().layer_begin, 0);
  EXPECT_EQ(p->stages.back().layer_end, m.layer_count());
  const auto text = p->describe();
  for (const auto& id : used_devices(*p)) EXPECT_NE(text.find(id), std::string::npos) << text;
}

TEST(Planner, SlowDeviceIsLeftOut) {
  cluster_profile c;
  for (int i = 0; i < 3; ++i)
    c.devices.push_back(device("n:gpu" + std::to_string(i), "n", 1000, 100, 24));
  const auto m = llama7b();
  workload w;
  const auto without = make_plan(c, m, w);
  c.devices.push_back(device("n:cpu0", "n", 10, 1, 64, 0, device_kind::cpu));
  const auto with = make_plan(c, m, w);
  ASSERT_TRUE(without && with);
  const auto used = used_devices(*with);
  EXPECT_EQ(std::count(used.begin(), used.end(), "n:cpu0"), 0) << with->describe();
  EXPECT_NEAR(with->step_s, without->step_s, 1e-12);
  // A device that is merely a bit slower still helps.
  c.devices.back() = device("n:gpu3", "n", 700, 70, 24);
  const auto helped = make_plan(c, m, w);
  ASSERT_TRUE(helped);
  EXPECT_EQ(used_devices(*helped).size(), 4u) << helped->describe();
  EXPECT_LT(helped->step_s, without->step_s);
}

TEST(Planner, SlowLinkIsLeftOutFastLinkIsUsed) {
  cluster_profile c;
  for (int i = 0; i < 2; ++i) {
    c.devices.push_back(device("a:gpu" + std::to_string(i), "a", 1000, 100, 24));
    c.devices.push_back(device("b:gpu" + std::to_string(i), "b", 1000, 100, 24));
  }
  const auto m = llama7b();
  workload w;
  w.batch = 8;
  c.links = {link("a", "b", 0.001, 5e-3)};  // 1 MB/s
  const auto slow = make_plan(c, m, w);
  ASSERT_TRUE(slow) << slow.error();
  const auto used = used_devices(*slow);
  const auto nodes_used = std::set<char>{used.front()[0], used.back()[0]};
  EXPECT_EQ(nodes_used.size(), 1u) << slow->describe();
  EXPECT_EQ(used.size(), 2u) << slow->describe();
  c.links = {link("a", "b", 25, 5e-6)};
  const auto fast = make_plan(c, m, w);
  ASSERT_TRUE(fast);
  EXPECT_EQ(used_devices(*fast).size(), 4u) << fast->describe();
  EXPECT_LT(fast->step_s, slow->step_s);
  // Node blocks are contiguous: one crossing.
  int crossings = 0;
  for (std::size_t i = 0; i + 1 < fast->stages.size(); ++i)
    crossings += fast->stages[i].devices[0][0] != fast->stages[i + 1].devices[0][0];
  EXPECT_EQ(crossings, 1) << fast->describe();
}

TEST(Planner, NoLoweringWhenEverythingFits) {
  cluster_profile c;
  c.devices = {device("n:gpu0", "n", 1000, 100, 80), device("n:gpu1", "n", 1000, 100, 80)};
  const auto m = llama7b();
  const auto p = make_plan(c, m, workload{});
  ASSERT_TRUE(p) << p.error();
  EXPECT_EQ(p->lowered_params(m, precision::f16), 0);
  for (const auto& s : p->stages)
    for (auto q : s.layer_precision) EXPECT_EQ(q, precision::f16);
}

TEST(Planner, MemoryPressureLowersOnlyNonSensitiveLayersProjectorStaysF16) {
  auto clip = clip_profile(24, 1024, 4096, 576);
  auto m = *with_vision(llama7b(), *clip);
  workload w;
  w.batch = 4;
  w.context_tokens = 1024;
  cluster_profile c;
  c.devices = {device("n:gpu0", "n", 1000, 100, 6), device("n:gpu1", "n", 1000, 100, 6)};
  // f16 needs ~13.5 GB of weights + 1 GiB KV + overhead: 12 GiB is not enough.
  const auto p = make_plan(c, m, w);
  ASSERT_TRUE(p) << p.error();
  int lowered = 0, q4 = 0;
  for (int l = 0; l < m.layer_count(); ++l) {
    const auto* s = p->stage_of(l);
    ASSERT_NE(s, nullptr);
    const auto q = s->layer_precision[static_cast<std::size_t>(l - s->layer_begin)];
    if (m.layers[static_cast<std::size_t>(l)].sensitive) {
      EXPECT_EQ(q, precision::f16) << "layer " << l;
    }
    lowered += q != precision::f16;
    q4 += q == precision::q4_0;
  }
  EXPECT_GT(lowered, 0) << p->describe();
  EXPECT_LT(lowered, m.layer_count() - 2) << "lowered more than needed:\n" << p->describe();
  EXPECT_EQ(q4, 0) << "q8_0 suffices:\n" << p->describe();
  EXPECT_EQ(p->head_precision, precision::f16);
  ASSERT_TRUE(p->encoder_device);
  EXPECT_TRUE(at_least(p->projector_precision, precision::f16));
  for (const auto& [id, bytes] : p->memory_bytes)
    EXPECT_LE(bytes, c.find(id)->memory_bytes * (1 + 1e-9)) << id;
  // Even asked for q4_0 weights, the projector stays at f16.
  planner_options low;
  low.preferred = precision::q4_0;
  const auto q = make_plan(c, m, w, low);
  ASSERT_TRUE(q) << q.error();
  EXPECT_EQ(q->projector_precision, precision::f16);
  EXPECT_EQ(q->encoder_precision, precision::q4_0);
}

TEST(Planner, InfeasibleModelGivesAClearError) {
  const auto m = llama7b();
  workload w;
  cluster_profile c;
  c.devices = {device("n:gpu0", "n", 1000, 100, 1.5), device("n:gpu1", "n", 1000, 100, 1.5)};
  auto p = make_plan(c, m, w);
  ASSERT_FALSE(p);
  EXPECT_NE(p.error().find("does not fit"), std::string::npos) << p.error();
  EXPECT_NE(p.error().find("usable devices offer"), std::string::npos) << p.error();
  // One layer larger than any device.
  c.devices = {device("n:gpu0", "n", 1000, 100, 0.3), device("n:gpu1", "n", 1000, 100, 0.3)};
  p = make_plan(c, m, w);
  ASSERT_FALSE(p);
  EXPECT_NE(p.error().find("layer 0 needs"), std::string::npos) << p.error();
  EXPECT_NE(p.error().find("n:gpu"), std::string::npos) << p.error();
  // Fits at q8_0 but not when lowering is forbidden.
  c.devices = {device("n:gpu0", "n", 1000, 100, 5), device("n:gpu1", "n", 1000, 100, 5)};
  ASSERT_TRUE(make_plan(c, m, w));
  planner_options strict;
  strict.min_precision = precision::f16;
  p = make_plan(c, m, w, strict);
  ASSERT_FALSE(p);
  EXPECT_NE(p.error().find("at f16"), std::string::npos) << p.error();
}

// A decoder held in formats of its own (a K-quant mix: Q5_0-sized layers
// in the Q8_0 tier) is planned at its own bytes: it fits where the tier's
// 8.5 bits a weight would not, every device's memory is what its layers
// hold, and nothing is lowered.
TEST(Planner, HeldFormatsCountTheirOwnBytes) {
  auto m = llama7b();
  workload w;
  cluster_profile c;
  c.devices = {device("n:gpu0", "n", 1000, 100, 3), device("n:gpu1", "n", 1000, 100, 3)};
  planner_options o;
  o.preferred = precision::q8_0;
  o.min_precision = precision::q8_0;
  auto tier = make_plan(c, m, w, o);
  ASSERT_FALSE(tier);  // ~7.2 GB at 8.5 bits, 6.4 GB offered
  EXPECT_NE(tier.error().find("at q8_0"), std::string::npos) << tier.error();
  const double bits = 5.5;
  for (auto& l : m.layers) l.held_bytes = l.params * bits / 8;
  m.embedding_held_bytes = m.embedding_params * bits / 8;
  m.lm_head_held_bytes = m.lm_head_params * bits / 8;
  m.held_at = precision::q8_0;
  const auto held = make_plan(c, m, w, o);
  ASSERT_TRUE(held) << held.error();
  double planned = 0, want = 0;
  for (const auto& [id, bytes] : held->memory_bytes) {
    EXPECT_LE(bytes, c.find(id)->memory_bytes * (1 + 1e-9)) << id;
    planned += bytes;
  }
  for (const auto& st : held->stages) {
    for (int l = st.layer_begin; l < st.layer_end; ++l) {
      EXPECT_EQ(st.layer_precision[static_cast<std::size_t>(l - st.layer_begin)], precision::q8_0);
      want += m.layers[static_cast<std::size_t>(l)].held_bytes +
              double(w.batch) * w.context_tokens *
                  m.layers[static_cast<std::size_t>(l)].kv_bytes_per_token;
    }
    want += w.overhead_bytes;
  }
  want += m.embedding_held_bytes + m.lm_head_held_bytes;
  EXPECT_NEAR(planned, want, 1e-6 * want);
  // Too big at f16 for two 6 GiB devices: lowering fits a plain model, but
  // a decoder held at f16 in its own formats is not lowered.
  c.devices = {device("n:gpu0", "n", 1000, 100, 6), device("n:gpu1", "n", 1000, 100, 6)};
  planner_options lowering;
  lowering.preferred = precision::f16;
  lowering.min_precision = precision::q4_0;
  auto plain = llama7b();
  const auto lowered = make_plan(c, plain, w, lowering);
  ASSERT_TRUE(lowered) << lowered.error();
  EXPECT_GT(lowered->lowered_params(plain, precision::f16), 0);
  for (auto& l : plain.layers) l.held_bytes = l.params * 2;
  plain.held_at = precision::f16;
  const auto kept = make_plan(c, plain, w, lowering);
  ASSERT_FALSE(kept);
  EXPECT_NE(kept.error().find("at f16"), std::string::npos) << kept.error();
}

TEST(Planner, TensorParallelWhenItPays) {
  // Eight GPUs on one node, a four-layer model: a pipeline can use at most
  // four of them; tensor-parallel pairs use all eight.
  cluster_profile c;
  for (int i = 0; i < 8; ++i)
    c.devices.push_back(device("n:gpu" + std::to_string(i), "n", 1000, 100, 24));
  c.local_link = link("n", "n", 100, 2e-6);
  const auto m = llama7b(4);
  workload w;
  planner_options no_tp;
  no_tp.allow_tensor_parallel = false;
  const auto tp = make_plan(c, m, w);
  const auto pp = make_plan(c, m, w, no_tp);
  ASSERT_TRUE(tp && pp);
  EXPECT_LT(tp->step_s, pp->step_s);
  const bool grouped = std::any_of(tp->stages.begin(), tp->stages.end(),
                                   [](const stage& s) { return s.devices.size() > 1; });
  EXPECT_TRUE(grouped) << tp->describe();
  for (const auto& s : pp->stages) EXPECT_EQ(s.devices.size(), 1u);
  // Over a slow node-local link the all-reduces cost more than they save.
  c.local_link = link("n", "n", 0.01, 1e-3);
  const auto slow = make_plan(c, m, w);
  ASSERT_TRUE(slow);
  for (const auto& s : slow->stages) EXPECT_EQ(s.devices.size(), 1u) << slow->describe();
}

TEST(Planner, VisionEncoderGoesWhereItCostsLeast) {
  auto m = *with_vision(llama7b(), *clip_profile(24, 1024, 4096, 576));
  workload w;
  w.images_per_step = 0.5;
  cluster_profile c;
  c.devices = {device("n:gpu0", "n", 1000, 100, 40), device("n:gpu1", "n", 1000, 100, 40),
               device("n:npu0", "n", 50, 50, 8, 0, device_kind::npu)};
  const auto p = make_plan(c, m, w);
  ASSERT_TRUE(p) << p.error();
  ASSERT_TRUE(p->encoder_device);
  // The NPU is too slow for decoder layers but takes the encoder off the
  // pipeline's critical path.
  EXPECT_EQ(*p->encoder_device, "n:npu0") << p->describe();
  EXPECT_EQ(used_devices(*p), (std::vector<std::string>{"n:gpu0", "n:gpu1"})) << p->describe();
  EXPECT_GT(p->memory_bytes.at("n:npu0"), encoder_bytes(m, precision::f16));
  const auto costed = evaluate(*p, c, m, w);
  ASSERT_TRUE(costed);
  EXPECT_NEAR(costed->step_s, p->step_s, 1e-12);
  // On either pipeline GPU it would slow every step.
  for (const auto& id : used_devices(*p)) {
    auto moved = *p;
    moved.encoder_device = id;
    const auto worse = evaluate(moved, c, m, w);
    ASSERT_TRUE(worse);
    EXPECT_GT(worse->step_s, p->step_s) << id;
  }
  // Rarely used, it fits in a pipeline stage's slack and goes to the device
  // that encodes an image fastest without slowing the step.
  w.images_per_step = 0.01;
  const auto rare = make_plan(c, m, w);
  ASSERT_TRUE(rare && rare->encoder_device);
  EXPECT_NE(*rare->encoder_device, "n:npu0") << rare->describe();
  auto on_npu = *rare;
  on_npu.encoder_device = "n:npu0";
  const auto npu = evaluate(on_npu, c, m, w);
  ASSERT_TRUE(npu);
  EXPECT_LE(rare->step_s, npu->step_s * (1 + 1e-12));
  EXPECT_LT(rare->encoder_s_per_image, npu->encoder_s_per_image);
}

TEST(Planner, VisionEncoderGetsMemoryReservedWhenTight) {
  auto m = *with_vision(llama7b(), *clip_profile(24, 1024, 4096, 576));
  workload w;
  w.overhead_bytes = 0.2 * GiB;
  cluster_profile c;
  // 13.5 GB decoder + 0.7 GB vision + KV on 2 × 7.6 GiB: the decoder alone
  // would spread over both; the encoder needs room set aside.
  c.devices = {device("n:gpu0", "n", 1000, 100, 7.6), device("n:gpu1", "n", 1000, 100, 7.6)};
  const auto p = make_plan(c, m, w);
  ASSERT_TRUE(p) << p.error();
  ASSERT_TRUE(p->encoder_device);
  for (const auto& [id, bytes] : p->memory_bytes)
    EXPECT_LE(bytes, c.find(id)->memory_bytes * (1 + 1e-9)) << id;
}

TEST(Planner, ReplanGainReflectsNewMeasurements) {
  cluster_profile c;
  for (int i = 0; i < 4; ++i)
    c.devices.push_back(device("n:gpu" + std::to_string(i), "n", 1000, 100, 24));
  const auto m = llama7b();
  workload w;
  const auto p = make_plan(c, m, w);
  ASSERT_TRUE(p);
  auto same = replan_gain(*p, c, m, w);
  ASSERT_TRUE(same);
  EXPECT_NEAR(same->gain, 0, 1e-12);
  c.devices[1].load = 0.6;
  const auto e = replan_gain(*p, c, m, w);
  ASSERT_TRUE(e) << e.error();
  EXPECT_GT(e->current_step_s, p->step_s);
  EXPECT_LT(e->proposed_step_s, e->current_step_s);
  EXPECT_NEAR(e->gain, (e->current_step_s - e->proposed_step_s) / e->current_step_s, 1e-15);
  EXPECT_GT(e->gain, 0.15);
  // A plan naming a device the cluster lost cannot be re-costed.
  c.devices.erase(c.devices.begin() + 1);
  const auto lost = replan_gain(*p, c, m, w);
  ASSERT_FALSE(lost);
  EXPECT_NE(lost.error().find("n:gpu1"), std::string::npos) << lost.error();
}

/// 32 nodes × 8 devices (GPUs of three speeds and CPUs), an 80-layer
/// 70B-class model.
cluster_profile large_cluster() {
  std::mt19937 rng(256);
  cluster_profile c;
  for (int n = 0; n < 32; ++n) {
    const std::string node = "node" + std::to_string(n);
    for (int d = 0; d < 8; ++d) {
      const bool cpu = d == 7;
      const double speed =
          cpu ? 100 : std::array<double, 3>{900, 1600, 3300}[static_cast<std::size_t>(n % 3)];
      auto dev = device(node + (cpu ? ":cpu0" : ":gpu" + std::to_string(d)), node, speed,
                        cpu ? 3 : speed / 10, cpu ? 256 : 80,
                        std::uniform_real_distribution<double>(0, 0.3)(rng),
                        cpu ? device_kind::cpu : device_kind::gpu);
      c.devices.push_back(dev);
    }
  }
  for (int a = 0; a < 32; ++a)
    for (int b = a + 1; b < 32; ++b)
      c.links.push_back(link("node" + std::to_string(a), "node" + std::to_string(b),
                             log_uniform(rng, 1, 50), log_uniform(rng, 2e-6, 50e-6)));
  return c;
}

TEST(Planner, LargeClusterPlansInUnderASecond) {
  const auto c = large_cluster();
  ASSERT_EQ(c.devices.size(), 256u);
  const auto m = *llama_profile(80, 8192, 28672, 64, 8, 128, 32000, false);
  workload w;
  w.batch = 32;
  w.context_tokens = 4096;
  const auto start = std::chrono::steady_clock::now();
  const auto p = make_plan(c, m, w);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(p) << p.error();
  std::printf("256 devices x 80 layers: %.1f ms, %zu stages, step %.3f ms\n", seconds * 1e3,
              p->stages.size(), p->step_s * 1e3);
  EXPECT_LT(seconds, 1.0);
  const auto costed = evaluate(*p, c, m, w);
  ASSERT_TRUE(costed);
  EXPECT_NEAR(costed->step_s, p->step_s, 1e-12);
  // The plan is at least as fast as the best single node (with TP groups).
  EXPECT_GT(p->stages.size(), 8u);
}

}  // namespace
