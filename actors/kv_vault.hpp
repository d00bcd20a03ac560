#pragma once

// The remote KV tier's store (a vault): copies of full KV blocks kept on a
// node apart from the stages that computed them, so that a stage lost with
// its node comes back without recomputing its requests' prompts.
//
// The scheduler's books (actors/core/kv_books.hpp) decide which block goes
// into which of the vault's slots. Each stage puts the rows of its own
// layers of a block (vault_blocks, over the data plane, asynchronously
// after the step that carried the copy); the vault keeps them per layer,
// each layer under the block's name, and tells the scheduler once a slot
// holds every layer of the model under one name: only then does the
// scheduler count on it. A stage that replaces a lost one gets the rows of
// its layers back, whatever layer range the new placement gives it; a get
// whose layers do not all hold the named block is refused (nothing half
// restored).
//
// Its memory is bounded: slots x layers x one layer's block, known from
// the first put (every later put must match it).

#include <cstdint>

#include "actors/protocol.hpp"

namespace troupe::actors {

struct kv_vault_options {
  std::int64_t slots = 0;   ///< blocks it holds (the books' remote slots)
  std::int32_t layers = 0;  ///< the model's decoder layers
  /// One layer's rows of one block (0: taken from the first put); a put of
  /// another size is refused, so memory stays within slots x layers x this.
  std::int64_t layer_bytes = 0;
  /// Told of the slots that became whole (vault_ok_atom).
  scheduler_actor notify;
};

/// Spawns a vault (detached: its copies are memcpy-bound).
kv_vault_actor spawn_kv_vault(caf::actor_system& sys, kv_vault_options opts);

}  // namespace troupe::actors
