#include "cli/model_setup.hpp"

namespace troupe::cli {

kernels::result<models::quant_plan> parse_quant_flags(const std::string& quant,
                                                      const std::vector<std::string>& overrides) {
  models::quant_plan plan;
  if (!quant.empty()) {
    auto f = kernels::weight_format_from_string(quant);
    if (!f) return kernels::make_error(f.error().code, "--quant: " + f.error().message);
    plan.default_format = *f;
  }
  for (const auto& o : overrides)
    if (auto r = plan.add_override(o); !r)
      return kernels::make_error(r.error().code, "--quant-override: " + r.error().message);
  return plan;
}

kernels::result<kernels::dtype> parse_kv_type(const std::string& name) {
  auto t = kernels::dtype_from_string(name == "int8" ? "i8" : name);
  if (!t || (*t != kernels::dtype::f32 && *t != kernels::dtype::f16 && *t != kernels::dtype::i8))
    return kernels::make_error(kernels::errc::invalid_argument,
                               "--kv-type must be f32, f16 or int8");
  return *t;
}

kernels::result<direct_model> load_direct_model(const models::weight_source& src,
                                                const std::optional<models::llava_config>& llava,
                                                const models::llama_config& text,
                                                kernels::cpu::context& ctx,
                                                const models::quant_plan& plan) {
  direct_model m;
  if (llava) {
    auto r = models::llava_model::build(src, *llava, ctx, plan);
    if (!r) return std::unexpected(r.error());
    m.llava = std::move(*r);
  } else {
    auto r = models::llama_model::build(src, text, ctx, plan);
    if (!r) return std::unexpected(r.error());
    m.plain = std::move(*r);
  }
  return m;
}

}  // namespace troupe::cli
