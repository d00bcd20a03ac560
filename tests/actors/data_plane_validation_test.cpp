// The actors' data plane between two "processes" (two data planes, each
// with its own engine; the in-process engine stands in for UCX, the
// contract is the same): a pushed tensor is taken on the other side
// intact, local refs stay local, and refs from a peer that describe
// impossible tensors or never arrive fail with a clear error.
#include "actors/data_plane.hpp"

#include <gtest/gtest.h>

#include <numeric>
#include <thread>

#include "actors/tensor_registry.hpp"
#include "transport/fault_engine.hpp"
#include "transport/inproc_engine.hpp"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;

struct two_processes : ::testing::Test {
  std::shared_ptr<kernels::memory_pool> pool = kernels::memory_pool::create();
  data_plane a, b;
  void SetUp() override {
    auto opt = data_plane::activation_chunks();
    opt.chunk_bytes = 4096;  // several chunks
    opt.timeout = 300ms;
    a.attach(std::make_shared<transport::inproc_engine>(300ms), opt);
    b.attach(std::make_shared<transport::inproc_engine>(300ms), opt);
    ASSERT_TRUE(a.connect("b", b.address()));
    ASSERT_TRUE(b.connect("a", a.address()));
  }
  kernels::tensor counting(std::int64_t rows, std::int64_t cols) {
    auto t = kernels::tensor::empty(*pool, kernels::dtype::f32, {rows, cols});
    EXPECT_TRUE(t);
    std::iota(t->data_as<float>(), t->data_as<float>() + rows * cols, 0.25f);
    return *t;
  }
};

TEST_F(two_processes, PushedTensorsArriveIntact) {
  for (int i = 0; i < 3; ++i) {
    auto ref = a.push("b", "cpu:0", counting(7 + i, 300));
    ASSERT_TRUE(ref) << ref.error().message;
    EXPECT_EQ(ref->shape, (std::vector<std::int64_t>{7 + i, 300}));
    auto got = b.take(*ref, *pool);
    ASSERT_TRUE(got) << got.error().message;
    const auto want = counting(7 + i, 300);
    ASSERT_EQ(got->numel(), want.numel());
    EXPECT_TRUE(std::equal(want.data_as<float>(), want.data_as<float>() + want.numel(),
                           got->data_as<float>()));
  }
  for (int k = 0; k < 100 && a.pushes_in_flight() > 0; ++k) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(a.pushes_in_flight(), 0u);
  EXPECT_EQ(a.failed_pushes(), 0u);
}

TEST_F(two_processes, RefsFromDifferentProcessesNeverCollide) {
  auto ra = a.push("b", "cpu", counting(1, 8));
  auto rb = b.push("a", "cpu", counting(1, 8));
  ASSERT_TRUE(ra && rb);
  // Each plane numbers its own transfers; the prefixes keep them apart
  // (this can fail only if both drew the same 15-bit prefix: 1 in 32768).
  EXPECT_NE(ra->transfer_id >> 32, rb->transfer_id >> 32);
  EXPECT_TRUE(b.take(*ra, *pool));
  EXPECT_TRUE(a.take(*rb, *pool));
}

TEST_F(two_processes, LocalRefsStayInTheRegistry) {
  auto ref = a.park("cpu", counting(2, 4));
  auto got = a.take(ref, *pool);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(got->numel(), 8);
  EXPECT_EQ(tensor_registry::local().pending(), 0u);
}

TEST_F(two_processes, BadRefsFailWithAClearError) {
  tensor_ref r{"cpu", static_cast<std::uint8_t>(kernels::dtype::f32), {4, 4}, 0x7777'0000'0001ull};
  auto never = b.take(r, *pool);  // nobody pushed it
  ASSERT_FALSE(never);
  EXPECT_NE(never.error().message.find("timed out"), std::string::npos) << never.error().message;

  r.shape = {4, -4};
  auto neg = b.take(r, *pool);
  ASSERT_FALSE(neg);
  EXPECT_NE(neg.error().message.find("impossible tensor"), std::string::npos)
      << neg.error().message;

  r.shape = {1ll << 20, 1ll << 20};
  auto huge = b.take(r, *pool);
  ASSERT_FALSE(huge);
  EXPECT_NE(huge.error().message.find("over the limit"), std::string::npos) << huge.error().message;

  r.shape = {4, 4};
  r.dtype = 200;
  EXPECT_FALSE(b.take(r, *pool));
  r.dtype = 0;
  r.shape = {};
  EXPECT_FALSE(b.take(r, *pool));
  r.shape = {1, 1, 1, 1, 1};
  EXPECT_FALSE(b.take(r, *pool));

  // A push to a process nobody connected.
  auto nobody = a.push("c", "cpu", counting(1, 1));
  ASSERT_FALSE(nobody);
  EXPECT_NE(nobody.error().message.find("not connected"), std::string::npos);
}

TEST_F(two_processes, AShapeMismatchBetweenRefAndTransferIsRefused) {
  auto ref = a.push("b", "cpu", counting(3, 5));
  ASSERT_TRUE(ref);
  auto lie = *ref;
  lie.shape = {5, 3};  // same bytes, another shape
  auto got = b.take(lie, *pool);
  ASSERT_FALSE(got);
  EXPECT_NE(got.error().message.find("shape [3,5], expected [5,3]"), std::string::npos)
      << got.error().message;
}

// The same two processes with faults on a's engine (transport/fault_engine):
// a push whose transfer fails or is cut short is counted as failed, and
// the receiver gets a clear error, never a wrong tensor; the next push is
// not affected.
TEST(DataPlaneFaults, AFailedOrTruncatedPushFailsCleanlyAndTheNextOneArrives) {
  using transport::fault_kind;
  using transport::op_kind;
  auto pool = kernels::memory_pool::create();
  data_plane a, b;
  auto opt = data_plane::activation_chunks();
  opt.chunk_bytes = 4096;
  opt.timeout = 300ms;
  auto faults = std::make_shared<transport::fault_engine>(
      std::make_shared<transport::inproc_engine>(300ms), 300ms);
  a.attach(faults, opt);
  b.attach(std::make_shared<transport::inproc_engine>(300ms), opt);
  ASSERT_TRUE(a.connect("b", b.address()));
  ASSERT_TRUE(b.connect("a", a.address()));
  auto tensor = [&](float first) {
    auto t = kernels::tensor::empty(*pool, kernels::dtype::f32, {8, 300});
    EXPECT_TRUE(t);
    std::iota(t->data_as<float>(), t->data_as<float>() + 2400, first);
    return *t;
  };
  // Push 1: its header send fails, so the push is refused at once. Push 2:
  // its first data chunk is cut; the receiver refuses what arrives.
  faults->inject({.kind = op_kind::send, .nth = 1, .what = fault_kind::fail});
  faults->inject({.kind = op_kind::send, .nth = 3, .what = fault_kind::truncate, .bytes = 10});
  auto refused = a.push("b", "cpu", tensor(1.f));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("injected fault"), std::string::npos)
      << refused.error().message;
  auto cut = a.push("b", "cpu", tensor(1.f));
  ASSERT_TRUE(cut) << "the push starts; its transfer fails later";
  auto got_cut = b.take(*cut, *pool);
  ASSERT_FALSE(got_cut) << "a cut transfer was taken as the tensor";
  EXPECT_NE(got_cut.error().message.find("has 10 bytes"), std::string::npos)
      << got_cut.error().message;
  for (int k = 0; k < 200 && a.pushes_in_flight() > 0; ++k) std::this_thread::sleep_for(5ms);
  EXPECT_EQ(a.pushes_in_flight(), 0u);
  EXPECT_EQ(faults->injected(), 2u);
  auto ok = a.push("b", "cpu", tensor(7.f));
  ASSERT_TRUE(ok);
  auto got = b.take(*ok, *pool);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(got->data_as<float>()[2399], 7.f + 2399);
}

}  // namespace
}  // namespace troupe::actors

namespace troupe::actors {
namespace {

// A peer process that is gone (lost, or restarted under a new identity) is
// forgotten: its endpoint closes, pushes to it fail cleanly, and a new
// connect (the node back) works. Without it, every restart of a peer left
// an open endpoint (with UCX's buffers and shared-memory mappings) behind.
TEST_F(two_processes, AForgottenPeerIsClosedAndCanBeConnectedAgain) {
  EXPECT_EQ(a.peers(), 1u);
  a.forget("b");
  a.forget("b");       // twice: nothing more
  a.forget("nobody");  // unknown: nothing
  EXPECT_EQ(a.peers(), 0u);
  EXPECT_FALSE(a.reachable("b"));
  auto refused = a.push("b", "cpu:0", counting(2, 8));
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message.find("not connected"), std::string::npos)
      << refused.error().message;
  ASSERT_TRUE(a.connect("b", b.address()));
  auto ref = a.push("b", "cpu:0", counting(2, 8));
  ASSERT_TRUE(ref) << ref.error().message;
  auto got = b.take(*ref, *pool);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(got->data_as<float>()[15], counting(2, 8).data_as<float>()[15]);
}

}  // namespace
}  // namespace troupe::actors
