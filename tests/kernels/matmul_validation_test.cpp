// matmul and onednn_matmul with bad arguments: errors, never crashes.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/cpu/context.hpp"
#include "kernels/cpu/onednn_matmul.hpp"
#include "kernels/matmul.hpp"
#include "kernels/quant.hpp"

using namespace troupe::kernels;

namespace {

struct fixture {
  std::unique_ptr<cpu::context> ctx = cpu::context::create(2);
  weight_matrix w;
  packed_matrix p;

  explicit fixture(weight_format f = weight_format::q8_0) {
    auto src = tensor::zeros(ctx->memory(), dtype::f32, {20, 64});
    for (std::int64_t i = 0; i < 20 * 64; ++i)
      src->data_as<float>()[i] = static_cast<float>(i % 7) - 3.0f;
    w = *quantize(ctx->memory(), *src, f);
    p = *packed_matrix::pack(*ctx, w);
  }
  tensor make(dtype t, shape_t s) { return *tensor::zeros(ctx->memory(), t, s); }
};

}  // namespace

TEST(MatmulValidation, GoodCallWorks) {
  fixture f;
  tensor x = f.make(dtype::f32, {3, 64}), y = f.make(dtype::f32, {3, 20});
  EXPECT_TRUE(matmul(*f.ctx, x, f.p, y));
}

TEST(MatmulValidation, MismatchedK) {
  fixture f;
  tensor x = f.make(dtype::f32, {3, 32}), y = f.make(dtype::f32, {3, 20});
  auto r = matmul(*f.ctx, x, f.p, y);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::shape_mismatch);
}

TEST(MatmulValidation, WrongDtypes) {
  fixture f;
  tensor xh = f.make(dtype::f16, {3, 64}), y = f.make(dtype::f32, {3, 20});
  auto r = matmul(*f.ctx, xh, f.p, y);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::unsupported_dtype);
  tensor x = f.make(dtype::f32, {3, 64}), yi = f.make(dtype::i32, {3, 20});
  EXPECT_FALSE(matmul(*f.ctx, x, f.p, yi));
}

TEST(MatmulValidation, WrongOutputShapeAndRank) {
  fixture f;
  tensor x = f.make(dtype::f32, {3, 64});
  tensor y1 = f.make(dtype::f32, {3, 19}), y2 = f.make(dtype::f32, {4, 20}),
         y3 = f.make(dtype::f32, {60});
  EXPECT_FALSE(matmul(*f.ctx, x, f.p, y1));
  EXPECT_FALSE(matmul(*f.ctx, x, f.p, y2));
  EXPECT_FALSE(matmul(*f.ctx, x, f.p, y3));
  tensor x3 = f.make(dtype::f32, {1, 3, 64}), y = f.make(dtype::f32, {3, 20});
  EXPECT_FALSE(matmul(*f.ctx, x3, f.p, y));
}

TEST(MatmulValidation, EmptyAndUnpacked) {
  fixture f;
  tensor empty_x, y = f.make(dtype::f32, {3, 20});
  EXPECT_FALSE(matmul(*f.ctx, empty_x, f.p, y));
  tensor x0 = f.make(dtype::f32, {0, 64}), y0 = f.make(dtype::f32, {0, 20});
  EXPECT_FALSE(matmul(*f.ctx, x0, f.p, y0));
  tensor x = f.make(dtype::f32, {3, 64});
  packed_matrix unpacked;
  auto r = matmul(*f.ctx, x, unpacked, y);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::invalid_argument);
}

TEST(MatmulValidation, RankOneAndBlockDtypeInputs) {
  // tensor offers no strided 2-D views, so rank and dtype are what can be wrong.
  fixture f;
  tensor x1 = f.make(dtype::f32, {64}), y = f.make(dtype::f32, {3, 20});
  EXPECT_FALSE(matmul(*f.ctx, x1, f.p, y));
  tensor xq = f.make(dtype::q8_0, {3, 64});
  EXPECT_FALSE(matmul(*f.ctx, xq, f.p, y));
}

TEST(MatmulValidation, OverlappingInputAndOutput) {
  fixture f;
  tensor buf = f.make(dtype::f32, {3, 64});
  auto y = tensor::view(buf.data(), dtype::f32, {3, 20});
  ASSERT_TRUE(y);
  auto r = matmul(*f.ctx, buf, f.p, *y);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code, errc::invalid_argument);
}

TEST(MatmulValidation, BadWeightMatrixParts) {
  auto ctx = cpu::context::create(1);
  auto src = tensor::zeros(ctx->memory(), dtype::f32, {8, 64});
  ASSERT_TRUE(src);
  {
    auto w = *quantize(ctx->memory(), *src, weight_format::int8_sym);
    w.scales = tensor();  // missing scales
    EXPECT_FALSE(packed_matrix::pack(*ctx, w));
  }
  {
    auto w = *quantize(ctx->memory(), *src, weight_format::int4_asym, 32);
    w.zeros = *tensor::zeros(ctx->memory(), dtype::u8, {8, 1});  // wrong shape
    EXPECT_FALSE(packed_matrix::pack(*ctx, w));
  }
  {
    auto w = *quantize(ctx->memory(), *src, weight_format::int4_sym, 64);
    w.group = 48;  // not a legal group
    EXPECT_FALSE(packed_matrix::pack(*ctx, w));
  }
  {
    auto w = *quantize(ctx->memory(), *src, weight_format::f16);
    w.data = *tensor::zeros(ctx->memory(), dtype::f32, {8, 64});  // dtype disagrees
    EXPECT_FALSE(packed_matrix::pack(*ctx, w));
  }
  {
    auto w = *quantize(ctx->memory(), *src, weight_format::q4_0);
    w.cols = 96;  // disagrees with the data
    EXPECT_FALSE(packed_matrix::pack(*ctx, w));
  }
  {
    weight_matrix w;  // empty
    EXPECT_FALSE(packed_matrix::pack(*ctx, w));
  }
}

TEST(MatmulValidation, OnednnBadArguments) {
  fixture f(weight_format::f32);
  EXPECT_FALSE(cpu::onednn_matmul::create(*f.ctx, f.w, 0, cpu::onednn_kind::f32));
  weight_matrix bad;
  EXPECT_FALSE(cpu::onednn_matmul::create(*f.ctx, bad, 2, cpu::onednn_kind::f32));
  auto mm = cpu::onednn_matmul::create(*f.ctx, f.w, 2, cpu::onednn_kind::f32);
  ASSERT_TRUE(mm) << mm.error().message;
  tensor x_bad = f.make(dtype::f32, {3, 64}), y = f.make(dtype::f32, {2, 20});
  EXPECT_FALSE(mm->run(*f.ctx, x_bad, y));
  tensor x = f.make(dtype::f32, {2, 64}), y_bad = f.make(dtype::f32, {2, 21});
  EXPECT_FALSE(mm->run(*f.ctx, x, y_bad));
  tensor xh = f.make(dtype::f16, {2, 64});
  EXPECT_FALSE(mm->run(*f.ctx, xh, y));
  EXPECT_TRUE(mm->run(*f.ctx, x, y));
}
