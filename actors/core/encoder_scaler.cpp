#include "actors/core/encoder_scaler.hpp"

#include <algorithm>
#include <cstdio>

namespace troupe::actors::core {

encoder_scaling sanitized(encoder_scaling o) {
  o.min = std::max(o.min, 1);
  o.max = std::max(o.max, o.min);
  o.up_queue = std::max(o.up_queue, 0.0);
  o.up_latency_ms = std::max(o.up_latency_ms, 0.0);
  o.up_after_s = std::max(o.up_after_s, 0.0);
  o.down_after_s = std::max(o.down_after_s, 0.0);
  return o;
}

encoder_scaler::encoder_scaler(encoder_scaling opt, const clock& clk)
    : opt_(sanitized(opt)), clk_(&clk) {}

void encoder_scaler::restart() {
  over_since_.reset();
  under_since_.reset();
}

namespace {

std::string format(const char* fmt, double a, double b) {
  char buf[160];
  std::snprintf(buf, sizeof buf, fmt, a, b);
  return buf;
}

}  // namespace

scale_decision encoder_scaler::observe(const encoder_load& load) {
  const auto now = clk_->now();
  const int n = load.replicas;
  scale_decision d{n, {}};
  auto change = [&](int to, std::string why) {
    restart();
    d.replicas = to;
    d.reason = std::move(why);
    return d;
  };
  if (n < opt_.min) return change(opt_.min, "fewer replicas than min");
  if (n > opt_.max) return change(opt_.max, "more replicas than max");

  const double per_replica = static_cast<double>(load.waiting) / std::max(n, 1);
  const bool timed = load.answered > 0;
  const double mean_wait = timed ? load.wait_ms / static_cast<double>(load.answered) : 0;
  const bool queue_high = per_replica > opt_.up_queue;
  const bool wait_high = timed && mean_wait > opt_.up_latency_ms;
  // One replica fewer would hold what waits now at half the threshold,
  // and the images wait half as long as the limit: far from overloaded.
  const bool quiet = n > opt_.min &&
                     static_cast<double>(load.waiting) <= opt_.up_queue * (n - 1) / 2.0 &&
                     mean_wait <= opt_.up_latency_ms / 2;

  if (queue_high || wait_high) {
    under_since_.reset();
    if (!over_since_) over_since_ = now;
    if (n < opt_.max && ms_between(*over_since_, now) >= opt_.up_after_s * 1000) {
      return change(n + 1, queue_high
                               ? format("%.1f images waiting per replica (up_queue %.1f)",
                                        per_replica, opt_.up_queue)
                               : format("images waited %.0f ms on average (up_latency_ms %.0f)",
                                        mean_wait, opt_.up_latency_ms));
    }
    return d;
  }
  over_since_.reset();
  if (!quiet) {
    under_since_.reset();
    return d;
  }
  if (!under_since_) under_since_ = now;
  if (ms_between(*under_since_, now) >= opt_.down_after_s * 1000)
    return change(n - 1, format("lightly loaded for %.0f s (down_after_s %.0f)",
                                ms_between(*under_since_, now) / 1000, opt_.down_after_s));
  return d;
}

}  // namespace troupe::actors::core
