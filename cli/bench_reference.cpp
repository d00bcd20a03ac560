// troupe bench: the reference, the plain generation loop in this process
// on the same model and prompts as the pipeline (one request, and a batch
// of the largest level's size).
#include <algorithm>
#include <thread>

#include "cli/bench.hpp"
#include "models/generate.hpp"

namespace troupe::cli::serve_bench {

kernels::result<reference_figures> measure_reference(
    const models::weight_source& src, const std::optional<models::llava_config>& lcfg,
    const std::string& dir, const actors::device_spec& device, const models::quant_plan& plan,
    const std::vector<work_item>& items, const models::sampling_params& params,
    const models::kv_options& kv, int max_level) {
  using namespace troupe::models;
  auto opened = actors::open_device(device);  // as the runtime opens it
  if (!opened) return std::unexpected(opened.error());
  auto ctx = *opened;
  auto text = lcfg            ? kernels::result<llama_config>(lcfg->text)
              : src.is_gguf() ? llama_config_from_gguf(*src.gguf())
                              : load_llama_config(dir + "/config.json");
  if (!text) return std::unexpected(text.error());
  auto loaded = load_direct_model(src, lcfg, *text, *ctx, plan);
  if (!loaded) return std::unexpected(loaded.error());
  reference_figures f;
  const llava_model* llava = loaded->llava.get();
  const llama_model& model = loaded->text();
  generation_request req;
  req.prompt = items.back().ids;  // a text-only prompt
  if (lcfg) {
    auto p = llava->prepare(*ctx, req.prompt, kernels::tensor());
    if (p) req.prompt = p->tokens;
  }
  req.params = params;
  generate_options opts;
  opts.kv = kv;
  opts.kv.capacity_tokens = static_cast<std::int64_t>(req.prompt.size()) + params.max_tokens + 32;
  double best = 0;
  for (int run = 0; run < 2; ++run) {  // the first run warms up
    const auto t_run = clock::now();
    auto out =
        generate_batch(*ctx, model, {req}, {[](std::int32_t) { return std::string(); }}, {}, opts);
    if (!out) return make_error(out.error().code, "reference: " + out.error().message);
    const auto& r = (*out)[0];
    if (r.decode_seconds > 0)
      best = std::max(best, static_cast<double>(r.tokens.size() - 1) / r.decode_seconds);
    f.single_out = std::max(
        f.single_out, static_cast<double>(r.tokens.size()) / (ms(clock::now() - t_run) / 1e3));
  }
  f.decode_tps = best;
  // The kernels' own batching gain: the plain loop with max_level text
  // requests in one batch (prefill and decode together, as the scheduler
  // does), against the same loop with one. What the actor pipeline can at
  // best reach at that concurrency on this machine.
  if (max_level > 1) {
    std::vector<generation_request> batch;
    std::vector<models::piece_fn> pieces;
    std::size_t next = 0;
    for (int k = 0; k < max_level; ++k) {
      generation_request r = req;
      for (std::size_t tries = 0; tries < items.size(); ++tries, ++next) {
        const auto& it = items[next % items.size()];
        if (it.image.empty()) {
          r.prompt = it.ids;
          ++next;
          break;
        }
      }
      r.params.seed = params.seed + static_cast<std::uint64_t>(k) + 1;
      batch.push_back(std::move(r));
      pieces.push_back([](std::int32_t) { return std::string(); });
    }
    generate_options bo = opts;
    bo.kv.capacity_tokens = opts.kv.capacity_tokens * max_level;
    const auto t_batch = clock::now();
    auto out = generate_batch(*ctx, model, batch, pieces, {}, bo);
    if (!out) return make_error(out.error().code, "batched reference: " + out.error().message);
    std::int64_t produced = 0;
    for (const auto& r : *out) produced += static_cast<std::int64_t>(r.tokens.size());
    f.batch_out = static_cast<double>(produced) / (ms(clock::now() - t_batch) / 1e3);
  }
  return f;
}

}  // namespace troupe::cli::serve_bench
