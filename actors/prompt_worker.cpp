#include "actors/prompt_worker.hpp"

#include <algorithm>

#include "models/grammar.hpp"

namespace troupe::actors {

std::expected<generate_request, caf::error> request_of(const prompt_setup& setup,
                                                       const prompt_renderer& render,
                                                       job_request job) {
  generate_request req;
  if (!job.prompt_ids.empty()) {
    if (!job.images.empty() || job.chat || !job.turns.empty() || !job.prompt.empty())
      return std::unexpected(make_error(error_code::invalid_request,
                                        "a prompt of token ids comes alone: no text, chat or "
                                        "images with it"));
    req.prompt_tokens = std::move(job.prompt_ids);
  }
  prompt_input in;
  in.prompt = job.prompt;
  in.system = job.system;
  in.images = static_cast<int>(job.images.size());
  in.chat = job.chat;
  for (const auto& t : job.turns) in.messages.push_back({t.role, t.content, t.images});
  if (req.prompt_tokens.empty()) {
    auto ids = render ? render(setup, in) : render_prompt(setup, in);
    if (!ids) return std::unexpected(make_error(error_code::invalid_request, ids.error().message));
    req.prompt_tokens = std::move(*ids);
  }
  req.id = job.id;
  req.images = std::move(job.images);
  req.params = default_sampling(setup, job.max_tokens);
  if (job.has_temperature) req.params.temperature = job.temperature;
  if (job.has_top_p) req.params.top_p = job.top_p;
  req.params.seed = job.seed;
  req.params.stop_strings = std::move(job.stop_strings);
  if (job.has_repetition_penalty) req.params.repetition_penalty = job.repetition_penalty;
  req.params.presence_penalty = job.presence_penalty;
  req.params.frequency_penalty = job.frequency_penalty;
  req.params.bias_ids = std::move(job.logit_bias_ids);
  req.params.bias_values = std::move(job.logit_bias_values);
  req.params.min_tokens = job.min_tokens;
  req.params.logprobs = job.logprobs;
  if (job.ignore_eos) req.params.stop_token_ids.clear();
  for (auto id : job.stop_token_ids)  // the request's own end too (ignore_eos drops the model's)
    if (std::find(req.params.stop_token_ids.begin(), req.params.stop_token_ids.end(), id) ==
        req.params.stop_token_ids.end())
      req.params.stop_token_ids.push_back(id);
  // max_tokens 0 (the rest of the context) is resolved by the scheduler,
  // which knows the context length.
  auto check = req.params;
  if (check.max_tokens == 0) check.max_tokens = std::max<std::int64_t>(1, check.min_tokens);
  if (auto v = check.validate(); !v)
    return std::unexpected(make_error(error_code::invalid_request, v.error().message));
  req.deadline_ms = job.deadline_ms;
  req.cache_salt = job.cache_salt;
  req.priority = job.priority;
  if (!job.grammar.empty()) {
    // The grammar ends on the model's stop tokens, which it needs; and it
    // may be complete before min_tokens.
    if (job.ignore_eos)
      return std::unexpected(make_error(error_code::invalid_request,
                                        "ignore_eos cannot be combined with structured output"));
    if (job.min_tokens > 0)
      return std::unexpected(make_error(error_code::invalid_request,
                                        "min_tokens cannot be combined with structured output"));
    if (req.params.stop_token_ids.empty())
      return std::unexpected(make_error(error_code::invalid_request,
                                        "structured output needs the model's end-of-text token"));
    if (job.grammar.size() > models::grammar_limits{}.max_bytes)
      return std::unexpected(make_error(error_code::invalid_request, "the grammar is too large"));
    req.grammar = std::move(job.grammar);
  }
  return req;
}

prompt_worker_actor spawn_prompt_worker(caf::actor_system& sys,
                                        std::shared_ptr<const prompt_setup> setup,
                                        prompt_renderer render) {
  auto impl = [](prompt_worker_actor::pointer self, std::shared_ptr<const prompt_setup> setup,
                 prompt_renderer render) -> prompt_worker_actor::behavior_type {
    return {
        [=](render_atom, job_request& job) -> caf::result<generate_request> {
          self->quit();
          auto req = request_of(*setup, render, std::move(job));
          if (!req) return std::move(req.error());
          return std::move(*req);
        },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(setup), std::move(render));
}

}  // namespace troupe::actors
