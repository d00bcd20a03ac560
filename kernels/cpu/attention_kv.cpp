// The paged KV cache: creation, validation, appending tokens (with f16
// rounding or int8 quantization) and the per-block key summaries.
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/half.hpp"
#include "kernels/kv_layout.hpp"

namespace troupe::kernels {
namespace {

constexpr int max_head_dim = 1 << 14;
constexpr int max_block_size = 1 << 20;

result<void> check_config(const kv_cache_config& c) {
  if (c.block_size < 1 || c.block_size > max_block_size)
    return make_error(errc::invalid_argument, "kv cache block_size must be 1.." +
                                                  std::to_string(max_block_size) + ", got " +
                                                  std::to_string(c.block_size));
  if (c.n_kv_heads < 1)
    return make_error(errc::invalid_argument,
                      "kv cache n_kv_heads must be >= 1, got " + std::to_string(c.n_kv_heads));
  if (c.head_dim < 1 || c.head_dim > max_head_dim)
    return make_error(errc::invalid_argument, "kv cache head_dim must be 1.." +
                                                  std::to_string(max_head_dim) + ", got " +
                                                  std::to_string(c.head_dim));
  if (c.n_blocks < 1)
    return make_error(errc::invalid_argument,
                      "kv cache n_blocks must be >= 1, got " + std::to_string(c.n_blocks));
  if (c.type != dtype::f32 && c.type != dtype::f16 && c.type != dtype::i8)
    return make_error(errc::unsupported_dtype, "kv cache dtype must be f32, f16 or i8, got " +
                                                   std::string(to_string(c.type)));
  return {};
}

result<void> check_part(const tensor& t, dtype want, const shape_t& shape, const char* what) {
  if (t.empty_view())
    return make_error(errc::invalid_argument, std::string("kv cache ") + what + " is missing");
  if (t.type() != want)
    return make_error(errc::unsupported_dtype, std::string("kv cache ") + what + " must be " +
                                                   std::string(to_string(want)) + ", got " +
                                                   std::string(to_string(t.type())));
  if (!(t.shape() == shape))
    return make_error(errc::shape_mismatch, std::string("kv cache ") + what + " must be " +
                                                shape.to_string() + ", got " +
                                                t.shape().to_string());
  if (!t.is_contiguous())
    return make_error(errc::invalid_argument,
                      std::string("kv cache ") + what + " must be contiguous");
  return {};
}

// The value the attention kernel will see for element c of a stored row.
float stored_value(const paged_kv_cache& cache, const std::byte* row, float scale, int c) {
  switch (cache.config.type) {
    case dtype::f16:
      return to_f32(reinterpret_cast<const f16*>(row)[c]);
    case dtype::i8:
      return scale * static_cast<float>(reinterpret_cast<const std::int8_t*>(row)[c]);
    default:
      return reinterpret_cast<const float*>(row)[c];
  }
}

// Byte offset of (block, head, slot) in k / v, and element offset in scales.
struct slot_ref {
  std::size_t bytes;
  std::size_t scale_index;
};

slot_ref locate(const kv_cache_config& c, std::int64_t block, int head, std::int64_t slot) {
  const auto row = (static_cast<std::size_t>(block) * static_cast<std::size_t>(c.n_kv_heads) +
                    static_cast<std::size_t>(head)) *
                       static_cast<std::size_t>(c.block_size) +
                   static_cast<std::size_t>(slot);
  return {row * static_cast<std::size_t>(c.head_dim) * block_bytes(c.type), row};
}

float* summary_of(const paged_kv_cache& cache, std::int64_t block, int head) {
  const auto& c = cache.config;
  return cache.k_summary.data_as<float>() +
         (static_cast<std::size_t>(block) * static_cast<std::size_t>(c.n_kv_heads) +
          static_cast<std::size_t>(head)) *
             2 * static_cast<std::size_t>(c.head_dim);
}

// Stores one token row of one head; returns its scale (1 for float types).
float store_row(const kv_cache_config& c, const float* src, std::byte* dst) {
  const int d = c.head_dim;
  if (c.type == dtype::f32) {
    std::memcpy(dst, src, static_cast<std::size_t>(d) * sizeof(float));
    return 1.0f;
  }
  if (c.type == dtype::f16) {
    auto* out = reinterpret_cast<f16*>(dst);
    for (int i = 0; i < d; ++i) out[i] = to_f16(src[i]);
    return 1.0f;
  }
  float amax = 0.0f;
  for (int i = 0; i < d; ++i) amax = std::fmax(amax, std::fabs(src[i]));
  const float scale = amax / 127.0f;
  auto* out = reinterpret_cast<std::int8_t*>(dst);
  for (int i = 0; i < d; ++i) {
    float qv = scale > 0.0f ? std::nearbyint(src[i] / scale) : 0.0f;
    if (!(qv >= -127.0f)) qv = qv > 0.0f ? 127.0f : (qv < 0.0f ? -127.0f : 0.0f);  // NaN -> 0
    if (qv > 127.0f) qv = 127.0f;
    out[i] = static_cast<std::int8_t>(qv);
  }
  return scale;
}

void update_summary(const paged_kv_cache& cache, std::int64_t block, int head, std::int64_t slot,
                    const std::byte* row, float scale, bool restart) {
  float* mn = summary_of(cache, block, head);
  float* mx = mn + cache.config.head_dim;
  for (int c = 0; c < cache.config.head_dim; ++c) {
    const float x = stored_value(cache, row, scale, c);
    if (restart || slot == 0) {
      mn[c] = x;
      mx[c] = x;
    } else {
      mn[c] = std::fmin(mn[c], x);
      mx[c] = std::fmax(mx[c], x);
    }
  }
}

// A zero-filled tensor whose pages the kernel may back with transparent huge
// pages: blocks are read in scattered order, and with 4 KiB pages a long
// context overflows the TLB (one miss per block).
result<tensor> zeros_huge(memory_pool& pool, dtype t, const shape_t& shape) {
  if (!pool.host_accessible())
    return make_error(errc::unsupported_op,
                      "a paged cache in a device's memory is made by create_paged_kv_cache");
  auto out = tensor::empty(pool, t, shape);
  if (!out) return out;
  constexpr std::uintptr_t huge = std::uintptr_t{2} << 20;
  const auto begin = reinterpret_cast<std::uintptr_t>(out->data());
  const std::uintptr_t first = (begin + huge - 1) & ~(huge - 1);
  const std::uintptr_t last = (begin + out->nbytes()) & ~(huge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  std::memset(out->data(), 0, out->nbytes());
  return out;
}

}  // namespace

result<paged_kv_cache> paged_kv_cache::create(memory_pool& pool, const kv_cache_config& config) {
  if (auto ok = check_config(config); !ok) return std::unexpected(ok.error());
  paged_kv_cache cache;
  cache.config = config;
  const shape_t data_shape{config.n_blocks, config.n_kv_heads, config.block_size, config.head_dim};
  auto k = zeros_huge(pool, config.type, data_shape);
  if (!k) return std::unexpected(k.error());
  auto v = zeros_huge(pool, config.type, data_shape);
  if (!v) return std::unexpected(v.error());
  cache.k = std::move(*k);
  cache.v = std::move(*v);
  if (config.type == dtype::i8) {
    const shape_t scale_shape{config.n_blocks, config.n_kv_heads, config.block_size};
    auto ks = zeros_huge(pool, dtype::f32, scale_shape);
    if (!ks) return std::unexpected(ks.error());
    auto vs = zeros_huge(pool, dtype::f32, scale_shape);
    if (!vs) return std::unexpected(vs.error());
    cache.k_scales = std::move(*ks);
    cache.v_scales = std::move(*vs);
  }
  if (config.summaries) {
    auto s = zeros_huge(pool, dtype::f32, {config.n_blocks, config.n_kv_heads, 2, config.head_dim});
    if (!s) return std::unexpected(s.error());
    cache.k_summary = std::move(*s);
  }
  return cache;
}

result<void> paged_kv_cache::validate() const {
  if (auto ok = check_config(config); !ok) return ok;
  const shape_t data_shape{config.n_blocks, config.n_kv_heads, config.block_size, config.head_dim};
  if (auto ok = check_part(k, config.type, data_shape, "k"); !ok) return ok;
  if (auto ok = check_part(v, config.type, data_shape, "v"); !ok) return ok;
  if (config.type == dtype::i8) {
    const shape_t scale_shape{config.n_blocks, config.n_kv_heads, config.block_size};
    if (auto ok = check_part(k_scales, dtype::f32, scale_shape, "k_scales"); !ok) return ok;
    if (auto ok = check_part(v_scales, dtype::f32, scale_shape, "v_scales"); !ok) return ok;
  }
  if (config.summaries || has_summaries()) {
    if (auto ok = check_part(k_summary, dtype::f32,
                             {config.n_blocks, config.n_kv_heads, 2, config.head_dim}, "k_summary");
        !ok)
      return ok;
  }
  return {};
}

result<void> check_block_table(const kv_cache_config& config,
                               std::span<const std::int32_t> block_table, std::int64_t length) {
  if (length < 0)
    return make_error(errc::invalid_argument,
                      "sequence length must be >= 0, got " + std::to_string(length));
  if (config.block_size < 1)
    return make_error(errc::invalid_argument, "kv cache block_size must be >= 1");
  const std::int64_t needed = (length + config.block_size - 1) / config.block_size;
  if (static_cast<std::int64_t>(block_table.size()) < needed)
    return make_error(errc::invalid_argument,
                      "block table has " + std::to_string(block_table.size()) + " blocks but " +
                          std::to_string(length) + " tokens need " + std::to_string(needed));
  for (std::int64_t i = 0; i < needed; ++i) {
    const std::int32_t id = block_table[static_cast<std::size_t>(i)];
    if (id < 0 || id >= config.n_blocks)
      return make_error(errc::invalid_argument, "block table entry " + std::to_string(i) +
                                                    " is block " + std::to_string(id) +
                                                    ", outside the pool of " +
                                                    std::to_string(config.n_blocks));
  }
  return {};
}

result<void> append_kv(paged_kv_cache& cache, std::span<const std::int32_t> block_table,
                       std::int64_t start, const tensor& k, const tensor& v) {
  if (auto ok = cache.validate(); !ok) return ok;
  const auto& c = cache.config;
  if (auto ok = expect_tensor(k, dtype::f32, 3, "append_kv k"); !ok) return ok;
  if (auto ok = expect_tensor(v, dtype::f32, 3, "append_kv v"); !ok) return ok;
  if (k.dim(1) != c.n_kv_heads || k.dim(2) != c.head_dim)
    return make_error(errc::shape_mismatch,
                      "append_kv k must be [n, " + std::to_string(c.n_kv_heads) + ", " +
                          std::to_string(c.head_dim) + "], got " + k.shape().to_string());
  if (!(v.shape() == k.shape()))
    return make_error(errc::shape_mismatch, "append_kv v " + v.shape().to_string() +
                                                " differs from k " + k.shape().to_string());
  if (start < 0 || start > (std::int64_t{1} << 40))
    return make_error(errc::invalid_argument,
                      "append_kv start must be >= 0, got " + std::to_string(start));
  const std::int64_t n = k.dim(0);
  if (auto ok = check_block_table(c, block_table, start + n); !ok) return ok;
  const bool quant = c.type == dtype::i8;
  for (std::int64_t t = 0; t < n; ++t) {
    const std::int64_t pos = start + t;
    const std::int64_t block = block_table[static_cast<std::size_t>(pos / c.block_size)];
    const std::int64_t slot = pos % c.block_size;
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const slot_ref ref = locate(c, block, h, slot);
      const float* ksrc = k.data_as<const float>() + (t * c.n_kv_heads + h) * c.head_dim;
      const float* vsrc = v.data_as<const float>() + (t * c.n_kv_heads + h) * c.head_dim;
      std::byte* kdst = cache.k.data_as<std::byte>() + ref.bytes;
      std::byte* vdst = cache.v.data_as<std::byte>() + ref.bytes;
      const float ks = store_row(c, ksrc, kdst);
      const float vs = store_row(c, vsrc, vdst);
      if (quant) {
        cache.k_scales.data_as<float>()[ref.scale_index] = ks;
        cache.v_scales.data_as<float>()[ref.scale_index] = vs;
      }
      if (cache.has_summaries()) update_summary(cache, block, h, slot, kdst, ks, false);
    }
  }
  return {};
}

result<void> build_kv_summaries(paged_kv_cache& cache, std::span<const std::int32_t> block_table,
                                std::int64_t length) {
  if (auto ok = cache.validate(); !ok) return ok;
  if (!cache.has_summaries())
    return make_error(errc::invalid_argument, "kv cache was created without summaries");
  const auto& c = cache.config;
  if (auto ok = check_block_table(c, block_table, length); !ok) return ok;
  for (std::int64_t pos = 0; pos < length; ++pos) {
    const std::int64_t block = block_table[static_cast<std::size_t>(pos / c.block_size)];
    const std::int64_t slot = pos % c.block_size;
    for (int h = 0; h < c.n_kv_heads; ++h) {
      const slot_ref ref = locate(c, block, h, slot);
      const float scale =
          c.type == dtype::i8 ? cache.k_scales.data_as<float>()[ref.scale_index] : 1.0f;
      update_summary(cache, block, h, slot, cache.k.data_as<std::byte>() + ref.bytes, scale,
                     slot == 0);
    }
  }
  return {};
}

}  // namespace troupe::kernels
