#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "kernels/device.hpp"
#include "kernels/memory_pool.hpp"
#include "kernels/quant.hpp"
#include "kernels/tensor.hpp"

using namespace troupe::kernels;

TEST(Quant, RejectsBadShapes) {
  auto pool = memory_pool::create();
  auto src = tensor::zeros(*pool, dtype::f32, {2, 40});
  ASSERT_TRUE(src);
  EXPECT_EQ(quantize(*pool, *src, weight_format::q8_0).error().code, errc::shape_mismatch);
  EXPECT_EQ(quantize(*pool, *src, weight_format::int4_sym, 48).error().code,
            errc::invalid_argument);
  auto f16src = tensor::zeros(*pool, dtype::f16, {2, 64});
  EXPECT_EQ(quantize(*pool, *f16src, weight_format::q8_0).error().code, errc::unsupported_dtype);
}

TEST(TensorValidation, BadShapesAndViews) {
  auto pool = memory_pool::create();
  EXPECT_EQ(tensor::empty(*pool, dtype::f32, {-1, 4}).error().code, errc::invalid_argument);
  EXPECT_FALSE(tensor::empty(*pool, dtype::f32, {1ll << 40, 1ll << 40}));
  EXPECT_FALSE(tensor::empty(*pool, dtype::f32, {1ll << 62, 4}));
  EXPECT_EQ(tensor::empty(*pool, dtype::q4_0, {2, 33}).error().code, errc::shape_mismatch);
  EXPECT_FALSE(tensor::view(nullptr, dtype::f32, {2, 2}));
  auto t = tensor::zeros(*pool, dtype::f32, {4, 4});
  ASSERT_TRUE(t);
  EXPECT_FALSE(t->slice_rows(-1, 1));
  EXPECT_FALSE(t->slice_rows(3, 2));
  EXPECT_FALSE(t->slice_rows(0, -1));
  EXPECT_FALSE(t->reshape({3, 5}));
  EXPECT_FALSE(expect_tensor(*t, dtype::f16, 2, "x"));
  EXPECT_FALSE(expect_tensor(*t, dtype::f32, 3, "x"));
  EXPECT_TRUE(expect_tensor(*t, dtype::f32, 2, "x"));
}

TEST(TensorValidation, RowBytesOverflowIsAnError) {
  EXPECT_FALSE(row_bytes(dtype::q8_0, 31));
  EXPECT_FALSE(row_bytes(dtype::f32, -4));
  EXPECT_TRUE(row_bytes(dtype::q8_0, 64));
  EXPECT_EQ(*row_bytes(dtype::q4_0, 64), 36u);
  EXPECT_FALSE(dtype_from_string("q7_k"));
  EXPECT_EQ(*dtype_from_string("q5_k"), dtype::q5_k);
  EXPECT_EQ(*row_bytes(dtype::q5_k, 512), 352u);
  EXPECT_FALSE(row_bytes(dtype::q5_k, 288));  // not a whole superblock
  EXPECT_FALSE(row_bytes(dtype::iq4_nl, 48));
}

TEST(WeightValidation, MismatchedPartsAreReported) {
  auto pool = memory_pool::create();
  auto src = tensor::zeros(*pool, dtype::f32, {4, 64});
  ASSERT_TRUE(src);
  auto w = quantize(*pool, *src, weight_format::int4_asym, 32);
  ASSERT_TRUE(w);
  weight_matrix broken = *w;
  broken.zeros = tensor{};
  EXPECT_FALSE(broken.validate());
  broken = *w;
  broken.cols = 128;
  EXPECT_FALSE(broken.validate());
  broken = *w;
  broken.group = 48;
  EXPECT_FALSE(broken.validate());
  broken = *w;
  broken.format = weight_format::q8_0;
  EXPECT_FALSE(broken.validate());
  EXPECT_FALSE(dequantize(*pool, broken));
  std::vector<float> row(10);
  EXPECT_FALSE(dequantize_row(*w, 0, row));
  std::vector<float> ok(64);
  EXPECT_FALSE(dequantize_row(*w, 4, ok));
  EXPECT_TRUE(dequantize_row(*w, 3, ok));
  EXPECT_FALSE(weight_format_from_string("int3"));
  // Every GGUF format is a target; unknown names are refused.
  EXPECT_EQ(*weight_format_from_string("q4_k"), weight_format::q4_k);
  EXPECT_EQ(*quant_target_from_string("q4_k"), weight_format::q4_k);
  EXPECT_EQ(*quant_target_from_string("iq4_xs"), weight_format::iq4_xs);
  EXPECT_TRUE(quant_target_from_string("q4_0"));
  EXPECT_FALSE(quant_target_from_string("q4_k_x"));
}

TEST(PoolValidation, HugeRequestIsRefused) {
  auto pool = memory_pool::create();
  auto r = pool->allocate(std::size_t{1} << 50);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::out_of_memory);
}
