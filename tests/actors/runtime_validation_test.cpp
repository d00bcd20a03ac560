// Bad device lists and bad tensor refs give clear errors (runs under
// ASan+UBSan in the test command).
#include <gtest/gtest.h>

#include <future>
#include <span>
#include <vector>

#include "actors/device.hpp"
#include "actors/device_spec.hpp"
#include "actors/tensor_registry.hpp"
#include "actors/tp_group.hpp"
#include "kernels/cpu/cpu_device.hpp"
#include "kernels/cuda/probe.hpp"
#include "kernels/memory_pool.hpp"
#include "tests/remote_memory_device.hpp"
#include "transport/inproc_engine.hpp"

namespace troupe::actors {
namespace {

void expect_error(const char* list, const char* words) {
  auto d = parse_devices(list);
  ASSERT_FALSE(d) << list;
  EXPECT_NE(d.error().message.find(words), std::string::npos) << list << ": " << d.error().message;
}

TEST(DeviceList, BadListsAreRefusedWithTheReason) {
  expect_error("", "empty device");
  expect_error("cpu:0,", "empty device");
  expect_error("gpu:0", "unknown device");
  expect_error("cpu:", "expected cpu");
  expect_error("cpu:1-0", "A <= B");
  expect_error("cpu:-1", "expected cpu");
  expect_error("cpu:0-99999999999", "expected cpu");
  expect_error("cpu:a", "expected cpu");
  expect_error("cpu:1000000", "expected cpu");
  expect_error("cpu:4000", "core 4000");
  expect_error("cpu:0,cpu:0", "another device");
  expect_error("cpu,cpu:0", "cannot be combined");
  expect_error("npu:0", "no backend runs on NPUs");
  expect_error("cuda:x", "expected cuda or cuda:N");
  expect_error("cuda:-1", "expected cuda or cuda:N");
  expect_error("cuda,cuda:0", "named twice");
}

TEST(DeviceList, GpusParseAndOpenOnlyWhereThereIsOne) {
  auto d = parse_devices("cpu:0,cuda,cuda:1");
  ASSERT_TRUE(d) << d.error().message;
  ASSERT_EQ(d->size(), 3u);
  EXPECT_EQ((*d)[0].kind, "cpu");
  EXPECT_EQ((*d)[1].name, "cuda:0");  // "cuda" alone is the first GPU
  EXPECT_EQ((*d)[1].kind, "cuda");
  EXPECT_EQ((*d)[1].index, 0);
  EXPECT_EQ((*d)[2].name, "cuda:1");
  EXPECT_EQ((*d)[2].index, 1);
  // "cpu" (every core) goes with GPUs: it shares no core with them.
  ASSERT_TRUE(parse_devices("cpu,cuda:0"));
  // Opening is where a missing GPU is found, with the device's name.
  device_spec far = (*d)[2];
  far.index = 99;
  far.name = "cuda:99";
  auto opened = open_device(far);
  ASSERT_FALSE(opened);
  EXPECT_NE(opened.error().message.find("device 'cuda:99'"), std::string::npos)
      << opened.error().message;
  if (kernels::cuda::probe().gpus.empty()) {
    auto first = open_device((*d)[1]);
    ASSERT_FALSE(first);
    EXPECT_NE(first.error().message.find("device 'cuda:0'"), std::string::npos)
        << first.error().message;
  }
}

TEST(DeviceList, RegisteredKindsParseAndOpenThroughTheirOpener) {
  EXPECT_FALSE(register_device_kind("cpu", [](const device_spec&) {
    return kernels::result<std::shared_ptr<kernels::device>>(nullptr);
  }));
  EXPECT_FALSE(register_device_kind("a:b", [](const device_spec&) {
    return kernels::result<std::shared_ptr<kernels::device>>(nullptr);
  }));
  expect_error("loopdev:0", "unknown device");
  int opened = -1;
  ASSERT_TRUE(register_device_kind("loopdev", [&](const device_spec& s) {
    opened = s.index;
    return kernels::result<std::shared_ptr<kernels::device>>(
        std::shared_ptr<kernels::device>(kernels::cpu::cpu_device::with_threads(1)));
  }));
  auto d = parse_devices("loopdev:3");
  ASSERT_TRUE(d) << d.error().message;
  EXPECT_EQ((*d)[0].kind, "loopdev");
  auto dev = open_device((*d)[0]);
  ASSERT_TRUE(dev) << dev.error().message;
  EXPECT_EQ(opened, 3);
  // An opener that makes nothing is an error, not a null device.
  ASSERT_TRUE(register_device_kind("loopdev", [](const device_spec&) {
    return kernels::result<std::shared_ptr<kernels::device>>(nullptr);
  }));
  auto none = open_device((*d)[0]);
  ASSERT_FALSE(none);
  EXPECT_NE(none.error().message.find("made no device"), std::string::npos);
}

TEST(DeviceList, GoodListsParse) {
  auto d = parse_devices("cpu:0");
  ASSERT_TRUE(d) << d.error().message;
  ASSERT_EQ(d->size(), 1u);
  EXPECT_EQ((*d)[0].name, "cpu:0");
  EXPECT_EQ((*d)[0].cores, std::vector<int>{0});
  d = parse_devices("cpu");
  ASSERT_TRUE(d);
  EXPECT_TRUE((*d)[0].cores.empty());
}

TEST(TensorRegistry, UnknownTakenTwiceOrMismatchedRefsFail) {
  auto pool = kernels::memory_pool::create();
  auto& reg = tensor_registry::local();
  const auto before = reg.pending();
  auto t = kernels::tensor::empty(*pool, kernels::dtype::f32, {3, 4});
  ASSERT_TRUE(t);
  auto ref = reg.put("cpu:0", *t);
  EXPECT_EQ(ref.shape, (std::vector<std::int64_t>{3, 4}));
  EXPECT_EQ(reg.pending(), before + 1);
  auto bad = ref;
  bad.shape = {4, 3};
  EXPECT_FALSE(reg.take(bad));  // taken out, but refused: the ref lies about it
  EXPECT_EQ(reg.pending(), before);
  auto again = reg.take(ref);
  ASSERT_FALSE(again);
  EXPECT_NE(again.error().message.find("already taken"), std::string::npos)
      << again.error().message;
  tensor_ref none;
  none.transfer_id = 987654321;
  EXPECT_FALSE(reg.take(none));
  auto ok = reg.put("cpu:0", *t);
  auto got = reg.take(ok);
  ASSERT_TRUE(got);
  EXPECT_EQ(got->data(), t->data());  // zero copies in one process
}

}  // namespace
}  // namespace troupe::actors

namespace troupe::actors {
namespace {

// The tensor-parallel all-reduce of a rank whose activations are on a
// device the ring cannot read (a GPU, with Debian's UCX) sums through host
// memory: both ranks end with the sum, in their device's memory.
TEST(TensorParallelRing, SumsTensorsOnADeviceWhoseMemoryIsNotTheHosts) {
  using namespace std::chrono_literals;
  transport::inproc_engine e0{10000ms}, e1{10000ms};
  auto g0 = std::make_shared<tp_group>(), g1 = std::make_shared<tp_group>();
  g0->size = g1->size = 2;
  g1->rank = 1;
  g0->ring.engine = &e0;
  g1->ring.engine = &e1;
  g0->ring.size = g1->ring.size = 2;
  g1->ring.rank = 1;
  g0->ring.next = *e0.connect(e1.address());
  g1->ring.next = *e1.connect(e0.address());
  test::remote_memory_device d0(1), d1(1);
  constexpr std::int64_t rows = 3, cols = 70;
  std::vector<float> a(rows * cols), b(rows * cols);
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i] = 0.25f * static_cast<float>(i);
    b[i] = 1000.0f - static_cast<float>(i);
  }
  auto put = [](kernels::device& d, const std::vector<float>& v) {
    auto t = kernels::tensor::empty(d.memory(), kernels::dtype::f32, {rows, cols});
    EXPECT_TRUE(t);
    EXPECT_TRUE(d.write(*t, std::as_bytes(std::span<const float>(v))));
    return *t;
  };
  auto t0 = put(d0, a), t1 = put(d1, b);
  ASSERT_FALSE(kernels::host_readable(t0));
  auto s0 = tp_group::split_of(g0), s1 = tp_group::split_of(g1);
  auto f1 = std::async(std::launch::async, [&] { return s1.all_reduce(t1); });
  auto r0 = s0.all_reduce(t0);
  auto r1 = f1.get();
  ASSERT_TRUE(r0) << r0.error().message;
  ASSERT_TRUE(r1) << r1.error().message;
  for (auto* t : {&t0, &t1}) {
    std::vector<float> got(a.size());
    ASSERT_TRUE(kernels::copy_to_host(*t, std::as_writable_bytes(std::span<float>(got))));
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], a[i] + b[i]) << i;
  }
}

}  // namespace
}  // namespace troupe::actors
