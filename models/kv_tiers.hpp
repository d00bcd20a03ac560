#pragma once

// The lower tiers of a stage's KV store: blocks moved out of the device
// cache (models::kv_cache) into host memory and into a file on local disk,
// and back. The scheduler's books (actors/core/kv_books.hpp) decide every
// move and every slot; each step carries the moves, and every stage
// carries them out in that order before it computes the step, so that all
// stages hold the same blocks in the same slots. A slot holds one block of
// every layer of the stage (kv_cache::slot_bytes()).
//
// The host tier is anonymous memory apart from the device's pool (pages
// are taken when first written); the disk tier is a file created in the
// configured folder, unlinked at once (it goes with the process, whatever
// way the process ends) and memory-mapped.

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "models/kv_cache.hpp"

namespace troupe::models {

/// Where a block is. `remote` is a KV store on another node (a vault,
/// actors/kv_vault.hpp) that keeps copies of full blocks: a stage carries
/// those moves out itself, over the data plane; kv_tiers refuses them.
enum class kv_tier : std::uint8_t { device = 0, host = 1, disk = 2, remote = 3 };

/// One block moving from one tier's slot (a device block id, a host, disk
/// or remote slot) to another's. `name` (the block's name, a SHA-256) goes
/// with moves to and from the remote tier, whose store checks it.
struct kv_move {
  std::uint8_t from = 0;  ///< a kv_tier
  std::int32_t from_index = 0;
  std::uint8_t to = 0;  ///< a kv_tier
  std::int32_t to_index = 0;
  std::array<std::uint8_t, 32> name{};
  bool operator==(const kv_move&) const = default;
};

class kv_tiers {
 public:
  /// `host_slots` and `disk_slots` slots of `slot_bytes` each.
  static result<std::unique_ptr<kv_tiers>> create(std::size_t slot_bytes, std::int64_t host_slots,
                                                  std::int64_t disk_slots,
                                                  const std::string& disk_dir);
  ~kv_tiers();
  kv_tiers(const kv_tiers&) = delete;
  kv_tiers& operator=(const kv_tiers&) = delete;

  /// Carries out `moves` in order between `cache` and these tiers. A move
  /// out of range, or between tiers this store lacks, is refused before
  /// anything moves (invalid_argument).
  result<void> apply(kv_cache& cache, std::span<const kv_move> moves);

  std::int64_t host_slots() const { return host_slots_; }
  std::int64_t disk_slots() const { return disk_slots_; }
  std::size_t slot_bytes() const { return slot_bytes_; }
  /// Blocks moved and bytes copied so far, for the counters.
  std::int64_t moves() const { return moves_; }
  std::int64_t bytes_moved() const { return bytes_; }

 private:
  kv_tiers() = default;
  std::span<std::byte> slot(kv_tier t, std::int32_t i);

  std::size_t slot_bytes_ = 0;
  std::int64_t host_slots_ = 0, disk_slots_ = 0;
  std::byte* host_ = nullptr;
  std::byte* disk_ = nullptr;
  std::size_t host_len_ = 0, disk_len_ = 0;
  std::int64_t moves_ = 0, bytes_ = 0;
};

}  // namespace troupe::models
