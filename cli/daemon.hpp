#pragma once

// What the long-running commands (troupe worker, troupe node) share: they
// end on SIGINT or SIGTERM, and they do not hang in CAF's shutdown.

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

namespace troupe::cli {

/// Blocks SIGINT and SIGTERM in this thread and in every thread started
/// after it (call it first), so that wait_for_stop_signal receives them.
inline sigset_t block_stop_signals() {
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  return sigs;
}

/// Waits for SIGINT or SIGTERM; the signal.
inline int wait_for_stop_signal(const sigset_t& sigs) {
  int sig = 0;
  sigwait(&sigs, &sig);
  return sig;
}

/// Ends the process `grace` from now if it has not ended by itself. CAF's
/// shutdown waits for every detached actor's last reference; about one run
/// in 25, an actor that had served another node kept one and the process
/// hung there. A daemon holds nothing that outlives it, so it just ends.
inline void exit_after(std::chrono::seconds grace, std::string who) {
  std::thread([grace, who = std::move(who)] {
    std::this_thread::sleep_for(grace);
    std::fprintf(stderr, "%s: still stopping %lld s after the signal; exiting anyway\n",
                 who.c_str(), static_cast<long long>(grace.count()));
    std::fflush(stdout);
    std::_Exit(0);
  }).detach();
}

}  // namespace troupe::cli
