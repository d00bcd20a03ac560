#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace troupe::cli {

/// Registers a subcommand on `app`; the returned function runs it after
/// parsing (exit code).
using command_runner = std::function<int()>;

/// `troupe generate` (run = false) or `troupe run` (run = true): the same
/// options; both go through the actor pipeline (generate: one stage unless
/// --stages/--devices say otherwise; --direct runs the plain loop).
command_runner add_generate(CLI::App& app, bool run = false);

/// The model commands use without --model: $TROUPE_MODEL, else the bundled
/// tiny LLaVA (assets/tiny-llava-shapes of the source tree this binary was
/// built from).
std::string bundled_model_path();
command_runner add_write_model(CLI::App& app);
/// `troupe score`: teacher-forced logits, perplexity (--out: the raw logits).
command_runner add_score(CLI::App& app);
/// `troupe bench`: concurrent requests through the actor pipeline.
command_runner add_bench(CLI::App& app);
/// `troupe worker`: serves a model's last layers to another process.
command_runner add_worker(CLI::App& app);
/// `troupe certs`: the cluster CA and node certificates of a manifest.
command_runner add_certs(CLI::App& app);
/// `troupe node`: the node daemon (mutual TLS, the gatekeeper).
command_runner add_node(CLI::App& app);
/// `troupe up`, `status`, `submit`, `down` (which: that name).
command_runner add_cluster(CLI::App& app, const std::string& which);
/// `troupe serve`: the OpenAI-compatible HTTP gateway.
command_runner add_serve(CLI::App& app);

}  // namespace troupe::cli
