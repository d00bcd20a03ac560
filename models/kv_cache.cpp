#include "models/kv_cache.hpp"

#include <algorithm>

namespace troupe::models {

result<kv_cache> kv_cache::create(kernels::memory_pool& pool, int layers, int n_kv_heads, int head_dim,
                                  const kv_options& opts) {
  if (layers < 1 || n_kv_heads < 1 || head_dim < 1) return make_error(errc::invalid_argument, "bad KV cache shape");
  if (opts.block_size < 1 || opts.block_size > 4096) return make_error(errc::invalid_argument, "KV block size must be 1..4096");
  if (opts.capacity_tokens < 1) return make_error(errc::invalid_argument, "KV capacity must be positive");
  if (opts.window < 0 || opts.sinks < 0) return make_error(errc::invalid_argument, "window and sinks must be >= 0");
  kv_cache c;
  c.opts_ = opts;
  c.n_blocks_ = (opts.capacity_tokens + opts.block_size - 1) / opts.block_size + 1;  // + the hole block
  kernels::kv_cache_config cfg;
  cfg.block_size = opts.block_size;
  cfg.n_kv_heads = n_kv_heads;
  cfg.head_dim = head_dim;
  cfg.type = opts.type;
  cfg.n_blocks = c.n_blocks_;
  cfg.summaries = opts.summaries;
  for (int l = 0; l < layers; ++l) {
    auto layer = kernels::paged_kv_cache::create(pool, cfg);
    if (!layer) return std::unexpected(layer.error());
    c.layers_.push_back(std::move(*layer));
  }
  for (std::int64_t b = c.n_blocks_ - 1; b >= 1; --b) c.free_.push_back(static_cast<std::int32_t>(b));
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
  for (auto b : it->second.table)
    if (b != 0) free_.push_back(b);
  seqs_.erase(it);
}

result<void> kv_cache::reserve(seq_id s, std::int64_t length) {
  auto it = seqs_.find(s);
  if (it == seqs_.end()) return make_error(errc::invalid_argument, "unknown sequence " + std::to_string(s));
  auto& table = it->second.table;
  const auto need = static_cast<std::size_t>((length + opts_.block_size - 1) / opts_.block_size);
  if (need <= table.size()) return {};
  const std::size_t more = need - table.size();
  if (more > free_.size())
    return make_error(errc::out_of_memory, "KV cache full: " + std::to_string(more) + " blocks needed, " +
                                               std::to_string(free_.size()) + " free");
  for (std::size_t i = 0; i < more; ++i) {
    table.push_back(free_.back());
    free_.pop_back();
  }
  return {};
}

result<void> kv_cache::commit(seq_id s, std::int64_t length) {
  auto it = seqs_.find(s);
  if (it == seqs_.end()) return make_error(errc::invalid_argument, "unknown sequence " + std::to_string(s));
  auto& seq = it->second;
  if (length < seq.length || length > static_cast<std::int64_t>(seq.table.size()) * opts_.block_size)
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

}  // namespace troupe::models
