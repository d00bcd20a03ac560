// Runs the troupe binary (TROUPE_CLI) from a test, capturing its output.
#pragma once

#include <string>

#include "tests/run_command.hpp"

namespace troupe::test {

/// Runs `troupe ARGS`; the output holds stdout, and stderr too when
/// `merge_stderr` (otherwise stderr is dropped).
inline run_result troupe_cli(const std::string& args, bool merge_stderr = true) {
  return run_command(std::string(TROUPE_CLI) + " " + args +
                     (merge_stderr ? " 2>&1" : " 2>/dev/null"));
}

}  // namespace troupe::test
