// Bad device lists and bad tensor refs give clear errors (runs under
// ASan+UBSan in the test command).
#include <gtest/gtest.h>

#include "actors/device_spec.hpp"
#include "actors/tensor_registry.hpp"
#include "kernels/memory_pool.hpp"

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
  expect_error("cuda:0", "CPU devices only");
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
