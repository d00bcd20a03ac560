// RoPE of kernels/ops.hpp: inverse frequencies as transformers computes them
// (float32, LLaMA-3 scaling), per-token cos/sin tables, scalar rotation and
// dispatch to the AVX2 rotation. Contraction is off, so the float32
// arithmetic below is exactly the sequence written (as torch runs it).
#include <algorithm>
#include <array>
#include <cmath>
#include <string>

#include "kernels/cpu/ops_common.hpp"
#include "kernels/cpu/ops_impl.hpp"
#include "kernels/ops.hpp"

#pragma GCC optimize("fp-contract=off")

namespace troupe::kernels {

namespace {

result<int> check_rope_params(const rope_params& p, int head_dim) {
  if (head_dim <= 0 || head_dim > rope_max_head_dim)
    return make_error(errc::invalid_argument, "rope head_dim must be in [1, " +
                                                  std::to_string(rope_max_head_dim) + "], got " +
                                                  std::to_string(head_dim));
  const int rot = p.rotary_dims == 0 ? head_dim : p.rotary_dims;
  if (rot <= 0 || rot > head_dim || rot % 2 != 0)
    return make_error(errc::invalid_argument, "rope rotary_dims must be even and in [2, head_dim=" +
                                                  std::to_string(head_dim) + "], got " +
                                                  std::to_string(rot));
  if (p.layout != rope_layout::neox && p.layout != rope_layout::adjacent)
    return make_error(errc::invalid_argument, "unknown rope layout");
  if (!std::isfinite(p.theta) || p.theta <= 0.0f)
    return make_error(errc::invalid_argument, "rope theta must be finite and > 0");
  if (!p.freq_factors.empty()) {
    if (static_cast<int>(p.freq_factors.size()) != rot / 2)
      return make_error(errc::shape_mismatch, "rope freq_factors must hold rotary_dims/2 = " +
                                                  std::to_string(rot / 2) + " values");
    for (float f : p.freq_factors)
      if (!std::isfinite(f) || f <= 0.0f)
        return make_error(errc::invalid_argument, "rope freq_factors must be finite and > 0");
  }
  if (p.llama3) {
    const auto& s = *p.llama3;
    if (!std::isfinite(s.factor) || s.factor <= 0.0f)
      return make_error(errc::invalid_argument, "rope llama3 factor must be finite and > 0");
    if (!std::isfinite(s.low_freq_factor) || !std::isfinite(s.high_freq_factor) ||
        s.low_freq_factor <= 0.0f || s.high_freq_factor <= s.low_freq_factor)
      return make_error(errc::invalid_argument,
                        "rope llama3 needs 0 < low_freq_factor < high_freq_factor");
    if (s.original_max_position_embeddings <= 0)
      return make_error(errc::invalid_argument,
                        "rope llama3 original_max_position_embeddings must be > 0");
  }
  return rot;
}

}  // namespace

result<void> rope_inv_freq(const rope_params& params, int head_dim, std::span<float> out) {
  auto rot = check_rope_params(params, head_dim);
  if (!rot) return std::unexpected(rot.error());
  const int half = *rot / 2;
  if (static_cast<int>(out.size()) != half)
    return make_error(errc::shape_mismatch, "rope_inv_freq output must hold rotary_dims/2 = " +
                                                std::to_string(half) + " floats");
  // transformers: 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), all float32.
  for (int i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(*rot);
    out[static_cast<std::size_t>(i)] = 1.0f / std::pow(params.theta, e);
  }
  if (!params.freq_factors.empty()) {  // llama.cpp: theta = pos * base^(-2i/d) / factor[i]
    for (int i = 0; i < half; ++i)
      out[static_cast<std::size_t>(i)] /= params.freq_factors[static_cast<std::size_t>(i)];
  }
  if (!params.llama3) return {};
  // transformers' _compute_llama3_parameters, op by op in float32. Python
  // scalars become float32 operands; `scalar / tensor` is
  // tensor.reciprocal() * scalar (torch's __rtruediv__).
  const auto& s = *params.llama3;
  const auto old_len = static_cast<double>(s.original_max_position_embeddings);
  const auto low_wavelen = static_cast<float>(old_len / static_cast<double>(s.low_freq_factor));
  const auto high_wavelen = static_cast<float>(old_len / static_cast<double>(s.high_freq_factor));
  const auto two_pi = static_cast<float>(2.0 * 3.14159265358979323846);
  const auto old_len_f = static_cast<float>(old_len);
  const auto span = static_cast<float>(static_cast<double>(s.high_freq_factor) -
                                       static_cast<double>(s.low_freq_factor));
  for (int i = 0; i < half; ++i) {
    const float inv = out[static_cast<std::size_t>(i)];
    const float wavelen = (1.0f / inv) * two_pi;
    const float llama = wavelen > low_wavelen ? inv / s.factor : inv;
    const float smooth = ((1.0f / wavelen) * old_len_f - s.low_freq_factor) / span;
    const float a = (1.0f - smooth) * llama / s.factor;
    const float b = smooth * llama;
    const float smoothed = a + b;
    const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
    out[static_cast<std::size_t>(i)] = medium ? smoothed : llama;
  }
  return {};
}

namespace {

template <class Pos>
result<void> rope_impl(cpu::context& ctx, const tensor& x, std::span<const Pos> positions,
                       const rope_params& params, const tensor& out) {
  if (auto r = ops_detail::check_rows("rope input", x); !r) return r;
  if (x.ndim() != 3)
    return make_error(errc::shape_mismatch,
                      "rope input must be [tokens, heads, head_dim], got " + x.shape().to_string());
  if (auto r = ops_detail::check_same("rope output", out, x); !r) return r;
  const std::int64_t tokens = x.dim(0);
  const std::int64_t heads = x.dim(1);
  if (x.dim(2) > rope_max_head_dim)
    return make_error(errc::invalid_argument, "rope head_dim " + std::to_string(x.dim(2)) +
                                                  " exceeds " + std::to_string(rope_max_head_dim));
  const int head_dim = static_cast<int>(x.dim(2));
  auto rot_or = check_rope_params(params, head_dim);
  if (!rot_or) return std::unexpected(rot_or.error());
  const int rot = *rot_or;
  if (static_cast<std::int64_t>(positions.size()) != tokens)
    return make_error(errc::shape_mismatch, "rope needs one position per token (" +
                                                std::to_string(tokens) + "), got " +
                                                std::to_string(positions.size()));
  auto pos_at = [&](std::int64_t t) -> std::int64_t {
    return positions[static_cast<std::size_t>(t)];
  };
  for (std::int64_t t = 0; t < tokens; ++t)
    if (pos_at(t) < 0)
      return make_error(errc::invalid_argument, "rope position " + std::to_string(pos_at(t)) +
                                                    " at token " + std::to_string(t) +
                                                    " is negative");
  if (tokens == 0 || heads == 0) return {};

  std::array<float, rope_max_head_dim / 2> inv{};
  if (auto r = rope_inv_freq(params, head_dim, {inv.data(), static_cast<std::size_t>(rot / 2)}); !r)
    return r;
  const bool adjacent = params.layout == rope_layout::adjacent;
  const bool use_avx2 = cpu::effective_isa(ctx.level(), cpu::isa::avx2) >= cpu::isa::avx2;
  const std::int64_t token_elems = heads * head_dim;
  const std::int64_t grain = std::max<std::int64_t>(1, 4096 / token_elems);

  ctx.pool().parallel_for(tokens, grain, [&](std::int64_t b, std::int64_t e, int) {
    std::array<float, rope_max_head_dim> cs{}, sn{};
    for (std::int64_t t = b; t < e; ++t) {
      // transformers: freqs = inv_freq.float() @ position_ids.float(), then cos/sin in float32.
      const auto pos = static_cast<float>(pos_at(t));
      for (int i = 0; i < rot / 2; ++i) {
        const float angle = pos * inv[static_cast<std::size_t>(i)];
        const float c = std::cos(angle), s = std::sin(angle);
        if (adjacent) {
          cs[static_cast<std::size_t>(2 * i)] = cs[static_cast<std::size_t>(2 * i + 1)] = c;
          sn[static_cast<std::size_t>(2 * i)] = sn[static_cast<std::size_t>(2 * i + 1)] = s;
        } else {
          cs[static_cast<std::size_t>(i)] = c;
          sn[static_cast<std::size_t>(i)] = s;
        }
      }
      const float* xt = x.data_as<float>() + t * token_elems;
      float* yt = out.data_as<float>() + t * token_elems;
      if (use_avx2) {
        cpu::rope_token_avx2(xt, yt, static_cast<int>(heads), head_dim, rot, adjacent, cs.data(),
                             sn.data());
        continue;
      }
      for (std::int64_t h = 0; h < heads; ++h) {
        const float* xh = xt + h * head_dim;
        float* yh = yt + h * head_dim;
        if (adjacent) {
          for (int i = 0; i < rot; i += 2) {
            const float a = xh[i], bb = xh[i + 1];
            const float c = cs[static_cast<std::size_t>(i)], s = sn[static_cast<std::size_t>(i)];
            yh[i] = a * c - bb * s;
            yh[i + 1] = bb * c + a * s;
          }
        } else {
          const int half = rot / 2;
          for (int i = 0; i < half; ++i) {
            const float a = xh[i], bb = xh[i + half];
            const float c = cs[static_cast<std::size_t>(i)], s = sn[static_cast<std::size_t>(i)];
            yh[i] = a * c - bb * s;
            yh[i + half] = bb * c + a * s;
          }
        }
        if (yh != xh) std::copy(xh + rot, xh + head_dim, yh + rot);
      }
    }
  });
  return {};
}

}  // namespace

result<void> rope(cpu::context& ctx, const tensor& x, std::span<const std::int32_t> positions,
                  const rope_params& params, const tensor& out) {
  return rope_impl(ctx, x, positions, params, out);
}

result<void> rope(cpu::context& ctx, const tensor& x, std::span<const std::int64_t> positions,
                  const rope_params& params, const tensor& out) {
  return rope_impl(ctx, x, positions, params, out);
}

result<void> rope(cpu::context& ctx, const tensor& x, const tensor& positions,
                  const rope_params& params, const tensor& out) {
  if (positions.type() != dtype::i32)
    return make_error(errc::unsupported_dtype, "rope positions must be i32, got " +
                                                   std::string(to_string(positions.type())));
  if (positions.ndim() != 1 || !positions.is_contiguous() ||
      (positions.numel() > 0 && positions.empty_view()))
    return make_error(errc::shape_mismatch, "rope positions must be a dense [tokens] tensor, got " +
                                                positions.shape().to_string());
  return rope_impl(ctx, x,
                   std::span<const std::int32_t>(positions.data_as<std::int32_t>(),
                                                 static_cast<std::size_t>(positions.numel())),
                   params, out);
}

}  // namespace troupe::kernels
