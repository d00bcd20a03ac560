#include "serve/gateway.hpp"

#include <httplib.h>
#include <spdlog/spdlog.h>

#include <sys/socket.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>

#include "actors/cluster.hpp"
#include "actors/log.hpp"
#include "serve/metrics.hpp"

namespace troupe::serve {

namespace {

using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;

std::int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The HTTP status for an image URL that could not be fetched: a body over
// the limit is 413; the rest is the request's fault as far as the gateway
// can tell.
int status_of(fetch_errc code) {
  switch (code) {
    case fetch_errc::too_large:
      return 413;
    case fetch_errc::bad_url:
    case fetch_errc::not_found:
    case fetch_errc::forbidden_address:
    case fetch_errc::redirect:
    case fetch_errc::bad_status:
    case fetch_errc::timeout:
    case fetch_errc::empty:
    case fetch_errc::io:
      return 400;
  }
  return 400;
}

// What a request's sink thread hands to the HTTP thread.
struct job_stream {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::string> texts;             ///< token texts not yet sent
  std::optional<actors::finish_event> done;  ///< set when ended
  bool ended = false;
  std::vector<double> gaps;  ///< seconds between tokens, per token
  steady::time_point last = steady::now();
  bool any = false;
};

}  // namespace

// Debian's cpp-httplib is a compiled library that listens with a backlog
// of 5: 16 streams opened at once overflowed it (the kernel's
// ListenOverflows counter grew by 34 in one 64-client burst) and clients
// saw "Read (status -1)" failures or 1 s SYN retries. Listening again on
// the bound socket raises the backlog (Linux updates it in place).
class http_server : public httplib::Server {
 public:
  bool widen_backlog(int backlog) {
    return svr_sock_ != INVALID_SOCKET && ::listen(svr_sock_, backlog) == 0;
  }
};

struct gateway::impl {
  caf::actor_system& sys;
  actors::frontdoor_actor door;
  actors::client jobs;  ///< every job goes through it; it watches the head
  gateway_options opt;
  http_server http;
  std::shared_ptr<metrics> stats = std::make_shared<metrics>();
  int bound_port = 0;
  std::atomic<bool> canary_ok{false};
  std::mutex canary_mtx;

  impl(caf::actor_system& s, actors::frontdoor_actor d, gateway_options o)
      : sys(s), door(d), jobs(s, std::move(d)), opt(std::move(o)) {}

  void reply_error(httplib::Response& res, const api_error& e) {
    stats->failed_http(e.status);
    res.status = e.status;
    res.set_content(error_json(e), "application/json");
  }

  // A request that failed after it was accepted: its code says whether the
  // request was at fault (an image that does not decode) or the head went
  // away.
  api_error finish_error(const actors::finish_event& f) {
    api_error e;
    e.message = f.error;
    if (f.code == actors::error_code::invalid_request) {
      e.status = 400;
    } else if (f.code == actors::error_code::unavailable) {
      e.status = 503;
      e.type = "server_error";
    } else {
      e.status = 500;
      e.type = "server_error";
    }
    return e;
  }

  bool authorized(const httplib::Request& req, httplib::Response& res) {
    if (opt.api_key.empty()) return true;
    if (req.get_header_value("Authorization") == "Bearer " + opt.api_key) return true;
    api_error e;
    e.status = 401;
    e.type = "authentication_error";
    e.message = "a missing or wrong API key (Authorization: Bearer KEY)";
    e.code = "invalid_api_key";
    reply_error(res, e);
    return false;
  }

  std::optional<actors::cluster_status> status() {
    auto s = actors::query_status(sys, door, 5s);
    return s ? std::optional<actors::cluster_status>(std::move(*s)) : std::nullopt;
  }

  // Submits; the stream fills as events come.
  std::expected<std::shared_ptr<job_stream>, api_error> submit(actors::job_request job) {
    auto js = std::make_shared<job_stream>();
    actors::client::callbacks cb;
    cb.on_token = [js](const actors::token_event& e) {
      std::lock_guard lock(js->m);
      const auto now = steady::now();
      if (js->any && !e.tokens.empty()) {
        const double gap = std::chrono::duration<double>(now - js->last).count() /
                           static_cast<double>(e.tokens.size());
        for (std::size_t i = 0; i < e.tokens.size(); ++i) js->gaps.push_back(gap);
      }
      js->any = js->any || !e.tokens.empty();
      js->last = now;
      if (!e.text.empty()) js->texts.push_back(e.text);
      js->cv.notify_all();
    };
    cb.on_finish = [js, stats = stats](const actors::finish_event& f) {
      // Every end is counted here, also of a request whose client left.
      std::vector<double> gaps;
      {
        std::lock_guard lock(js->m);
        gaps = js->gaps;
      }
      stats->finished(f, gaps);
      std::lock_guard lock(js->m);
      js->done = f;
      js->ended = true;
      js->cv.notify_all();
    };
    auto ok = jobs.submit(std::move(job), std::move(cb));
    if (!ok) {
      api_error e;
      e.message = ok.error().message;
      switch (ok.error().code) {
        case actors::error_code::invalid_request:
        case actors::error_code::duplicate_id:
        case actors::error_code::kv_exhausted:
          e.status = 400;
          break;
        case actors::error_code::overloaded:
          e.status = 429;
          e.type = "rate_limit_error";
          break;
        default:  // unavailable (not ready, shutting down), or the head did not answer
          e.status = 503;
          e.type = "server_error";
      }
      return std::unexpected(e);
    }
    return js;
  }

  void handle(const httplib::Request& req, httplib::Response& res, bool chat) {
    if (!authorized(req, res)) return;
    auto r = chat ? parse_chat_request(req.body, opt.limits)
                  : parse_completion_request(req.body, opt.limits);
    if (!r) return reply_error(res, r.error());
    for (const auto& ri : r->remote_images) {
      auto f = opt.fetch;
      f.max_bytes = opt.limits.max_image_bytes;
      auto bytes = fetch_image(ri.url, f);
      if (!bytes) {
        api_error e;
        e.message = ri.param + ": " + bytes.error().message;
        e.param = ri.param;
        e.status = status_of(bytes.error().code);
        return reply_error(res, e);
      }
      r->job.images[ri.index].bytes = std::move(*bytes);
    }
    if (r->model.empty()) r->model = opt.model_name;
    r->job.id = actors::random_job_id();
    const auto id = std::string(chat ? "chatcmpl-" : "cmpl-") + std::to_string(r->job.id);
    const auto created = unix_now();
    const auto job_id = r->job.id;
    auto js = submit(r->job);
    if (!js) return reply_error(res, js.error());
    auto stream = *js;
    if (!r->stream) {
      std::unique_lock lock(stream->m);
      stream->cv.wait(lock, [&] { return stream->ended; });
      if (stream->done->reason == actors::finish_reason::error)
        return reply_error(res, finish_error(*stream->done));
      res.set_content(completion_json(*r, id, created, *stream->done), "application/json");
      return;
    }
    auto request = std::make_shared<api_request>(std::move(*r));
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, stream, request, id, created, job_id](std::size_t, httplib::DataSink& sink) {
          auto send = [&](const std::string& data) {
            const std::string line = "data: " + data + "\n\n";
            return sink.write(line.data(), line.size());
          };
          std::unique_lock lock(stream->m);
          stream->cv.wait_for(lock, 100ms, [&] { return !stream->texts.empty() || stream->ended; });
          std::string text;
          while (!stream->texts.empty()) {
            text += stream->texts.front();
            stream->texts.pop_front();
          }
          const bool ended = stream->ended;
          lock.unlock();
          if (!sink.is_writable() ||
              (!text.empty() && !send(chunk_json(*request, id, created, text, "")))) {
            // The client went away: its request stops and frees its KV blocks.
            if (!ended) jobs.cancel(job_id);
            return false;
          }
          if (!ended) return true;
          if (stream->done->reason == actors::finish_reason::error) {
            const auto e = finish_error(*stream->done);
            stats->failed_http(e.status);
            send(error_json(e));
          } else {
            send(chunk_json(*request, id, created, "", finish_reason(stream->done->reason)));
            if (request->include_usage)
              send(chunk_json(*request, id, created, "", "", &*stream->done));
          }
          send("[DONE]");
          sink.done();
          return true;
        });
  }

  // A one-token decode, once, the first time the cluster says it is ready.
  bool canary() {
    if (canary_ok) return true;
    std::lock_guard lock(canary_mtx);
    if (canary_ok) return true;
    actors::job_request j;
    j.id = actors::random_job_id();
    j.prompt = "Hello";
    j.max_tokens = 1;
    j.ignore_eos = true;
    auto f = jobs.run(j);
    canary_ok = f && f->reason == actors::finish_reason::length && f->tokens.size() == 1;
    return canary_ok;
  }
};

gateway::gateway(caf::actor_system& sys, actors::frontdoor_actor door, gateway_options opt)
    : impl_(std::make_unique<impl>(sys, std::move(door), std::move(opt))) {
  auto* d = impl_.get();
  auto& h = d->http;
  h.new_task_queue = [n = d->opt.threads] {
    return new httplib::ThreadPool(static_cast<std::size_t>(std::max(2, n)));
  };
  h.set_payload_max_length(d->opt.max_body_bytes);
  h.set_read_timeout(30, 0);
  h.set_write_timeout(30, 0);
  // cpp-httplib 0.11 caps each header line at 8 KiB but not their number:
  // requests with too many or too large headers are refused before any
  // handler runs (they have been read by then, line by line).
  h.set_pre_routing_handler([d](const httplib::Request& req, httplib::Response& res) {
    std::size_t bytes = 0;
    for (const auto& [k, v] : req.headers) bytes += k.size() + v.size();
    if (req.headers.size() <= d->opt.max_headers && bytes <= d->opt.max_header_bytes)
      return httplib::Server::HandlerResponse::Unhandled;
    api_error e;
    e.status = 431;
    e.message = "request headers over the limit (" + std::to_string(d->opt.max_headers) +
                " headers, " + std::to_string(d->opt.max_header_bytes >> 10) +
                " KiB in all); this request has " + std::to_string(req.headers.size()) +
                " headers, " + std::to_string(bytes) + " bytes";
    d->reply_error(res, e);
    return httplib::Server::HandlerResponse::Handled;
  });
  h.Post("/v1/chat/completions",
         [d](const httplib::Request& req, httplib::Response& res) { d->handle(req, res, true); });
  h.Post("/v1/completions",
         [d](const httplib::Request& req, httplib::Response& res) { d->handle(req, res, false); });
  h.Get("/v1/models", [d](const httplib::Request& req, httplib::Response& res) {
    if (!d->authorized(req, res)) return;
    nlohmann::json j{{"object", "list"},
                     {"data", nlohmann::json::array({{{"id", d->opt.model_name},
                                                      {"object", "model"},
                                                      {"created", unix_now()},
                                                      {"owned_by", "troupe"}}})}};
    res.set_content(j.dump(), "application/json");
  });
  h.Get("/live", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("live\n", "text/plain");
  });
  h.Get("/ready", [d](const httplib::Request&, httplib::Response& res) {
    auto s = d->status();
    std::string why;
    if (!s)
      why = "the head does not answer";
    else if (!s->ready)
      why = "the model is not placed (" + s->last_event + ")";
    else if (!d->canary())
      why = "the canary decode failed";
    res.status = why.empty() ? 200 : 503;
    res.set_content(why.empty() ? "ready\n" : "not ready: " + why + "\n", "text/plain");
  });
  // Behind the API key when one is set (Prometheus sends it as a bearer
  // token): the figures tell who uses the cluster how much. /live and
  // /ready stay open for health checks.
  h.Get("/metrics", [d](const httplib::Request& req, httplib::Response& res) {
    if (!d->authorized(req, res)) return;
    auto s = d->status();
    res.set_content(d->stats->render(s ? &*s : nullptr), "text/plain; version=0.0.4");
  });
  h.set_error_handler([d](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    api_error e;
    e.status = res.status;
    // cpp-httplib caps form-encoded bodies (curl -d without a content type)
    // at 8 KiB before any handler runs.
    const bool form =
        req.get_header_value("Content-Type").find("x-www-form-urlencoded") != std::string::npos;
    e.message = res.status == 413 && form
                    ? "a form-encoded body over 8 KiB: send Content-Type: application/json"
                : res.status == 413 ? "the body is larger than " +
                                          std::to_string(d->opt.max_body_bytes >> 20) + " MiB"
                : res.status == 404 ? "no such endpoint"
                                    : "HTTP error " + std::to_string(res.status);
    if (res.status == 404) e.type = "not_found_error";
    res.set_content(error_json(e), "application/json");
  });
}

gateway::~gateway() {
  stop();
}

bool gateway::bind(std::string& why) {
  // cpp-httplib sets SO_REUSEPORT on its listening socket: a second gateway
  // on the same port would then start and take half the connections (with
  // its own API key, or none). SO_REUSEADDR alone lets a restart bind at
  // once past TIME_WAIT, and a port another process listens on is refused.
  impl_->http.set_socket_options([](socket_t sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  if (impl_->opt.port == 0)
    impl_->bound_port = impl_->http.bind_to_any_port(impl_->opt.host.c_str());
  else
    impl_->bound_port =
        impl_->http.bind_to_port(impl_->opt.host.c_str(), impl_->opt.port) ? impl_->opt.port : -1;
  if (impl_->bound_port <= 0) {
    const int err = errno;
    why = "cannot listen on " + impl_->opt.host + ":" + std::to_string(impl_->opt.port) + ": " +
          (err == EADDRINUSE ? std::string("the port is in use (another troupe serve?)")
                             : std::string(std::strerror(err)));
    return false;
  }
  if (!impl_->http.widen_backlog(SOMAXCONN))
    actors::logging::of("gateway").warn("could not raise the listen backlog: {}",
                                        std::strerror(errno));
  return true;
}

int gateway::port() const {
  return impl_->bound_port;
}

void gateway::serve() {
  impl_->http.listen_after_bind();
}

void gateway::stop() {
  if (impl_) impl_->http.stop();
}

}  // namespace troupe::serve
