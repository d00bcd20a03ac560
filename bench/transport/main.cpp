// bench_transport: the UCX engine's bandwidth between two processes next
// to ucx_perftest's tag_bw on the same path in the same run, for 4 KiB to
// 256 MiB messages over shared memory and over TCP on loopback.
//
//   bench_transport [--quick] [--sizes 4096,1048576] [--window 8] [--rounds 3]
//                   [--engine-arg "--spin-us 1000"]...
//
// Each figure is the median of `rounds` rounds; a round measures the
// engine, the tuned engine and ucx_perftest one after the other, so a slow
// spell of this machine lands on all three rather than on one. The ratio
// column is the median of the per-round ratios, with their range.
//
// The engine runs in two troupe_transport_peer processes (tag messages,
// `window` in flight from one buffer, as ucx_perftest does), once as
// configured by default (sleeping on the event fd when idle, progress
// thread on, peer error handling on TCP) and once tuned for throughput
// (busy-polling, no progress thread, no peer error handling: what
// ucx_perftest runs). Ratios are against ucx_perftest. For TCP a second
// table keeps peer error handling on both sides (ucx_perftest -e).
#define TROUPE_MULTIPROC_NO_GTEST
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "bench/common/stats.hpp"
#include "tests/multiproc.hpp"

using namespace std::chrono_literals;
using troupe::bench::median;
using troupe::test::child_process;

namespace {

struct path {
  const char* name;
  std::vector<std::string> engine_args;
  std::vector<std::string> env;  // for ucx_perftest
  std::size_t total_bytes;       // per measurement
};

// How the engine runs: as configured by default, tuned like ucx_perftest,
// or tuned but with peer error handling kept (like `ucx_perftest -e`).
enum class engine_mode { as_default, tuned, tuned_with_errors };

// Extra options for every engine process (--engine-arg), for experiments.
std::vector<std::string> g_engine_extra;

double engine_gbps(const path& p, std::size_t size, std::size_t iters, std::size_t window,
                   engine_mode mode) {
  std::vector<std::string> argv{TROUPE_TRANSPORT_PEER};
  argv.insert(argv.end(), p.engine_args.begin(), p.engine_args.end());
  argv.insert(argv.end(), g_engine_extra.begin(), g_engine_extra.end());
  if (mode != engine_mode::as_default) {
    for (const char* a : {"--busy-poll", "1", "--progress-thread", "0", "--peer-errors"})
      argv.push_back(a);
    argv.push_back(mode == engine_mode::tuned ? "0" : "1");
  }
  child_process a("bench-a", argv), b("bench-b", argv);
  auto aa = a.expect("address ", 20000ms), bb = b.expect("address ", 20000ms);
  if (!aa || !bb || !aa->starts_with("address") || !bb->starts_with("address")) return -1;
  a.send_line("connect " + bb->substr(8));
  b.send_line("connect " + aa->substr(8));
  auto pa = a.expect("peer ", 20000ms);
  b.expect("peer ", 20000ms);
  if (!pa || !pa->starts_with("peer")) return -1;
  const std::string peer = pa->substr(5);
  double best = -1;
  for (int rep = 0; rep < 2; ++rep) {  // the first run warms up
    b.send_line("bw_recv " + std::to_string(size) + " " + std::to_string(iters) + " " +
                std::to_string(window));
    a.send_line("bw_send " + peer + " " + std::to_string(size) + " " + std::to_string(iters) + " " +
                std::to_string(window));
    auto r = a.expect("gbps ", 300000ms);
    b.expect("gbps ", 300000ms);
    if (!r || !r->starts_with("gbps")) {
      std::fprintf(stderr, "engine run failed: %s\n", r.value_or("(no answer)").c_str());
      a.keep_logs = b.keep_logs = true;
      return -1;
    }
    best = std::max(best, std::stod(r->substr(5)));
  }
  return best;
}

double perftest_gbps(const path& p, std::size_t size, std::size_t iters,
                     bool error_handling = false) {
  const int port = troupe::test::free_port();
  std::vector<std::string> env = p.env;
  const std::string bin = "/usr/bin/ucx_perftest";
  child_process server("perftest-server", {bin, "-p", std::to_string(port)}, env);
  std::this_thread::sleep_for(300ms);
  const std::size_t warm = std::max<std::size_t>(2, std::min<std::size_t>(iters / 10, 1000));
  std::vector<std::string> args{
      bin,  "127.0.0.1",          "-p", std::to_string(port),  "-t", "tag_bw",
      "-s", std::to_string(size), "-n", std::to_string(iters), "-w", std::to_string(warm),
      "-f"};
  if (error_handling) args.push_back("-e");
  child_process client("perftest-client", args, env);
  for (;;) {
    auto l = client.read_line(300000ms);
    if (!l) return -1;
    // With -f the result is one line of 8 numbers: iterations, overhead
    // (50%, average, overall), bandwidth MB/s (average, overall), rates.
    std::istringstream in(*l);
    double f[8] = {};
    int got = 0;
    while (got < 8 && in >> f[got]) ++got;
    if (got == 8 && static_cast<std::size_t>(f[0]) == iters) {
      return f[5] * 1048576.0 / 1e9;  // overall bandwidth, MB/s (2^20) -> GB/s
    }
  }
}

// One table cell: the median ratio of the rounds, with their range.
std::string ratio_cell(const std::vector<double>& num, const std::vector<double>& den) {
  std::vector<double> r;
  for (std::size_t i = 0; i < num.size() && i < den.size(); ++i)
    if (num[i] > 0 && den[i] > 0) r.push_back(num[i] / den[i]);
  if (r.empty()) return "failed";
  char buf[64];
  if (r.size() == 1) {
    std::snprintf(buf, sizeof buf, "%.2f", r[0]);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f (%.2f-%.2f)", median(r),
                  *std::min_element(r.begin(), r.end()), *std::max_element(r.begin(), r.end()));
  }
  return buf;
}

struct row {
  std::vector<double> engine, tuned, perftest;
  bool failed() const {
    auto bad = [](const std::vector<double>& v) {
      return std::any_of(v.begin(), v.end(), [](double x) { return x <= 0; });
    };
    return bad(engine) || bad(tuned) || bad(perftest);
  }
};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes{4096, 65536, 1u << 20, 16u << 20, 256u << 20};
  std::size_t window = 8;
  int rounds = 3;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
      sizes = {65536, 1u << 20};
    } else if (a == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::stoi(argv[++i]));
    } else if (a == "--engine-arg" && i + 1 < argc) {
      std::stringstream ss(argv[++i]);
      std::string part;
      while (ss >> part) g_engine_extra.push_back(part);
    } else if (a == "--window" && i + 1 < argc) {
      window = std::stoul(argv[++i]);
    } else if (a == "--sizes" && i + 1 < argc) {
      sizes.clear();
      std::stringstream ss(argv[++i]);
      std::string part;
      while (std::getline(ss, part, ',')) sizes.push_back(std::stoul(part));
    } else {
      std::fprintf(stderr,
                   "usage: bench_transport [--quick] [--sizes N,N,...] [--window W] [--rounds R] "
                   "[--engine-arg \"ARGS\"]...\n");
      return 2;
    }
  }
  const std::vector<path> paths{
      {"shared memory", {"--timeout-ms", "60000"}, {}, quick ? (64u << 20) : (2ull << 30)},
      {"tcp (lo)",
       {"--tls", "tcp", "--net-devices", "lo", "--timeout-ms", "60000"},
       {"UCX_TLS=tcp", "UCX_NET_DEVICES=lo"},
       quick ? (32u << 20) : (1ull << 30)},
  };
  std::printf(
      "UCX engine vs ucx_perftest tag_bw, 2 processes, %zu messages in flight (GB/s = 1e9 "
      "bytes/s); medians of %d "
      "rounds, ratios as median (lowest-highest) of the rounds' ratios\n\n",
      window, rounds);
  std::printf(
      "| path | message | engine GB/s | engine tuned GB/s | ucx_perftest GB/s | engine / perftest "
      "| tuned / perftest |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  int failures = 0;
  auto size_name = [](std::size_t size) {
    return size >= (1u << 20) ? std::to_string(size >> 20) + " MiB"
                              : std::to_string(size >> 10) + " KiB";
  };
  for (const auto& p : paths) {
    for (const std::size_t size : sizes) {
      const std::size_t iters =
          std::max<std::size_t>(8, std::min<std::size_t>(100000, p.total_bytes / size));
      row r;
      for (int k = 0; k < rounds; ++k) {
        r.engine.push_back(engine_gbps(p, size, iters, window, engine_mode::as_default));
        r.tuned.push_back(engine_gbps(p, size, iters, window, engine_mode::tuned));
        r.perftest.push_back(perftest_gbps(p, size, iters));
      }
      if (r.failed()) ++failures;
      std::printf("| %s | %s | %.2f | %.2f | %.2f | %s | %s |\n", p.name, size_name(size).c_str(),
                  median(r.engine), median(r.tuned), median(r.perftest),
                  ratio_cell(r.engine, r.perftest).c_str(),
                  ratio_cell(r.tuned, r.perftest).c_str());
      std::fflush(stdout);
    }
  }
  // Over TCP the engine keeps UCX's peer error handling on (without it a
  // dead peer's requests never complete in UCX 1.13); ucx_perftest -e runs
  // the same endpoint mode, so this is the like-for-like comparison.
  {
    const auto& p = paths[1];
    std::printf("\nTCP with peer error handling on both sides (ucx_perftest -e)\n\n");
    std::printf(
        "| message | engine GB/s | engine busy-poll GB/s | ucx_perftest -e GB/s | engine / "
        "perftest -e | busy-poll / perftest -e |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (const std::size_t size : sizes) {
      if (size < (1u << 20)) continue;
      const std::size_t iters =
          std::max<std::size_t>(8, std::min<std::size_t>(100000, p.total_bytes / size));
      row r;
      for (int k = 0; k < rounds; ++k) {
        r.engine.push_back(engine_gbps(p, size, iters, window, engine_mode::as_default));
        r.tuned.push_back(engine_gbps(p, size, iters, window, engine_mode::tuned_with_errors));
        r.perftest.push_back(perftest_gbps(p, size, iters, true));
      }
      if (r.failed()) ++failures;
      std::printf("| %s | %.2f | %.2f | %.2f | %s | %s |\n", size_name(size).c_str(),
                  median(r.engine), median(r.tuned), median(r.perftest),
                  ratio_cell(r.engine, r.perftest).c_str(),
                  ratio_cell(r.tuned, r.perftest).c_str());
      std::fflush(stdout);
    }
  }
  // Overlap: a pipeline step computes a micro-batch and sends its
  // activations; with overlap the send of step i runs while step i+1
  // computes. Compute is sized so that the transfers take about half of it.
  {
    const std::size_t bytes = quick ? (1u << 20) : (8u << 20), steps = quick ? 10 : 40;
    std::vector<std::string> argv{TROUPE_TRANSPORT_PEER, "--timeout-ms", "60000"};
    child_process a("overlap-a", argv), b("overlap-b", argv);
    auto aa = a.expect("address ", 20000ms), bb = b.expect("address ", 20000ms);
    std::string peer;
    if (aa && bb && aa->starts_with("address") && bb->starts_with("address")) {
      a.send_line("connect " + bb->substr(8));
      b.send_line("connect " + aa->substr(8));
      auto pa = a.expect("peer ", 20000ms);
      b.expect("peer ", 20000ms);
      if (pa && pa->starts_with("peer")) peer = pa->substr(5);
    }
    std::size_t base = 1;
    auto run = [&](const std::string& mode, std::size_t compute_us) -> double {
      if (peer.empty()) return -1;
      if (mode != "compute")
        b.send_line("overlap_recv " + std::to_string(bytes) + " " + std::to_string(steps) + " " +
                    std::to_string(base));
      a.send_line("overlap " + peer + " " + std::to_string(bytes) + " " + std::to_string(steps) +
                  " " + std::to_string(base) + " " + std::to_string(compute_us) + " " + mode);
      base += steps;
      auto r = a.expect("ms ", 300000ms);
      if (mode != "compute") b.expect("ms ", 300000ms);
      if (!r || !r->starts_with("ms ")) {
        a.keep_logs = b.keep_logs = true;
        return -1;
      }
      return std::stod(r->substr(3)) / static_cast<double>(steps);
    };
    run("transfer", 0);  // warm-up
    std::vector<double> transfer, compute, seq, over, hidden, slowdown;
    std::size_t compute_us = 0;
    for (int k = 0; k < rounds; ++k) {
      const double t = run("transfer", 0);
      // Compute is sized from the first round's transfer, so that every
      // round runs the same step.
      if (compute_us == 0) compute_us = static_cast<std::size_t>(std::max(200.0, 2000.0 * t));
      const double c = run("compute", compute_us), sq = run("seq", compute_us),
                   ov = run("overlap", compute_us);
      if (t <= 0 || c <= 0 || sq <= 0 || ov <= 0) {
        ++failures;
        continue;
      }
      transfer.push_back(t);
      compute.push_back(c);
      seq.push_back(sq);
      over.push_back(ov);
      hidden.push_back(sq > c ? (sq - ov) / (sq - c) : 0);
      slowdown.push_back(ov / c);
    }
    std::printf(
        "\nOverlap, shared memory: %zu MiB of activations per step, %zu steps (ms per step; "
        "medians of %d rounds)\n\n",
        bytes >> 20, steps, rounds);
    std::printf(
        "| transfer alone | compute alone | compute then send | send overlapped | transfer / "
        "compute | "
        "transfer time hidden (range) | step with transfers / without "
        "|\n|---|---|---|---|---|---|---|\n");
    const double c = median(compute);
    std::printf("| %.3f | %.3f | %.3f | %.3f | %.2f | %.0f%% (%.0f-%.0f%%) | %.3f |\n",
                median(transfer), c, median(seq), median(over), c > 0 ? median(transfer) / c : 0,
                100.0 * median(hidden),
                hidden.empty() ? 0.0 : 100.0 * *std::min_element(hidden.begin(), hidden.end()),
                hidden.empty() ? 0.0 : 100.0 * *std::max_element(hidden.begin(), hidden.end()),
                median(slowdown));
  }
  return failures ? 1 : 0;
}
