#include "models/generate.hpp"

#include <algorithm>
#include <chrono>

namespace troupe::models {

namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

result<std::vector<generation_result>> generate_batch(
    kernels::device& dev, const llama_model& model, const std::vector<generation_request>& requests,
    std::vector<piece_fn> pieces, const text_fn& on_text, const generate_options& opts) {
  if (requests.empty()) return std::vector<generation_result>{};
  if (pieces.size() != requests.size())
    return make_error(errc::invalid_argument, "one piece decoder per request");
  if (opts.prefill_chunk < 1)
    return make_error(errc::invalid_argument, "prefill chunk must be >= 1");
  const std::int64_t vocab = model.config().vocab_size;
  std::int64_t need = 0;
  for (const auto& r : requests) {
    if (r.prompt.empty()) return make_error(errc::invalid_argument, "empty prompt");
    if (auto v = r.params.validate(); !v) return std::unexpected(v.error());
    for (auto t : r.prompt)
      if (t < 0 || t >= vocab)
        return make_error(errc::invalid_argument,
                          "prompt token " + std::to_string(t) + " outside the vocabulary");
    if (r.image_token < -1 || r.image_token >= vocab ||
        (r.image_token == -1 && !r.image_embeds.empty()))
      return make_error(errc::invalid_argument,
                        "image embeddings need an image token in the vocabulary");
    if (r.image_token >= 0) {
      const auto n =
          static_cast<std::size_t>(std::count(r.prompt.begin(), r.prompt.end(), r.image_token));
      if (n * static_cast<std::size_t>(model.config().hidden_size) != r.image_embeds.size())
        return make_error(errc::invalid_argument,
                          "the prompt holds " + std::to_string(n) + " image token(s) but " +
                              std::to_string(r.image_embeds.size()) +
                              " image embedding floats came (hidden " +
                              std::to_string(model.config().hidden_size) + " each)");
    }
    need += static_cast<std::int64_t>(r.prompt.size()) + r.params.max_tokens;
  }
  kv_options kvo = opts.kv;
  kvo.capacity_tokens = std::max(
      kvo.capacity_tokens, need + kvo.block_size * static_cast<std::int64_t>(requests.size()));
  auto cache = model.make_cache(dev, kvo);
  std::vector<std::byte> logits_host;  // the logits where host code cannot read the device's
  if (!cache) return std::unexpected(cache.error());

  struct state {
    seq_id seq = 0;
    std::size_t prefilled = 0;
    std::size_t embeds_used = 0;  // image embedding rows fed so far
    std::vector<std::int64_t> history;
    std::vector<std::int32_t> next;  // tokens to feed this step
    bool done = false;
    double t0 = 0;
  };
  std::vector<state> st(requests.size());
  std::vector<sampler> samplers;
  std::vector<stop_checker> stops;
  std::vector<generation_result> out(requests.size());
  for (std::size_t i = 0; i < requests.size(); ++i) {
    st[i].seq = cache->add_sequence();
    st[i].history.assign(requests[i].prompt.begin(), requests[i].prompt.end());
    st[i].t0 = now_s();
    auto s = sampler::create(requests[i].params);
    if (!s) return std::unexpected(s.error());
    samplers.push_back(std::move(*s));
    stops.emplace_back(requests[i].params);
    out[i].prompt_tokens = static_cast<std::int64_t>(requests[i].prompt.size());
  }
  for (;;) {
    std::vector<step_input> inputs;
    std::vector<std::size_t> who;
    for (std::size_t i = 0; i < requests.size(); ++i) {
      if (st[i].done) continue;
      const auto& prompt = requests[i].prompt;
      step_input in{st[i].seq, {}, false};
      if (st[i].prefilled < prompt.size()) {
        const std::size_t n = std::min<std::size_t>(static_cast<std::size_t>(opts.prefill_chunk),
                                                    prompt.size() - st[i].prefilled);
        st[i].next.assign(prompt.begin() + static_cast<std::ptrdiff_t>(st[i].prefilled),
                          prompt.begin() + static_cast<std::ptrdiff_t>(st[i].prefilled + n));
        st[i].prefilled += n;
        if (requests[i].image_token >= 0) {  // this chunk's share of the image rows
          const auto rows = static_cast<std::size_t>(
              std::count(st[i].next.begin(), st[i].next.end(), requests[i].image_token));
          const auto H = static_cast<std::size_t>(model.config().hidden_size);
          in.embed_token = requests[i].image_token;
          in.embeddings = std::span<const float>(requests[i].image_embeds)
                              .subspan(st[i].embeds_used * H, rows * H);
          st[i].embeds_used += rows;
        }
      }
      in.tokens = st[i].next;
      inputs.push_back(in);
      who.push_back(i);
    }
    if (inputs.empty()) break;
    auto on_device = model.forward(dev, *cache, inputs, opts.attention);
    if (!on_device) return std::unexpected(on_device.error());
    auto logits = kernels::host_view(dev, *on_device, logits_host);
    if (!logits) return std::unexpected(logits.error());
    for (std::size_t j = 0; j < who.size(); ++j) {
      const std::size_t i = who[j];
      if (st[i].prefilled < requests[i].prompt.size()) continue;  // mid-prefill: no token yet
      auto& res = out[i];
      if (res.tokens.empty()) {
        res.prompt_seconds = now_s() - st[i].t0;
        st[i].t0 = now_s();
      }
      const std::span<const float> row(logits->row_as<float>(static_cast<std::int64_t>(j)),
                                       static_cast<std::size_t>(vocab));
      const auto tok = static_cast<std::int32_t>(samplers[i].sample(row, st[i].history));
      res.tokens.push_back(tok);
      st[i].history.push_back(tok);
      const std::string text = stops[i].feed(tok, pieces[i](tok));
      res.text += text;
      if (!text.empty() && on_text) on_text(i, text);
      if (stops[i].reason() != stop_reason::none) {
        st[i].done = true;
        res.reason = stops[i].reason();
        res.decode_seconds = now_s() - st[i].t0;
        if (res.reason != stop_reason::stop_string) {
          const std::string rest = stops[i].flush();
          res.text += rest;
          if (!rest.empty() && on_text) on_text(i, rest);
        }
        cache->release(st[i].seq);
      } else {
        st[i].next.assign(1, tok);
      }
    }
  }
  return out;
}

}  // namespace troupe::models
