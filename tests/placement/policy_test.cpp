// The offload policy with simulated time: no flapping under an oscillating
// load, a move for a lasting improvement, none under the gain threshold,
// offload under memory pressure, the cooldown and what overrides it.
#include "placement/policy.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <map>

#include "synthetic.hpp"

namespace {

using namespace troupe::placement;
using namespace troupe::placement::testing;
using namespace std::chrono_literals;

cluster_profile three_gpus() {
  cluster_profile c;
  for (int i = 0; i < 3; ++i)
    c.devices.push_back(device("n:gpu" + std::to_string(i), "n", 1000, 100, 24));
  return c;
}

bool mentions(const std::vector<move>& moves, const std::string& id) {
  for (const auto& m : moves)
    for (const auto& d : m.to)
      if (d == id) return true;
  return false;
}

struct oscillation_result {
  int decisions_with_moves = 0;
  int layer_moves = 0;
  duration shortest_gap = duration::max();
};

/// gpu1's load alternates 0.1 / 0.8 every 10 s for 10 simulated minutes;
/// the policy is asked every 5 s and its moves are carried out.
oscillation_result oscillate(const policy_options& opt) {
  auto c = three_gpus();
  const auto m = llama7b();
  const workload w;
  auto current = *make_plan(c, m, w);
  policy_state state;
  const time_point t0{};
  std::map<int, time_point> last_move;
  oscillation_result r;
  for (int t = 0; t <= 600; t += 5) {
    c.devices[1].load = (t / 10) % 2 == 0 ? 0.1 : 0.8;
    const auto now = t0 + std::chrono::seconds(t);
    auto d = decide(state, current, c, m, w, now, opt);
    EXPECT_TRUE(d) << d.error();
    if (!d || d->moves.empty()) continue;
    ++r.decisions_with_moves;
    for (const auto& mv : d->moves) {
      commit(state, mv, now);
      for (int l = mv.layer_begin; l < mv.layer_end; ++l) {
        ++r.layer_moves;
        if (auto it = last_move.find(l); it != last_move.end())
          r.shortest_gap = std::min(r.shortest_gap, now - it->second);
        last_move[l] = now;
      }
    }
    current = d->target;
  }
  return r;
}

TEST(Policy, OscillatingLoadDoesNotFlap) {
  // Smoothed loads (the default): the policy sees the average, moves at
  // most once or twice, and never a layer twice within the cooldown.
  const policy_options opt;
  const auto smooth = oscillate(opt);
  std::printf("smoothed: %d decisions with moves, %d layer moves\n", smooth.decisions_with_moves,
              smooth.layer_moves);
  EXPECT_LE(smooth.decisions_with_moves, 2);
  EXPECT_GE(smooth.shortest_gap, opt.cooldown);
  // Raw loads: the load swings do trigger moves, but the cooldown alone keeps
  // every layer still for 60 s after it moved.
  policy_options raw = opt;
  raw.load_half_life = 0s;
  const auto r = oscillate(raw);
  std::printf("raw: %d decisions with moves, %d layer moves, shortest gap %.0f s\n",
              r.decisions_with_moves, r.layer_moves,
              std::chrono::duration<double>(r.shortest_gap).count());
  EXPECT_GT(r.decisions_with_moves, 0);
  EXPECT_GE(r.shortest_gap, opt.cooldown);
  EXPECT_LE(r.decisions_with_moves, 600 / 60 + 1);
}

TEST(Policy, FastDeviceJoiningProducesAMove) {
  cluster_profile c;
  c.devices = {device("n:gpu0", "n", 300, 30, 24), device("n:gpu1", "n", 300, 30, 24)};
  const auto m = llama7b();
  const workload w;
  const auto current = *make_plan(c, m, w);
  c.devices.push_back(device("n:gpu9", "n", 3000, 300, 24));
  policy_state state;
  const auto d = decide(state, current, c, m, w, time_point{} + 1h);
  ASSERT_TRUE(d) << d.error();
  ASSERT_FALSE(d->moves.empty()) << d->reason;
  EXPECT_TRUE(mentions(d->moves, "n:gpu9")) << d->reason;
  EXPECT_GE(d->gain, 0.15);
  const auto e = replan_gain(current, c, m, w);
  ASSERT_TRUE(e);
  EXPECT_NEAR(d->gain, e->gain, 1e-9);
  EXPECT_NE(d->reason.find("gain"), std::string::npos) << d->reason;
  for (const auto& mv : d->moves) {
    EXPECT_EQ(mv.gain, d->gain);
    EXPECT_FALSE(mv.describe().empty());
  }
  EXPECT_LT(d->target.step_s, d->current_step_s);
}

TEST(Policy, GainBelowThresholdMovesNothing) {
  cluster_profile c;
  for (int i = 0; i < 4; ++i)
    c.devices.push_back(device("n:gpu" + std::to_string(i), "n", 1000, 100, 24));
  const auto m = llama7b(64);
  const workload w;
  const auto current = *make_plan(c, m, w);
  c.devices[2].load = 0.08;
  const auto e = replan_gain(current, c, m, w);
  ASSERT_TRUE(e);
  ASSERT_GT(e->gain, 0);
  ASSERT_LT(e->gain, 0.15);
  policy_state state;
  auto d = decide(state, current, c, m, w, time_point{});
  ASSERT_TRUE(d) << d.error();
  EXPECT_TRUE(d->moves.empty());
  EXPECT_NE(d->reason.find("below the 15.0% threshold"), std::string::npos) << d->reason;
  // The same gain passes a lower threshold.
  policy_options low;
  low.gain_threshold = e->gain / 2;
  policy_state fresh;
  d = decide(fresh, current, c, m, w, time_point{}, low);
  ASSERT_TRUE(d);
  EXPECT_FALSE(d->moves.empty()) << d->reason;
}

TEST(Policy, MemoryPressureOffloadsWithinTheCooldownRules) {
  auto c = three_gpus();
  const auto m = llama7b();
  const workload w;
  const auto current = *make_plan(c, m, w);
  // Another process took memory on gpu0: the plan now needs 95% of it.
  const std::string victim = current.stages.front().devices.front();
  const double used = current.memory_bytes.at(victim);
  for (auto& d : c.devices)
    if (d.id == victim) d.memory_bytes = used / 0.95;
  policy_state state;
  const time_point t0{};
  auto d = decide(state, current, c, m, w, t0);
  ASSERT_TRUE(d) << d.error();
  ASSERT_FALSE(d->moves.empty()) << d->reason;
  EXPECT_LT(d->gain, 0.15);  // it moves for memory, not speed
  EXPECT_NE(d->reason.find("memory pressure: " + victim), std::string::npos) << d->reason;
  const auto after = evaluate(d->target, c, m, w);
  ASSERT_TRUE(after);
  EXPECT_LE(after->memory_bytes.at(victim), 0.9 * used / 0.95 * (1 + 1e-9));
  for (const auto& mv : d->moves) commit(state, mv, t0);
  auto moved = d->target;
  // 10 s later the device that took the layers is squeezed too: within the
  // cooldown, pressure alone does not move them again.
  const auto& first_move = d->moves.front();
  const std::string receiver = first_move.to.front();
  const double recv_used = after->memory_bytes.at(receiver);
  for (auto& dev : c.devices)
    if (dev.id == receiver) dev.memory_bytes = recv_used / 0.95;
  d = decide(state, moved, c, m, w, t0 + 10s);
  ASSERT_TRUE(d) << d.error();
  EXPECT_TRUE(d->moves.empty());
  EXPECT_NE(d->reason.find("cooldown"), std::string::npos) << d->reason;
  // Overflow overrides the cooldown.
  for (auto& dev : c.devices)
    if (dev.id == receiver) dev.memory_bytes = recv_used * 0.97;
  d = decide(state, moved, c, m, w, t0 + 20s);
  ASSERT_TRUE(d) << d.error();
  EXPECT_FALSE(d->moves.empty()) << d->reason;
  EXPECT_NE(d->reason.find("overflow: " + receiver), std::string::npos) << d->reason;
  EXPECT_NE(d->reason.find("overriding the cooldown"), std::string::npos) << d->reason;
}

TEST(Policy, CooldownDelaysASecondMove) {
  cluster_profile c;
  c.devices = {device("n:gpu0", "n", 300, 30, 24), device("n:gpu1", "n", 300, 30, 24)};
  const auto m = llama7b();
  const workload w;
  auto current = *make_plan(c, m, w);
  c.devices.push_back(device("n:gpu8", "n", 1500, 150, 24));
  policy_state state;
  const time_point t0{};
  auto d = decide(state, current, c, m, w, t0);
  ASSERT_TRUE(d && !d->moves.empty());
  for (const auto& mv : d->moves) commit(state, mv, t0);
  EXPECT_EQ(state.moves, static_cast<int>(d->moves.size()));
  current = d->target;
  // An even faster device joins 30 s later: worth it, but the layers just moved.
  c.devices.push_back(device("n:gpu9", "n", 6000, 600, 24));
  d = decide(state, current, c, m, w, t0 + 30s);
  ASSERT_TRUE(d);
  EXPECT_GE(d->gain, 0.15);
  EXPECT_TRUE(d->moves.empty());
  EXPECT_NE(d->reason.find("cooldown"), std::string::npos) << d->reason;
  // Once the cooldown has passed, it moves.
  d = decide(state, current, c, m, w, t0 + 61s);
  ASSERT_TRUE(d);
  EXPECT_FALSE(d->moves.empty()) << d->reason;
  EXPECT_TRUE(mentions(d->moves, "n:gpu9")) << d->reason;
}

TEST(Policy, GoneDeviceForcesAMove) {
  auto c = three_gpus();
  const auto m = llama7b();
  const workload w;
  const auto current = *make_plan(c, m, w);
  policy_state state;
  const time_point t0{};
  // Its layers moved a moment ago, so only the loss can justify moving them.
  for (int l = 0; l < m.layer_count(); ++l) {
    move mv;
    mv.layer_begin = l;
    mv.layer_end = l + 1;
    commit(state, mv, t0);
  }
  c.devices.erase(c.devices.begin() + 1);
  const auto d = decide(state, current, c, m, w, t0 + 1s);
  ASSERT_TRUE(d) << d.error();
  ASSERT_FALSE(d->moves.empty());
  EXPECT_NE(d->reason.find("n:gpu1 is gone"), std::string::npos) << d->reason;
  bool from_gone = false;
  for (const auto& mv : d->moves) {
    from_gone = from_gone || (!mv.from.empty() && mv.from.front() == "n:gpu1");
    for (const auto& id : mv.to) EXPECT_NE(id, "n:gpu1");
  }
  EXPECT_TRUE(from_gone);
}

TEST(Policy, LoadSmoothingFollowsALastingChange) {
  auto c = three_gpus();
  const auto m = llama7b();
  const workload w;
  const auto current = *make_plan(c, m, w);
  policy_state state;
  const time_point t0{};
  ASSERT_TRUE(decide(state, current, c, m, w, t0));
  c.devices[1].load = 0.8;
  // One half-life later the smoothed load is halfway there.
  auto d = decide(state, current, c, m, w, t0 + 30s);
  ASSERT_TRUE(d);
  EXPECT_NEAR(state.loads.at("n:gpu1").load, 0.4, 1e-9);
  // A lasting change is followed.
  d = decide(state, current, c, m, w, t0 + 300s);
  ASSERT_TRUE(d);
  EXPECT_NEAR(state.loads.at("n:gpu1").load, 0.8, 0.8 / 1000);
  EXPECT_FALSE(d->moves.empty()) << d->reason;
}

}  // namespace
