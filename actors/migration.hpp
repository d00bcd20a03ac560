#pragma once

// Live migration of a stage or of the vision encoder (migration.cpp).
//
// Make-before-break (ARCHITECTURE.md): the target node loads the stage from
// its own model files while the old one serves; the KV of every sequence
// is copied in rounds while decoding goes on (whole sequences first, then
// the blocks that changed since); at a step boundary the scheduler holds
// its steps, the last delta is copied, the stage before (or the scheduler)
// is re-routed to the new shard, and steps resume; the old actors go.

#include "actors/head_state.hpp"

namespace troupe::actors::head_detail {

// Moves a stage ("2", "stage2" or "[a,b)" as status prints it) or the
// vision encoder ("vision") to node `req.to` while it serves, or says why
// not. One migration at a time.
caf::result<migrate_report> start_migration(head_ptr self, const migrate_request& req);

}  // namespace troupe::actors::head_detail
