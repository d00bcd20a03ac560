#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace troupe::cli {

/// Registers a subcommand on `app`; the returned function runs it after
/// parsing (exit code).
using command_runner = std::function<int()>;

command_runner add_generate(CLI::App& app);

/// The model commands use without --model: $TROUPE_MODEL, else the bundled
/// tiny LLaVA (assets/tiny-llava-shapes of the source tree this binary was
/// built from).
std::string bundled_model_path();
command_runner add_write_model(CLI::App& app);

}  // namespace troupe::cli
