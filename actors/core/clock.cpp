#include "actors/core/clock.hpp"

namespace troupe::actors::core {

namespace {
class steady_source final : public clock {
 public:
  time_point now() const override { return steady::now(); }
};
}  // namespace

const clock& system_clock() {
  static const steady_source source;
  return source;
}

}  // namespace troupe::actors::core
