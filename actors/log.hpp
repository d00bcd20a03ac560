#pragma once

// The process's logging: spdlog to stderr, as text or one JSON object per
// line, every line tagged with the node (the manifest's name of this
// process, when it has one) and the actor kind that wrote it ("head",
// "agent", "scheduler", "gateway", ...; "troupe" for the command itself).
//
// Text:  [2026-12-03 19:40:01.123] [info] [node0/head] placed node0 [0,2) -> ...
// JSON:
// {"time":"2026-12-03T19:40:01.123","level":"info","node":"node0","actor":"head","msg":"placed
// ..."}

#include <spdlog/spdlog.h>

#include <expected>
#include <string>
#include <string_view>

namespace troupe::actors::logging {

enum class format { text, json };

/// "text" or "json"; anything else is an error naming the choices.
std::expected<format, std::string> parse_format(std::string_view name);

/// Sets the format and the node tag of every logger (those made already
/// and those made later). `node` may be empty (a command that is no node).
void configure(format f, std::string node);
/// The node tag alone (`troupe node` learns its name after start).
void set_node(std::string node);
format current_format();

/// The logger of one actor kind: same sinks and format as the default
/// logger, its name is the line's actor tag.
spdlog::logger& of(const std::string& actor);

/// The JSON line for one message (exposed for the tests).
std::string json_line(std::string_view time, std::string_view level, std::string_view node,
                      std::string_view actor, std::string_view msg);

}  // namespace troupe::actors::logging
