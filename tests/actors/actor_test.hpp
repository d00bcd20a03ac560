// The actor system configuration every actors test uses.
#pragma once

#include <caf/all.hpp>

#include "actors/protocol.hpp"

namespace troupe::test {

/// A config with troupe's protocol registered, built once per process.
inline caf::actor_system_config& actor_config() {
  static caf::actor_system_config cfg = [] {
    caf::actor_system_config c;
    actors::register_protocol(c);
    return c;
  }();
  return cfg;
}

}  // namespace troupe::test
