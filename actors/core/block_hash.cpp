#include "actors/core/block_hash.hpp"

#include <openssl/evp.h>

#include <algorithm>
#include <cstdio>
#include <memory>

namespace troupe::actors::core {

namespace {

struct digest {
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx{EVP_MD_CTX_new(), EVP_MD_CTX_free};
  digest() { EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr); }
  void add(const void* p, std::size_t n) { EVP_DigestUpdate(ctx.get(), p, n); }
  void add_u64(std::uint64_t v) {
    std::uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(v >> (8 * i));
    add(b, sizeof(b));
  }
  block_hash done() {
    block_hash h{};
    unsigned len = 0;
    EVP_DigestFinal_ex(ctx.get(), h.data(), &len);
    return h;
  }
};

}  // namespace

block_hash sha256(std::span<const std::uint8_t> bytes) {
  digest d;
  d.add(bytes.data(), bytes.size());
  return d.done();
}

block_hash sha256(std::span<const std::uint8_t> a, std::span<const std::byte> b) {
  digest d;
  d.add(a.data(), a.size());
  d.add(b.data(), b.size());
  return d.done();
}

block_hash root_hash(std::string_view ns, std::string_view salt) {
  digest d;
  d.add("troupe-kv-prefix-v1", 19);
  d.add_u64(ns.size());
  d.add(ns.data(), ns.size());
  d.add_u64(salt.size());
  d.add(salt.data(), salt.size());
  return d.done();
}

block_hash chain_hash(const block_hash& parent, std::span<const std::int32_t> tokens,
                      std::span<const block_hash> images) {
  digest d;
  d.add(parent.data(), parent.size());
  d.add_u64(tokens.size());
  for (auto t : tokens) {
    const auto u = static_cast<std::uint32_t>(t);
    const std::uint8_t b[4] = {static_cast<std::uint8_t>(u), static_cast<std::uint8_t>(u >> 8),
                               static_cast<std::uint8_t>(u >> 16),
                               static_cast<std::uint8_t>(u >> 24)};
    d.add(b, 4);
  }
  d.add_u64(images.size());
  for (const auto& h : images) d.add(h.data(), h.size());
  return d.done();
}

std::string to_hex(const block_hash& h) {
  std::string s(64, '0');
  for (std::size_t i = 0; i < h.size(); ++i) std::snprintf(&s[2 * i], 3, "%02x", h[i]);
  return s;
}

block_chain::block_chain(block_hash root, int block_size, std::int32_t image_token,
                         const std::vector<std::int64_t>& rows, std::vector<block_hash> items)
    : root_(root), block_size_(block_size), image_token_(image_token), images_(std::move(items)) {
  std::int64_t end = 0;
  for (auto r : rows) ends_.push_back(end += std::max<std::int64_t>(r, 0));
}

block_chain::block_chain(block_hash root, int block_size, std::int32_t image_token,
                         std::int64_t tokens_per_image, std::vector<block_hash> images)
    : root_(root), block_size_(block_size), image_token_(image_token), images_(std::move(images)) {
  for (std::size_t k = 1; k <= images_.size(); ++k)
    ends_.push_back(static_cast<std::int64_t>(k) * std::max<std::int64_t>(tokens_per_image, 0));
}

std::size_t block_chain::item_of(std::int64_t n) const {
  return static_cast<std::size_t>(std::upper_bound(ends_.begin(), ends_.end(), n) - ends_.begin());
}

std::optional<block_hash> block_chain::partial(std::span<const std::int32_t> tokens,
                                               std::int64_t index, std::int64_t count) const {
  const std::int64_t B = block_size_;
  if (B <= 0 || index < 0 || index > std::ssize(hashes_) || count > std::ssize(tokens))
    return std::nullopt;
  const auto start = index * B;
  if (count <= start || count - start >= B) return std::nullopt;
  const auto part =
      tokens.subspan(static_cast<std::size_t>(start), static_cast<std::size_t>(count - start));
  // Image rows name their image, as in a full block.
  std::vector<block_hash> here;
  if (names_media()) {
    std::int64_t seen = std::count(tokens.begin(), tokens.begin() + start, image_token_);
    std::size_t last = static_cast<std::size_t>(-1);
    for (auto t : part) {
      if (t != image_token_) continue;
      const auto k = item_of(seen++);
      if (k != last) here.push_back(k < images_.size() ? images_[k] : block_hash{});
      last = k;
    }
  }
  return chain_hash(index == 0 ? root_ : hashes_[static_cast<std::size_t>(index - 1)], part, here);
}

void block_chain::extend(std::span<const std::int32_t> tokens) {
  if (block_size_ <= 0) return;
  const auto B = static_cast<std::size_t>(block_size_);
  std::vector<block_hash> here;
  for (std::size_t b = hashes_.size(); (b + 1) * B <= tokens.size(); ++b) {
    here.clear();
    std::size_t last = static_cast<std::size_t>(-1);
    const auto block = tokens.subspan(b * B, B);
    for (auto t : block) {
      if (t != image_token_ || !names_media()) continue;
      const auto k = item_of(image_tokens_seen_++);
      // An image token past the known images (cannot happen for a prompt
      // the scheduler expanded) still names something: a hash of nothing.
      const auto h = k < images_.size() ? images_[k] : block_hash{};
      if (k != last) here.push_back(h);  // once per image the block holds rows of
      last = k;
    }
    hashes_.push_back(chain_hash(hashes_.empty() ? root_ : hashes_.back(), block, here));
  }
}

}  // namespace troupe::actors::core
