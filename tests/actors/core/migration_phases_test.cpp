// The live migration's phase machine: the path the migration takes (with
// and without the verify step), every other step refused with the phase
// left as it was, failure from every phase that has not ended, nothing
// after the end, and the progress the status shows along the way.

#include "actors/core/migration_phases.hpp"

#include <gtest/gtest.h>

#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

using troupe::actors::core::error_code;
using troupe::actors::core::migration_phase;
using troupe::actors::core::migration_phases;
using enum troupe::actors::core::migration_phase;

const std::vector<migration_phase> all_phases = {loading,   kv_rounds, paused, switching,
                                                 verifying, dropping,  done,   failed};

// The steps the migration may take, written out by hand (not from the
// machine): failure from every phase that has not ended comes on top.
const std::set<std::pair<migration_phase, migration_phase>> allowed = {
    {loading, kv_rounds}, {kv_rounds, kv_rounds}, {kv_rounds, paused},   {paused, verifying},
    {paused, switching},  {verifying, switching}, {switching, dropping}, {dropping, done},
};

bool expected_legal(migration_phase from, migration_phase to) {
  if (from == done || from == failed) return false;
  return to == failed || allowed.count({from, to}) > 0;
}

// A machine brought to `p` by legal steps.
migration_phases at(migration_phase p) {
  std::vector<migration_phase> path;
  switch (p) {
    case loading:
      break;
    case kv_rounds:
      path = {kv_rounds};
      break;
    case paused:
      path = {kv_rounds, paused};
      break;
    case verifying:
      path = {kv_rounds, paused, verifying};
      break;
    case switching:
      path = {kv_rounds, paused, switching};
      break;
    case dropping:
      path = {kv_rounds, paused, switching, dropping};
      break;
    case done:
      path = {kv_rounds, paused, switching, dropping, done};
      break;
    case failed:
      path = {failed};
      break;
  }
  migration_phases m;
  for (auto to : path) {
    auto r = m.advance(to);
    EXPECT_TRUE(r.has_value()) << "to " << to_string(to) << ": " << r.error().message;
  }
  EXPECT_EQ(m.current(), p);
  return m;
}

TEST(migration_phases, starts_loading) {
  migration_phases m;
  EXPECT_EQ(m.current(), loading);
  EXPECT_EQ(m.kv_rounds(), 0);
  EXPECT_FALSE(m.finished());
  EXPECT_DOUBLE_EQ(m.progress(), 0.05);
}

TEST(migration_phases, the_legal_path_with_its_progress) {
  migration_phases m;
  ASSERT_TRUE(m.advance(kv_rounds));
  EXPECT_EQ(m.kv_rounds(), 1);
  EXPECT_DOUBLE_EQ(m.progress(), 0.3);
  ASSERT_TRUE(m.advance(kv_rounds));
  EXPECT_EQ(m.kv_rounds(), 2);
  EXPECT_DOUBLE_EQ(m.progress(), 0.45);
  ASSERT_TRUE(m.advance(kv_rounds));
  ASSERT_TRUE(m.advance(kv_rounds));
  ASSERT_TRUE(m.advance(kv_rounds));
  EXPECT_EQ(m.kv_rounds(), 5);
  EXPECT_DOUBLE_EQ(m.progress(), 0.8);  // at most 0.8 while copying
  ASSERT_TRUE(m.advance(paused));
  EXPECT_DOUBLE_EQ(m.progress(), 0.9);
  ASSERT_TRUE(m.advance(switching));
  EXPECT_DOUBLE_EQ(m.progress(), 0.9);
  ASSERT_TRUE(m.advance(dropping));
  EXPECT_DOUBLE_EQ(m.progress(), 0.9);
  EXPECT_FALSE(m.finished());
  ASSERT_TRUE(m.advance(done));
  EXPECT_EQ(m.current(), done);
  EXPECT_TRUE(m.finished());
  EXPECT_DOUBLE_EQ(m.progress(), 1.0);
  EXPECT_EQ(m.kv_rounds(), 5);
}

TEST(migration_phases, the_verify_step_comes_between_the_pause_and_the_switch) {
  migration_phases m;
  for (auto to : {kv_rounds, paused, verifying, switching, dropping, done}) {
    auto r = m.advance(to);
    ASSERT_TRUE(r.has_value()) << to_string(to) << ": " << r.error().message;
    EXPECT_EQ(m.current(), to);
  }
  EXPECT_EQ(m.kv_rounds(), 1);
}

TEST(migration_phases, every_illegal_step_is_refused_and_changes_nothing) {
  int refused = 0;
  for (auto from : all_phases)
    for (auto to : all_phases) {
      EXPECT_EQ(migration_phases::legal(from, to), expected_legal(from, to))
          << to_string(from) << " -> " << to_string(to);
      if (expected_legal(from, to)) continue;
      auto m = at(from);
      const auto rounds = m.kv_rounds();
      const auto progress = m.progress();
      auto r = m.advance(to);
      ASSERT_FALSE(r.has_value()) << to_string(from) << " -> " << to_string(to);
      EXPECT_EQ(r.error().code, error_code::internal);
      EXPECT_NE(r.error().message.find(std::string(to_string(from)) + " to " + to_string(to)),
                std::string::npos)
          << r.error().message;
      EXPECT_EQ(m.current(), from);
      EXPECT_EQ(m.kv_rounds(), rounds);
      EXPECT_DOUBLE_EQ(m.progress(), progress);
      ++refused;
    }
  // 64 pairs: 8 legal steps and 6 failures are allowed, everything else not.
  EXPECT_EQ(refused, 64 - 8 - 6);
}

TEST(migration_phases, every_live_phase_may_fail) {
  for (auto from : {loading, kv_rounds, paused, verifying, switching, dropping}) {
    auto m = at(from);
    ASSERT_TRUE(m.advance(failed)) << to_string(from);
    EXPECT_EQ(m.current(), failed);
    EXPECT_TRUE(m.finished());
    EXPECT_DOUBLE_EQ(m.progress(), 0.0);
  }
}

TEST(migration_phases, nothing_follows_the_end) {
  for (auto end : {done, failed}) {
    auto m = at(end);
    for (auto to : all_phases) {
      EXPECT_FALSE(m.advance(to)) << to_string(end) << " -> " << to_string(to);
      EXPECT_EQ(m.current(), end);
    }
  }
}

TEST(migration_phases, names) {
  const std::vector<std::string> names = {"loading",   "kv_rounds", "paused", "switching",
                                          "verifying", "dropping",  "done",   "failed"};
  for (std::size_t i = 0; i < all_phases.size(); ++i) EXPECT_EQ(to_string(all_phases[i]), names[i]);
}

}  // namespace
