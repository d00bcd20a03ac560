#include "actors/core/migration_phases.hpp"

#include <algorithm>
#include <string>

namespace troupe::actors::core {

const char* to_string(migration_phase p) {
  switch (p) {
    case migration_phase::loading:
      return "loading";
    case migration_phase::kv_rounds:
      return "kv_rounds";
    case migration_phase::paused:
      return "paused";
    case migration_phase::switching:
      return "switching";
    case migration_phase::verifying:
      return "verifying";
    case migration_phase::dropping:
      return "dropping";
    case migration_phase::done:
      return "done";
    case migration_phase::failed:
      return "failed";
  }
  return "unknown";
}

bool migration_phases::legal(migration_phase from, migration_phase to) {
  using enum migration_phase;
  if (from == done || from == failed) return false;
  if (to == failed) return true;
  switch (from) {
    case loading:
      return to == kv_rounds;
    case kv_rounds:
      return to == kv_rounds || to == paused;
    case paused:
      return to == verifying || to == switching;
    case verifying:
      return to == switching;
    case switching:
      return to == dropping;
    case dropping:
      return to == done;
    case done:
    case failed:
      break;
  }
  return false;
}

std::expected<void, core_error> migration_phases::advance(migration_phase to) {
  if (!legal(phase_, to))
    return std::unexpected(core_error{
        error_code::internal,
        std::string("migration: no step from ") + to_string(phase_) + " to " + to_string(to)});
  phase_ = to;
  if (to == migration_phase::kv_rounds) ++kv_rounds_;
  return {};
}

double migration_phases::progress() const {
  using enum migration_phase;
  switch (phase_) {
    case loading:
      return 0.05;
    case kv_rounds:
      return std::min(0.8, 0.3 + 0.15 * (kv_rounds_ - 1));
    case paused:
    case verifying:
    case switching:
    case dropping:
      return 0.9;
    case done:
      return 1.0;
    case failed:
      return 0.0;
  }
  return 0.0;
}

}  // namespace troupe::actors::core
