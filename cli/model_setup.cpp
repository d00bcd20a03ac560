#include "cli/model_setup.hpp"

#include <caf/io/all.hpp>

namespace troupe::cli {

kernels::result<models::quant_plan> parse_quant_flags(const std::string& quant,
                                                      const std::vector<std::string>& overrides) {
  models::quant_plan plan;
  if (auto mix = models::gguf_mix_from_string(quant)) {
    plan.mix = *mix;  // llama.cpp's file types (q4_k_m, q6_k, iq4_xs, ...)
  } else if (!quant.empty()) {
    auto f = kernels::quant_target_from_string(quant);
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

kernels::result<precision_flags> parse_precision_flags(const std::string& quant,
                                                       const std::vector<std::string>& overrides,
                                                       const std::string& kv_type) {
  auto plan = parse_quant_flags(quant, overrides);
  if (!plan) return std::unexpected(plan.error());
  auto kv = parse_kv_type(kv_type);
  if (!kv) return std::unexpected(kv.error());
  return precision_flags{std::move(*plan), *kv};
}

kernels::result<direct_model> load_direct_model(const models::weight_source& src,
                                                const std::optional<models::llava_config>& llava,
                                                const models::llama_config& text,
                                                kernels::device& dev,
                                                const models::quant_plan& plan) {
  direct_model m;
  if (llava) {
    auto r = models::llava_model::build(src, *llava, dev, plan);
    if (!r) return std::unexpected(r.error());
    m.llava = std::move(*r);
  } else {
    auto r = models::llama_model::build(src, text, dev, plan);
    if (!r) return std::unexpected(r.error());
    m.plain = std::move(*r);
  }
  return m;
}

void add_context_flags(CLI::App& cmd, models::context_options& context) {
  cmd.add_option("--max-model-len", context.max_model_len,
                 "Prompt plus generated tokens a request may reach (default: the model's "
                 "max_position_embeddings)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24));
  cmd.add_flag("--allow-long-context", context.allow_long,
               "Allow a --max-model-len past the positions the model was trained on");
}

void add_cache_flags(CLI::App& cmd, pipeline_flags& f) {
  cmd.add_flag("!--no-prefix-caching", f.prefix_caching,
               "Compute every prompt whole: no KV blocks kept and shared between requests "
               "(prefix caching is on by default)");
  cmd.add_option("--kv-host-tokens", f.tiers.host_tokens,
                 "KV host tier per stage, in tokens: cached and preempted blocks go there "
                 "instead of being recomputed (0: none)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 30));
  cmd.add_option("--kv-disk-tokens", f.tiers.disk_tokens,
                 "KV disk tier per stage, in tokens (a memory-mapped file; 0: none)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 32));
  cmd.add_option("--kv-disk-dir", f.tiers.disk_dir,
                 "Folder of the KV disk tier's file (default: the temporary folder)");
}

void configure_pipeline_system(caf::actor_system_config& cfg, const pipeline_flags& f) {
  actors::configure_runtime(cfg);
  if (!f.remote_stage.empty() || !f.tp_peers.empty()) cfg.load<caf::io::middleman>();
}

actors::runtime_config pipeline_config(const pipeline_flags& f, const std::string& model,
                                       std::vector<actors::device_spec> devices,
                                       const models::quant_plan& plan,
                                       const models::kv_options& kv) {
  actors::runtime_config rc;
  rc.model = model;
  rc.remote_tail = f.remote_stage;
  rc.tp_peers = f.tp_peers;
  rc.devices = std::move(devices);
  rc.stages = f.stages;
  rc.plan = plan;
  rc.kv = kv;
  rc.kv.tiers = f.tiers;
  rc.scheduler.micro_batches = f.micro_batches;
  rc.scheduler.max_decode_steps = f.decode_steps;
  rc.scheduler.context = f.context;
  rc.scheduler.prefix_caching = f.prefix_caching;
  return rc;
}

}  // namespace troupe::cli
