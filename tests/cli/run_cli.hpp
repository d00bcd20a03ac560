// Runs the troupe binary (TROUPE_CLI) from a test, capturing its output.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

namespace troupe::test {

struct run_result {
  int exit_code = -1;
  std::string out;
};

/// Runs `troupe ARGS`; the output holds stdout, and stderr too when
/// `merge_stderr` (otherwise stderr is dropped).
inline run_result troupe_cli(const std::string& args, bool merge_stderr = true) {
  const std::string cmd =
      std::string(TROUPE_CLI) + " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  run_result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf{};
  while (std::fgets(buf.data(), buf.size(), p)) r.out += buf.data();
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

}  // namespace troupe::test
