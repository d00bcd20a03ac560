#include <gtest/gtest.h>
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "kernels/cpu/context.hpp"
#include "kernels/cpu/isa.hpp"
#include "kernels/cuda/probe.hpp"
#include "kernels/device.hpp"
#include "kernels/half.hpp"
#include "kernels/memory_pool.hpp"
#include "kernels/quant.hpp"
#include "kernels/tensor.hpp"

using namespace troupe::kernels;

namespace {

__attribute__((target("f16c"))) std::uint16_t hw_f16(float f) {
  return static_cast<std::uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
}

}  // namespace

TEST(Half, F16RoundTripMatchesF16C) {
  if (cpu::hardware_isa() < cpu::isa::avx2) GTEST_SKIP() << "no F16C";
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const std::uint32_t b = bits(rng);
    float f;
    std::memcpy(&f, &b, 4);
    if (std::isnan(f)) continue;
    ASSERT_EQ(to_f16(f).bits, hw_f16(f)) << "input bits " << std::hex << b;
  }
  // Every f16 converts to f32 exactly and back.
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = to_f32(f16{static_cast<std::uint16_t>(h)});
    if (std::isnan(f)) continue;
    ASSERT_EQ(to_f16(f).bits, h);
  }
}

TEST(Half, Bf16RoundsToNearestEven) {
  EXPECT_EQ(to_bf16(1.0f).bits, 0x3f80);
  // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
  EXPECT_EQ(to_bf16(1.00390625f).bits, 0x3f80);
  // 1 + 3*2^-8 is halfway: ties to even (1 + 2^-6).
  EXPECT_EQ(to_bf16(1.01171875f).bits, 0x3f82);
  EXPECT_TRUE(std::isnan(to_f32(to_bf16(std::nanf("")))));
}

TEST(MemoryPool, ReusesFreedBlocksAndAligns) {
  auto pool = memory_pool::create();
  void* first = nullptr;
  {
    auto b = pool->allocate(1000);
    ASSERT_TRUE(b);
    first = (*b)->data();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(first) % tensor_alignment, 0u);
  }
  auto again = pool->allocate(1000);
  ASSERT_TRUE(again);
  EXPECT_EQ((*again)->data(), first);
  const auto s = pool->snapshot();
  EXPECT_EQ(s.allocations, 1u);
  EXPECT_EQ(s.reuses, 1u);
}

TEST(MemoryPool, LimitGivesAnError) {
  auto pool = memory_pool::create(1 << 20);
  auto ok = pool->allocate(512 << 10);
  ASSERT_TRUE(ok);
  auto too_much = pool->allocate(768 << 10);
  ASSERT_FALSE(too_much);
  EXPECT_EQ(too_much.error().code, errc::out_of_memory);
}

TEST(Tensor, ShapesStridesAndErrors) {
  auto pool = memory_pool::create();
  auto t = tensor::zeros(*pool, dtype::f32, {3, 5});
  ASSERT_TRUE(t);
  EXPECT_EQ(t->nbytes(), 60u);
  EXPECT_EQ(t->stride_bytes(0), 20u);
  EXPECT_EQ(t->row(2), reinterpret_cast<std::byte*>(t->data()) + 40);
  auto s = t->slice_rows(1, 2);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->dim(0), 2);
  EXPECT_EQ(s->data(), t->row(1));
  EXPECT_FALSE(t->slice_rows(2, 2));
  EXPECT_FALSE(t->reshape({4, 4}));
  auto q = tensor::empty(*pool, dtype::q8_0, {2, 64});
  ASSERT_TRUE(q);
  EXPECT_EQ(q->nbytes(), 2u * 2 * sizeof(block_q8_0));
  auto bad = tensor::empty(*pool, dtype::q4_0, {2, 33});
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().code, errc::shape_mismatch);
  EXPECT_FALSE(tensor::empty(*pool, dtype::f32, {-1, 4}));
  EXPECT_FALSE(tensor::empty(*pool, dtype::f32, {1ll << 40, 1ll << 40}));
}

TEST(ThreadPool, CoversEveryIndexOnce) {
  for (int threads : {1, 2, 3}) {
    cpu::thread_pool pool(threads);
    for (std::int64_t n : {1, 7, 64, 1001}) {
      for (std::int64_t grain : {1, 4, 16}) {
        std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
        pool.parallel_for(n, grain, [&](std::int64_t b, std::int64_t e, int) {
          EXPECT_EQ(b % grain, 0);
          for (std::int64_t i = b; i < e; ++i) hits[static_cast<std::size_t>(i)]++;
        });
        for (auto& h : hits) ASSERT_EQ(h.load(), 1);
      }
    }
  }
}

TEST(Isa, DetectionIsConsistent) {
  EXPECT_LE(cpu::detect_isa(), cpu::hardware_isa());
  EXPECT_TRUE(cpu::isa_from_string("avx2"));
  EXPECT_FALSE(cpu::isa_from_string("sse9"));
  auto ctx = cpu::context::create(1);
  ctx->set_level(cpu::isa::avx512_vnni);
  EXPECT_LE(ctx->level(), cpu::hardware_isa());
}

TEST(Devices, RegistryListsCpuAndRejectsBadCoreSets) {
  auto reg = device_registry::discover();
  ASSERT_TRUE(reg);
  auto cpu0 = (*reg)->find("cpu");
  ASSERT_TRUE(cpu0);
  EXPECT_EQ((*cpu0)->info().kind, device_kind::cpu);
  EXPECT_GE((*cpu0)->info().cores, 1);
  EXPECT_FALSE((*reg)->find("cuda:7"));
  // Without a GPU the probe must say why (never crash, never an empty story).
  const auto probe = cuda::probe();
  if (probe.gpus.empty()) {
    EXPECT_FALSE((*reg)->cuda_status().empty());
  }
  registry_options twice;
  twice.cpu_core_sets = {{0}, {0}};
  EXPECT_FALSE(device_registry::discover(twice));
  registry_options missing;
  missing.cpu_core_sets = {{100000}};
  EXPECT_FALSE(device_registry::discover(missing));
}

TEST(Quant, Q8AndQ4DequantizeCloseToSource) {
  auto pool = memory_pool::create();
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  auto src = tensor::empty(*pool, dtype::f32, {5, 128});
  ASSERT_TRUE(src);
  for (std::int64_t i = 0; i < src->numel(); ++i) src->data_as<float>()[i] = nd(rng);
  struct c {
    weight_format f;
    int group;
    float tol;
  };
  for (auto [f, group, tol] :
       {c{weight_format::f16, 0, 2e-3f}, c{weight_format::bf16, 0, 1.6e-2f},
        c{weight_format::int8_sym, 0, 0.02f}, c{weight_format::int8_asym, 0, 0.02f},
        c{weight_format::int4_sym, 32, 0.5f}, c{weight_format::int4_asym, 32, 0.5f},
        c{weight_format::int4_sym, 64, 0.5f}, c{weight_format::q8_0, 0, 0.02f},
        c{weight_format::q4_0, 0, 0.5f}}) {
    auto w = quantize(*pool, *src, f, group ? group : 32);
    ASSERT_TRUE(w) << to_string(f);
    ASSERT_TRUE(w->validate()) << to_string(f);
    auto back = dequantize(*pool, *w);
    ASSERT_TRUE(back);
    double max_err = 0;
    for (std::int64_t i = 0; i < src->numel(); ++i)
      max_err = std::max<double>(max_err,
                                 std::fabs(back->data_as<float>()[i] - src->data_as<float>()[i]));
    EXPECT_LT(max_err, tol) << to_string(f);
    EXPECT_GT(max_err, 0.0) << to_string(f) << " lost nothing: suspicious";
  }
}
