// bench_transport: the UCX engine's bandwidth between two processes next
// to ucx_perftest's tag_bw on the same path in the same run, for 4 KiB to
// 256 MiB messages over shared memory and over TCP on loopback.
//
//   bench_transport [--quick] [--sizes 4096,1048576] [--window 8]
//
// The engine runs in two troupe_transport_peer processes (tag messages,
// `window` in flight from one buffer, as ucx_perftest does), once as
// configured by default (sleeping on the event fd when idle, progress
// thread on, peer error handling on TCP) and once tuned for throughput
// (busy-polling, no progress thread, no peer error handling: what
// ucx_perftest runs). Ratios are against ucx_perftest. For TCP a second
// table keeps peer error handling on both sides (ucx_perftest -e).
#define TROUPE_MULTIPROC_NO_GTEST
#include <cstdio>
#include <cstring>
#include <sstream>

#include "tests/multiproc.hpp"

using namespace std::chrono_literals;
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

double engine_gbps(const path& p, std::size_t size, std::size_t iters, std::size_t window, engine_mode mode) {
  std::vector<std::string> argv{TROUPE_TRANSPORT_PEER};
  argv.insert(argv.end(), p.engine_args.begin(), p.engine_args.end());
  if (mode != engine_mode::as_default) {
    for (const char* a : {"--busy-poll", "1", "--progress-thread", "0", "--peer-errors"}) argv.push_back(a);
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
    b.send_line("bw_recv " + std::to_string(size) + " " + std::to_string(iters) + " " + std::to_string(window));
    a.send_line("bw_send " + peer + " " + std::to_string(size) + " " + std::to_string(iters) + " " + std::to_string(window));
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

double perftest_gbps(const path& p, std::size_t size, std::size_t iters, bool error_handling = false) {
  const int port = troupe::test::free_port();
  std::vector<std::string> env = p.env;
  const std::string bin = "/usr/bin/ucx_perftest";
  child_process server("perftest-server", {bin, "-p", std::to_string(port)}, env);
  std::this_thread::sleep_for(300ms);
  const std::size_t warm = std::max<std::size_t>(2, std::min<std::size_t>(iters / 10, 1000));
  std::vector<std::string> args{bin, "127.0.0.1", "-p", std::to_string(port), "-t", "tag_bw", "-s", std::to_string(size),
                                "-n", std::to_string(iters), "-w", std::to_string(warm), "-f"};
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

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes{4096, 65536, 1u << 20, 16u << 20, 256u << 20};
  std::size_t window = 8;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {
      quick = true;
      sizes = {65536, 1u << 20};
    } else if (a == "--window" && i + 1 < argc) {
      window = std::stoul(argv[++i]);
    } else if (a == "--sizes" && i + 1 < argc) {
      sizes.clear();
      std::stringstream ss(argv[++i]);
      std::string part;
      while (std::getline(ss, part, ',')) sizes.push_back(std::stoul(part));
    } else {
      std::fprintf(stderr, "usage: bench_transport [--quick] [--sizes N,N,...] [--window W]\n");
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
  std::printf("UCX engine vs ucx_perftest tag_bw, 2 processes, %zu messages in flight (GB/s = 1e9 bytes/s)\n\n", window);
  std::printf("| path | message | engine GB/s | engine tuned GB/s | ucx_perftest GB/s | engine / perftest | tuned / perftest |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  int failures = 0;
  for (const auto& p : paths) {
    for (const std::size_t size : sizes) {
      const std::size_t iters = std::max<std::size_t>(8, std::min<std::size_t>(100000, p.total_bytes / size));
      const double e = engine_gbps(p, size, iters, window, engine_mode::as_default);
      const double eb = engine_gbps(p, size, iters, window, engine_mode::tuned);
      const double pf = perftest_gbps(p, size, iters);
      if (e <= 0 || eb <= 0 || pf <= 0) ++failures;
      const std::string sz = size >= (1u << 20) ? std::to_string(size >> 20) + " MiB" : std::to_string(size >> 10) + " KiB";
      std::printf("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f |\n", p.name, sz.c_str(), e, eb, pf, pf > 0 ? e / pf : 0,
                  pf > 0 ? eb / pf : 0);
      std::fflush(stdout);
    }
  }
  // Over TCP the engine keeps UCX's peer error handling on (without it a
  // dead peer's requests never complete in UCX 1.13); ucx_perftest -e runs
  // the same endpoint mode, so this is the like-for-like comparison.
  {
    const auto& p = paths[1];
    std::printf("\nTCP with peer error handling on both sides (ucx_perftest -e)\n\n");
    std::printf("| message | engine GB/s | engine busy-poll GB/s | ucx_perftest -e GB/s | engine / perftest -e | busy-poll / perftest -e |\n");
    std::printf("|---|---|---|---|---|---|\n");
    for (const std::size_t size : sizes) {
      if (size < (1u << 20)) continue;
      const std::size_t iters = std::max<std::size_t>(8, std::min<std::size_t>(100000, p.total_bytes / size));
      const double e = engine_gbps(p, size, iters, window, engine_mode::as_default);
      const double eb = engine_gbps(p, size, iters, window, engine_mode::tuned_with_errors);
      const double pf = perftest_gbps(p, size, iters, true);
      if (e <= 0 || eb <= 0 || pf <= 0) ++failures;
      std::printf("| %zu MiB | %.2f | %.2f | %.2f | %.2f | %.2f |\n", size >> 20, e, eb, pf, pf > 0 ? e / pf : 0,
                  pf > 0 ? eb / pf : 0);
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
      if (mode != "compute") b.send_line("overlap_recv " + std::to_string(bytes) + " " + std::to_string(steps) + " " + std::to_string(base));
      a.send_line("overlap " + peer + " " + std::to_string(bytes) + " " + std::to_string(steps) + " " +
                  std::to_string(base) + " " + std::to_string(compute_us) + " " + mode);
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
    const double transfer = run("transfer", 0);
    const auto compute_us = static_cast<std::size_t>(std::max(200.0, 2000.0 * transfer));
    const double compute = run("compute", compute_us);
    const double seq = run("seq", compute_us);
    const double over = run("overlap", compute_us);
    if (transfer <= 0 || compute <= 0 || seq <= 0 || over <= 0) ++failures;
    const double hidden = seq > compute ? (seq - over) / (seq - compute) : 0;
    std::printf("\nOverlap, shared memory: %zu MiB of activations per step, %zu steps (ms per step)\n\n",
                bytes >> 20, steps);
    std::printf("| transfer alone | compute alone | compute then send | send overlapped | transfer / compute | "
                "transfer time hidden | step with transfers / without |\n|---|---|---|---|---|---|---|\n");
    std::printf("| %.3f | %.3f | %.3f | %.3f | %.2f | %.0f%% | %.3f |\n", transfer, compute, seq, over,
                compute > 0 ? transfer / compute : 0, 100.0 * hidden, compute > 0 ? over / compute : 0);
  }
  return failures ? 1 : 0;
}
