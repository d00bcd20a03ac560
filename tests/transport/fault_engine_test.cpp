// The fault-injecting engine over the in-process engine: each fault does
// what it says to the operation it picks and nothing else, and the
// chunked tensor transfer above it turns every fault into a clear error
// with nothing left behind.
#include "transport/fault_engine.hpp"

#include <gtest/gtest.h>

#include <future>
#include <numeric>

#include "transport/chunked.hpp"
#include "transport/inproc_engine.hpp"

namespace troupe::transport {
namespace {

using namespace std::chrono_literals;

struct faulty_pair {
  std::shared_ptr<fault_engine> a;
  std::unique_ptr<inproc_engine> b = std::make_unique<inproc_engine>(2000ms);
  peer_id a_to_b = 0;
  faulty_pair() : a(std::make_shared<fault_engine>(std::make_shared<inproc_engine>(2000ms))) {
    a_to_b = a->connect(b->address()).value();
    EXPECT_TRUE(b->connect(a->address()));
  }
  /// Sends `n` bytes of a pattern under `tag`; the receiver's result.
  std::pair<result<op_status>, result<op_status>> exchange(std::uint64_t tag, std::size_t n,
                                                           std::chrono::milliseconds t = 500ms) {
    std::vector<std::uint8_t> out(n), in(n, 0);
    std::iota(out.begin(), out.end(), std::uint8_t{1});
    auto recv = std::async(std::launch::async, [&] {
      return run_op(*b, op_spec{op_kind::recv, 0, tag, in.data(), in.size(), nullptr, 0, t});
    });
    auto sent = run_op(*a, op_spec{op_kind::send, a_to_b, tag, out.data(), n, nullptr, 0, t});
    auto got = recv.get();
    if (got && got->state == op_state::done && in != out && got->bytes == n)
      got = make_error(errc::corrupt_data, "the bytes changed on the way");
    return {sent, got};
  }
};

TEST(FaultEngine, AFailedSendFailsOnlyTheOperationItPicks) {
  faulty_pair p;
  p.a->inject({.kind = op_kind::send, .nth = 2, .what = fault_kind::fail});
  auto [s1, r1] = p.exchange(1, 64);
  EXPECT_TRUE(s1 && r1) << "the first send is not picked";
  auto [s2, r2] = p.exchange(2, 64, 200ms);
  ASSERT_FALSE(s2);
  EXPECT_NE(s2.error().message.find("injected fault"), std::string::npos) << s2.error().message;
  EXPECT_FALSE(r2) << "nothing arrived, the receive times out";
  auto [s3, r3] = p.exchange(3, 64);
  EXPECT_TRUE(s3 && r3) << "later sends go through";
  EXPECT_EQ(p.a->injected(), 1u);
  EXPECT_EQ(p.a->live_ops(), 0u);
  EXPECT_EQ(p.b->live_ops(), 0u);
}

TEST(FaultEngine, ADroppedSendTimesOutOnBothSides) {
  faulty_pair p;
  p.a->inject({.kind = op_kind::send, .nth = 0, .what = fault_kind::drop});
  const auto t0 = std::chrono::steady_clock::now();
  auto [s, r] = p.exchange(5, 64, 150ms);
  ASSERT_FALSE(s);
  EXPECT_NE(s.error().message.find("dropped"), std::string::npos) << s.error().message;
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 150ms);
  EXPECT_FALSE(r);
  EXPECT_EQ(p.a->live_ops(), 0u);
}

TEST(FaultEngine, ADelayedSendArrivesIntactAfterTheDelay) {
  faulty_pair p;
  p.a->inject({.kind = op_kind::send, .nth = 1, .what = fault_kind::delay, .delay = 120ms});
  const auto t0 = std::chrono::steady_clock::now();
  auto [s, r] = p.exchange(6, 4096, 2000ms);
  EXPECT_TRUE(s) << (s ? "" : s.error().message);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_EQ(r->bytes, 4096u);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 120ms);
}

TEST(FaultEngine, ATruncatedChunkIsRefusedByTheTensorReceiver) {
  faulty_pair p;
  tensor_header h;
  h.transfer_id = 77;
  h.type = kernels::dtype::f32;
  h.shape = {64, 256};  // 64 KiB: 4 chunks of 16 KiB
  std::vector<float> src(64 * 256);
  std::iota(src.begin(), src.end(), 0.5f);
  chunk_options opt;
  opt.chunk_bytes = 16 * 1024;
  opt.window = 2;
  opt.timeout = 500ms;
  // The header goes first; cut the second data chunk to 100 bytes.
  p.a->inject({.kind = op_kind::send, .nth = 3, .what = fault_kind::truncate, .bytes = 100});
  auto sender = std::async(std::launch::async,
                           [&] { return send_tensor(*p.a, p.a_to_b, h, src.data(), opt); });
  std::vector<float> dst(src.size());
  auto got = receive_tensor(*p.b, h, dst.data(), dst.size() * sizeof(float), opt);
  ASSERT_FALSE(got) << "a short chunk was taken as the tensor";
  EXPECT_FALSE(got.error().message.empty());
  std::printf("[ fault ] receiver: %s\n", got.error().message.c_str());
  (void)sender.get();
  EXPECT_EQ(p.a->injected(), 1u);
  EXPECT_EQ(p.b->live_ops(), 0u);
  EXPECT_EQ(p.a->live_ops(), 0u);
}

TEST(FaultEngine, RulesFromTextAndTheirRefusals) {
  auto r = parse_fault_rules("send:1:fail:min=65536,put:0:delay:25,send:3:truncate:100");
  ASSERT_TRUE(r) << r.error().message;
  ASSERT_EQ(r->size(), 3u);
  EXPECT_EQ((*r)[0].kind, op_kind::send);
  EXPECT_EQ((*r)[0].min_bytes, 65536u);
  EXPECT_EQ((*r)[0].what, fault_kind::fail);
  EXPECT_EQ((*r)[1].kind, op_kind::put);
  EXPECT_EQ((*r)[1].nth, 0u);
  EXPECT_EQ((*r)[1].delay, 25ms);
  EXPECT_EQ((*r)[2].bytes, 100u);
  EXPECT_TRUE(parse_fault_rules("")->empty());
  for (const char* bad :
       {"send", "send:1", "poke:1:fail", "send:x:fail", "send:1:melt", "send:1:delay",
        "send:1:fail:5", "send:1:fail:min=x", "send:1:truncate:9:min=1:7", "send:-1:fail"}) {
    auto e = parse_fault_rules(bad);
    ASSERT_FALSE(e) << bad;
    EXPECT_NE(e.error().message.find("fault rule"), std::string::npos) << e.error().message;
  }
}

TEST(FaultEngine, AMinimumSizePicksOnlyLargeOperations) {
  faulty_pair p;
  p.a->inject({.kind = op_kind::send, .min_bytes = 1024, .nth = 1, .what = fault_kind::fail});
  auto [s1, r1] = p.exchange(1, 64);
  EXPECT_TRUE(s1 && r1) << "small: not picked, not counted";
  auto [s2, r2] = p.exchange(2, 4096, 200ms);
  EXPECT_FALSE(s2) << "the first large one fails";
  auto [s3, r3] = p.exchange(3, 4096);
  EXPECT_TRUE(s3 && r3);
  EXPECT_EQ(p.a->injected(), 1u);
}

}  // namespace
}  // namespace troupe::transport
