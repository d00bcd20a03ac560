// Ring all-reduce over real engines, one thread per rank: every rank ends
// with the exact sum (integer-valued floats are summed exactly in any
// order) and with bit-identical values for arbitrary floats.
#include "transport/collectives.hpp"

#include <gtest/gtest.h>

#include <future>
#include <random>
#include <thread>

#include "transport/inproc_engine.hpp"
#include "transport/ucx_engine.hpp"

namespace tr = troupe::transport;
using namespace std::chrono_literals;

namespace {

struct group {
  std::vector<std::unique_ptr<tr::transfer_engine>> engines;
  std::vector<tr::ring> rings;
};

group make_group(const std::string& kind, int n) {
  group g;
  for (int i = 0; i < n; ++i) {
    if (kind == "inproc") {
      g.engines.push_back(std::make_unique<tr::inproc_engine>(10000ms));
    } else {
      auto e = tr::ucx_engine::create();
      EXPECT_TRUE(e) << e.error().message;
      g.engines.push_back(std::move(*e));
    }
  }
  for (int i = 0; i < n; ++i) {
    tr::ring r;
    r.engine = g.engines[static_cast<std::size_t>(i)].get();
    r.rank = i;
    r.size = n;
    auto p = r.engine->connect(g.engines[static_cast<std::size_t>((i + 1) % n)]->address());
    EXPECT_TRUE(p) << p.error().message;
    r.next = *p;
    r.timeout = 10000ms;
    g.rings.push_back(r);
  }
  return g;
}

// Runs one all-reduce on every rank at once; the errors, "" for success.
std::vector<std::string> allreduce(group& g, std::vector<std::vector<float>>& data,
                                   std::uint64_t id) {
  std::vector<std::future<std::string>> fs;
  for (std::size_t i = 0; i < g.rings.size(); ++i) {
    fs.push_back(std::async(std::launch::async, [&, i] {
      auto r = tr::ring_allreduce_sum(g.rings[i], data[i].data(), data[i].size(), id);
      return r ? std::string() : r.error().message;
    }));
  }
  std::vector<std::string> out;
  for (auto& f : fs) out.push_back(f.get());
  return out;
}

class RingAllReduce : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(RingAllReduce, EveryRankGetsTheExactSum) {
  std::uint64_t id = 1;
  for (int n : {2, 3, 4}) {
    auto g = make_group(GetParam(), n);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{2}, std::size_t{7},
                              std::size_t{1000}, std::size_t{300001}}) {
      std::vector<std::vector<float>> data(static_cast<std::size_t>(n), std::vector<float>(count));
      std::vector<float> want(count, 0.f);
      std::mt19937 rng(static_cast<std::uint32_t>(count * 10 + static_cast<std::size_t>(n)));
      for (auto& d : data) {
        for (std::size_t i = 0; i < count; ++i) {
          d[i] = static_cast<float>(static_cast<int>(rng() % 2001) - 1000);
          want[i] += d[i];
        }
      }
      const auto errs = allreduce(g, data, id++);
      for (int r = 0; r < n; ++r) {
        ASSERT_EQ(errs[static_cast<std::size_t>(r)], "") << "rank " << r;
        EXPECT_EQ(data[static_cast<std::size_t>(r)], want)
            << n << " ranks, " << count << " values, rank " << r;
      }
    }
    for (auto& e : g.engines) EXPECT_EQ(e->live_ops(), 0u);
  }
}

TEST_P(RingAllReduce, ArbitraryFloatsAreBitIdenticalOnEveryRank) {
  auto g = make_group(GetParam(), 3);
  const std::size_t count = 4099;
  std::vector<std::vector<float>> data(3, std::vector<float>(count));
  std::vector<double> exact(count, 0.0);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 3.f);
  for (auto& d : data) {
    for (std::size_t i = 0; i < count; ++i) {
      d[i] = dist(rng);
      exact[i] += d[i];
    }
  }
  const auto errs = allreduce(g, data, 99);
  for (const auto& e : errs) ASSERT_EQ(e, "");
  EXPECT_EQ(data[0], data[1]);
  EXPECT_EQ(data[0], data[2]);
  for (std::size_t i = 0; i < count; ++i)
    EXPECT_NEAR(data[0][i], exact[i], 1e-5 * (1 + std::abs(exact[i])));
}

TEST_P(RingAllReduce, AMissingRankFailsWithinTheTimeout) {
  auto g = make_group(GetParam(), 3);
  for (auto& r : g.rings) r.timeout = 300ms;
  std::vector<std::vector<float>> data(3, std::vector<float>(100, 1.f));
  // Ranks 0 and 1 only: rank 2 never joins.
  std::vector<std::future<std::string>> fs;
  for (std::size_t i = 0; i < 2; ++i) {
    fs.push_back(std::async(std::launch::async, [&, i] {
      auto r = tr::ring_allreduce_sum(g.rings[i], data[i].data(), data[i].size(), 5);
      return r ? std::string() : r.error().message;
    }));
  }
  for (auto& f : fs) {
    const auto e = f.get();
    EXPECT_NE(e.find("all-reduce 5, rank "), std::string::npos) << e;
    EXPECT_NE(e.find("timed out"), std::string::npos) << e;
  }
  tr::ring bad = g.rings[0];
  bad.rank = 3;
  EXPECT_FALSE(tr::ring_allreduce_sum(bad, data[0].data(), 100, 6));
}

TEST_P(RingAllReduce, AnAbortEndsAWaitingRankLongBeforeItsTimeout) {
  auto g = make_group(GetParam(), 2);
  std::atomic<bool> abort{false};
  g.rings[0].abort = &abort;  // timeout stays 10 s
  std::vector<float> data(100, 1.f);
  const auto t0 = std::chrono::steady_clock::now();
  auto f = std::async(std::launch::async, [&] {
    auto r = tr::ring_allreduce_sum(g.rings[0], data.data(), data.size(), 7);
    return r ? std::string() : r.error().message;
  });
  // Rank 1 never joins; whoever learns it is gone sets the flag.
  std::this_thread::sleep_for(100ms);
  abort = true;
  const auto e = f.get();
  EXPECT_NE(e.find("aborted: a rank of the group is gone"), std::string::npos) << e;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5000ms);
  EXPECT_EQ(g.engines[0]->live_ops(), 0u);
}

// The counters: every call, byte and exchange; a rank that arrives late
// shows up as the other ranks' waiting, not as transfer.
TEST_P(RingAllReduce, CountsWhereTheTimeWent) {
  constexpr int n = 3;
  auto g = make_group(GetParam(), n);
  std::vector<tr::allreduce_stats> stats(n);
  for (int i = 0; i < n; ++i)
    g.rings[static_cast<std::size_t>(i)].stats = &stats[static_cast<std::size_t>(i)];
  const std::size_t count = 4096;
  std::vector<std::vector<float>> data(n, std::vector<float>(count, 1.0f));
  for (std::uint64_t id = 1; id <= 4; ++id) {
    for (auto& e : allreduce(g, data, id)) EXPECT_EQ(e, "");
    for (auto& d : data) std::fill(d.begin(), d.end(), 1.0f);
  }
  // Rank 2 arrives 200 ms late: ranks 0 and 1 wait for it (at whichever
  // step needs its data first).
  std::vector<std::future<std::string>> fs;
  for (std::size_t i = 0; i < n; ++i)
    fs.push_back(std::async(std::launch::async, [&, i] {
      if (i == 2) std::this_thread::sleep_for(200ms);
      auto r = tr::ring_allreduce_sum(g.rings[i], data[i].data(), count, 9);
      return r ? std::string() : r.error().message;
    }));
  for (auto& f : fs) EXPECT_EQ(f.get(), "");
  for (int i = 0; i < n; ++i) {
    const auto t = stats[static_cast<std::size_t>(i)].snapshot();
    EXPECT_EQ(t.calls, 5u);
    EXPECT_EQ(t.bytes, 5u * count * sizeof(float));
    EXPECT_EQ(t.exchanges, 5u * 2 * (n - 1));
    EXPECT_GE(t.total_ns, t.exchange_ns + t.reduce_ns);
    EXPECT_LE(t.paced_ns, t.exchange_ns);
    const auto b = tr::breakdown_of(t);
    EXPECT_EQ(b.calls, 5.0);
    EXPECT_NEAR(b.kib, count * sizeof(float) / 1024.0, 1e-9);
    if (i < 2) {
      // 200 ms over 5 calls: at least ~40 ms of waiting per call, and far
      // more than the transfers of 16 KiB.
      EXPECT_GT(b.waiting_us, 30000.0) << "rank " << i;
      EXPECT_LT(b.transfer_us, b.waiting_us) << "rank " << i;
    }
  }
  // Differences of snapshots are what a benchmark level reports.
  const auto d = stats[0].snapshot() - tr::allreduce_totals{};
  EXPECT_EQ(d.calls, 5u);
}

INSTANTIATE_TEST_SUITE_P(Engines, RingAllReduce, ::testing::Values("inproc", "ucx"));
