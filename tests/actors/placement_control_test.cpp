// The head's side of placement: node reports into the planner's profiles,
// plans back into stages, the device probe, the load meter and the
// throughput windows of the decision log.

#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "actors/device_probe.hpp"
#include "actors/placement_control.hpp"
#include "actors/prompt.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "models/llama.hpp"
#include "placement/planner.hpp"
#include "tests/remote_memory_device.hpp"

namespace {

using namespace troupe;
using namespace troupe::actors;
using namespace std::chrono_literals;

device_probe probe(double scale, std::int64_t memory = std::int64_t{8} << 30) {
  device_probe p;
  p.device = "cpu";
  p.cores = 1;
  p.gemv_f32 = 20e9 * scale;
  p.gemv_f16 = 19e9 * scale;
  p.gemv_q8_0 = 18e9 * scale;
  p.gemv_q4_0 = 17e9 * scale;
  p.gemm_f32 = 50e9 * scale;
  p.gemm_f16 = 51e9 * scale;
  p.gemm_q8_0 = 80e9 * scale;
  p.gemm_q4_0 = 110e9 * scale;
  p.memory_bytes = memory;
  return p;
}

placement::model_profile bundled_profile(const std::string& kv = "f32") {
  auto s = load_prompt_setup(TROUPE_BUNDLED_MODEL);
  EXPECT_TRUE(s.has_value()) << (s ? "" : s.error().message);
  auto m = model_profile_of(s->text, s->llava, kv);
  EXPECT_TRUE(m.has_value()) << (m ? "" : m.error());
  return *m;
}

TEST(PlacementControl, ModelProfileFollowsTheConfigAndTheCacheType) {
  auto s = load_prompt_setup(TROUPE_BUNDLED_MODEL);
  ASSERT_TRUE(s.has_value());
  const auto f32 = bundled_profile("f32"), f16 = bundled_profile("f16"),
             i8 = bundled_profile("int8");
  EXPECT_EQ(f32.layer_count(), s->text.num_layers);
  EXPECT_EQ(f32.hidden, s->text.hidden_size);
  ASSERT_TRUE(f32.vision.has_value());
  EXPECT_EQ(f32.vision->hidden, s->llava->vision.hidden_size);
  for (int i = 0; i < f32.layer_count(); ++i) {
    const auto k = static_cast<std::size_t>(i);
    // K and V, kv_heads x head_dim each, per token: 2 x 4 bytes in f32.
    EXPECT_DOUBLE_EQ(f32.layers[k].kv_bytes_per_token,
                     2.0 * 4.0 * static_cast<double>(s->text.num_kv_heads * s->text.head_dim));
    EXPECT_DOUBLE_EQ(f16.layers[k].kv_bytes_per_token * 2, f32.layers[k].kv_bytes_per_token);
    EXPECT_DOUBLE_EQ(i8.layers[k].kv_bytes_per_token * 4, f32.layers[k].kv_bytes_per_token);
  }
  EXPECT_FALSE(model_profile_of(s->text, std::nullopt, "f32")->vision.has_value());
}

TEST(PlacementControl, PrecisionOfEachWeightFormat) {
  using kernels::weight_format;
  EXPECT_EQ(precision_of(weight_format::f32), placement::precision::f32);
  EXPECT_EQ(precision_of(weight_format::bf16), placement::precision::f16);
  EXPECT_EQ(precision_of(weight_format::int8_asym), placement::precision::q8_0);
  EXPECT_EQ(precision_of(weight_format::int4_sym), placement::precision::q4_0);
  EXPECT_EQ(precision_of(weight_format::q4_0), placement::precision::q4_0);
}

// A llama.cpp Q4_K_M file as the head plans it: the tier of its most
// precise matrix (Q6_K: q8_0), and at that tier each layer's bytes are what
// the loaded model streams for it (its prepared matrices) plus its norms.
TEST(PlacementControl, HeldFormatsAreWhatTheLoadedModelHolds) {
  const std::string path = std::string(TROUPE_FIXTURES_DIR) + "/gguf_quants/kq-q4_k_m.gguf";
  auto src = models::weight_source::open(path);
  ASSERT_TRUE(src) << src.error().message;
  auto cfg = models::llama_config_from_gguf(*(*src)->gguf());
  ASSERT_TRUE(cfg);
  const auto held = models::decoder_formats(*cfg, **src, models::quant_plan{});
  auto tier = placement::precision::q4_0;
  for (const auto& h : held) tier = placement::most_precise(tier, precision_of(h.format));
  EXPECT_EQ(tier, placement::precision::q8_0);
  auto m = model_profile_of(*cfg, std::nullopt, "f32");
  ASSERT_TRUE(m) << m.error();
  hold_as_stored(*m, held, tier);
  ASSERT_EQ(m->held_at, tier);

  auto dev = kernels::cpu::cpu_device::with_threads(1);
  auto model = models::llama_model::load(path, *dev, models::quant_plan{});
  ASSERT_TRUE(model) << model.error().message;
  // bytes_per_token: the prepared matrices of every layer and the head,
  // and one embedding row.
  const double embed_row =
      double(cfg->hidden_size) * kernels::bits_per_weight(held.front().format) / 8;
  double layers = 0, norms = 0;
  for (int l = 0; l < m->layer_count(); ++l) {
    const double held_l = m->layers[static_cast<std::size_t>(l)].held_bytes;
    EXPECT_GT(held_l, 0);
    EXPECT_LT(held_l, m->layers[static_cast<std::size_t>(l)].bytes(tier));  // below 8.5 bits
    layers += held_l;
    norms += 2.0 * cfg->hidden_size * 4;  // two RMS norms a layer, f32
  }
  const double head_matrix = m->lm_head_held_bytes - cfg->hidden_size * 4.0;  // less the norm
  const double planned = layers - norms + head_matrix + embed_row;
  const double loaded = static_cast<double>((*model)->bytes_per_token());
  // The CPU device aligns each panel of 16 rows to 64 bytes: Q6_K's 3,360
  // bytes a panel of one superblock take 3,392. At most 64 bytes a panel.
  double rows = 0;
  for (const auto& h : held)
    if (h.name != "embed_tokens") rows += double(h.rows);
  EXPECT_GE(loaded, planned);
  EXPECT_LE(loaded - planned, rows / 16 * 64);
  EXPECT_LT((loaded - planned) / loaded, 0.005);
}

TEST(PlacementControl, ClusterProfileFromReportsAndLinks) {
  std::vector<node_measure> nodes = {
      {"n0", probe(1.0), 0.2}, {"n1", probe(2.0), 1.0}, {"n2", probe(1.0), 0.0}};
  nodes[2].probe.cores = 0;  // not measured yet: left out
  const std::vector<placement::link_profile> links = {
      {"n0", "n1", 2e9, 50e-6}, {"n1", "n0", 9e9, 1e-6}, {"n0", "n2", 1e9, 1e-3}};
  const auto c = cluster_profile_of(nodes, links, placement::precision::q4_0);
  ASSERT_EQ(c.devices.size(), 2u);
  EXPECT_EQ(c.devices[0].id, "n0:cpu");
  EXPECT_EQ(c.devices[1].node, "n1");
  EXPECT_DOUBLE_EQ(c.devices[0].gemm_flop_per_s, nodes[0].probe.gemm_q4_0);  // the weights' format
  EXPECT_DOUBLE_EQ(c.devices[1].gemv(placement::precision::q8_0), nodes[1].probe.gemv_q8_0);
  EXPECT_DOUBLE_EQ(c.devices[0].load, 0.2);
  EXPECT_DOUBLE_EQ(c.devices[1].load, 0.95);  // all taken is still usable, barely
  // One link per pair (the first), none to a node left out.
  ASSERT_EQ(c.links.size(), 1u);
  EXPECT_DOUBLE_EQ(c.links[0].bandwidth_bytes_per_s, 2e9);
  ASSERT_TRUE(c.default_remote_link.has_value());
  EXPECT_DOUBLE_EQ(c.default_remote_link->bandwidth_bytes_per_s, 2e9);
  EXPECT_TRUE(placement::validate(c).has_value());
  // Without measured links: 1 GB/s, 100 us.
  const auto d = cluster_profile_of(nodes, {}, placement::precision::f32);
  ASSERT_TRUE(d.default_remote_link.has_value());
  EXPECT_DOUBLE_EQ(d.default_remote_link->bandwidth_bytes_per_s, 1e9);
  EXPECT_DOUBLE_EQ(d.default_remote_link->latency_s, 100e-6);
  EXPECT_DOUBLE_EQ(d.devices[0].gemm_flop_per_s, nodes[0].probe.gemm_f32);
}

TEST(PlacementControl, PlansBecomeStagesAndStagesBecomePlans) {
  const auto model = bundled_profile();
  const auto c = cluster_profile_of({{"n0", probe(1.0), 0}, {"n1", probe(1.0), 0}},
                                    {{"n0", "n1", 5e9, 50e-6}}, placement::precision::f32);
  placement::workload w;
  w.batch = 16;
  w.context_tokens = 512;
  w.overhead_bytes = 64.0 * (1 << 20);
  placement::planner_options o;
  o.preferred = o.min_precision = placement::precision::f32;
  o.allow_tensor_parallel = false;
  auto p = placement::make_plan(c, model, w, o);
  ASSERT_TRUE(p.has_value()) << p.error();
  auto slots = slots_of(*p, c);
  ASSERT_TRUE(slots.has_value()) << slots.error();
  ASSERT_EQ(slots->size(), p->stages.size());
  int next = 0;
  for (std::size_t i = 0; i < slots->size(); ++i) {
    EXPECT_EQ((*slots)[i].first_layer, next);
    next = (*slots)[i].last_layer;
    EXPECT_EQ(c.find(p->stages[i].devices[0])->node, (*slots)[i].node);
  }
  EXPECT_EQ(next, model.layer_count());
  // The stages back as a plan, re-costed: the planner's own prediction.
  const std::string enc = p->encoder_device ? c.find(*p->encoder_device)->node : "";
  auto back = plan_of(*slots, c, placement::precision::f32, enc);
  ASSERT_TRUE(back.has_value()) << back.error();
  auto cost = placement::evaluate(*back, c, model, w);
  ASSERT_TRUE(cost.has_value()) << cost.error();
  EXPECT_NEAR(cost->step_s, p->step_s, 1e-12 + 1e-9 * p->step_s);

  // Refusals: a tensor-parallel stage, an unknown device or node.
  auto tp = *p;
  tp.stages[0].devices = {"n0:cpu", "n1:cpu"};
  EXPECT_NE(slots_of(tp, c).error().find("tensor-parallel"), std::string::npos);
  auto unknown = *p;
  unknown.stages[0].devices = {"n9:cpu"};
  EXPECT_NE(slots_of(unknown, c).error().find("n9:cpu"), std::string::npos);
  EXPECT_NE(plan_of({{"n7", 0, 4}}, c, placement::precision::f32, "").error().find("n7"),
            std::string::npos);
  EXPECT_NE(plan_of(*slots, c, placement::precision::f32, "n8").error().find("n8"),
            std::string::npos);
  // A tensor-parallel stage re-costs over every rank's device.
  const std::vector<cluster::stage_slot> tp_slots{{"n0", 0, model.layer_count(), {"n1"}}};
  auto tpp = plan_of(tp_slots, c, placement::precision::f32, "");
  ASSERT_TRUE(tpp.has_value()) << tpp.error();
  EXPECT_EQ(tpp->stages[0].devices, (std::vector<std::string>{"n0:cpu", "n1:cpu"}));
  EXPECT_TRUE(placement::evaluate(*tpp, c, model, w).has_value());
  EXPECT_NE(plan_of({{"n0", 0, 4, {"n7"}}}, c, placement::precision::f32, "").error().find("n7"),
            std::string::npos);
}

TEST(PlacementControl, ChangesBetweenPlacements) {
  const std::vector<cluster::stage_slot> cur = {{"n0", 0, 2}, {"n1", 2, 4}};
  // Same split, stage 1 to n2, encoder stays: one live migration.
  auto c = change_between(cur, {{"n0", 0, 2}, {"n2", 2, 4}}, "n0", "n0");
  EXPECT_FALSE(c.resplit);
  ASSERT_EQ(c.moves.size(), 1u);
  EXPECT_EQ(c.moves[0], (migrate_request{"1", "n2"}));
  // Both stages and the encoder, in that order.
  c = change_between(cur, {{"n1", 0, 2}, {"n0", 2, 4}}, "n0", "n2");
  EXPECT_FALSE(c.resplit);
  ASSERT_EQ(c.moves.size(), 3u);
  EXPECT_EQ(c.moves[0], (migrate_request{"0", "n1"}));
  EXPECT_EQ(c.moves[1], (migrate_request{"1", "n0"}));
  EXPECT_EQ(c.moves[2], (migrate_request{"vision", "n2"}));
  // Nothing changes.
  c = change_between(cur, cur, "n0", "");
  EXPECT_FALSE(c.resplit);
  EXPECT_TRUE(c.moves.empty());
  // Another split (one stage becomes two, or the boundary moves): a
  // re-placement; no stage migrations, the encoder still moves after.
  c = change_between({{"n0", 0, 4}}, cur, "n0", "n1");
  EXPECT_TRUE(c.resplit);
  ASSERT_EQ(c.moves.size(), 1u);
  EXPECT_EQ(c.moves[0].shard, "vision");
  EXPECT_TRUE(change_between(cur, {{"n0", 0, 3}, {"n1", 3, 4}}, "n0", "").resplit);
}

TEST(PlacementControl, TokenRateOverWindows) {
  token_rate r;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i <= 20; ++i) r.add(t0 + i * 500ms, i < 10 ? i * 50 : 450 + (i - 9) * 200);
  // 0..4.5 s: 50 tokens per 0.5 s; from 5 s: 200 per 0.5 s.
  ASSERT_TRUE(r.rate(t0, t0 + 4500ms).has_value());
  EXPECT_DOUBLE_EQ(*r.rate(t0, t0 + 4500ms), 100.0);
  EXPECT_DOUBLE_EQ(*r.rate(t0 + 5s, t0 + 10s), 400.0);
  EXPECT_FALSE(r.rate(t0, t0 + 1s).has_value());         // under the 2 s span
  EXPECT_FALSE(r.rate(t0 + 20s, t0 + 30s).has_value());  // no samples there
  r.add(t0, 0);                                          // out of order: ignored
  EXPECT_DOUBLE_EQ(*r.rate(t0 + 5s, t0 + 10s), 400.0);
  // Old samples go after `keep`.
  r.add(t0 + 700s, 10000);
  EXPECT_FALSE(r.rate(t0, t0 + 10s).has_value());
}

TEST(DeviceProbe, MeasuresRatesAndMemoryOnItsTeam) {
  device_spec spec;
  spec.name = "cpu:0-0";
  spec.cores = {0};
  auto d = open_device(spec);
  ASSERT_TRUE(d) << d.error().message;
  const auto p = measure_device(**d, std::int64_t{1} << 30);
  EXPECT_EQ(p.device, "cpu:0-0");
  EXPECT_EQ(p.cores, 1);
  for (double v : {p.gemv_f32, p.gemv_f16, p.gemv_q8_0, p.gemv_q4_0, p.gemm_f32, p.gemm_f16,
                   p.gemm_q8_0, p.gemm_q4_0})
    EXPECT_GT(v, 0);
  // The limit less what this process holds.
  EXPECT_GT(p.memory_bytes, 0);
  EXPECT_LT(p.memory_bytes, std::int64_t{1} << 30);
  EXPECT_GT(p.probe_ms, 0);
  // Without a limit: the machine's available memory (plus our own).
  const auto q = measure_device(**d, 0);
  EXPECT_GT(q.memory_bytes, 0);
}

// A node's probe on a device whose memory host code cannot touch (a GPU's
// situation): its weights and input reach the device through the seam.
TEST(DeviceProbe, MeasuresADeviceWhoseMemoryIsNotTheHosts) {
  test::remote_memory_device remote(1);
  const auto p = measure_device(remote, std::int64_t{1} << 30);
  EXPECT_EQ(p.device, "remote");
  for (double v : {p.gemv_f32, p.gemv_f16, p.gemv_q8_0, p.gemv_q4_0, p.gemm_f32, p.gemm_f16,
                   p.gemm_q8_0, p.gemm_q4_0})
    EXPECT_GT(v, 0);
  EXPECT_GT(p.memory_bytes, 0);
}

TEST(DeviceProbe, ForeignLoadSeesAnotherProcessSpinning) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(0, &set);
    ::sched_setaffinity(0, sizeof set, &set);
    std::atomic<unsigned long> spin{0};
    for (;;) spin.fetch_add(1, std::memory_order_relaxed);
  }
  foreign_load meter({0});
  std::this_thread::sleep_for(600ms);
  const double load = meter.sample();
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  // The child alone keeps core 0 busy unless others share it, and they
  // count as foreign work too.
  EXPECT_GT(load, 0.5);
  EXPECT_LE(load, 1.0);
}

TEST(FixedSlots, EvenStagesHeadFirst) {
  auto p = fixed_slots(4, 3, {"n1", "n0", "n2"}, "n0");
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(cluster::describe(p), "n0 [0,1) -> n1 [1,2) -> n2 [2,4)");
  // Fewer nodes than stages: one stage per node; auto: one per node.
  EXPECT_EQ(cluster::describe(fixed_slots(4, 3, {"n0", "n2"}, "n0")), "n0 [0,2) -> n2 [2,4)");
  EXPECT_EQ(cluster::describe(fixed_slots(22, 0, {"n0", "n1"}, "n0")), "n0 [0,11) -> n1 [11,22)");
  EXPECT_EQ(cluster::describe(fixed_slots(2, 0, {"n0", "n1", "n2"}, "n0")), "n0 [0,1) -> n1 [1,2)");
  // Every layer is covered exactly once.
  auto q = fixed_slots(7, 3, {"a", "b", "c"}, "a");
  int next = 0;
  for (const auto& s : q) {
    EXPECT_EQ(s.first_layer, next);
    EXPECT_GT(s.last_layer, s.first_layer);
    next = s.last_layer;
  }
  EXPECT_EQ(next, 7);
  // Without the head nothing is placed.
  EXPECT_TRUE(fixed_slots(4, 3, {"n1", "n2"}, "n0").empty());
  EXPECT_TRUE(fixed_slots(0, 3, {"n0"}, "n0").empty());
}

// Tensor-parallel stages: runs of k nodes, the head's run first; a node
// left over holds nothing, too few nodes for one group place nothing.
TEST(FixedSlots, TensorParallelStagesAreRunsOfNodes) {
  const std::vector<std::string> nodes{"n1", "n0", "n2", "n3", "n4"};
  auto p = fixed_slots(4, 2, nodes, "n0", 2);
  EXPECT_EQ(cluster::describe(p), "n0+n1 [0,2) -> n2+n3 [2,4)");
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[1].ranks, (std::vector<std::string>{"n3"}));
  EXPECT_TRUE(cluster::plan_uses(p, "n3"));
  EXPECT_FALSE(cluster::plan_uses(p, "n4"));
  // Three nodes left after a loss: one group, the whole model.
  EXPECT_EQ(cluster::describe(fixed_slots(4, 2, {"n0", "n1", "n2"}, "n0", 2)), "n0+n1 [0,4)");
  EXPECT_EQ(cluster::describe(fixed_slots(4, 1, nodes, "n0", 3)), "n0+n1+n2 [0,4)");
  EXPECT_TRUE(fixed_slots(4, 1, {"n0"}, "n0", 2).empty());
}

TEST(FixedSlots, EvenSplitCoversEveryLayerOnce) {
  for (int layers = 1; layers <= 40; ++layers)
    for (int parts = 1; parts <= 12; ++parts) {
      const auto r = placement::even_split(layers, parts);
      ASSERT_EQ(static_cast<int>(r.size()), std::min(layers, parts));
      int next = 0, smallest = layers, largest = 0;
      for (const auto& [first, last] : r) {
        EXPECT_EQ(first, next);
        smallest = std::min(smallest, last - first);
        largest = std::max(largest, last - first);
        next = last;
      }
      EXPECT_EQ(next, layers);
      EXPECT_LE(largest - smallest, 1) << layers << " layers in " << parts;
    }
  EXPECT_TRUE(placement::even_split(0, 3).empty());
  EXPECT_TRUE(placement::even_split(5, 0).empty());
}

}  // namespace
