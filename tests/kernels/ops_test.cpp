// Ops of kernels/ops.hpp against plain double-precision references on random
// inputs (several shapes, odd sizes), scalar vs AVX2, and batch invariance:
// a row alone, in a batch of 7, in chunks of 1/16/64 and with 1 or 2 threads
// gives the same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/ops.hpp"

using namespace troupe::kernels;

namespace {

struct buf {
  std::vector<float> v;
  tensor t;
  buf(shape_t s, std::mt19937& rng, float scale = 1.0f, float shift = 0.0f)
      : v(static_cast<std::size_t>(s.numel())) {
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (auto& x : v) x = nd(rng) * scale + shift;
    t = *tensor::view(v.data(), dtype::f32, s);
  }
  explicit buf(shape_t s) : v(static_cast<std::size_t>(s.numel())) {
    t = *tensor::view(v.data(), dtype::f32, s);
  }
};

bool bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

void expect_near_ref(const std::vector<float>& got, const std::vector<double>& want, double atol,
                     double rtol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_LE(std::fabs(got[i] - want[i]), atol + rtol * std::fabs(want[i]))
        << what << " [" << i << "] got " << got[i] << " want " << want[i];
}

const std::vector<std::int64_t> kCols = {1, 7, 8, 31, 64, 257, 4099};

double silu_ref(double x) {
  return x / (1.0 + std::exp(-x));
}
double gelu_ref(double x, gelu_kind k) {
  switch (k) {
    case gelu_kind::tanh:
      return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    case gelu_kind::erf:
      return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case gelu_kind::quick:
      return x / (1.0 + std::exp(-1.702 * x));
  }
  return 0;
}

class Ops : public ::testing::TestWithParam<cpu::isa> {
 protected:
  void SetUp() override {
    ctx_ = cpu::context::create(2);
    if (GetParam() > ctx_->hardware_level()) GTEST_SKIP() << "ISA not available";
    ctx_->set_level(GetParam());
  }
  std::unique_ptr<cpu::context> ctx_;
  std::mt19937 rng_{42};
};

TEST_P(Ops, RmsNormAndLayerNormMatchDoubleReference) {
  for (std::int64_t cols : kCols) {
    for (std::int64_t rows : {1, 3}) {
      buf x({rows, cols}, rng_, 2.0f, 0.3f), w({cols}, rng_), b({cols}, rng_), y({rows, cols});
      ASSERT_TRUE(rms_norm(*ctx_, x.t, w.t, 1e-5f, y.t));
      std::vector<double> want(x.v.size());
      for (std::int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (std::int64_t c = 0; c < cols; ++c) ss += double(x.v[r * cols + c]) * x.v[r * cols + c];
        const double inv = 1.0 / std::sqrt(ss / cols + 1e-5);
        for (std::int64_t c = 0; c < cols; ++c)
          want[r * cols + c] = w.v[c] * x.v[r * cols + c] * inv;
      }
      expect_near_ref(y.v, want, 1e-6, 1e-5, "rms_norm cols " + std::to_string(cols));

      ASSERT_TRUE(layer_norm(*ctx_, x.t, w.t, b.t, 1e-5f, y.t));
      for (std::int64_t r = 0; r < rows; ++r) {
        double m = 0, v = 0;
        for (std::int64_t c = 0; c < cols; ++c) m += x.v[r * cols + c];
        m /= cols;
        for (std::int64_t c = 0; c < cols; ++c)
          v += (x.v[r * cols + c] - m) * (x.v[r * cols + c] - m);
        v /= cols;
        for (std::int64_t c = 0; c < cols; ++c)
          want[r * cols + c] = (x.v[r * cols + c] - m) / std::sqrt(v + 1e-5) * w.v[c] + b.v[c];
      }
      expect_near_ref(y.v, want, 1e-5, 1e-5, "layer_norm cols " + std::to_string(cols));
    }
  }
}

TEST_P(Ops, ActivationsMatchDoubleReference) {
  for (std::int64_t cols : kCols) {
    buf x({3, cols}, rng_, 4.0f), u({3, cols}, rng_), y({3, cols});
    std::vector<double> want(x.v.size());
    ASSERT_TRUE(silu(*ctx_, x.t, y.t));
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = silu_ref(x.v[i]);
    expect_near_ref(y.v, want, 1e-6, 1e-5, "silu");
    ASSERT_TRUE(swiglu(*ctx_, x.t, u.t, y.t));
    for (std::size_t i = 0; i < want.size(); ++i) want[i] = silu_ref(x.v[i]) * u.v[i];
    expect_near_ref(y.v, want, 1e-6, 1e-5, "swiglu");
    for (gelu_kind k : {gelu_kind::tanh, gelu_kind::erf, gelu_kind::quick}) {
      ASSERT_TRUE(gelu(*ctx_, x.t, k, y.t));
      for (std::size_t i = 0; i < want.size(); ++i) want[i] = gelu_ref(x.v[i], k);
      expect_near_ref(y.v, want, 1e-6, 1e-5, "gelu " + std::to_string(int(k)));
    }
    // add is one rounded float addition: exact against the rounded double sum.
    ASSERT_TRUE(add(*ctx_, x.t, u.t, y.t));
    for (std::size_t i = 0; i < want.size(); ++i)
      ASSERT_EQ(y.v[i], static_cast<float>(double(x.v[i]) + u.v[i]));
  }
}

TEST_P(Ops, SoftmaxMatchesDoubleReference) {
  for (std::int64_t cols : kCols) {
    for (float scale : {1.0f, 0.125f}) {
      buf x({3, cols}, rng_, 6.0f), y({3, cols});
      if (cols > 4) x.v[2] = -INFINITY, x.v[cols + 1] = 500.0f;  // masked entry, a far outlier
      ASSERT_TRUE(softmax(*ctx_, x.t, y.t, scale));
      std::vector<double> want(x.v.size());
      for (std::int64_t r = 0; r < 3; ++r) {
        double m = -INFINITY, s = 0;
        for (std::int64_t c = 0; c < cols; ++c) m = std::max(m, double(scale) * x.v[r * cols + c]);
        for (std::int64_t c = 0; c < cols; ++c)
          s += std::exp(double(scale) * x.v[r * cols + c] - m);
        for (std::int64_t c = 0; c < cols; ++c)
          want[r * cols + c] = std::exp(double(scale) * x.v[r * cols + c] - m) / s;
      }
      expect_near_ref(y.v, want, 1e-7, 1e-5, "softmax cols " + std::to_string(cols));
    }
  }
  buf x({2, 9}), y({2, 9});
  for (auto& v : x.v) v = -INFINITY;
  ASSERT_TRUE(softmax(*ctx_, x.t, y.t));
  for (float v : y.v) EXPECT_EQ(v, 0.0f);
}

// inv_freq in double straight from the formula (and LLaMA-3's rule).
std::vector<double> inv_freq_ref(const rope_params& p, int rot) {
  std::vector<double> out(static_cast<std::size_t>(rot / 2));
  for (int i = 0; i < rot / 2; ++i) {
    double f = 1.0 / std::pow(double(p.theta), 2.0 * i / rot);
    if (p.llama3) {
      const auto& s = *p.llama3;
      const double wl = 2 * M_PI / f, old = double(s.original_max_position_embeddings);
      if (wl > old / s.low_freq_factor) {
        f /= s.factor;
      } else if (wl >= old / s.high_freq_factor) {
        const double sm = (old / wl - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1 - sm) * f / s.factor + sm * f;
      }
    }
    out[static_cast<std::size_t>(i)] = f;
  }
  return out;
}

TEST_P(Ops, RopeMatchesDoubleReference) {
  struct rcase {
    rope_layout layout;
    int head_dim, rot;
    float theta;
    bool llama3;
  };
  const rcase cases[] = {{rope_layout::neox, 64, 64, 10000.0f, false},
                         {rope_layout::adjacent, 64, 64, 10000.0f, false},
                         {rope_layout::neox, 128, 128, 500000.0f, true},
                         {rope_layout::adjacent, 128, 128, 500000.0f, true},
                         {rope_layout::neox, 80, 40, 10000.0f, false},
                         {rope_layout::adjacent, 80, 24, 10000.0f, false},
                         {rope_layout::neox, 6, 6, 100.0f, false},
                         {rope_layout::adjacent, 18, 18, 1e6f, false}};
  const std::vector<std::int64_t> pos = {0, 1, 2, 17, 511, 4096, 12345, 100000, 3};
  const auto tokens = static_cast<std::int64_t>(pos.size());
  for (const rcase& c : cases) {
    SCOPED_TRACE("layout " + std::to_string(int(c.layout)) + " head_dim " +
                 std::to_string(c.head_dim) + " rot " + std::to_string(c.rot));
    rope_params p;
    p.layout = c.layout;
    p.theta = c.theta;
    p.rotary_dims = c.rot == c.head_dim ? 0 : c.rot;
    if (c.llama3) p.llama3 = rope_llama3_scaling{};
    std::vector<float> inv(static_cast<std::size_t>(c.rot / 2));
    ASSERT_TRUE(rope_inv_freq(p, c.head_dim, inv));
    const auto inv_d = inv_freq_ref(p, c.rot);
    for (std::size_t i = 0; i < inv.size(); ++i)
      ASSERT_NEAR(inv[i], inv_d[i], 1e-6 * inv_d[i]) << i;

    buf x({tokens, 3, c.head_dim}, rng_), y({tokens, 3, c.head_dim});
    ASSERT_TRUE(rope(*ctx_, x.t, std::span<const std::int64_t>(pos), p, y.t));
    // Reference: the documented float32 angle float(pos) * inv_freq, then exact
    // cos/sin and rotation in double.
    std::vector<double> want(x.v.size());
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t h = 0; h < 3; ++h) {
        const std::int64_t base = (t * 3 + h) * c.head_dim;
        for (int d = 0; d < c.head_dim; ++d) want[base + d] = x.v[base + d];
        for (int i = 0; i < c.rot / 2; ++i) {
          const double a = static_cast<float>(pos[t]) * inv[static_cast<std::size_t>(i)];
          const int i0 = c.layout == rope_layout::neox ? i : 2 * i;
          const int i1 = c.layout == rope_layout::neox ? i + c.rot / 2 : 2 * i + 1;
          const double x0 = x.v[base + i0], x1 = x.v[base + i1];
          want[base + i0] = x0 * std::cos(a) - x1 * std::sin(a);
          want[base + i1] = x1 * std::cos(a) + x0 * std::sin(a);
        }
      }
    expect_near_ref(y.v, want, 2e-6, 1e-6, "rope");
  }
}

TEST_P(Ops, EmbeddingEveryFormatMatchesDequantizedRows) {
  auto pool = memory_pool::create();
  buf table({50, 64}, rng_);
  std::vector<std::int32_t> ids = {0, 49, 7, 7, 23, 1, 48};
  auto tids = *tensor::view(ids.data(), dtype::i32, {static_cast<std::int64_t>(ids.size())});
  for (auto fmt : {weight_format::f32, weight_format::f16, weight_format::bf16,
                   weight_format::int8_sym, weight_format::int8_asym, weight_format::int4_sym,
                   weight_format::int4_asym, weight_format::q8_0, weight_format::q4_0}) {
    auto w = quantize(*pool, table.t, fmt, 32);
    ASSERT_TRUE(w) << w.error().message;
    auto full = dequantize(*pool, *w);
    ASSERT_TRUE(full);
    buf out({static_cast<std::int64_t>(ids.size()), 64});
    ASSERT_TRUE(embedding(*ctx_, *w, tids, out.t)) << to_string(fmt);
    for (std::size_t i = 0; i < ids.size(); ++i)
      ASSERT_EQ(std::memcmp(out.v.data() + i * 64, full->row(ids[i]), 64 * 4), 0)
          << to_string(fmt) << " id " << ids[i];
    // The dequantized row is close to the source row (the format's error).
    for (std::size_t i = 0; i < ids.size(); ++i)
      for (int c = 0; c < 64; ++c)
        ASSERT_NEAR(out.v[i * 64 + c], table.v[ids[i] * 64 + c], 0.6) << to_string(fmt);
  }
}

TEST_P(Ops, PatchEmbeddingMatchesDirectConvolution) {
  const std::int64_t hidden = 10, ch = 3, p = 4, batch = 3, h = 8, w = 12;
  buf wt({hidden, ch, p, p}, rng_, 0.2f), bias({hidden}, rng_), in({batch, ch, h, w}, rng_);
  auto pe = patch_embedding::create(wt.t, bias.t);
  ASSERT_TRUE(pe) << pe.error().message;
  const std::int64_t gh = h / p, gw = w / p, np = gh * gw;
  buf out({batch, np, hidden});
  auto r = (*pe)->run(*ctx_, in.t, out.t);
  ASSERT_TRUE(r) << r.error().message;
  std::vector<double> want(out.v.size());
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t py = 0; py < gh; ++py)
      for (std::int64_t px = 0; px < gw; ++px)
        for (std::int64_t o = 0; o < hidden; ++o) {
          double s = bias.v[o];
          for (std::int64_t c = 0; c < ch; ++c)
            for (std::int64_t ky = 0; ky < p; ++ky)
              for (std::int64_t kx = 0; kx < p; ++kx)
                s += double(wt.v[((o * ch + c) * p + ky) * p + kx]) *
                     in.v[((b * ch + c) * h + py * p + ky) * w + px * p + kx];
          want[(b * np + py * gw + px) * hidden + o] = s;
        }
  expect_near_ref(out.v, want, 1e-5, 1e-5, "patch embedding");

  // Batch invariance: each image alone gives the same bits; a second shape
  // gets its own primitive and the first keeps working.
  for (std::int64_t b = 0; b < batch; ++b) {
    auto one_in = *in.t.slice_rows(b, 1);
    buf one({1, np, hidden});
    ASSERT_TRUE((*pe)->run(*ctx_, one_in, one.t));
    EXPECT_EQ(std::memcmp(one.v.data(), out.v.data() + b * np * hidden, one.v.size() * 4), 0) << b;
  }
  buf small({1, ch, p, p}, rng_), sout({1, 1, hidden});
  ASSERT_TRUE((*pe)->run(*ctx_, small.t, sout.t));
  auto ctx1 = cpu::context::create(1);
  ctx1->set_level(GetParam());
  buf out1({batch, np, hidden});
  ASSERT_TRUE((*pe)->run(*ctx1, in.t, out1.t));
  EXPECT_TRUE(bits_equal(out1.v, out.v));
}

INSTANTIATE_TEST_SUITE_P(Isa, Ops, ::testing::Values(cpu::isa::scalar, cpu::isa::avx2),
                         [](const auto& info) { return std::string(cpu::to_string(info.param)); });

// --- scalar vs AVX2 and batch invariance ----------------------------------

// Every op as "run on x (and its row-aligned companion y) into out".
using row_op =
    std::function<result<void>(cpu::context&, const tensor& x, const tensor& y, const tensor& out)>;

struct named_op {
  const char* name;
  row_op fn;
  double tol;  // scalar vs AVX2 (relative, plus the same absolute)
};

std::vector<named_op> all_ops(std::vector<float>& w, std::vector<float>& b, std::int64_t cols) {
  static rope_params neox_params, adj_params;
  adj_params.layout = rope_layout::adjacent;
  auto wt = [&w, cols] { return *tensor::view(w.data(), dtype::f32, {cols}); };
  auto bt = [&b, cols] { return *tensor::view(b.data(), dtype::f32, {cols}); };
  // RoPE sees a row as [1 token, heads, 16] with the row index as position.
  auto rope_fn = [cols](const rope_params& p) {
    return [cols, &p](cpu::context& c, const tensor& x, const tensor&,
                      const tensor& o) -> result<void> {
      const std::int64_t rows = x.rows();
      std::vector<std::int64_t> pos(static_cast<std::size_t>(rows));
      for (std::int64_t i = 0; i < rows; ++i) pos[static_cast<std::size_t>(i)] = 1000 + 37 * i;
      auto x3 = *x.reshape({rows, cols / 16, 16});
      auto o3 = *o.reshape({rows, cols / 16, 16});
      return rope(c, x3, std::span<const std::int64_t>(pos), p, o3);
    };
  };
  return {
      {"rms_norm",
       [wt](cpu::context& c, const tensor& x, const tensor&, const tensor& o) {
         return rms_norm(c, x, wt(), 1e-6f, o);
       },
       1e-5},
      {"layer_norm",
       [wt, bt](cpu::context& c, const tensor& x, const tensor&, const tensor& o) {
         return layer_norm(c, x, wt(), bt(), 1e-5f, o);
       },
       0},
      {"silu",
       [](cpu::context& c, const tensor& x, const tensor&, const tensor& o) {
         return silu(c, x, o);
       },
       1e-6},
      {"gelu_tanh",
       [](cpu::context& c, const tensor& x, const tensor&, const tensor& o) {
         return gelu(c, x, gelu_kind::tanh, o);
       },
       1e-6},
      {"gelu_erf",
       [](cpu::context& c, const tensor& x, const tensor&, const tensor& o) {
         return gelu(c, x, gelu_kind::erf, o);
       },
       2e-6},
      {"gelu_quick",
       [](cpu::context& c, const tensor& x, const tensor&, const tensor& o) {
         return gelu(c, x, gelu_kind::quick, o);
       },
       1e-6},
      {"swiglu",
       [](cpu::context& c, const tensor& x, const tensor& y, const tensor& o) {
         return swiglu(c, x, y, o);
       },
       1e-6},
      {"softmax",
       [](cpu::context& c, const tensor& x, const tensor&, const tensor& o) {
         return softmax(c, x, o, 0.5f);
       },
       1e-6},
      {"add",
       [](cpu::context& c, const tensor& x, const tensor& y, const tensor& o) {
         return add(c, x, y, o);
       },
       0},
      {"rope_neox", rope_fn(neox_params), 0},
      {"rope_adjacent", rope_fn(adj_params), 0},
  };
}

TEST(OpsIsa, Avx2MatchesScalar) {
  auto ctx = cpu::context::create(2);
  if (ctx->hardware_level() < cpu::isa::avx2) GTEST_SKIP() << "no AVX2";
  std::mt19937 rng(5);
  for (std::int64_t cols : {16, 48, 4096 + 16}) {
    buf w({cols}, rng), b({cols}, rng);
    for (const auto& op : all_ops(w.v, b.v, cols)) {
      buf x({5, cols}, rng, 3.0f), y({5, cols}, rng), o_s({5, cols}), o_v({5, cols});
      ctx->set_level(cpu::isa::scalar);
      ASSERT_TRUE(op.fn(*ctx, x.t, y.t, o_s.t)) << op.name;
      ctx->set_level(cpu::isa::avx2);
      ASSERT_TRUE(op.fn(*ctx, x.t, y.t, o_v.t)) << op.name;
      for (std::size_t i = 0; i < o_s.v.size(); ++i)
        ASSERT_LE(std::fabs(o_s.v[i] - o_v.v[i]), op.tol * (1.0 + std::fabs(o_s.v[i])))
            << op.name << " cols " << cols << " [" << i << "] scalar " << o_s.v[i] << " avx2 "
            << o_v.v[i];
    }
  }
}

class OpsBatchInvariance : public ::testing::TestWithParam<cpu::isa> {};

TEST_P(OpsBatchInvariance, RowAloneBatchOf7ChunksAndThreadsAgreeBitwise) {
  auto ctx2 = cpu::context::create(2), ctx1 = cpu::context::create(1);
  if (GetParam() > ctx2->hardware_level()) GTEST_SKIP() << "ISA not available";
  ctx2->set_level(GetParam());
  ctx1->set_level(GetParam());
  std::mt19937 rng(9);
  for (std::int64_t cols : {16, 272, 4096 + 48}) {
    buf w({cols}, rng), b({cols}, rng);
    for (const auto& op : all_ops(w.v, b.v, cols)) {
      SCOPED_TRACE(std::string(op.name) + " cols " + std::to_string(cols));
      // Batch of 7 vs each row alone. RoPE takes the row index as position,
      // so a lone row gets the position it had in the batch via an offset
      // copy: compare only row-wise ops here and RoPE below.
      const bool is_rope = std::string(op.name).rfind("rope", 0) == 0;
      buf x({7, cols}, rng, 2.0f), y({7, cols}, rng), batch_out({7, cols});
      ASSERT_TRUE(op.fn(*ctx2, x.t, y.t, batch_out.t));
      if (!is_rope)
        for (std::int64_t r = 0; r < 7; ++r) {
          buf one({1, cols});
          ASSERT_TRUE(op.fn(*ctx2, *x.t.slice_rows(r, 1), *y.t.slice_rows(r, 1), one.t));
          ASSERT_EQ(std::memcmp(one.v.data(), batch_out.v.data() + r * cols, cols * 4), 0)
              << "row " << r;
        }
      // 100 rows at once vs chunks of 1, 16, 64 (the rows' own positions for
      // RoPE are not preserved by chunking, so it is checked with threads only).
      buf bx({100, cols}, rng), by({100, cols}, rng), whole({100, cols}), whole1({100, cols});
      ASSERT_TRUE(op.fn(*ctx2, bx.t, by.t, whole.t));
      ASSERT_TRUE(op.fn(*ctx1, bx.t, by.t, whole1.t));
      ASSERT_TRUE(bits_equal(whole.v, whole1.v)) << "1 vs 2 threads";
      if (is_rope) continue;
      for (std::int64_t chunk : {1, 16, 64}) {
        buf pieces({100, cols});
        for (std::int64_t r0 = 0; r0 < 100; r0 += chunk) {
          const std::int64_t n = std::min<std::int64_t>(chunk, 100 - r0);
          ASSERT_TRUE(op.fn(*ctx2, *bx.t.slice_rows(r0, n), *by.t.slice_rows(r0, n),
                            *pieces.t.slice_rows(r0, n)));
        }
        ASSERT_TRUE(bits_equal(pieces.v, whole.v)) << "chunk " << chunk;
      }
    }
  }
}

TEST_P(OpsBatchInvariance, RopeTokenAloneMatchesBatch) {
  auto ctx = cpu::context::create(2);
  if (GetParam() > ctx->hardware_level()) GTEST_SKIP() << "ISA not available";
  ctx->set_level(GetParam());
  std::mt19937 rng(11);
  const std::vector<std::int64_t> pos = {5, 900, 3, 70000, 12, 12, 4095};
  for (rope_layout layout : {rope_layout::neox, rope_layout::adjacent}) {
    rope_params p;
    p.layout = layout;
    p.rotary_dims = 48;
    buf x({7, 4, 64}, rng), all({7, 4, 64});
    ASSERT_TRUE(rope(*ctx, x.t, std::span<const std::int64_t>(pos), p, all.t));
    for (std::int64_t t = 0; t < 7; ++t) {
      buf one({1, 4, 64});
      ASSERT_TRUE(
          rope(*ctx, *x.t.slice_rows(t, 1), std::span<const std::int64_t>(&pos[t], 1), p, one.t));
      ASSERT_EQ(std::memcmp(one.v.data(), all.v.data() + t * 256, 256 * 4), 0) << "token " << t;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, OpsBatchInvariance,
                         ::testing::Values(cpu::isa::scalar, cpu::isa::avx2),
                         [](const auto& info) { return std::string(cpu::to_string(info.param)); });

}  // namespace
