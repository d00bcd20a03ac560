#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace troupe::cli {

/// Registers a subcommand on `app`; the returned function runs it after
/// parsing (exit code).
using command_runner = std::function<int()>;

command_runner add_generate(CLI::App& app);
command_runner add_write_model(CLI::App& app);

}  // namespace troupe::cli
