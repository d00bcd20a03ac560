// troupe bench --http --migrate: live migrations (troupe migrate) during
// the last level, and the longest inter-token gap each caused next to the
// gaps the workload makes by itself.
#include <algorithm>
#include <cstdio>
#include <thread>
#include <utility>

#include "actors/cluster.hpp"
#include "cli/bench.hpp"

namespace troupe::cli::serve_bench {

namespace {

clock::time_point gap_began(const timed_gap& g) {
  return g.at - std::chrono::duration_cast<clock::duration>(
                    std::chrono::duration<double, std::milli>(g.gap_ms));
}

/// The longest gap that overlaps [from, to].
double longest_gap_in(const std::vector<timed_gap>& gaps, clock::time_point from,
                      clock::time_point to) {
  double worst = 0;
  for (const auto& g : gaps)
    if (g.at >= from && gap_began(g) <= to) worst = std::max(worst, g.gap_ms);
  return worst;
}

/// A move's reference from the same run: the longest gap in windows of the
/// move's length placed every 5 ms across the level, leaving out windows
/// within 100 ms of any move. The workload makes long gaps of its own (a
/// wave of requests arriving together prefills at once, images are
/// encoded); these say how long a gap a window of that length meets
/// without a move. Returns each window's longest gap, sorted.
std::vector<double> longest_gap_without_moves(
    const std::vector<timed_gap>& gaps, clock::duration length,
    const std::vector<std::pair<clock::time_point, clock::time_point>>& moves) {
  if (gaps.empty()) return {};
  auto first = gap_began(gaps.front()), last = gaps.front().at;
  for (const auto& g : gaps) {
    first = std::min(first, gap_began(g));
    last = std::max(last, g.at);
  }
  const auto margin = std::chrono::milliseconds(100);
  std::vector<double> worst;
  for (auto t = first; t + length <= last; t += std::chrono::milliseconds(5)) {
    bool near_a_move = false;
    for (const auto& [a, b] : moves) near_a_move |= t <= b + margin && t + length >= a - margin;
    if (!near_a_move) worst.push_back(longest_gap_in(gaps, t, t + length));
  }
  std::sort(worst.begin(), worst.end());
  return worst;
}

}  // namespace

std::vector<move_done> run_moves(client_session& client, const std::vector<std::string>& moves) {
  std::vector<move_done> done;
  for (const auto& mv : moves) {
    const auto colon = mv.rfind(':');
    move_done r;
    r.what = mv;
    r.start = clock::now();
    auto rep =
        actors::migrate_shard(*client.sys, client.door,
                              actors::migrate_request{mv.substr(0, colon), mv.substr(colon + 1)},
                              std::chrono::seconds(120));
    r.end = clock::now();
    if (rep)
      r.report = *rep;
    else
      r.error = rep.error();
    done.push_back(std::move(r));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return done;
}

void print_moves(const level_result& level, const std::vector<move_done>& moves) {
  std::vector<double> all;
  for (const auto& g : level.gaps) all.push_back(g.gap_ms);
  const double median = bench::summarize(all).p50;
  std::printf("\nLive migrations during the concurrency-%d level (median ITL %.2f ms there):\n\n",
              level.concurrency, median);
  std::printf(
      "| move | result | pause ms | KV MiB (in the pause) | load ms | total ms | longest gap "
      "during it, ms | x median ITL "
      "| same-length windows without a move: longest gap p50 / p90 ms | of those, with a longer "
      "gap |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::pair<clock::time_point, clock::time_point>> windows;
  for (const auto& mv : moves) windows.emplace_back(mv.start, mv.end);
  for (const auto& mv : moves) {
    const double worst = longest_gap_in(level.gaps, mv.start, mv.end);
    const auto ref = longest_gap_without_moves(level.gaps, mv.end - mv.start, windows);
    if (!mv.report) {
      std::printf("| %s | failed: %s | | | | | %.1f | | | |\n", mv.what.c_str(), mv.error.c_str(),
                  worst);
      continue;
    }
    const auto& r = *mv.report;
    char without[64] = "(no window)", longer[32] = "";
    if (!ref.empty()) {
      // The windows at rank n/2 and 9n/10 of the sorted reference.
      std::snprintf(without, sizeof without, "%.1f / %.1f", ref[ref.size() / 2],
                    ref[ref.size() * 9 / 10]);
      const auto above =
          static_cast<double>(ref.end() - std::upper_bound(ref.begin(), ref.end(), worst));
      std::snprintf(longer, sizeof longer, "%.0f%%",
                    100.0 * above / static_cast<double>(ref.size()));
    }
    std::printf("| %s %s -> %s | ok | %.2f | %.3f (%.3f) | %.0f | %.0f | %.1f | %.1f | %s | %s |\n",
                r.what.c_str(), r.from.c_str(), r.to.c_str(), r.pause_ms,
                static_cast<double>(r.kv_bytes) / (1 << 20),
                static_cast<double>(r.final_kv_bytes) / (1 << 20), r.load_ms, r.total_ms, worst,
                median > 0 ? worst / median : 0.0, without, longer);
  }
  std::printf(
      "\nThe same-length windows are placed every 5 ms across the level, 100 ms or more away "
      "from the moves: "
      "the gaps the workload makes by itself (waves of requests prefilling together, images "
      "encoded). A move "
      "that adds nothing lands at a random rank among them.\n");
  std::printf(
      "\nThe aim (issue 8) is a longest gap of at most 3x the median inter-token latency.\n");
}

}  // namespace troupe::cli::serve_bench
