// Bad input gives an error naming what is wrong, never a crash (this file
// also runs under ASan + UBSan).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "placement/policy.hpp"
#include "synthetic.hpp"

namespace {

using namespace troupe::placement;
using namespace troupe::placement::testing;

cluster_profile two_nodes() {
  cluster_profile c;
  c.devices = {device("a:gpu0", "a", 1000, 100, 24), device("b:gpu0", "b", 1000, 100, 24)};
  c.links = {link("a", "b", 10, 1e-5)};
  return c;
}

/// make_plan fails and its error contains `what`.
void expect_error(const cluster_profile& c, const model_profile& m, const workload& w,
                  const planner_options& opt, const std::string& what) {
  const auto p = make_plan(c, m, w, opt);
  ASSERT_FALSE(p) << "expected an error about '" << what << "'";
  EXPECT_NE(p.error().find(what), std::string::npos) << p.error();
}

void expect_cluster_error(const cluster_profile& c, const std::string& what) {
  expect_error(c, small_llama(), workload{}, planner_options{}, what);
}

TEST(PlannerValidation, Cluster) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  ASSERT_TRUE(make_plan(two_nodes(), small_llama(), workload{}));
  expect_cluster_error(cluster_profile{}, "no devices");
  auto c = two_nodes();
  c.devices[0].gemv_bytes_per_s[index(precision::q8_0)] = -1;
  expect_cluster_error(c, "a:gpu0: GEMV bandwidth at q8_0 must be > 0");
  c = two_nodes();
  c.devices[1].gemv_bytes_per_s = uniform(0);
  expect_cluster_error(c, "b:gpu0: GEMV bandwidth");
  c = two_nodes();
  c.devices[0].gemm_flop_per_s = nan;
  expect_cluster_error(c, "GEMM rate");
  c = two_nodes();
  c.devices[0].memory_bytes = 0;
  expect_cluster_error(c, "a:gpu0: memory must be > 0");
  c = two_nodes();
  c.devices[0].load = 1.5;
  expect_cluster_error(c, "load must be in [0, 1]");
  c.devices[0].load = nan;
  expect_cluster_error(c, "load must be in [0, 1]");
  c = two_nodes();
  c.devices[1].id = "a:gpu0";
  expect_cluster_error(c, "'a:gpu0' appears twice");
  c = two_nodes();
  c.devices[1].id = "";
  expect_cluster_error(c, "empty id");
  c = two_nodes();
  c.devices[1].node = "";
  expect_cluster_error(c, "has no node");
  c = two_nodes();
  c.links.push_back(link("a", "z", 10, 1e-5));
  expect_cluster_error(c, "link a - z names a node that holds no device");
  c = two_nodes();
  c.links.push_back(link("b", "a", 10, 1e-5));
  expect_cluster_error(c, "is given twice");
  c = two_nodes();
  c.links[0].bandwidth_bytes_per_s = -5;
  expect_cluster_error(c, "link a - b: bandwidth must be > 0");
  c = two_nodes();
  c.links[0].latency_s = -1;
  expect_cluster_error(c, "latency must be >= 0");
  c = two_nodes();
  c.links.clear();
  expect_cluster_error(c, "no link between nodes a and b");
  c.default_remote_link = link("", "", 1, 1e-4);
  EXPECT_TRUE(make_plan(c, small_llama(), workload{}));
  c.local_link.bandwidth_bytes_per_s = 0;
  expect_cluster_error(c, "default local link");
  // Every device fully busy: nothing can take a stage.
  c = two_nodes();
  for (auto& d : c.devices) d.load = 1;
  expect_cluster_error(c, "fully loaded");
}

TEST(PlannerValidation, ModelWorkloadOptions) {
  const auto c = two_nodes();
  model_profile empty;
  empty.hidden = 16;
  expect_error(c, empty, workload{}, {}, "no decoder layers");
  auto m = small_llama();
  m.layers[3].params = 0;
  expect_error(c, m, workload{}, {}, "layer 3: params must be > 0");
  m = small_llama();
  m.layers[2].kv_bytes_per_token = -1;
  expect_error(c, m, workload{}, {}, "layer 2: KV bytes");
  m = small_llama();
  m.hidden = 0;
  expect_error(c, m, workload{}, {}, "hidden size");
  workload w;
  w.batch = 0;
  expect_error(c, small_llama(), w, {}, "batch must be >= 1");
  w = {};
  w.context_tokens = -3;
  expect_error(c, small_llama(), w, {}, "context tokens");
  w = {};
  w.images_per_step = std::numeric_limits<double>::infinity();
  expect_error(c, small_llama(), w, {}, "images per step");
  planner_options opt;
  opt.preferred = precision::q8_0;
  opt.min_precision = precision::f16;
  expect_error(c, small_llama(), workload{}, opt,
               "min_precision f16 is more precise than preferred q8_0");
  opt = {};
  opt.memory_fraction = 0;
  expect_error(c, small_llama(), workload{}, opt, "memory_fraction");
  opt.memory_fraction = 1.5;
  expect_error(c, small_llama(), workload{}, opt, "memory_fraction");
  opt = {};
  opt.max_tensor_parallel = 0;
  expect_error(c, small_llama(), workload{}, opt, "max_tensor_parallel");
  opt = {};
  opt.step_time_slack = -0.1;
  expect_error(c, small_llama(), workload{}, opt, "step_time_slack");
}

TEST(PlannerValidation, EvaluateAndExhaustive) {
  const auto c = two_nodes();
  const auto m = small_llama();
  const workload w;
  const auto p = make_plan(c, m, w);
  ASSERT_TRUE(p) << p.error();
  auto bad = *p;
  bad.stages.back().layer_end -= 1;
  bad.stages.back().layer_precision.pop_back();
  auto e = evaluate(bad, c, m, w);
  ASSERT_FALSE(e);
  EXPECT_NE(e.error().find("covers layers"), std::string::npos) << e.error();
  bad = *p;
  bad.stages.front().devices = {"nowhere:gpu"};
  e = evaluate(bad, c, m, w);
  ASSERT_FALSE(e);
  EXPECT_NE(e.error().find("nowhere:gpu is not in the cluster"), std::string::npos) << e.error();
  bad = *p;
  bad.stages.front().layer_precision.push_back(precision::f16);
  e = evaluate(bad, c, m, w);
  ASSERT_FALSE(e);
  EXPECT_NE(e.error().find("precisions for"), std::string::npos) << e.error();
  bad = *p;
  bad.stages.clear();
  EXPECT_FALSE(evaluate(bad, c, m, w));
  bad = *p;
  bad.stages.front().devices.clear();
  EXPECT_FALSE(evaluate(bad, c, m, w));
  // Brute force refuses large inputs instead of running for hours.
  cluster_profile big;
  for (int i = 0; i < 7; ++i)
    big.devices.push_back(device("n:gpu" + std::to_string(i), "n", 1000, 100, 24));
  const auto x = exhaustive_plan(big, m, w);
  ASSERT_FALSE(x);
  EXPECT_NE(x.error().find("at most 6 devices"), std::string::npos) << x.error();
}

TEST(PlannerValidation, Policy) {
  const auto c = two_nodes();
  const auto m = small_llama();
  const workload w;
  const auto p = make_plan(c, m, w);
  ASSERT_TRUE(p);
  policy_state state;
  policy_options opt;
  opt.gain_threshold = -1;
  auto d = decide(state, *p, c, m, w, time_point{}, opt);
  ASSERT_FALSE(d);
  EXPECT_NE(d.error().find("gain_threshold"), std::string::npos) << d.error();
  opt = {};
  opt.memory_pressure = 0;
  d = decide(state, *p, c, m, w, time_point{}, opt);
  ASSERT_FALSE(d);
  EXPECT_NE(d.error().find("memory_pressure"), std::string::npos) << d.error();
  opt = {};
  opt.cooldown = -std::chrono::seconds(1);
  EXPECT_FALSE(decide(state, *p, c, m, w, time_point{}, opt));
  // A plan for another model.
  d = decide(state, *p, c, small_llama(12), w, time_point{});
  ASSERT_FALSE(d);
  EXPECT_NE(d.error().find("cannot be re-costed"), std::string::npos) << d.error();
  // Time going backwards is harmless.
  EXPECT_TRUE(decide(state, *p, c, m, w, time_point{} + std::chrono::seconds(10)));
  EXPECT_TRUE(decide(state, *p, c, m, w, time_point{}));
  // Everything gone: must move, cannot.
  cluster_profile other;
  other.devices = {device("z:cpu", "z", 1, 1, 0.3)};
  d = decide(state, *p, other, m, w, time_point{});
  ASSERT_FALSE(d);
  EXPECT_NE(d.error().find("no plan fits"), std::string::npos) << d.error();
  // A move with an empty range commits nothing but is counted.
  move none;
  commit(state, none, time_point{});
  EXPECT_EQ(state.moves, 1);
  EXPECT_TRUE(state.layer_moved.empty());
}

}  // namespace
