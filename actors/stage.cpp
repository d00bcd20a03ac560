#include "actors/stage.hpp"

#include <filesystem>

#include "models/llava_config.hpp"

namespace troupe::actors {

namespace {

/// The decoder config of a LLaMA/LLaVA folder or a GGUF file.
kernels::result<models::llama_config> text_config(const models::weight_source& src,
                                                  const std::string& path) {
  if (src.is_gguf()) return models::llama_config_from_gguf(*src.gguf());
  const std::string dir = std::filesystem::is_directory(path)
                              ? path
                              : std::filesystem::path(path).parent_path().string();
  auto text = models::read_text_file(dir + "/config.json");
  if (!text) return std::unexpected(text.error());
  if (models::is_llava_config(*text)) {
    auto cfg = models::parse_llava_config(*text, dir + "/config.json");
    if (!cfg) return std::unexpected(cfg.error());
    return cfg->text;
  }
  return models::load_llama_config(dir + "/config.json");
}

}  // namespace

kernels::result<models::llama_config> model_text_config(const std::string& path) {
  auto src = models::weight_source::open(path);
  if (!src) return std::unexpected(src.error());
  return text_config(**src, path);
}

stage_resources::~stage_resources() {
  model.reset();
  kv.reset();
  tp.reset();
  if (dev) dev->memory().trim();
}

kernels::result<std::shared_ptr<stage_resources>> make_stage(const device_spec& device,
                                                             const std::string& path,
                                                             const models::layer_range& range,
                                                             const models::quant_plan& plan,
                                                             const models::kv_options& kv) {
  auto dev = open_device(device);
  if (!dev) return std::unexpected(dev.error());
  return make_stage(device, std::move(*dev), path, range, plan, kv);
}

kernels::result<std::shared_ptr<stage_resources>> make_stage(
    const device_spec& spec, std::shared_ptr<kernels::device> device, const std::string& path,
    const models::layer_range& range, const models::quant_plan& plan, const models::kv_options& kv,
    std::shared_ptr<tp_group> tp) {
  auto res = std::make_shared<stage_resources>();
  res->tp = tp;
  res->device = spec;
  res->dev = std::move(device);
  auto src = models::weight_source::open(path);
  if (!src) return std::unexpected(src.error());
  auto cfg = text_config(**src, path);
  if (!cfg) return std::unexpected(cfg.error());
  // Building packs the weights on the device's team, so it holds the
  // device like a step does: a stage loaded next to one that is serving (a
  // live migration to a node that already holds a stage) would otherwise
  // call parallel_for on the team while that stage's step does, and the
  // team (one loop at a time) would mix the two loops' ranges: wrong
  // activations or packed weights, or a crash.
  auto model = [&] {
    std::lock_guard device_lock(res->dev->run_lock());
    return models::llama_model::build(**src, *cfg, *res->dev, plan, range,
                                      tp ? tp_group::split_of(tp) : models::tensor_split{});
  }();
  if (!model) return std::unexpected(model.error());
  auto cache = (*model)->make_cache(*res->dev, kv);
  if (!cache) return std::unexpected(cache.error());
  res->model = std::move(*model);
  res->kv = std::make_shared<stage_kv>(std::move(*cache));
  // Lower tiers: as many slots as the scheduler's books count (tokens /
  // block size, the same on every stage), a slot being one block of every
  // layer here.
  const auto& t = kv.tiers;
  if (t.host_tokens > 0 || t.disk_tokens > 0) {
    auto& c = res->kv->cache;
    auto tiers = models::kv_tiers::create(c.slot_bytes(), t.host_tokens / kv.block_size,
                                          t.disk_tokens / kv.block_size, t.disk_dir);
    if (!tiers) return std::unexpected(tiers.error());
    res->kv->tiers = std::move(*tiers);
  }
  return res;
}

}  // namespace troupe::actors
