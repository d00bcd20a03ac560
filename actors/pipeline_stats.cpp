#include "actors/pipeline_stats.hpp"

#include <algorithm>
#include <cstdio>

namespace troupe::actors {

std::optional<pipeline_breakdown> breakdown_between(const scheduler_stats& a,
                                                    const scheduler_stats& b, double wall_s) {
  const auto steps = b.steps - a.steps;
  if (!(wall_s > 0) || steps <= 0 || b.step_rows < a.step_rows ||
      b.round_trip_ms < a.round_trip_ms || b.compute_ms < a.compute_ms ||
      b.in_flight_ms < a.in_flight_ms || b.scheduler_ms < a.scheduler_ms ||
      b.tokens_out < a.tokens_out)
    return std::nullopt;
  pipeline_breakdown p;
  const double n = static_cast<double>(steps);
  const double wall_ms = wall_s * 1e3;
  p.wall_s = wall_s;
  p.stages =
      std::max<std::int64_t>({1, b.stages, static_cast<std::int64_t>(b.stage_compute_ms.size())});
  p.steps_per_s = n / wall_s;
  p.rows_per_s = static_cast<double>(b.step_rows - a.step_rows) / wall_s;
  p.tokens_per_s = static_cast<double>(b.tokens_out - a.tokens_out) / wall_s;
  p.round_trip_ms = (b.round_trip_ms - a.round_trip_ms) / n;
  p.compute_ms = (b.compute_ms - a.compute_ms) / n;
  p.other_ms = std::max(0.0, p.round_trip_ms - p.compute_ms);
  p.stage_busy = std::clamp(
      (b.compute_ms - a.compute_ms) / (static_cast<double>(p.stages) * wall_ms), 0.0, 1.0);
  if (a.stage_compute_ms.size() <= b.stage_compute_ms.size())
    for (std::size_t i = 0; i < b.stage_compute_ms.size(); ++i) {
      const double before = i < a.stage_compute_ms.size() ? a.stage_compute_ms[i] : 0.0;
      p.busy_per_stage.push_back(std::clamp((b.stage_compute_ms[i] - before) / wall_ms, 0.0, 1.0));
    }
  p.idle = std::clamp(1.0 - (b.in_flight_ms - a.in_flight_ms) / wall_ms, 0.0, 1.0);
  p.scheduler = std::clamp((b.scheduler_ms - a.scheduler_ms) / wall_ms, 0.0, 1.0);
  return p;
}

std::string pipeline_breakdown::describe() const {
  char buf[640];
  std::snprintf(
      buf, sizeof buf,
      "  over %.1f s: %.1f steps/s, %.1f tokens/s through the stages, %.1f generated tokens/s\n"
      "  a step's round trip %.2f ms: the stages' compute %.2f ms, waiting and hand-offs %.2f ms\n"
      "  each of the %lld stages computes %.0f%% of the time; no step in flight %.0f%%; "
      "the scheduler's own work %.0f%%\n",
      wall_s, steps_per_s, rows_per_s, tokens_per_s, round_trip_ms, compute_ms, other_ms,
      static_cast<long long>(stages), 100 * stage_busy, 100 * idle, 100 * scheduler);
  std::string out = buf;
  if (!busy_per_stage.empty()) {
    out += "  busy per stage:";
    for (std::size_t i = 0; i < busy_per_stage.size(); ++i) {
      std::snprintf(buf, sizeof buf, "%s %zu: %.0f%%", i ? "," : "", i, 100 * busy_per_stage[i]);
      out += buf;
    }
    out += "\n";
  }
  return out;
}

std::string describe_kv_tiers(const scheduler_stats& s) {
  if (s.kv_host_blocks + s.kv_disk_blocks + s.kv_remote_blocks <= 0) return {};
  std::string store;
  if (s.kv_remote_blocks > 0) {
    char b[256];
    std::snprintf(
        b, sizeof b,
        "KV store: %lld of %lld blocks hold a whole copy (%lld on their way); copied "
        "device->store %lld, store->device %lld (%.1f MiB in all)",
        static_cast<long long>(s.kv_remote_used), static_cast<long long>(s.kv_remote_blocks),
        static_cast<long long>(s.kv_remote_pending), static_cast<long long>(s.kv_to_remote),
        static_cast<long long>(s.kv_from_remote),
        static_cast<double>((s.kv_to_remote + s.kv_from_remote) * s.kv_slot_bytes) / (1 << 20));
    store = b;
    if (s.kv_host_blocks + s.kv_disk_blocks <= 0) return store;
    store = "\n" + store;
  }
  const auto moved = s.kv_to_host + s.kv_from_host + s.kv_to_disk + s.kv_from_disk;
  char buf[384];
  std::snprintf(buf, sizeof buf,
                "KV tiers: host %lld of %lld blocks used, disk %lld of %lld; moved device->host "
                "%lld, host->device %lld, ->disk %lld, disk->device %lld (%.1f MiB in all); %lld "
                "dropped",
                static_cast<long long>(s.kv_host_used), static_cast<long long>(s.kv_host_blocks),
                static_cast<long long>(s.kv_disk_used), static_cast<long long>(s.kv_disk_blocks),
                static_cast<long long>(s.kv_to_host), static_cast<long long>(s.kv_from_host),
                static_cast<long long>(s.kv_to_disk), static_cast<long long>(s.kv_from_disk),
                static_cast<double>(moved * s.kv_slot_bytes) / (1 << 20),
                static_cast<long long>(s.kv_dropped));
  return buf + store;
}

}  // namespace troupe::actors
