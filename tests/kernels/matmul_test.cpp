// matmul: every weight format, scalar and AVX2, against an independent
// reference (dequantize, then a double-precision dot); AVX2 == scalar bit for
// bit; batch invariance over batch composition, chunking and thread count;
// oneDNN's matmul against the same reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/context.hpp"
#include "kernels/cpu/onednn_matmul.hpp"
#include "kernels/matmul.hpp"
#include "kernels/quant.hpp"
#include "tests/kernels/gguf_blocks.hpp"

using namespace troupe::kernels;

namespace {

struct format_case {
  weight_format format;
  int group;
  std::int64_t k;
};

// K is a multiple of the group for int4 and of 32 for the block formats;
// the plain and int8 formats also get a K that is not.
const std::vector<format_case>& all_cases() {
  static const std::vector<format_case> cases = {
      {weight_format::f32, 0, 224},
      {weight_format::f32, 0, 101},
      {weight_format::f16, 0, 224},
      {weight_format::f16, 0, 77},
      {weight_format::bf16, 0, 224},
      {weight_format::bf16, 0, 45},
      {weight_format::int8_sym, 0, 224},
      {weight_format::int8_sym, 0, 100},
      {weight_format::int8_asym, 0, 224},
      {weight_format::int8_asym, 0, 70},
      {weight_format::int4_sym, 32, 224},
      {weight_format::int4_sym, 64, 320},
      {weight_format::int4_sym, 128, 384},
      {weight_format::int4_asym, 32, 224},
      {weight_format::int4_asym, 64, 320},
      {weight_format::int4_asym, 128, 384},
      {weight_format::q8_0, 0, 224},
      {weight_format::q4_0, 0, 224},
      // GGUF formats read from files (random blocks, tests/kernels/gguf_blocks.hpp)
      {weight_format::q4_1, 0, 224},
      {weight_format::q5_0, 0, 224},
      {weight_format::q5_1, 0, 224},
      {weight_format::iq4_nl, 0, 224},
      {weight_format::q2_k, 0, 512},
      {weight_format::q3_k, 0, 256},
      {weight_format::q4_k, 0, 512},
      {weight_format::q5_k, 0, 256},
      {weight_format::q6_k, 0, 512},
      {weight_format::iq4_xs, 0, 256},
  };
  return cases;
}

std::string name(const format_case& c) {
  return std::string(to_string(c.format)) + " g" + std::to_string(c.group) +
         " K=" + std::to_string(c.k);
}

// The weights of a case: `src` quantized, or random blocks of a GGUF format
// past Q4_0.
result<weight_matrix> make_weights(memory_pool& pool, const tensor& src, const format_case& fc,
                                   std::uint32_t seed) {
  if (troupe::test::is_random_block_format(fc.format))
    return troupe::test::random_block_weights(pool, fc.format, src.dim(0), src.dim(1), seed);
  return quantize(pool, src, fc.format, fc.group ? fc.group : 32);
}

bool is_float(weight_format f) {
  return f == weight_format::f32 || f == weight_format::f16 || f == weight_format::bf16;
}

tensor random_matrix(memory_pool& pool, std::int64_t r, std::int64_t c, std::uint32_t seed) {
  auto t = tensor::empty(pool, dtype::f32, {r, c});
  EXPECT_TRUE(t);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(0.1f, 3.0f);
  for (std::int64_t i = 0; i < r; ++i) {
    const float row_scale = mag(rng);  // rows of different magnitude
    for (std::int64_t j = 0; j < c; ++j) t->row_as<float>(i)[j] = nd(rng) * row_scale;
  }
  return *t;
}

struct reference {
  std::vector<double> y;    // [m, n]
  std::vector<double> tol;  // [m, n]
};

// y = x * dequant(w)^T in double; tolerance: the activation quantization
// bound sum_b (dx_b / 2) * sum_{k in b} |w_k| for integer formats, plus a
// float-accumulation term relative to sum |x_k w_k|.
reference make_reference(memory_pool& pool, const tensor& x, const weight_matrix& w) {
  auto wd = dequantize(pool, w);
  EXPECT_TRUE(wd);
  const std::int64_t m = x.dim(0), n = w.rows, k = w.cols;
  reference ref;
  ref.y.assign(static_cast<std::size_t>(m * n), 0.0);
  ref.tol.assign(static_cast<std::size_t>(m * n), 0.0);
  for (std::int64_t r = 0; r < m; ++r) {
    const float* xr = x.row_as<float>(r);
    std::vector<double> dx((static_cast<std::size_t>(k) + 31) / 32, 0.0);
    for (std::int64_t j = 0; j < k; ++j)
      dx[static_cast<std::size_t>(j / 32)] =
          std::max<double>(dx[static_cast<std::size_t>(j / 32)], std::fabs(xr[j]) / 127.0);
    for (std::int64_t c = 0; c < n; ++c) {
      const float* wr = wd->row_as<float>(c);
      double acc = 0, mag = 0, quant = 0;
      for (std::int64_t j = 0; j < k; ++j) {
        acc += static_cast<double>(xr[j]) * wr[j];
        mag += std::fabs(static_cast<double>(xr[j]) * wr[j]);
        quant += dx[static_cast<std::size_t>(j / 32)] / 2 * std::fabs(wr[j]);
      }
      const auto i = static_cast<std::size_t>(r * n + c);
      ref.y[i] = acc;
      ref.tol[i] = (is_float(w.format) ? 0.0 : quant * 1.001) + 2e-6 * mag + 1e-6;
    }
  }
  return ref;
}

std::vector<float> run(cpu::context& ctx, const tensor& x, const packed_matrix& p) {
  auto y = tensor::empty(ctx.memory(), dtype::f32, {x.dim(0), p.rows()});
  EXPECT_TRUE(y);
  auto r = matmul(ctx, x, p, *y);
  EXPECT_TRUE(r) << (r ? "" : r.error().message);
  return std::vector<float>(y->data_as<float>(), y->data_as<float>() + y->numel());
}

bool bit_equal(const float* a, const float* b, std::size_t n) {
  return std::memcmp(a, b, n * sizeof(float)) == 0;
}

bool have_avx2() {
  return cpu::hardware_isa() >= cpu::isa::avx2;
}

}  // namespace

TEST(Matmul, EveryFormatMatchesReferenceScalarAndAvx2) {
  auto ctx = cpu::context::create(2);
  const std::int64_t n = 13;
  for (const auto& fc : all_cases()) {
    SCOPED_TRACE(name(fc));
    tensor wf = random_matrix(ctx->memory(), n, fc.k, 11);
    auto w = make_weights(ctx->memory(), wf, fc, 11);
    ASSERT_TRUE(w) << w.error().message;
    auto p = packed_matrix::pack(*ctx, *w);
    ASSERT_TRUE(p) << p.error().message;
    EXPECT_EQ(p->rows(), n);
    EXPECT_EQ(p->cols(), fc.k);
    for (std::int64_t m : {1, 3, 17, 64}) {
      SCOPED_TRACE("M=" + std::to_string(m));
      tensor x = random_matrix(ctx->memory(), m, fc.k, 100 + static_cast<std::uint32_t>(m));
      const reference ref = make_reference(ctx->memory(), x, *w);
      ctx->set_level(cpu::isa::scalar);
      const auto ys = run(*ctx, x, *p);
      for (std::size_t i = 0; i < ys.size(); ++i)
        ASSERT_NEAR(ys[i], ref.y[i], ref.tol[i]) << "scalar, element " << i;
      if (!have_avx2()) continue;
      ctx->set_level(cpu::isa::avx2);
      const auto yv = run(*ctx, x, *p);
      for (std::size_t i = 0; i < yv.size(); ++i)
        ASSERT_NEAR(yv[i], ref.y[i], ref.tol[i]) << "avx2, element " << i;
      EXPECT_TRUE(bit_equal(ys.data(), yv.data(), ys.size())) << "AVX2 differs from scalar";
    }
  }
}

TEST(Matmul, ToleranceCatchesAWrongWeight) {
  // The reference check above must be able to fail: perturb one output.
  auto ctx = cpu::context::create(1);
  tensor wf = random_matrix(ctx->memory(), 13, 224, 5);
  auto w = quantize(ctx->memory(), wf, weight_format::q4_0);
  ASSERT_TRUE(w);
  auto p = packed_matrix::pack(*ctx, *w);
  ASSERT_TRUE(p);
  tensor x = random_matrix(ctx->memory(), 1, 224, 6);
  x.data_as<float>()[2 * 32 + 3] = 5.0f;
  const reference ref = make_reference(ctx->memory(), x, *w);
  // Same matrix with one code moved by 8 steps: output 4 leaves the bound.
  w->data.row_as<block_q4_0>(4)[2].qs[3] ^= 0x08;
  auto p2 = packed_matrix::pack(*ctx, *w);
  ASSERT_TRUE(p2);
  const auto y = run(*ctx, x, *p2);
  EXPECT_GT(std::fabs(y[4] - ref.y[4]), ref.tol[4]);
}

TEST(Matmul, MinusOneTwentyEightCodesUseAnExactPath) {
  // ggml never writes -128 into Q8_0, but foreign files may; int8 likewise.
  auto ctx = cpu::context::create(2);
  for (auto fmt : {weight_format::q8_0, weight_format::int8_sym}) {
    SCOPED_TRACE(std::string(to_string(fmt)));
    tensor wf = random_matrix(ctx->memory(), 21, 256, 9);
    auto w = quantize(ctx->memory(), wf, fmt);
    ASSERT_TRUE(w);
    for (std::int64_t r = 0; r < 21; ++r)
      for (int j = 0; j < 256; j += 7) {
        if (fmt == weight_format::q8_0)
          w->data.row_as<block_q8_0>(r)[j / 32].qs[j % 32] = -128;
        else
          w->data.row_as<std::int8_t>(r)[j] = -128;
      }
    auto p = packed_matrix::pack(*ctx, *w);
    ASSERT_TRUE(p);
    EXPECT_EQ(p->layout().kernel, cpu::mm_kernel::s8_m);
    tensor x = random_matrix(ctx->memory(), 9, 256, 10);
    // Activations at full scale in every block: codes of +-127 meet -128.
    for (std::int64_t r = 0; r < 9; ++r)
      for (int j = 0; j < 256; j += 7) x.row_as<float>(r)[j] = (j % 2 ? -50.0f : 50.0f);
    const reference ref = make_reference(ctx->memory(), x, *w);
    ctx->set_level(cpu::isa::scalar);
    const auto ys = run(*ctx, x, *p);
    for (std::size_t i = 0; i < ys.size(); ++i) ASSERT_NEAR(ys[i], ref.y[i], ref.tol[i]) << i;
    if (!have_avx2()) continue;
    ctx->set_level(cpu::isa::avx2);
    const auto yv = run(*ctx, x, *p);
    EXPECT_TRUE(bit_equal(ys.data(), yv.data(), ys.size()));
  }
}

TEST(Matmul, BatchInvariantOverBatchChunksAndThreads) {
  auto ctx1 = cpu::context::create(1);
  auto ctx2 = cpu::context::create(2);
  const std::int64_t n = 70, total = 80;  // several panels, so both threads work
  for (const auto& fc : all_cases()) {
    SCOPED_TRACE(name(fc));
    tensor wf = random_matrix(ctx2->memory(), n, fc.k, 21);
    auto w = make_weights(ctx2->memory(), wf, fc, 21);
    ASSERT_TRUE(w);
    auto p = packed_matrix::pack(*ctx2, *w);
    ASSERT_TRUE(p);
    tensor x = random_matrix(ctx2->memory(), total, fc.k, 22);
    const auto full = run(*ctx2, x, *p);
    const auto full1 = run(*ctx1, x, *p);
    ASSERT_TRUE(bit_equal(full.data(), full1.data(), full.size())) << "1 vs 2 threads";
    // Prefill-style chunks of 1, 16 and 64 rows.
    for (std::int64_t chunk : {1, 16, 64}) {
      for (std::int64_t r0 = 0; r0 < total; r0 += chunk) {
        const std::int64_t cnt = std::min(chunk, total - r0);
        auto xs = x.slice_rows(r0, cnt);
        ASSERT_TRUE(xs);
        const auto y = run(*ctx2, *xs, *p);
        ASSERT_TRUE(bit_equal(y.data(), full.data() + r0 * n, y.size()))
            << "chunk " << chunk << " at row " << r0;
      }
    }
    // Row 5 alone and inside a batch of 7 unrelated rows (at position 3).
    tensor batch = random_matrix(ctx2->memory(), 7, fc.k, 23);
    std::memcpy(batch.row(3), x.row(5), static_cast<std::size_t>(fc.k) * 4);
    const auto yb = run(*ctx2, batch, *p);
    auto alone = x.slice_rows(5, 1);
    ASSERT_TRUE(alone);
    const auto ya = run(*ctx1, *alone, *p);
    EXPECT_TRUE(bit_equal(yb.data() + 3 * n, full.data() + 5 * n, static_cast<std::size_t>(n)));
    EXPECT_TRUE(bit_equal(ya.data(), full.data() + 5 * n, static_cast<std::size_t>(n)));
  }
}

TEST(Matmul, PackedBytesCoverTheStream) {
  auto ctx = cpu::context::create(1);
  tensor wf = random_matrix(ctx->memory(), 64, 256, 1);
  auto w = quantize(ctx->memory(), wf, weight_format::q8_0);
  ASSERT_TRUE(w);
  auto p = packed_matrix::pack(*ctx, *w);
  ASSERT_TRUE(p);
  // 64 x 256 Q8_0 = 64 * 8 blocks * 34 bytes, no padding at these sizes.
  EXPECT_EQ(p->bytes(), 64u * 8u * 34u);
  EXPECT_EQ(p->format(), weight_format::q8_0);
  // K-quants keep their compact scales: per 16 columns and superblock of 256,
  // f16 d and dmin (64 bytes) and int8 sub-scales and sub-mins (2 x 128) for
  // Q4_K (4.625 bits a weight, the file's 4.5); f16 d (32) and 16 int8
  // half-block scales per column (256) for Q6_K, whose 6-bit codes are
  // nibbles plus two bit planes (384 bytes a block: 6.5625 bits a weight, the
  // file's); Q5_K's, nibbles and one plane (5.625 bits, the file's 5.5).
  auto q4k = troupe::test::random_block_weights(ctx->memory(), weight_format::q4_k, 64, 512, 5);
  auto pk = packed_matrix::pack(*ctx, q4k);
  ASSERT_TRUE(pk);
  EXPECT_EQ(pk->bytes(), 4u * 2u * (320u + 8u * 256u));
  auto q6k = troupe::test::random_block_weights(ctx->memory(), weight_format::q6_k, 64, 512, 6);
  auto p6 = packed_matrix::pack(*ctx, q6k);
  ASSERT_TRUE(p6);
  EXPECT_EQ(p6->bytes(), 4u * 2u * (288u + 8u * 384u));
  auto q5k = troupe::test::random_block_weights(ctx->memory(), weight_format::q5_k, 64, 512, 7);
  auto p5 = packed_matrix::pack(*ctx, q5k);
  ASSERT_TRUE(p5);
  EXPECT_EQ(p5->bytes(), 4u * 2u * (320u + 8u * 320u));
  // IQ4_XS: nibble indices into its table (4.3125 bits, the file's 4.25).
  auto iq4 = troupe::test::random_block_weights(ctx->memory(), weight_format::iq4_xs, 64, 512, 8);
  auto pi = packed_matrix::pack(*ctx, iq4);
  ASSERT_TRUE(pi);
  EXPECT_EQ(pi->bytes(), 4u * 2u * (160u + 8u * 256u));
  // A superblock scale that is not finite cannot be factored: the matrix
  // falls back to f32 scales and offsets per 32-block (128 bytes a block).
  auto* d = reinterpret_cast<std::uint16_t*>(q4k.data.row(7));
  *d = 0x7e00;  // f16 NaN
  auto pf = packed_matrix::pack(*ctx, q4k);
  ASSERT_TRUE(pf);
  EXPECT_EQ(pf->bytes(), 4u * 16u * (128u + 256u));
}

// What placement counts a prepared matrix at (held_bits_per_weight) is what
// packing gives, for every format, at a shape of whole panels and blocks.
TEST(Matmul, HeldBitsPerWeightAreThePackedBytes) {
  auto ctx = cpu::context::create(1);
  tensor wf = random_matrix(ctx->memory(), 64, 512, 3);
  for (int i = 0; i <= static_cast<int>(weight_format::iq4_xs); ++i) {
    const auto f = static_cast<weight_format>(i);
    SCOPED_TRACE(std::string(to_string(f)));
    auto w = quantize(ctx->memory(), wf, f, 32);
    ASSERT_TRUE(w) << w.error().message;
    auto p = packed_matrix::pack(*ctx, *w);
    ASSERT_TRUE(p) << p.error().message;
    // int8 adds a scale (and a zero point) per row: 4 and 8 bytes a row here.
    const double per_row = f == weight_format::int8_sym ? 4 : f == weight_format::int8_asym ? 8 : 0;
    EXPECT_DOUBLE_EQ(static_cast<double>(p->bytes()),
                     64.0 * 512.0 * held_bits_per_weight(f) / 8 + 64 * per_row);
  }
}

TEST(OnednnMatmul, AgreesWithReference) {
  auto ctx = cpu::context::create(2);
  const std::int64_t n = 40, k = 96, m = 5;
  tensor wf = random_matrix(ctx->memory(), n, k, 31);
  tensor x = random_matrix(ctx->memory(), m, k, 32);
  for (auto kind : {cpu::onednn_kind::f32, cpu::onednn_kind::bf16, cpu::onednn_kind::u8s8}) {
    SCOPED_TRACE(std::string(cpu::to_string(kind)));
    auto w =
        quantize(ctx->memory(), wf,
                 kind == cpu::onednn_kind::u8s8 ? weight_format::int8_sym : weight_format::f32);
    ASSERT_TRUE(w);
    auto mm = cpu::onednn_matmul::create(*ctx, *w, m, kind);
    if (!mm && kind == cpu::onednn_kind::bf16 && cpu::hardware_isa() < cpu::isa::avx512) {
      // oneDNN 2.6 implements bf16 matmul only from AVX-512 on.
      EXPECT_EQ(mm.error().code, errc::unsupported_op);
      continue;
    }
    ASSERT_TRUE(mm) << mm.error().message;
    auto y = tensor::empty(ctx->memory(), dtype::f32, {m, n});
    ASSERT_TRUE(y);
    auto r = mm->run(*ctx, x, *y);
    ASSERT_TRUE(r) << r.error().message;
    auto wd = dequantize(ctx->memory(), *w);
    ASSERT_TRUE(wd);
    // Per-tensor activation scale for u8s8.
    double amax = 0;
    for (std::int64_t i = 0; i < m * k; ++i)
      amax = std::max<double>(amax, std::fabs(x.data_as<float>()[i]));
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t c = 0; c < n; ++c) {
        double acc = 0, mag = 0, wabs = 0;
        for (std::int64_t j = 0; j < k; ++j) {
          acc += static_cast<double>(x.row_as<float>(i)[j]) * wd->row_as<float>(c)[j];
          mag += std::fabs(static_cast<double>(x.row_as<float>(i)[j]) * wd->row_as<float>(c)[j]);
          wabs += std::fabs(wd->row_as<float>(c)[j]);
        }
        double tol = 1e-5 * mag + 1e-6;
        if (kind == cpu::onednn_kind::bf16) tol = mag * 2.0 / 256 + 1e-6;
        if (kind == cpu::onednn_kind::u8s8) tol = amax / 63 / 2 * wabs * 1.001 + 1e-4 * mag + 1e-6;
        ASSERT_NEAR(y->row_as<float>(i)[c], acc, tol) << "row " << i << " col " << c;
      }
  }
}
