// matmul: argument checks, activation quantization, ISA dispatch and the
// split of output panels (or rows) over the device's threads.
#include "kernels/matmul.hpp"

#include <algorithm>
#include <string>

#include "kernels/cpu/matmul_impl.hpp"

namespace troupe::kernels {

namespace {

bool overlaps(const tensor& a, const tensor& b) {
  const auto* a0 = static_cast<const std::byte*>(a.data());
  const auto* b0 = static_cast<const std::byte*>(b.data());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

result<void> check_args(const tensor& x, const packed_matrix& w, const tensor& y) {
  if (w.empty()) return make_error(errc::invalid_argument, "matmul: weight matrix is not packed");
  if (auto r = expect_tensor(x, dtype::f32, 2, "matmul input x"); !r) return r;
  if (auto r = expect_tensor(y, dtype::f32, 2, "matmul output y"); !r) return r;
  if (x.dim(0) < 1 || x.empty_view())
    return make_error(errc::invalid_argument, "matmul: input x has no rows");
  if (x.dim(1) != w.cols())
    return make_error(errc::shape_mismatch, "matmul: x " + x.shape().to_string() + " needs " +
                                                std::to_string(w.cols()) + " columns (weight [" +
                                                std::to_string(w.rows()) + ", " +
                                                std::to_string(w.cols()) + "])");
  if (y.dim(0) != x.dim(0) || y.dim(1) != w.rows() || y.empty_view())
    return make_error(errc::shape_mismatch, "matmul: output y " + y.shape().to_string() +
                                                " must be [" + std::to_string(x.dim(0)) + ", " +
                                                std::to_string(w.rows()) + "]");
  if (overlaps(x, y)) return make_error(errc::invalid_argument, "matmul: x and y overlap");
  return {};
}

// Runs fn(r0, r1, p0, p1) over a split of the output: by panels when there
// are enough of them, else by rows (tiles of 4). Either way every output is
// computed whole by one thread.
template <class Fn>
void split_output(cpu::context& ctx, std::int64_t m, std::int64_t panels, Fn&& fn) {
  if (panels >= 2 * ctx.threads() || m < 8) {
    ctx.pool().parallel_for(panels, 1,
                            [&](std::int64_t p0, std::int64_t p1, int) { fn(0, m, p0, p1); });
  } else {
    ctx.pool().parallel_for(m, 4,
                            [&](std::int64_t r0, std::int64_t r1, int) { fn(r0, r1, 0, panels); });
  }
}

}  // namespace

result<void> matmul(cpu::context& ctx, const tensor& x, const packed_matrix& w, tensor& y) {
  if (auto r = check_args(x, w, y); !r) return r;
  const cpu::mm_layout& l = w.layout();
  const std::int64_t m = x.dim(0);
  const bool avx2 = cpu::effective_isa(ctx.level(), cpu::isa::avx2) >= cpu::isa::avx2;
  const bool avx512 = cpu::effective_isa(ctx.level(), cpu::isa::avx512) >= cpu::isa::avx512 &&
                      ctx.wide_float_matmul();
  const bool vnni = cpu::effective_isa(ctx.level(), cpu::isa::avx512_vnni) >= cpu::isa::avx512_vnni;
  const float* xp = x.data_as<float>();
  float* yp = y.data_as<float>();
  const std::int64_t ldx = l.k, ldy = l.n;

  if (l.is_float()) {
    split_output(ctx, m, l.panels,
                 [&](std::int64_t r0, std::int64_t r1, std::int64_t p0, std::int64_t p1) {
                   if (avx512)
                     cpu::mm_float_avx512(l, w.data(), xp + r0 * ldx, ldx, r1 - r0, yp + r0 * ldy,
                                          ldy, p0, p1);
                   else if (avx2)
                     cpu::mm_float_avx2(l, w.data(), xp + r0 * ldx, ldx, r1 - r0, yp + r0 * ldy,
                                        ldy, p0, p1);
                   else
                     cpu::mm_float_scalar(l, w.data(), xp + r0 * ldx, ldx, r1 - r0, yp + r0 * ldy,
                                          ldy, p0, p1);
                 });
    return {};
  }

  // Integer formats: quantize each activation row once per call.
  const auto codes = static_cast<std::size_t>(m * l.kp);
  const auto per_block = static_cast<std::size_t>(m * l.blocks);
  // With VNNI, the codes + 128 as well (after the scales and sums).
  auto qbuf = ctx.memory().allocate(2 * codes + 8 * per_block + 128 + (vnni ? codes : 0));
  if (!qbuf) return std::unexpected(qbuf.error());
  auto* base = static_cast<std::byte*>((*qbuf)->data());
  auto* q = reinterpret_cast<std::int8_t*>(base);
  auto* a = q + codes;
  // Scales and sums after the codes, 4-byte aligned.
  const std::size_t off = (2 * codes + 63) / 64 * 64;
  auto* d = reinterpret_cast<float*>(base + off);
  auto* s = reinterpret_cast<std::int32_t*>(base + off + 4 * per_block);
  auto* u = reinterpret_cast<std::uint8_t*>(base + (off + 8 * per_block + 63) / 64 * 64);
  ctx.pool().parallel_for(m, 1, [&](std::int64_t r0, std::int64_t r1, int) {
    if (avx2)
      cpu::mm_quantize_rows_avx2(xp, ldx, l.k, r0, r1, q, a, d, s, l.kp);
    else
      cpu::mm_quantize_rows(xp, ldx, l.k, r0, r1, q, a, d, s, l.kp);
    if (vnni) cpu::mm_flip_codes_avx2(q + r0 * l.kp, u + r0 * l.kp, (r1 - r0) * l.kp);
  });
  split_output(ctx, m, l.panels,
               [&](std::int64_t r0, std::int64_t r1, std::int64_t p0, std::int64_t p1) {
                 cpu::mm_int_acts acts;
                 acts.q = q + r0 * l.kp;
                 acts.a = a + r0 * l.kp;
                 acts.d = d + r0 * l.blocks;
                 acts.s = s + r0 * l.blocks;
                 acts.u = vnni ? u + r0 * l.kp : nullptr;
                 acts.kp = l.kp;
                 acts.blocks = l.blocks;
                 if (vnni)
                   cpu::mm_int_avx512_vnni(l, w.data(), acts, r1 - r0, yp + r0 * ldy, ldy, p0, p1);
                 else if (avx2)
                   cpu::mm_int_avx2(l, w.data(), acts, r1 - r0, yp + r0 * ldy, ldy, p0, p1);
                 else
                   cpu::mm_int_scalar(l, w.data(), acts, r1 - r0, yp + r0 * ldy, ldy, p0, p1);
               });
  return {};
}

}  // namespace troupe::kernels
