#pragma once

// What `troupe generate`, `run` and `bench` share: parsing the precision
// flags and loading a model for the plain generation loop.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/cpu/context.hpp"
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
                                                kernels::cpu::context& ctx,
                                                const models::quant_plan& plan);

}  // namespace troupe::cli
