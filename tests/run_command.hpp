// Runs a shell command from a test and captures what it prints.
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

/// Runs `cmd` with /bin/sh; `out` holds its stdout (redirect stderr in
/// `cmd` to have it too).
inline run_result run_command(const std::string& cmd) {
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
