#pragma once

// The phases of a live stage migration (actors/migration.cpp), as a small
// state machine: the actor code says which step it takes next, and a step
// the protocol does not have is refused instead of silently taken. The
// order is the one the migration runs in (make-before-break):
//
//   loading -> kv_rounds (once or more) -> paused -> [verifying] -> switching
//           -> dropping -> done
//
// and any phase that has not ended may fail. `verifying` is the optional
// debugging aid (TROUPE_MIGRATE_VERIFY=1): the copied KV is compared with
// the old store's while the steps are held, before the switch. `done` and
// `failed` are final: nothing follows them.

#include <cstdint>
#include <expected>

#include "actors/core/errors.hpp"

namespace troupe::actors::core {

/// Where a live stage migration is.
enum class migration_phase : std::uint8_t {
  loading,    ///< the target node loads the stage from its own model files
  kv_rounds,  ///< the KV is copied in rounds while decoding goes on
  paused,     ///< the scheduler holds its steps; the last KV delta is copied
  switching,  ///< the stage before (or the scheduler) is re-routed to the new shard
  verifying,  ///< (debugging aid) the copied KV is compared with the old store's
  dropping,   ///< steps resumed on the new shard; the old node lets go of its stage
  done,       ///< the new stage serves, the old one is gone
  failed,     ///< given up; the old stage kept serving
};

/// The phase's name, as in the enum ("kv_rounds").
const char* to_string(migration_phase p);

/// A migration's current phase; it moves only along the legal steps.
class migration_phases {
 public:
  /// Whether the machine allows the step `from` -> `to`.
  static bool legal(migration_phase from, migration_phase to);

  /// Moves to `to`, or refuses (error_code::internal: a step the protocol
  /// does not have is a bug in its caller) and stays where it is.
  std::expected<void, core_error> advance(migration_phase to);

  migration_phase current() const { return phase_; }

  /// How many KV rounds were started (entries into kv_rounds).
  int kv_rounds() const { return kv_rounds_; }

  /// Done or failed: nothing follows.
  bool finished() const {
    return phase_ == migration_phase::done || phase_ == migration_phase::failed;
  }

  /// Its progress from 0 to 1, as `troupe migrate`'s progress bar shows
  /// it: 0.05 while loading; 0.3 for the first KV round, 0.15 more for each
  /// further one, at most 0.8; 0.9 once the steps are held (until it ends);
  /// 1 when done, 0 when failed.
  double progress() const;

 private:
  migration_phase phase_ = migration_phase::loading;
  int kv_rounds_ = 0;
};

}  // namespace troupe::actors::core
