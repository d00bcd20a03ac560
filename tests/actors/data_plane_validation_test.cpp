// The actors' data plane between two "processes" (two data planes, each
// with its own engine; the in-process engine stands in for UCX, the
// contract is the same): a pushed tensor is taken on the other side
// intact, local refs stay local, and refs from a peer that describe
// impossible tensors or never arrive fail with a clear error.
#include "actors/data_plane.hpp"

#include <gtest/gtest.h>

#include <numeric>

#include "actors/tensor_registry.hpp"
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

}  // namespace
}  // namespace troupe::actors
