// The control plane's guard (actors/control_guard.hpp) without sockets:
// BASP framing followed across any split of the stream, lengths and the
// shared budget enforced before CAF would allocate, and the admission caps
// and deadline of unfinished handshakes.
#include "actors/control_guard.hpp"

#include <gtest/gtest.h>

#include <optional>
#include <random>
#include <vector>

using namespace troupe::actors;
using namespace std::chrono_literals;

namespace {

// A BASP header announcing `len` payload bytes, then the payload.
std::vector<std::uint8_t> message(std::uint32_t len, std::uint8_t op = 0x02) {
  std::vector<std::uint8_t> m(basp_header_bytes + len, 0xab);
  std::fill(m.begin(), m.begin() + basp_header_bytes, 0);
  m[0] = op;
  m[4] = static_cast<std::uint8_t>(len >> 24);
  m[5] = static_cast<std::uint8_t>(len >> 16);
  m[6] = static_cast<std::uint8_t>(len >> 8);
  m[7] = static_cast<std::uint8_t>(len);
  return m;
}

}  // namespace

TEST(BaspStreamGuard, FollowsMessagesHoweverTheStreamIsSplit) {
  std::vector<std::uint8_t> stream;
  for (std::uint32_t len : {0u, 5u, 4096u, 0u, 70000u, 1u}) {
    const auto m = message(len);
    stream.insert(stream.end(), m.begin(), m.end());
  }
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    std::atomic<std::uint64_t> budget{0};
    basp_stream_guard g(&budget);
    std::size_t at = 0;
    while (at < stream.size()) {
      const std::size_t n = std::min<std::size_t>(stream.size() - at, 1 + rng() % 100);
      ASSERT_FALSE(g.feed(std::span(stream).subspan(at, n)));
      at += n;
    }
    EXPECT_EQ(g.messages(), 6u);
    EXPECT_EQ(g.outstanding(), 0u);
    EXPECT_EQ(budget.load(), 0u);
  }
}

TEST(BaspStreamGuard, AHeaderAnnouncingTooMuchIsRefusedBeforeItsPayload) {
  std::atomic<std::uint64_t> budget{0};
  basp_stream_guard g(&budget);
  auto ok = message(10);
  EXPECT_FALSE(g.feed(ok));
  auto bomb = message(0);
  const std::uint32_t len = 0xF0000000u;  // the report's ~4 GiB
  bomb[4] = static_cast<std::uint8_t>(len >> 24);
  bomb[5] = static_cast<std::uint8_t>(len >> 16);
  bomb[6] = static_cast<std::uint8_t>(len >> 8);
  bomb[7] = static_cast<std::uint8_t>(len);
  // The first 31 bytes pass; the byte that completes the header fails.
  EXPECT_FALSE(g.feed(std::span(bomb).first(31)));
  auto why = g.feed(std::span(bomb).subspan(31, 1));
  ASSERT_TRUE(why);
  EXPECT_NE(why->find("4026531840"), std::string::npos) << *why;
  EXPECT_TRUE(g.feed(message(0))) << "a refused stream stays refused";
  EXPECT_EQ(budget.load(), 0u);
  // Exactly the limit is fine; one more is not.
  basp_stream_guard edge(nullptr, 1000);
  auto at = message(0);
  at[6] = 1000 >> 8;
  at[7] = 1000 & 255;
  EXPECT_FALSE(edge.feed(at));
  basp_stream_guard over(nullptr, 999);
  EXPECT_TRUE(over.feed(at));
}

TEST(BaspStreamGuard, ConnectionsShareOneBudgetOfAnnouncedBytes) {
  std::atomic<std::uint64_t> budget{0};
  const std::uint64_t limit = 1000;
  basp_stream_guard a(&budget, 800, limit), b(&budget, 800, limit);
  std::optional<basp_stream_guard> c;
  c.emplace(&budget, 800, limit);
  auto h = [](std::uint32_t len) {
    auto m = message(len);
    m.resize(basp_header_bytes);
    return m;
  };
  EXPECT_FALSE(a.feed(h(600)));
  EXPECT_EQ(budget.load(), 600u);
  auto why = b.feed(h(500));  // 1100 > 1000
  ASSERT_TRUE(why);
  EXPECT_EQ(budget.load(), 600u);
  // a delivers 300 of its 600: room for 400 more.
  EXPECT_FALSE(a.feed(std::vector<std::uint8_t>(300, 1)));
  EXPECT_EQ(budget.load(), 300u);
  EXPECT_FALSE(c->feed(h(700)));
  EXPECT_EQ(budget.load(), 1000u);
  {
    basp_stream_guard d(&budget, 800, limit);
    EXPECT_TRUE(d.feed(h(1)));
  }
  // A connection that goes away gives back what it still owed.
  c.reset();
  EXPECT_EQ(budget.load(), 300u);
}

TEST(ConnectionAdmission, CapsUnfinishedHandshakesPerAddressAndInAll) {
  connection_admission adm({.per_address = 3, .total = 5, .handshake_deadline = 10s});
  const auto t = connection_admission::clock::now();
  using v = connection_admission::verdict;
  EXPECT_EQ(adm.accepted(10, "10.0.0.1", t), v::admit);
  EXPECT_EQ(adm.accepted(11, "10.0.0.1", t), v::admit);
  EXPECT_EQ(adm.accepted(12, "10.0.0.1", t), v::admit);
  EXPECT_EQ(adm.accepted(13, "10.0.0.1", t), v::refuse_address);
  EXPECT_EQ(adm.accepted(20, "10.0.0.2", t), v::admit);
  EXPECT_EQ(adm.accepted(21, "10.0.0.2", t), v::admit);
  EXPECT_EQ(adm.accepted(30, "10.0.0.3", t), v::refuse_total);
  EXPECT_EQ(adm.pending(), 5u);
  // A finished handshake and a closed connection free their places.
  adm.authenticated(10);
  adm.closed(20);
  EXPECT_EQ(adm.pending_from("10.0.0.1"), 2u);
  EXPECT_EQ(adm.accepted(13, "10.0.0.1", t), v::admit);
  EXPECT_EQ(adm.accepted(30, "10.0.0.3", t), v::admit);
  EXPECT_EQ(adm.pending(), 5u);
  // Closing what was never counted changes nothing.
  adm.closed(99);
  adm.authenticated(98);
  EXPECT_EQ(adm.pending(), 5u);
}

TEST(ConnectionAdmission, NamesEachOverdueHandshakeOnce) {
  connection_admission adm({.per_address = 8, .total = 8, .handshake_deadline = 10s});
  const auto t = connection_admission::clock::now();
  adm.accepted(1, "a", t);
  adm.accepted(2, "a", t + 5s);
  adm.accepted(3, "b", t + 6s);
  adm.authenticated(3);
  EXPECT_TRUE(adm.overdue(t + 9s).empty());
  EXPECT_EQ(adm.overdue(t + 10s), std::vector<int>{1});
  EXPECT_TRUE(adm.overdue(t + 11s).empty()) << "named twice";
  EXPECT_EQ(adm.overdue(t + 16s), std::vector<int>{2});
  // Still counted until closed; a reused descriptor starts afresh.
  EXPECT_EQ(adm.pending(), 2u);
  adm.accepted(1, "c", t + 20s);
  EXPECT_EQ(adm.pending_from("a"), 1u);
  EXPECT_EQ(adm.pending_from("c"), 1u);
  EXPECT_TRUE(adm.overdue(t + 25s).empty());
}
