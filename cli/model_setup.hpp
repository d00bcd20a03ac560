#pragma once

// What `troupe generate`, `run` and `bench` share: parsing the precision
// flags, loading a model for the plain generation loop, and setting up the
// actor pipeline from the pipeline flags.

#include <CLI/CLI.hpp>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "actors/runtime.hpp"
#include "kernels/device.hpp"
#include "models/context_length.hpp"
#include "models/llama.hpp"
#include "models/llava.hpp"
#include "models/llava_config.hpp"
#include "models/weights.hpp"

namespace troupe::cli {

/// --quant FORMAT and --quant-override PATTERN=FORMAT as a plan (the error
/// names the flag).
kernels::result<models::quant_plan> parse_quant_flags(const std::string& quant,
                                                      const std::vector<std::string>& overrides);

/// --kv-type f32 | f16 | int8 (i8).
kernels::result<kernels::dtype> parse_kv_type(const std::string& name);

/// The precision flags: the weights' (--quant, --quant-override) and the KV
/// cache's (--kv-type).
struct precision_flags {
  models::quant_plan plan;
  kernels::dtype kv_type = kernels::dtype::f32;
};
/// parse_quant_flags, then parse_kv_type: the first error.
kernels::result<precision_flags> parse_precision_flags(const std::string& quant,
                                                       const std::vector<std::string>& overrides,
                                                       const std::string& kv_type);

/// A whole model for the plain loop: a LLaVA (vision + decoder) or a LLaMA.
struct direct_model {
  std::unique_ptr<models::llava_model> llava;
  std::unique_ptr<models::llama_model> plain;
  const models::llama_model& text() const { return llava ? llava->language_model() : *plain; }
};

/// Builds the model of `src`: LLaVA when `llava` is set, else a LLaMA of `text`.
kernels::result<direct_model> load_direct_model(const models::weight_source& src,
                                                const std::optional<models::llava_config>& llava,
                                                const models::llama_config& text,
                                                kernels::device& dev,
                                                const models::quant_plan& plan);

/// The pipeline flags (--stages, --remote-stage, --tp-peer,
/// --micro-batches, --decode-steps).
struct pipeline_flags {
  std::string remote_stage;           ///< HOST:PORT of a troupe worker serving the last layers
  std::vector<std::string> tp_peers;  ///< HOST:PORT of tensor-parallel workers (ranks 1..K-1)
  int stages = 1, micro_batches = 0, decode_steps = 16;
  models::context_options context;  ///< --max-model-len, --allow-long-context
  bool prefix_caching = true;       ///< --no-prefix-caching turns it off
  models::kv_tier_options tiers;    ///< --kv-host-tokens, --kv-disk-tokens, --kv-disk-dir
};

/// --max-model-len and --allow-long-context on `cmd`.
void add_context_flags(CLI::App& cmd, models::context_options& context);
/// --no-prefix-caching and the KV tier flags on `cmd`.
void add_cache_flags(CLI::App& cmd, pipeline_flags& f);

/// The runtime's CAF settings, and the middleman where a stage or a
/// tensor-parallel rank runs in another process.
void configure_pipeline_system(caf::actor_system_config& cfg, const pipeline_flags& f);

/// The pipeline of `model` over `devices` as the flags say.
actors::runtime_config pipeline_config(const pipeline_flags& f, const std::string& model,
                                       std::vector<actors::device_spec> devices,
                                       const models::quant_plan& plan,
                                       const models::kv_options& kv);

}  // namespace troupe::cli
