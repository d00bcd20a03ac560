#pragma once

// The scheduler's books of the stages' KV blocks. Every stage holds the
// same sequences with the same block layout, so one set of books stands
// for all of them; it counts blocks with the formula the stages' caches
// use (models::kv_cache::blocks_held), which is what makes the books and
// the caches agree (tests/actors/core/kv_books_test.cpp checks it against
// a real cache).
//
// Two ways to keep them:
//
// - Counting (a sliding window, or prefix caching turned off): each stage's
//   cache picks its own blocks and the books only count them. A block a
//   sequence gives back is not free until every stage's store has freed it
//   (`released` -> `freed`); until then it still counts as used, so the
//   scheduler never books a block a store still holds.
//
// - Naming (prefix caching, vLLM's block manager): the books pick every
//   block id themselves and each step tells the stages which ids a
//   sequence's table gained (`take_delta`); a stage's cache then only
//   writes where it is told. A full block can be given a name (its
//   block_hash) once every stage has computed it; a new sequence whose
//   prompt starts with named blocks takes them (`attach`, a reference
//   count) and computes only the rest. A named block no sequence holds
//   stays cached, counts as free in `available()` and is evicted least
//   recently used when a booking needs it. Because the books decide every
//   id, the stages never disagree with them about what a block holds.
//
// Tiers (naming books with lower tiers): a cached block evicted from the
// device goes down to the host tier (and from there, least recently used
// first, to the disk tier) instead of being lost; a prefix found in a lower
// tier comes back up into a fresh device block. The books pick every slot
// of every tier too and queue the copies (`take_moves`), which the next
// step carries to every stage ahead of its compute. A lower tier holds
// only named blocks nobody holds.
//
// The remote tier (a KV store on another node, actors/kv_vault.hpp) is
// different: it keeps copies. Each block named on the device is also
// copied there (the next step carries the copy, which each stage sends
// asynchronously); the store confirms a block once every layer has
// arrived (`confirm`), and only confirmed blocks count. They outlive a
// pipeline reset (`clear`): when a node dies, the new stages take the
// blocks back from the store instead of recomputing them.

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "actors/core/block_hash.hpp"
#include "models/kv_cache.hpp"
#include "models/kv_tiers.hpp"

namespace troupe::actors::core {

class kv_books {
 public:
  /// `name_blocks`: the naming books above (needs a layout without a
  /// window); `host_blocks`, `disk_blocks`: its lower tiers' slots (naming
  /// books only).
  kv_books(models::kv_options layout, std::int64_t total_blocks, bool name_blocks = false,
           std::int64_t host_blocks = 0, std::int64_t disk_blocks = 0,
           std::int64_t remote_blocks = 0);

  /// Blocks a sequence holds with `committed` tokens in its cache and room
  /// for `reserved` (>= committed) tokens.
  std::int64_t blocks_for(std::int64_t committed, std::int64_t reserved) const {
    return models::kv_cache::blocks_held(layout_, committed, reserved);
  }
  /// Whether a sequence of `tokens` tokens could ever fit (alone).
  bool fits_alone(std::int64_t tokens) const { return blocks_for(tokens - 1, tokens) <= total_; }
  /// The most tokens, at most `cap`, a sequence of `from` or more could
  /// reach alone; `from` when not even `from + 1` fits.
  std::int64_t longest_alone(std::int64_t from, std::int64_t cap) const;

  /// Books what `seq` needs to hold `committed` tokens with room for
  /// `reserved`; false (nothing booked) when the pool cannot give it.
  bool reserve(std::int64_t seq, std::int64_t committed, std::int64_t reserved);
  /// After a step: `seq` holds exactly what `committed` tokens keep (a
  /// sliding window lets blocks go; naming: blocks booked ahead and not
  /// used go back).
  void settle(std::int64_t seq, std::int64_t committed);
  /// The sequence ends. Counting: its blocks are pending until `freed`;
  /// returns them. Naming: they are free (or cached) at once; returns 0.
  std::int64_t release(std::int64_t seq);
  /// The stores freed `blocks` released earlier.
  void freed(std::int64_t blocks) { used_ -= blocks; }
  /// Every store was replaced (a pipeline reset): nothing is held, nothing
  /// cached, but for the remote tier's confirmed blocks.
  void clear();

  std::int64_t held(std::int64_t seq) const;
  std::int64_t used() const { return used_; }  ///< booked, pending frees included
  std::int64_t total() const { return total_; }
  std::int64_t peak() const { return peak_; }
  /// Blocks a new booking may take (cached blocks nobody holds included).
  std::int64_t available() const { return total_ - used_; }
  const models::kv_options& layout() const { return layout_; }

  // -- naming books only ------------------------------------------------------------------

  bool names_blocks() const { return naming_; }
  /// How many of `names`, from the first, are cached.
  std::int64_t cached_prefix(std::span<const block_hash> names) const;
  /// A new sequence (holding nothing) takes the cached blocks named by
  /// `names`' longest cached prefix, bringing those in lower tiers up into
  /// device blocks while there is room; returns how many (full blocks:
  /// the partial one below is not counted). With `partial`,
  /// when every one of `names` was taken: also the block named `partial`
  /// (a partly filled last block a preempted sequence left), which becomes
  /// the sequence's own (unnamed: it will write into it); `*took_partial`
  /// says whether it was.
  std::int64_t attach(std::int64_t seq, std::span<const block_hash> names,
                      const block_hash* partial = nullptr, bool* took_partial = nullptr);
  /// `seq`'s block `index` (full, computed on every stage) is named `name`,
  /// unless that name is taken (another sequence computed the same block:
  /// this one stays private) or the block has a name already.
  void publish(std::int64_t seq, std::int64_t index, const block_hash& name);
  /// The ids `seq`'s table gained (or changed) since the last call: its
  /// entries from `from` on are `ids` (from = -1: nothing changed).
  struct delta {
    std::int32_t from = -1;
    std::vector<std::int32_t> ids;
  };
  delta take_delta(std::int64_t seq);
  std::span<const std::int32_t> table(std::int64_t seq) const;
  /// Forgets every name: cached blocks nobody holds are free again, held
  /// ones stay with their sequences as private blocks. For an admin reset
  /// (`keep_remote` false), and after a stage moved (the new one holds only
  /// live sequences' blocks) or a step that carried copies failed part-way
  /// (the remote tier is sure: its store checks every layer's name).
  /// Returns the cached blocks that became free.
  std::int64_t forget_names(bool keep_remote = false);
  std::int64_t named() const { return static_cast<std::int64_t>(names_.size()); }
  std::int64_t cached_free() const { return static_cast<std::int64_t>(lru_.size()); }
  std::int64_t evictions() const { return evictions_; }

  // -- tiers (naming books only) ------------------------------------------------------------

  /// Copies the stages must carry out, in order, before the next step's
  /// compute (the ones queued since the last call).
  std::vector<models::kv_move> take_moves();
  bool has_moves() const { return !moves_.empty(); }
  std::int64_t tier_slots(models::kv_tier t) const;
  std::int64_t tier_used(models::kv_tier t) const;
  /// Blocks moved from tier `from` to tier `to` so far.
  std::int64_t moved(models::kv_tier from, models::kv_tier to) const {
    return moved_[static_cast<int>(from)][static_cast<int>(to)];
  }
  /// Cached blocks dropped from the lowest tier (lost for good).
  std::int64_t dropped() const { return dropped_; }

  // -- the remote tier ------------------------------------------------------------------------

  /// Copies the device block named `name` to the remote tier (a move in the
  /// next step), unless a copy is there or on its way; the tier's least
  /// recent block makes room when it is full. No remote tier: nothing.
  void back_up(const block_hash& name);
  /// The store holds every layer of `name` in remote slot `slot`. False
  /// when the slot holds another block now (a late answer).
  bool confirm(std::int32_t slot, const block_hash& name);
  /// Blocks copied to the remote tier whose store has not confirmed them.
  std::int64_t remote_pending() const { return remote_.pending; }
  /// Whether the remote tier's store is there. Off: no copies are made or
  /// taken, and what it held is forgotten (the store went with it); on
  /// again, it starts empty.
  void remote_online(bool on);
  bool remote_on() const { return remote_on_ && remote_.slots > 0; }

  // -- block events (naming books only) -------------------------------------------------------

  /// A change of what the cache holds, as one following it from outside (a
  /// router choosing the replica with a prompt's prefix) sees it: vLLM's
  /// KV events BlockStored, BlockRemoved and AllBlocksCleared.
  struct event {
    enum class kind : std::uint8_t { stored, removed, cleared };
    kind what = kind::stored;
    block_hash name{};
    models::kv_tier tier = models::kv_tier::device;
    bool operator==(const event&) const = default;
  };
  /// The events since the last call, oldest first. Kept up to `max_events`
  /// between calls; past that they are dropped and `*overflowed` is set
  /// (the follower then starts over from contents()).
  std::vector<event> take_events(bool* overflowed);
  /// Every named block and its tier, nobody's or held.
  std::vector<std::pair<block_hash, models::kv_tier>> contents() const;
  static constexpr std::size_t max_events = 1 << 16;

 private:
  struct block {
    block_hash name{};
    bool named = false;
    std::int32_t refs = 0;
    std::list<std::int32_t>::iterator lru;  // when named and refs == 0
  };
  struct sequence {
    std::vector<std::int32_t> table;
    std::int32_t delta_from = -1;
  };
  /// A lower tier: slots holding named blocks nobody holds.
  struct tier {
    std::int64_t slots = 0;
    std::vector<std::int32_t> free;
    std::list<std::int32_t> lru;   ///< occupied slots, least recently used first
    std::vector<block_hash> name;  ///< by slot
    std::vector<std::list<std::int32_t>::iterator> at;  ///< by slot: its place in lru
    std::unordered_map<block_hash, std::int32_t, block_hash_hasher> names;
    std::vector<char> confirmed;  ///< by slot (the remote tier)
    std::int64_t pending = 0;     ///< the remote tier: slots not confirmed yet
    void reset();
    /// A free slot, else the least recently used one, taken out of the LRU
    /// list and its name forgotten; `*evicted` says which (the caller deals
    /// with the block that was there).
    std::int32_t take(bool* evicted);
  };
  std::int32_t take_block();
  void drop_ref(std::int32_t id);
  /// Puts block `name`, now at `index` of tier `from`, into the first
  /// lower tier with slots (evicting that tier's least recent further
  /// down), queueing the copy; dropped when there is none.
  void demote(const block_hash& name, models::kv_tier from, std::int32_t index);
  /// Finds `name` in a lower tier: the tier (device: none) and slot.
  std::pair<models::kv_tier, std::int32_t> find_lower(const block_hash& name) const;
  /// Brings `name` up from slot `slot` of `t` into a new device block
  /// (named `name` when `keep_name`); -1 when no device block is available.
  std::int32_t promote(const block_hash& name, models::kv_tier t, std::int32_t slot,
                       bool keep_name);
  void take_ref(std::int32_t id);
  /// Confirmed remote slot of `name`, or -1.
  std::int32_t find_remote(const block_hash& name) const;
  /// Copies remote slot `slot` into a new device block named `name`; -1
  /// when no device block is available.
  std::int32_t promote_remote(const block_hash& name, std::int32_t slot);
  /// After a `cleared` event: the remote blocks, stored again (a follower
  /// drops every tier on `cleared`).
  void note_remote();

  models::kv_options layout_;
  std::int64_t total_ = 0;
  std::int64_t used_ = 0;
  std::int64_t peak_ = 0;
  std::unordered_map<std::int64_t, std::int64_t> held_;  ///< counting: per live sequence
  // naming:
  bool naming_ = false;
  std::vector<block> blocks_;  ///< by id (0 is the caches' hole block, never booked)
  std::vector<std::int32_t> free_;
  std::list<std::int32_t> lru_;  ///< cached blocks nobody holds, least recently used first
  std::unordered_map<block_hash, std::int32_t, block_hash_hasher> names_;
  std::unordered_map<std::int64_t, sequence> seqs_;
  std::int64_t evictions_ = 0;
  tier lower_[2];  ///< host, disk
  tier remote_;    ///< copies
  bool remote_on_ = true;
  std::vector<models::kv_move> moves_;
  std::int64_t moved_[4][4] = {};
  std::int64_t dropped_ = 0;
  std::vector<event> events_;
  bool overflowed_ = false;
  void note(event::kind k, const block_hash& name, models::kv_tier t);
};

}  // namespace troupe::actors::core
