#include "serve/grpc_server.hpp"

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>

#include "actors/log.hpp"
#include "troupe_generate.grpc.pb.h"

namespace troupe::serve {

namespace {

using nlohmann::json;
namespace pb = troupe::v1;
using namespace std::chrono_literals;

grpc::Status status_of(const api_error& e) {
  auto code = grpc::StatusCode::INTERNAL;
  switch (e.status) {
    case 400:
    case 413:
    case 431:
      code = grpc::StatusCode::INVALID_ARGUMENT;
      break;
    case 401:
      code = grpc::StatusCode::UNAUTHENTICATED;
      break;
    case 404:
      code = grpc::StatusCode::NOT_FOUND;
      break;
    case 429:
      code = grpc::StatusCode::RESOURCE_EXHAUSTED;
      break;
    case 503:
      code = grpc::StatusCode::UNAVAILABLE;
      break;
    default:
      break;
  }
  return {code, e.message + (e.param.empty() ? "" : " (" + e.param + ")")};
}

grpc::Status status_of(actors::error_code c, const std::string& why) {
  switch (c) {
    case actors::error_code::invalid_request:
    case actors::error_code::duplicate_id:
    case actors::error_code::kv_exhausted:
    case actors::error_code::context_length:
      return {grpc::StatusCode::INVALID_ARGUMENT, why};
    case actors::error_code::overloaded:
      return {grpc::StatusCode::RESOURCE_EXHAUSTED, why};
    case actors::error_code::unavailable:
      return {grpc::StatusCode::UNAVAILABLE, why};
    default:
      return {grpc::StatusCode::INTERNAL, why};
  }
}

// A GenerateRequest is the OpenAI body it stands for: the same parser
// checks it, with the same limits.
std::expected<api_request, grpc::Status> to_api(const pb::GenerateRequest& q,
                                                const request_limits& limits) {
  const auto bad = [](std::string why) {
    return std::unexpected(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::move(why)));
  };
  json b = json::object();
  if (!q.model().empty()) b["model"] = q.model();
  const bool chat = q.messages_size() > 0;
  if (chat && !q.prompt().empty()) return bad("give prompt or messages, not both");
  if (chat) {
    b["messages"] = json::array();
    for (const auto& m : q.messages())
      b["messages"].push_back({{"role", m.role()}, {"content", m.content()}});
  } else {
    if (q.prompt().empty()) return bad("prompt or messages is required");
    b["prompt"] = q.prompt();
  }
  if (q.has_max_tokens()) b["max_tokens"] = q.max_tokens();
  if (q.has_temperature()) b["temperature"] = q.temperature();
  if (q.has_top_p()) b["top_p"] = q.top_p();
  if (q.has_seed()) b["seed"] = q.seed();
  if (q.stop_size() > 0)
    b["stop"] = json(std::vector<std::string>(q.stop().begin(), q.stop().end()));
  if (q.has_presence_penalty()) b["presence_penalty"] = q.presence_penalty();
  if (q.has_frequency_penalty()) b["frequency_penalty"] = q.frequency_penalty();
  if (q.has_repetition_penalty()) b["repetition_penalty"] = q.repetition_penalty();
  if (q.logit_bias_size() > 0) {
    b["logit_bias"] = json::object();
    for (const auto& [id, v] : q.logit_bias()) b["logit_bias"][std::to_string(id)] = v;
  }
  if (q.has_min_tokens()) b["min_tokens"] = q.min_tokens();
  if (q.stop_token_ids_size() > 0)
    b["stop_token_ids"] =
        json(std::vector<std::int64_t>(q.stop_token_ids().begin(), q.stop_token_ids().end()));
  if (q.ignore_eos()) b["ignore_eos"] = true;
  if (q.priority() != 0) b["priority"] = q.priority();
  if (q.has_top_logprobs()) {
    if (chat) {
      b["logprobs"] = true;
      b["top_logprobs"] = q.top_logprobs();
    } else {
      b["logprobs"] = q.top_logprobs();
    }
  }
  if (!q.json_schema().empty()) b["guided_json"] = q.json_schema();
  if (q.json_object()) b["response_format"] = {{"type", "json_object"}};
  if (!q.regex().empty()) b["guided_regex"] = q.regex();
  if (q.choice_size() > 0)
    b["guided_choice"] = json(std::vector<std::string>(q.choice().begin(), q.choice().end()));
  if (!q.grammar().empty()) b["grammar"] = q.grammar();
  const auto body = b.dump(-1, ' ', false, json::error_handler_t::replace);
  auto r = chat ? parse_chat_request(body, limits) : parse_completion_request(body, limits);
  if (!r) return std::unexpected(status_of(r.error()));
  return std::move(*r);
}

void fill(pb::TokenLogprob& out, const models::token_logprob& lp) {
  out.set_token(lp.token);
  out.set_logprob(lp.logprob);
  out.set_piece(lp.piece);
  for (auto id : lp.top_ids) out.add_top_ids(id);
  for (auto v : lp.top_logprobs) out.add_top_logprobs(v);
}

}  // namespace

struct grpc_server::impl final : pb::Generation::Service {
  std::shared_ptr<actors::client> jobs;
  grpc_options opt;
  std::unique_ptr<grpc::Server> server;
  int bound = 0;

  impl(std::shared_ptr<actors::client> j, grpc_options o) : jobs(std::move(j)), opt(std::move(o)) {}

  std::optional<grpc::Status> authorized(grpc::ServerContext* ctx) const {
    if (opt.api_key.empty()) return std::nullopt;
    const auto& md = ctx->client_metadata();
    auto it = md.find("authorization");
    if (it != md.end() &&
        std::string(it->second.data(), it->second.size()) == "Bearer " + opt.api_key)
      return std::nullopt;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "a valid API key is needed (metadata authorization: Bearer KEY)");
  }

  std::expected<api_request, grpc::Status> checked(grpc::ServerContext* ctx,
                                                   const pb::GenerateRequest& q) {
    if (auto e = authorized(ctx)) return std::unexpected(*e);
    auto r = to_api(q, opt.limits);
    if (!r) return r;
    if (auto e = check_model(r->model, opt.model_name)) return std::unexpected(status_of(*e));
    return r;
  }

  // A submitted job's events, as they come.
  struct job_events {
    std::uint64_t id = 0;
    std::mutex m;
    std::condition_variable cv;
    std::deque<actors::token_event> events;
    std::optional<actors::finish_event> done;
  };

  // Runs a job: `on_token` gets its token events (false: the client is
  // gone); the call ends with the job's end in `out`.
  grpc::Status run(grpc::ServerContext* ctx, actors::job_request job,
                   const std::function<bool(const actors::token_event&)>& on_token,
                   actors::finish_event& out) {
    auto st = submit(std::move(job));
    if (!st) return st.error();
    return follow(ctx, **st, on_token, out);
  }

  std::expected<std::shared_ptr<job_events>, grpc::Status> submit(actors::job_request job) {
    auto st = std::make_shared<job_events>();
    job.id = actors::random_job_id();
    st->id = job.id;
    actors::client::callbacks cb;
    cb.on_token = [st](const actors::token_event& e) {
      std::lock_guard lock(st->m);
      st->events.push_back(e);
      st->cv.notify_all();
    };
    cb.on_finish = [st](const actors::finish_event& f) {
      std::lock_guard lock(st->m);
      st->done = f;
      st->cv.notify_all();
    };
    auto ack = jobs->submit(std::move(job), std::move(cb));
    if (!ack) return std::unexpected(status_of(ack.error().code, ack.error().message));
    return st;
  }

  grpc::Status follow(grpc::ServerContext* ctx, job_events& st_,
                      const std::function<bool(const actors::token_event&)>& on_token,
                      actors::finish_event& out) {
    auto* st = &st_;
    const auto id = st->id;
    for (;;) {
      std::deque<actors::token_event> events;
      std::optional<actors::finish_event> done;
      {
        std::unique_lock lock(st->m);
        st->cv.wait_for(lock, 100ms, [&] { return !st->events.empty() || st->done; });
        events.swap(st->events);
        done = st->done;
      }
      for (const auto& e : events)
        if (!on_token(e)) {
          jobs->cancel_async(id);
          return {grpc::StatusCode::CANCELLED, "the client went away"};
        }
      if (done) {
        out = std::move(*done);
        break;
      }
      if (ctx->IsCancelled()) {
        jobs->cancel_async(id);  // its KV blocks are freed
        return {grpc::StatusCode::CANCELLED, "cancelled"};
      }
    }
    if (out.reason == actors::finish_reason::error) return status_of(out.code, out.error);
    return grpc::Status::OK;
  }

  grpc::Status Generate(grpc::ServerContext* ctx, const pb::GenerateRequest* q,
                        pb::GenerateResponse* res) override {
    if (q->audio_stream())
      return {grpc::StatusCode::INVALID_ARGUMENT, "audio_stream is for GenerateFromChunks"};
    auto r = checked(ctx, *q);
    if (!r) return r.error();
    actors::finish_event f;
    auto s = run(
        ctx, std::move(r->job),
        [&](const actors::token_event& e) {
          for (const auto& lp : e.logprobs) fill(*res->add_logprobs(), lp);
          return true;
        },
        f);
    if (!s.ok()) return s;
    res->set_text(f.text);
    for (auto t : f.tokens) res->add_tokens(t);
    res->set_finish_reason(finish_reason(f.reason));
    res->set_prompt_tokens(f.prompt_tokens);
    res->set_completion_tokens(static_cast<std::int64_t>(f.tokens.size()));
    return grpc::Status::OK;
  }

  template <class Writer>
  grpc::Status stream(grpc::ServerContext* ctx, api_request r, Writer* w) {
    auto st = submit(std::move(r.job));
    if (!st) return st.error();
    return stream(ctx, **st, w);
  }

  // Streams a submitted job's tokens to `w`, then its end.
  template <class Writer>
  grpc::Status stream(grpc::ServerContext* ctx, job_events& st, Writer* w) {
    actors::finish_event f;
    auto s = follow(
        ctx, st,
        [&](const actors::token_event& e) {
          pb::GenerateChunk c;
          c.set_text(e.text);
          for (auto t : e.tokens) c.add_tokens(t);
          for (const auto& lp : e.logprobs) fill(*c.add_logprobs(), lp);
          return w->Write(c);
        },
        f);
    if (!s.ok()) return s;
    pb::GenerateChunk last;
    last.set_finish_reason(finish_reason(f.reason));
    last.set_prompt_tokens(f.prompt_tokens);
    last.set_completion_tokens(static_cast<std::int64_t>(f.tokens.size()));
    w->Write(last);
    return grpc::Status::OK;
  }

  grpc::Status GenerateStream(grpc::ServerContext* ctx, const pb::GenerateRequest* q,
                              grpc::ServerWriter<pb::GenerateChunk>* w) override {
    if (q->audio_stream())
      return {grpc::StatusCode::INVALID_ARGUMENT, "audio_stream is for GenerateFromChunks"};
    auto r = checked(ctx, *q);
    if (!r) return r.error();
    return stream(ctx, std::move(*r), w);
  }

  grpc::Status GenerateFromChunks(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<pb::GenerateChunk, pb::InputChunk>* rw) override {
    if (auto e = authorized(ctx)) return *e;
    pb::InputChunk in;
    if (!rw->Read(&in) || !in.has_start())
      return {grpc::StatusCode::INVALID_ARGUMENT, "the first message must carry `start`"};
    pb::GenerateRequest q = in.start();
    if (q.audio_stream()) return stream_audio(ctx, q, in.last(), rw);
    std::size_t bytes = q.prompt().size();
    for (const auto& m : q.messages()) bytes += m.content().size();
    // The prompt (or the chat's last message) grows chunk by chunk.
    bool last = in.last();
    while (!last && rw->Read(&in)) {
      if (in.has_start()) return {grpc::StatusCode::INVALID_ARGUMENT, "`start` comes once, first"};
      if (in.part_case() == pb::InputChunk::kAudio)
        return {grpc::StatusCode::INVALID_ARGUMENT, "`audio` pieces need start.audio_stream"};
      bytes += in.text().size();
      if (bytes > opt.limits.max_text_bytes)
        return {grpc::StatusCode::INVALID_ARGUMENT,
                "the input is larger than " + std::to_string(opt.limits.max_text_bytes) + " bytes"};
      if (q.messages_size() > 0)
        q.mutable_messages(q.messages_size() - 1)->mutable_content()->append(in.text());
      else
        q.mutable_prompt()->append(in.text());
      last = in.last();
    }
    auto r = checked(ctx, q);
    if (!r) return r.error();
    return stream(ctx, std::move(*r), rw);
  }

  // GenerateFromChunks with start.audio_stream: the job starts now, with a
  // clip after its last message that comes in the `audio` pieces read
  // next (each answered by the cluster once its windows are encoded);
  // its tokens stream back after the last one.
  grpc::Status stream_audio(grpc::ServerContext* ctx, const pb::GenerateRequest& q, bool last,
                            grpc::ServerReaderWriter<pb::GenerateChunk, pb::InputChunk>* rw) {
    if (q.messages_size() == 0)
      return {grpc::StatusCode::INVALID_ARGUMENT, "audio_stream needs messages (a chat)"};
    auto r = checked(ctx, q);
    if (!r) return r.error();
    if (r->job.turns.empty())
      return {grpc::StatusCode::INVALID_ARGUMENT, "audio_stream needs messages (a chat)"};
    add_streamed_clip(*r);
    auto st = submit(std::move(r->job));
    if (!st) return st.error();
    const auto id = (*st)->id;
    auto give_up = [&](grpc::Status why) {
      jobs->cancel_async(id);
      return why;
    };
    pb::InputChunk in;
    std::int64_t bytes = 0;
    bool sent_last = false;
    while (!last) {
      if (!rw->Read(&in))
        return give_up({grpc::StatusCode::INVALID_ARGUMENT,
                        "the input ended before a piece with `last` ended the audio"});
      const bool empty_end = in.part_case() == pb::InputChunk::PART_NOT_SET && in.last();
      if (in.part_case() != pb::InputChunk::kAudio && !empty_end)
        return give_up({grpc::StatusCode::INVALID_ARGUMENT,
                        "with audio_stream, the messages after `start` carry `audio`"});
      last = in.last();
      bytes += static_cast<std::int64_t>(in.audio().size());
      if (bytes > static_cast<std::int64_t>(opt.limits.max_audio_bytes))
        return give_up({grpc::StatusCode::INVALID_ARGUMENT,
                        "the streamed audio is larger than " +
                            std::to_string(opt.limits.max_audio_bytes) + " bytes"});
      const auto& a = in.audio();
      auto p = jobs->send_audio(id, std::vector<std::uint8_t>(a.begin(), a.end()), last);
      if (!p) return give_up(status_of(p.error().code, p.error().message));
      sent_last = last;
      if (ctx->IsCancelled()) return give_up({grpc::StatusCode::CANCELLED, "cancelled"});
    }
    if (!sent_last) {  // `last` came with `start`: the clip ends empty (and is refused so)
      auto p = jobs->send_audio(id, {}, true);
      if (!p) return give_up(status_of(p.error().code, p.error().message));
    }
    return stream(ctx, **st, rw);
  }
};

grpc_server::grpc_server(std::shared_ptr<actors::client> jobs, grpc_options opt)
    : impl_(std::make_unique<impl>(std::move(jobs), std::move(opt))) {}

grpc_server::~grpc_server() {
  stop();
}

bool grpc_server::start(std::string& why) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder b;
  const auto addr = impl_->opt.host + ":" + std::to_string(impl_->opt.port);
  b.AddListeningPort(addr, grpc::InsecureServerCredentials(), &impl_->bound);
  // One server per port: a second one must fail, not share it.
  b.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  b.SetMaxReceiveMessageSize(static_cast<int>(impl_->opt.max_message_bytes));
  grpc::ResourceQuota quota("troupe-grpc");
  quota.SetMaxThreads(impl_->opt.max_threads);
  b.SetResourceQuota(quota);
  b.RegisterService(impl_.get());
  impl_->server = b.BuildAndStart();
  if (!impl_->server || impl_->bound == 0) {
    why = "cannot serve gRPC on " + addr + " (in use?)";
    impl_->server.reset();
    return false;
  }
  if (auto* h = impl_->server->GetHealthCheckService())
    h->SetServingStatus("troupe.v1.Generation", true);
  return true;
}

int grpc_server::port() const {
  return impl_->bound;
}

void grpc_server::stop() {
  if (!impl_->server) return;
  if (auto* h = impl_->server->GetHealthCheckService()) h->SetServingStatus(false);
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  impl_->server.reset();
}

}  // namespace troupe::serve
