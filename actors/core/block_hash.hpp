#pragma once

// Names of full KV blocks for prefix caching: a SHA-256 chain. Block i's
// name covers its parent's name (block i-1's, or the root for block 0), its
// token ids and the content hash of every image whose rows fill some of its
// positions; the root covers the cache's namespace (the model, its weight
// formats, the KV layout: what makes the same tokens give other KV) and the
// request's cache_salt. Two prompts share block i's name only when they
// share everything up to the end of block i under the same model and salt.
// A 256-bit name: a 64-bit one could collide and hand one tenant's KV to
// another.

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::actors::core {

using block_hash = std::array<std::uint8_t, 32>;

struct block_hash_hasher {
  std::size_t operator()(const block_hash& h) const noexcept {
    std::size_t x = 0;  // the name is already uniform: its first bytes do
    for (std::size_t i = 0; i < sizeof(x); ++i) x = (x << 8) | h[i];
    return x;
  }
};

/// SHA-256 of `bytes`.
block_hash sha256(std::span<const std::uint8_t> bytes);
/// SHA-256 of `a` followed by `b` (no copy of either).
block_hash sha256(std::span<const std::uint8_t> a, std::span<const std::byte> b);
inline block_hash sha256(std::string_view s) {
  return sha256(std::span(reinterpret_cast<const std::uint8_t*>(s.data()), s.size()));
}

/// The chain's root: the namespace and the salt (each length-prefixed, so
/// that no two pairs give the same bytes).
block_hash root_hash(std::string_view ns, std::string_view salt);

/// One block's name: parent, then the block's tokens (int32 little-endian),
/// then the hashes of the images whose rows it holds, in order.
block_hash chain_hash(const block_hash& parent, std::span<const std::int32_t> tokens,
                      std::span<const block_hash> images);

/// Lowercase hex (logs, tests).
std::string to_hex(const block_hash& h);

/// The names of a sequence's full blocks, extended as its tokens grow.
/// Media tokens (`image_token`: each image `tokens_per_image` of them in a
/// row, or each item its own count, in the order of `images`) bring their
/// item's hash into each block they fall in.
class block_chain {
 public:
  block_chain() = default;
  block_chain(block_hash root, int block_size, std::int32_t image_token,
              std::int64_t tokens_per_image, std::vector<block_hash> images);
  /// Items of their own row counts (`rows[k]` marker tokens for item k:
  /// images and audio clips in prompt order).
  block_chain(block_hash root, int block_size, std::int32_t image_token,
              const std::vector<std::int64_t>& rows, std::vector<block_hash> items);

  /// Names every full block of `tokens` not named yet (tokens only grow:
  /// the prefix named before must be unchanged).
  void extend(std::span<const std::int32_t> tokens);
  const std::vector<block_hash>& hashes() const { return hashes_; }
  /// The name of a partly filled block: block `index` (at most the full
  /// blocks named so far) holding `tokens`' positions [index * B, count),
  /// fewer than B. Its token count is in the name, so it never equals a
  /// full block's. None when that is empty or a full block.
  std::optional<block_hash> partial(std::span<const std::int32_t> tokens, std::int64_t index,
                                    std::int64_t count) const;
  bool enabled() const { return block_size_ > 0; }

 private:
  block_hash root_{};
  int block_size_ = 0;
  std::int32_t image_token_ = -1;
  std::vector<std::int64_t> ends_;  // where each item's rows end (cumulative counts)
  std::vector<block_hash> images_;
  // The item of the n-th media token (0-based); images_.size() or more: none.
  std::size_t item_of(std::int64_t n) const;
  bool names_media() const { return image_token_ >= 0 && !ends_.empty(); }
  std::vector<block_hash> hashes_;
  std::int64_t image_tokens_seen_ = 0;  // in the named blocks
};

}  // namespace troupe::actors::core
