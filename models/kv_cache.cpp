#include "models/kv_cache.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace troupe::models {

result<kv_cache> kv_cache::create(kernels::memory_pool& pool, int layers, int n_kv_heads,
                                  int head_dim, const kv_options& opts) {
  return create_with(
      [&pool](const kernels::kv_cache_config& cfg) {
        return kernels::paged_kv_cache::create(pool, cfg);
      },
      layers, n_kv_heads, head_dim, opts);
}

result<kv_cache> kv_cache::create(kernels::device& dev, int layers, int n_kv_heads, int head_dim,
                                  const kv_options& opts) {
  auto c = create_with(
      [&dev](const kernels::kv_cache_config& cfg) {
        return kernels::create_paged_kv_cache(dev, cfg);
      },
      layers, n_kv_heads, head_dim, opts);
  if (c && !dev.host_visible()) c->dev_ = &dev;
  return c;
}

result<kv_cache> kv_cache::create_with(
    const std::function<result<kernels::paged_kv_cache>(const kernels::kv_cache_config&)>& make,
    int layers, int n_kv_heads, int head_dim, const kv_options& opts) {
  if (layers < 1 || n_kv_heads < 1 || head_dim < 1)
    return make_error(errc::invalid_argument, "bad KV cache shape");
  if (opts.block_size < 1 || opts.block_size > 4096)
    return make_error(errc::invalid_argument, "KV block size must be 1..4096");
  if (opts.capacity_tokens < 1)
    return make_error(errc::invalid_argument, "KV capacity must be positive");
  if (opts.window < 0 || opts.sinks < 0)
    return make_error(errc::invalid_argument, "window and sinks must be >= 0");
  kv_cache c;
  c.opts_ = opts;
  c.n_blocks_ =
      (opts.capacity_tokens + opts.block_size - 1) / opts.block_size + 1;  // + the hole block
  kernels::kv_cache_config cfg;
  cfg.block_size = opts.block_size;
  cfg.n_kv_heads = n_kv_heads;
  cfg.head_dim = head_dim;
  cfg.type = opts.type;
  cfg.n_blocks = c.n_blocks_;
  cfg.summaries = opts.summaries;
  for (int l = 0; l < layers; ++l) {
    auto layer = make(cfg);
    if (!layer) return std::unexpected(layer.error());
    c.layers_.push_back(std::move(*layer));
  }
  for (std::int64_t b = c.n_blocks_ - 1; b >= 1; --b)
    c.free_.push_back(static_cast<std::int32_t>(b));
  return c;
}

seq_id kv_cache::add_sequence() {
  const seq_id id = next_++;
  seqs_[id];
  return id;
}

void kv_cache::release(seq_id s) {
  auto it = seqs_.find(s);
  if (it == seqs_.end()) return;
  if (!named_)
    for (auto b : it->second.table)
      if (b != 0) free_.push_back(b);
  seqs_.erase(it);
}

result<void> kv_cache::name_blocks() {
  if (named_) return {};
  if (!seqs_.empty())
    return make_error(errc::invalid_argument,
                      "the scheduler can name a KV cache's blocks only while it holds no sequence");
  if (opts_.window > 0)
    return make_error(errc::invalid_argument,
                      "a KV cache with a sliding window frees its own blocks: the scheduler "
                      "cannot name them");
  named_ = true;
  return {};
}

result<void> kv_cache::assign(seq_id s, std::int32_t from, std::span<const std::int32_t> ids,
                              std::int64_t length) {
  if (!named_) return make_error(errc::invalid_argument, "this KV cache picks its own blocks");
  auto it = seqs_.find(s);
  if (it == seqs_.end())
    return make_error(errc::invalid_argument, "unknown sequence " + std::to_string(s));
  auto& seq = it->second;
  const std::int64_t B = opts_.block_size;
  for (auto id : ids)
    if (id < 1 || id >= n_blocks_)
      return make_error(
          errc::invalid_argument,
          "KV block id " + std::to_string(id) + " is outside 1.." + std::to_string(n_blocks_ - 1));
  if (seq.table.empty() && seq.length == 0) {
    if (from != 0)
      return make_error(
          errc::invalid_argument,
          "a new sequence's blocks must start at entry 0, not " + std::to_string(from));
    if (length < 0 || length > static_cast<std::int64_t>(ids.size()) * B)
      return make_error(errc::invalid_argument, "a cached prefix of " + std::to_string(length) +
                                                    " tokens needs more than " +
                                                    std::to_string(ids.size()) + " blocks");
    seq.table.assign(ids.begin(), ids.end());
    seq.length = length;
    return {};
  }
  if (length != seq.length)
    return make_error(errc::invalid_argument,
                      "sequence " + std::to_string(s) + " holds " + std::to_string(seq.length) +
                          " tokens, the blocks were named for " + std::to_string(length));
  const std::int64_t holding = (seq.length + B - 1) / B;
  if (from < holding || from > static_cast<std::int64_t>(seq.table.size()))
    return make_error(errc::invalid_argument,
                      "new blocks from entry " + std::to_string(from) + " of sequence " +
                          std::to_string(s) + " would drop its tokens or leave a gap (" +
                          std::to_string(holding) + " entries hold tokens, " +
                          std::to_string(seq.table.size()) + " in its table)");
  seq.table.resize(static_cast<std::size_t>(from));
  seq.table.insert(seq.table.end(), ids.begin(), ids.end());
  return {};
}

result<void> kv_cache::reserve(seq_id s, std::int64_t length) {
  auto it = seqs_.find(s);
  if (it == seqs_.end())
    return make_error(errc::invalid_argument, "unknown sequence " + std::to_string(s));
  auto& table = it->second.table;
  const auto need = static_cast<std::size_t>((length + opts_.block_size - 1) / opts_.block_size);
  if (need <= table.size()) return {};
  if (named_)
    return make_error(errc::invalid_argument,
                      "sequence " + std::to_string(s) + " needs " + std::to_string(need) +
                          " KV blocks but the scheduler named " + std::to_string(table.size()));
  const std::size_t more = need - table.size();
  if (more > free_.size())
    return make_error(errc::out_of_memory, "KV cache full: " + std::to_string(more) +
                                               " blocks needed, " + std::to_string(free_.size()) +
                                               " free");
  for (std::size_t i = 0; i < more; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  return {};
}

result<void> kv_cache::commit(seq_id s, std::int64_t length) {
  auto it = seqs_.find(s);
  if (it == seqs_.end())
    return make_error(errc::invalid_argument, "unknown sequence " + std::to_string(s));
  auto& seq = it->second;
  if (length < seq.length ||
      length > static_cast<std::int64_t>(seq.table.size()) * opts_.block_size)
    return make_error(errc::invalid_argument, "bad KV length");
  seq.length = length;
  if (opts_.window > 0) {
    // The next query sits at position `length`; it needs keys > length - window
    // and keys < sinks. A block [b*B, (b+1)*B) is dead when it ends at or
    // before the window's start and starts at or after the sinks.
    const std::int64_t B = opts_.block_size;
    const std::int64_t window_start = length + 1 - opts_.window;
    for (std::size_t b = 0; b < seq.table.size(); ++b) {
      const std::int64_t lo = static_cast<std::int64_t>(b) * B, hi = lo + B;
      if (seq.table[b] != 0 && hi <= window_start && lo >= opts_.sinks) {
        free_.push_back(seq.table[b]);
        seq.table[b] = 0;
      }
    }
  }
  return {};
}

std::int64_t kv_cache::length(seq_id s) const {
  auto it = seqs_.find(s);
  return it == seqs_.end() ? 0 : it->second.length;
}

std::span<const std::int32_t> kv_cache::block_table(seq_id s) const {
  auto it = seqs_.find(s);
  if (it == seqs_.end()) return {};
  return it->second.table;
}

std::int64_t kv_cache::blocks_held(const kv_options& opts, std::int64_t committed,
                                   std::int64_t reserved) {
  const std::int64_t B = opts.block_size;
  if (B < 1) return 0;
  committed = std::max<std::int64_t>(committed, 0);
  reserved = std::max(reserved, committed);
  const std::int64_t entries = reserved / B + (reserved % B != 0);
  if (opts.window <= 0) return entries;
  // commit() frees block b when (b + 1) * B <= committed + 1 - window and
  // b * B >= sinks: the blocks [ceil(sinks / B), floor(window_start / B)).
  const std::int64_t window_start = committed + 1 - opts.window;
  if (window_start <= 0) return entries;
  const std::int64_t dead_lo = opts.sinks / B + (opts.sinks % B != 0);
  const std::int64_t dead_hi = std::min(entries, window_start / B);
  return entries - std::max<std::int64_t>(0, dead_hi - dead_lo);
}

kv_usage kv_cache::usage() const {
  kv_usage u;
  u.total_blocks = total_blocks();
  u.free_blocks = free_blocks();
  if (named_) {  // what no table holds (the scheduler also keeps cached blocks)
    std::vector<bool> held(static_cast<std::size_t>(n_blocks_), false);
    std::int64_t n = 0;
    for (const auto& [id, seq] : seqs_)
      for (auto b : seq.table)
        if (b > 0 && b < n_blocks_ && !held[static_cast<std::size_t>(b)]) {
          held[static_cast<std::size_t>(b)] = true;
          ++n;
        }
    u.free_blocks = total_blocks() - n;
  }
  u.sequences = static_cast<std::int64_t>(seqs_.size());
  for (const auto& [id, seq] : seqs_) u.tokens += seq.length;
  return u;
}

std::size_t kv_snapshot::block_bytes() const {
  if (n_kv_heads < 1 || head_dim < 1 || block_size < 1) return 0;
  if (type != kernels::dtype::f32 && type != kernels::dtype::f16 && type != kernels::dtype::i8)
    return 0;
  // Each factor is below 2^31, so the slot count fits; cap the total at 2^40.
  const auto slots = static_cast<unsigned __int128>(n_kv_heads) * static_cast<unsigned>(block_size);
  const unsigned __int128 bytes =
      2 * slots * static_cast<unsigned>(head_dim) * kernels::block_bytes(type) +
      (type == kernels::dtype::i8 ? 2 * slots * sizeof(float) : 0);
  if (bytes > (static_cast<unsigned __int128>(1) << 40)) return 0;
  return static_cast<std::size_t>(bytes);
}

namespace {

// Longest sequence an import accepts, and most block-table entries (window
// holes included) it will allocate.
constexpr std::int64_t max_import_tokens = std::int64_t{1} << 40;
constexpr std::int64_t max_import_entries = std::int64_t{1} << 24;

// The byte ranges of one block in one layer's tensors, in snapshot order.
struct block_parts {
  std::size_t data_bytes = 0;   // k (and v) bytes of one block
  std::size_t scale_bytes = 0;  // k (and v) scale bytes of one block (i8)
};

block_parts parts_of(const kernels::kv_cache_config& c) {
  block_parts p;
  const auto slots =
      static_cast<std::size_t>(c.n_kv_heads) * static_cast<std::size_t>(c.block_size);
  p.data_bytes = slots * static_cast<std::size_t>(c.head_dim) * kernels::block_bytes(c.type);
  p.scale_bytes = c.type == kernels::dtype::i8 ? slots * sizeof(float) : 0;
  return p;
}

}  // namespace

result<kv_snapshot> kv_cache::export_sequence(seq_id s, std::int32_t from_block) const {
  if (from_block < 0) return make_error(errc::invalid_argument, "export: a negative first block");
  auto it = seqs_.find(s);
  if (it == seqs_.end())
    return make_error(errc::invalid_argument, "export: unknown sequence " + std::to_string(s));
  const auto& seq = it->second;
  const auto& c = layers_.front().config;
  kv_snapshot snap;
  snap.layers = layers();
  snap.n_kv_heads = c.n_kv_heads;
  snap.head_dim = c.head_dim;
  snap.block_size = c.block_size;
  snap.type = c.type;
  snap.window = opts_.window;
  snap.sinks = opts_.sinks;
  snap.length = seq.length;
  const std::int64_t B = c.block_size;
  const std::int64_t entries = (seq.length + B - 1) / B;
  for (std::int64_t b = 0; b < entries; ++b)
    if (b >= from_block && seq.table[static_cast<std::size_t>(b)] != 0) {
      snap.live.push_back(static_cast<std::int32_t>(b));
      if (named_) snap.ids.push_back(seq.table[static_cast<std::size_t>(b)]);
    }
  const block_parts p = parts_of(c);
  const std::size_t per_block = 2 * p.data_bytes + 2 * p.scale_bytes;
  snap.data.resize(static_cast<std::size_t>(snap.layers) * snap.live.size() * per_block);
  // Slots past the length in the last block hold stale data of earlier
  // owners: they stay zero in the snapshot.
  const std::int64_t used_in_last = seq.length - (entries - 1) * B;
  const std::size_t row_bytes = static_cast<std::size_t>(c.head_dim) * kernels::block_bytes(c.type);
  std::byte* out = snap.data.data();
  std::vector<std::byte> scratch[4];
  for (const auto& layer : layers_) {
    for (auto index : snap.live) {
      const auto id = static_cast<std::size_t>(seq.table[static_cast<std::size_t>(index)]);
      const std::size_t used = index == entries - 1 ? static_cast<std::size_t>(used_in_last)
                                                    : static_cast<std::size_t>(B);
      const std::byte* parts[4] = {nullptr, nullptr, nullptr, nullptr};
      const kernels::tensor* whole[4] = {&layer.k, &layer.v, &layer.k_scales, &layer.v_scales};
      for (int part = 0; part < (p.scale_bytes != 0 ? 4 : 2); ++part) {
        const std::size_t bytes = part < 2 ? p.data_bytes : p.scale_bytes;
        if (dev_ == nullptr) {
          parts[part] = whole[part]->data_as<const std::byte>() + id * bytes;
          continue;
        }
        // The block's part out of device memory first.
        auto block = whole[part]->slice_rows(static_cast<std::int64_t>(id), 1);
        if (!block) return std::unexpected(block.error());
        scratch[part].resize(bytes);
        if (auto r = dev_->read(*block, scratch[part]); !r) return std::unexpected(r.error());
        parts[part] = scratch[part].data();
      }
      for (int part = 0; part < 4; ++part) {
        if (parts[part] == nullptr) continue;
        const std::size_t slot_bytes = part < 2 ? row_bytes : sizeof(float);
        const std::size_t bytes = part < 2 ? p.data_bytes : p.scale_bytes;
        for (int h = 0; h < c.n_kv_heads; ++h) {  // head-major: copy the used slots of each head
          const std::size_t at =
              static_cast<std::size_t>(h) * static_cast<std::size_t>(B) * slot_bytes;
          std::memcpy(out + at, parts[part] + at, used * slot_bytes);
        }
        out += bytes;
      }
    }
  }
  return snap;
}

namespace {

/// The tensors of one layer a block has rows in, in slot order.
std::vector<const kernels::tensor*> block_rows(const kernels::paged_kv_cache& l) {
  std::vector<const kernels::tensor*> v{&l.k, &l.v};
  if (!l.k_scales.empty_view()) v.push_back(&l.k_scales);
  if (!l.v_scales.empty_view()) v.push_back(&l.v_scales);
  if (l.has_summaries()) v.push_back(&l.k_summary);
  return v;
}

std::size_t row_bytes(const kernels::tensor& t) {
  const auto rows = t.shape()[0];
  return rows > 0 ? t.nbytes() / static_cast<std::size_t>(rows) : 0;
}

}  // namespace

std::size_t kv_cache::slot_bytes() const {
  std::size_t n = 0;
  for (const auto& l : layers_)
    for (const auto* t : block_rows(l)) n += row_bytes(*t);
  return n;
}

namespace {

/// Calls `copy(tensor, row bytes, offset in the slot)` for each row block
/// `id` has, every layer, in slot order, after checking the id and the
/// slot's size; stops at the first error.
template <class F>
result<void> for_each_block_row(const std::vector<kernels::paged_kv_cache>& layers,
                                std::int64_t n_blocks, std::int32_t id, std::size_t slot,
                                std::size_t want, const char* what, F&& copy) {
  if (id < 1 || id >= n_blocks || slot != want)
    return make_error(errc::invalid_argument, std::string(what) + ": block " + std::to_string(id) +
                                                  " or a slot of " + std::to_string(slot) +
                                                  " bytes does not fit this cache");
  std::size_t at = 0;
  for (const auto& l : layers)
    for (const auto* t : block_rows(l)) {
      const auto n = row_bytes(*t);
      if (auto r = copy(*t, n, at); !r) return r;
      at += n;
    }
  return {};
}

}  // namespace

result<void> kv_cache::read_block(std::int32_t id, std::span<std::byte> out) const {
  return for_each_block_row(
      layers_, n_blocks_, id, out.size(), slot_bytes(), "read_block",
      [&](const kernels::tensor& t, std::size_t n, std::size_t at) -> result<void> {
        if (dev_ == nullptr) {
          std::memcpy(out.data() + at,
                      t.data_as<const std::byte>() + n * static_cast<std::size_t>(id), n);
          return {};
        }
        auto row = t.slice_rows(id, 1);
        if (!row) return std::unexpected(row.error());
        return dev_->read(*row, out.subspan(at, n));
      });
}

result<void> kv_cache::write_block(std::int32_t id, std::span<const std::byte> in) {
  return for_each_block_row(
      layers_, n_blocks_, id, in.size(), slot_bytes(), "write_block",
      [&](const kernels::tensor& t, std::size_t n, std::size_t at) -> result<void> {
        if (dev_ == nullptr) {
          std::memcpy(t.data_as<std::byte>() + n * static_cast<std::size_t>(id), in.data() + at, n);
          return {};
        }
        auto row = t.slice_rows(id, 1);
        if (!row) return std::unexpected(row.error());
        return dev_->write(*row, in.subspan(at, n));
      });
}

/// copy_blocks_in for a cache in a device's memory: each part of a block
/// is written through the device, and the block's key summary is rebuilt in
/// a one-block host cache (the same kernel as on the host) and written too.
static result<void> copy_blocks_to_device(std::vector<kernels::paged_kv_cache>& layers,
                                          kernels::device& dev,
                                          const std::vector<std::int32_t>& table,
                                          const kv_snapshot& snap, const block_parts& p) {
  const std::int64_t B = snap.block_size;
  const std::byte* in = snap.data.data();
  std::shared_ptr<kernels::memory_pool> host;
  std::optional<kernels::paged_kv_cache> one;  // a host cache of one block
  for (auto& layer : layers) {
    kernels::tensor* whole[4] = {&layer.k, &layer.v, &layer.k_scales, &layer.v_scales};
    for (auto index : snap.live) {
      const auto id = static_cast<std::int64_t>(table[static_cast<std::size_t>(index)]);
      const std::byte* parts[4] = {nullptr, nullptr, nullptr, nullptr};
      for (int part = 0; part < (p.scale_bytes != 0 ? 4 : 2); ++part) {
        const std::size_t bytes = part < 2 ? p.data_bytes : p.scale_bytes;
        auto block = whole[part]->slice_rows(id, 1);
        if (!block) return std::unexpected(block.error());
        if (auto r = dev.write(*block, std::span<const std::byte>(in, bytes)); !r) return r;
        parts[part] = in;
        in += bytes;
      }
      if (!layer.has_summaries()) continue;
      if (!one) {
        auto cfg = layer.config;
        cfg.n_blocks = 1;
        host = kernels::memory_pool::create();
        auto made = kernels::paged_kv_cache::create(*host, cfg);
        if (!made) return std::unexpected(made.error());
        one = std::move(*made);
      }
      std::memcpy(one->k.data(), parts[0], p.data_bytes);
      if (p.scale_bytes != 0) std::memcpy(one->k_scales.data(), parts[2], p.scale_bytes);
      const std::int32_t zero[1] = {0};
      const std::int64_t used = std::min<std::int64_t>(B, snap.length - std::int64_t{index} * B);
      if (auto r = kernels::build_kv_summaries(*one, zero, used); !r) return r;
      auto summary = layer.k_summary.slice_rows(id, 1);
      if (!summary) return std::unexpected(summary.error());
      if (auto r = dev.write(*summary, std::span<const std::byte>(
                                           static_cast<const std::byte*>(one->k_summary.data()),
                                           one->k_summary.nbytes()));
          !r)
        return r;
    }
  }
  return {};
}

/// Copies a snapshot's blocks into the blocks `table` maps its live
/// indices to, every layer, and rebuilds their key summaries (over each
/// block's used slots, as appending them one by one would have left them).
static result<void> copy_blocks_in(std::vector<kernels::paged_kv_cache>& layers,
                                   kernels::device* dev, const std::vector<std::int32_t>& table,
                                   const kv_snapshot& snap, const block_parts& p) {
  const std::int64_t B = snap.block_size;
  const std::byte* in = snap.data.data();
  if (dev != nullptr) return copy_blocks_to_device(layers, *dev, table, snap, p);
  for (auto& layer : layers) {
    for (auto index : snap.live) {
      const auto id = static_cast<std::size_t>(table[static_cast<std::size_t>(index)]);
      std::memcpy(layer.k.data_as<std::byte>() + id * p.data_bytes, in, p.data_bytes);
      in += p.data_bytes;
      std::memcpy(layer.v.data_as<std::byte>() + id * p.data_bytes, in, p.data_bytes);
      in += p.data_bytes;
      if (p.scale_bytes != 0) {
        std::memcpy(layer.k_scales.data_as<std::byte>() + id * p.scale_bytes, in, p.scale_bytes);
        in += p.scale_bytes;
        std::memcpy(layer.v_scales.data_as<std::byte>() + id * p.scale_bytes, in, p.scale_bytes);
        in += p.scale_bytes;
      }
      if (layer.has_summaries()) {
        const std::int32_t one[1] = {static_cast<std::int32_t>(id)};
        const std::int64_t used = std::min<std::int64_t>(B, snap.length - std::int64_t{index} * B);
        if (auto r = kernels::build_kv_summaries(layer, one, used); !r)
          return std::unexpected(r.error());
      }
    }
  }
  return {};
}

result<void> kv_cache::check_ids(const kv_snapshot& snap) const {
  if (!named_) {
    if (!snap.ids.empty())
      return make_error(errc::invalid_argument,
                        "KV snapshot: block ids from a cache whose blocks the scheduler names, "
                        "into one that picks its own");
    return {};
  }
  if (snap.ids.size() != snap.live.size())
    return make_error(errc::invalid_argument,
                      "KV snapshot: " + std::to_string(snap.ids.size()) + " block ids for " +
                          std::to_string(snap.live.size()) +
                          " blocks (this cache's blocks are named by the scheduler)");
  for (auto id : snap.ids)
    if (id < 1 || id >= n_blocks_)
      return make_error(errc::invalid_argument, "KV snapshot: block id " + std::to_string(id) +
                                                    " is outside 1.." +
                                                    std::to_string(n_blocks_ - 1));
  return {};
}

result<seq_id> kv_cache::import_sequence(const kv_snapshot& snap) {
  const auto& c = layers_.front().config;
  auto bad = [](const std::string& what) {
    return make_error(errc::invalid_argument, "KV snapshot: " + what);
  };
  auto differs = [&](const char* field, std::int64_t got, std::int64_t want) {
    return bad(std::string(field) + " is " + std::to_string(got) + ", this cache has " +
               std::to_string(want));
  };
  if (snap.layers != layers()) return differs("layers", snap.layers, layers());
  if (snap.n_kv_heads != c.n_kv_heads) return differs("n_kv_heads", snap.n_kv_heads, c.n_kv_heads);
  if (snap.head_dim != c.head_dim) return differs("head_dim", snap.head_dim, c.head_dim);
  if (snap.block_size != c.block_size) return differs("block_size", snap.block_size, c.block_size);
  if (snap.type != c.type)
    return bad("dtype is " + std::string(kernels::to_string(snap.type)) + ", this cache has " +
               std::string(kernels::to_string(c.type)));
  if (snap.window != opts_.window) return differs("window", snap.window, opts_.window);
  if (snap.sinks != opts_.sinks) return differs("sinks", snap.sinks, opts_.sinks);
  if (snap.length < 0 || snap.length > max_import_tokens)
    return bad("length " + std::to_string(snap.length) + " is outside 0.." +
               std::to_string(max_import_tokens));
  const std::int64_t B = c.block_size;
  const std::int64_t entries = (snap.length + B - 1) / B;
  if (entries > max_import_entries)
    return bad("length " + std::to_string(snap.length) + " needs " + std::to_string(entries) +
               " block-table entries, more than the limit of " +
               std::to_string(max_import_entries));
  // The live blocks must be exactly the ones commit() keeps for `length`.
  const std::int64_t held = blocks_held(opts_, snap.length, snap.length);
  std::int64_t dead_lo = 0, dead_hi = 0;
  if (opts_.window > 0 && held < entries) {
    dead_lo = (opts_.sinks + B - 1) / B;
    dead_hi = dead_lo + (entries - held);
  }
  if (static_cast<std::int64_t>(snap.live.size()) != held)
    return bad(std::to_string(snap.live.size()) + " live blocks, but " +
               std::to_string(snap.length) + " tokens under this cache's window keep " +
               std::to_string(held));
  for (std::size_t i = 0; i < snap.live.size(); ++i) {
    const std::int64_t b = snap.live[i];
    if (b < 0 || b >= entries)
      return bad("live block index " + std::to_string(b) + " is outside the " +
                 std::to_string(entries) + " blocks of " + std::to_string(snap.length) + " tokens");
    if (i > 0 && b <= snap.live[i - 1])
      return bad("live block indices are not strictly increasing");
    if (b >= dead_lo && b < dead_hi)
      return bad("live block index " + std::to_string(b) + " lies behind the window (blocks " +
                 std::to_string(dead_lo) + ".." + std::to_string(dead_hi - 1) + " are holes)");
  }
  const block_parts p = parts_of(c);
  const std::size_t per_block = 2 * p.data_bytes + 2 * p.scale_bytes;
  if (per_block != snap.block_bytes())
    return make_error(errc::internal, "KV snapshot block size disagrees");
  const std::size_t want = static_cast<std::size_t>(snap.layers) * snap.live.size() * per_block;
  if (snap.data.size() != want)
    return bad("data has " + std::to_string(snap.data.size()) + " bytes, expected " +
               std::to_string(want) + " (" + std::to_string(snap.layers) + " layers x " +
               std::to_string(snap.live.size()) + " blocks x " + std::to_string(per_block) + ")");
  if (auto r = check_ids(snap); !r) return std::unexpected(r.error());
  if (named_) {
    sequence seq;
    seq.length = snap.length;
    seq.table.assign(snap.ids.begin(), snap.ids.end());
    if (auto r = copy_blocks_in(layers_, dev_, seq.table, snap, p); !r)
      return std::unexpected(r.error());
    const seq_id id = next_++;
    seqs_.emplace(id, std::move(seq));
    return id;
  }
  if (snap.live.size() > free_.size())
    return make_error(errc::out_of_memory, "KV cache full: importing needs " +
                                               std::to_string(snap.live.size()) + " blocks, " +
                                               std::to_string(free_.size()) + " free");

  sequence seq;
  seq.length = snap.length;
  seq.table.assign(static_cast<std::size_t>(entries), 0);
  for (auto index : snap.live) {
    seq.table[static_cast<std::size_t>(index)] = free_.back();
    free_.pop_back();
  }
  auto give_back = [&] {  // in reverse, so the free list is as it was
    for (auto index = snap.live.rbegin(); index != snap.live.rend(); ++index)
      free_.push_back(seq.table[static_cast<std::size_t>(*index)]);
  };
  if (auto r = copy_blocks_in(layers_, dev_, seq.table, snap, p); !r) {
    give_back();
    return std::unexpected(r.error());
  }
  const seq_id id = next_++;
  seqs_.emplace(id, std::move(seq));
  return id;
}

result<void> kv_cache::import_tail(seq_id s, const kv_snapshot& snap, std::int32_t from_block) {
  auto bad = [](const std::string& what) {
    return make_error(errc::invalid_argument, "KV delta: " + what);
  };
  auto it = seqs_.find(s);
  if (it == seqs_.end()) return bad("unknown sequence " + std::to_string(s));
  const auto& c = layers_.front().config;
  if (opts_.window > 0) return bad("a cache with a sliding window takes whole sequences only");
  if (snap.layers != layers() || snap.n_kv_heads != c.n_kv_heads || snap.head_dim != c.head_dim ||
      snap.block_size != c.block_size || snap.type != c.type || snap.window != opts_.window ||
      snap.sinks != opts_.sinks)
    return bad("the snapshot's shape or policy differs from this cache's");
  auto& seq = it->second;
  const std::int64_t B = c.block_size;
  if (snap.length < seq.length || snap.length > max_import_tokens)
    return bad("length " + std::to_string(snap.length) + " is below the sequence's " +
               std::to_string(seq.length) + " or too large");
  const std::int64_t have = (seq.length + B - 1) / B;
  if (from_block < 0 || from_block > have)
    return bad("first block " + std::to_string(from_block) + " lies past the sequence's " +
               std::to_string(have) + " blocks");
  const std::int64_t entries = (snap.length + B - 1) / B;
  if (entries > max_import_entries) return bad("too many blocks");
  if (static_cast<std::int64_t>(snap.live.size()) != entries - from_block)
    return bad(std::to_string(snap.live.size()) + " blocks, expected " +
               std::to_string(entries - from_block));
  for (std::size_t i = 0; i < snap.live.size(); ++i)
    if (snap.live[i] != from_block + static_cast<std::int64_t>(i))
      return bad("the blocks are not consecutive from the first");
  const block_parts p = parts_of(c);
  const std::size_t per_block = 2 * p.data_bytes + 2 * p.scale_bytes;
  if (per_block != snap.block_bytes())
    return make_error(errc::internal, "KV snapshot block size disagrees");
  if (snap.data.size() != static_cast<std::size_t>(snap.layers) * snap.live.size() * per_block)
    return bad(
        "data has " + std::to_string(snap.data.size()) + " bytes, expected " +
        std::to_string(static_cast<std::size_t>(snap.layers) * snap.live.size() * per_block));
  if (auto r = check_ids(snap); !r) return std::unexpected(r.error());
  if (named_) {
    // The named ids from the first block on; those before stay.
    if (from_block > static_cast<std::int64_t>(seq.table.size()))
      return bad("first block past the sequence's table");
    std::vector<std::int32_t> table(seq.table.begin(), seq.table.begin() + from_block);
    table.insert(table.end(), snap.ids.begin(), snap.ids.end());
    if (auto r = copy_blocks_in(layers_, dev_, table, snap, p); !r)
      return std::unexpected(r.error());
    seq.table = std::move(table);
    seq.length = snap.length;
    return {};
  }
  // New blocks for the entries the sequence does not have yet; the rest
  // are overwritten in place.
  const std::int64_t add = entries - static_cast<std::int64_t>(seq.table.size());
  if (add > static_cast<std::int64_t>(free_.size()))
    return make_error(errc::out_of_memory, "KV cache full: the delta needs " + std::to_string(add) +
                                               " blocks, " + std::to_string(free_.size()) +
                                               " free");
  for (std::int64_t e = static_cast<std::int64_t>(seq.table.size()); e < entries; ++e) {
    seq.table.push_back(free_.back());
    free_.pop_back();
  }
  if (auto r = copy_blocks_in(layers_, dev_, seq.table, snap, p); !r)
    return std::unexpected(r.error());
  seq.length = snap.length;
  return {};
}

}  // namespace troupe::models
