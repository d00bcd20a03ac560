#include "serve/gateway.hpp"

#include "models/audio.hpp"

// Asio 1.74's awaitable uses std::exchange without including <utility>;
// Beast speaks std::string_view.
#include <utility>
#define BOOST_BEAST_USE_STD_STRING_VIEW 1

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <atomic>
#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>
#include <cerrno>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <thread>
#include <unordered_map>

#include "actors/client.hpp"
#include "actors/cluster_client.hpp"
#include "actors/log.hpp"
#include "serve/metrics.hpp"

namespace troupe::serve {

namespace {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
namespace websocket = beast::websocket;
using tcp = net::ip::tcp;
using steady = std::chrono::steady_clock;
using namespace std::chrono_literals;
using strand_t = net::any_io_executor;  ///< a connection's strand
using error_code = boost::system::error_code;
template <class T>
using task = net::awaitable<T>;

auto use_ec(error_code& ec) {
  return net::redirect_error(net::use_awaitable, ec);
}

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

// One connection's wake-up call. Actor threads (a job's tokens, the head's
// answer) post to the connection's strand and cancel the timer its
// coroutine waits on; everything but `notify` runs on that strand. It
// holds the io_context, so a late post never reaches a destroyed one.
struct conn_state : std::enable_shared_from_this<conn_state> {
  conn_state(std::shared_ptr<net::io_context> c, strand_t s)
      : ctx(std::move(c)), strand(s), wake(s) {}
  std::shared_ptr<net::io_context> ctx;
  strand_t strand;
  net::steady_timer wake;
  beast::tcp_stream* stream = nullptr;  ///< while the session runs
  bool busy = false;                    ///< between a request and its whole response
  bool draining = false;                ///< stop(): end what runs, take nothing new
  bool peer_closed = false;             ///< the client hung up mid-request
  std::uint64_t watch = 0;              ///< the current peer watch (older ones do nothing)

  static void notify(const std::weak_ptr<conn_state>& w) {
    if (auto c = w.lock()) net::post(c->strand, [c] { c->wake.cancel(); });
  }
};

// What a job's callbacks (actor threads) hand to its connection.
struct job_stream {
  std::mutex m;
  std::optional<std::expected<actors::submit_ack, actors::client::rejection>> ack;
  std::deque<std::string> texts;                ///< token texts not yet sent
  std::vector<models::token_logprob> logprobs;  ///< every token's, when asked for
  std::string held;                             ///< with tools: the text, sent whole at the end
  std::size_t sent_logprobs = 0;                ///< of them, sent (streaming)
  std::int64_t tokens = 0;                      ///< tokens so far
  std::optional<actors::finish_event> done;
  std::vector<double> gaps;  ///< seconds between tokens, per token
  steady::time_point last = steady::now();
  bool any = false;
};

// One request on a connection and what its access-log line says.
struct exchange {
  http::request<http::string_body> req;
  std::string method, path;
  std::string request_id;
  std::string allow_origin;  ///< the Access-Control-Allow-Origin value; empty: none
  steady::time_point t0 = steady::now();
  unsigned status = 0;
  std::int64_t prompt_tokens = 0, completion_tokens = 0;
  std::optional<std::int64_t> cached_tokens;  ///< known once a choice ended
  bool keep_alive = true;
};

struct reply {
  unsigned status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
};

bool valid_request_id(std::string_view s) {
  if (s.empty() || s.size() > 128) return false;
  for (char ch : s)
    if (!(std::isalnum(static_cast<unsigned char>(ch)) || ch == '-' || ch == '_' || ch == '.' ||
          ch == ':'))
      return false;
  return true;
}

std::string random_hex(int n) {
  static std::mutex m;
  static std::mt19937_64 gen{std::random_device{}()};
  std::lock_guard lock(m);
  static const char* digits = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += digits[gen() & 15];
  return s;
}

// Raises the open-file limit to the hard limit: each connection is a file.
void raise_file_limit(std::size_t want) {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return;
  const rlim_t need = static_cast<rlim_t>(want) + 256;
  if (r.rlim_cur >= need) return;
  r.rlim_cur = std::min(need, r.rlim_max);
  if (::setrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur < need)
    actors::logging::of("gateway").warn(
        "open files limited to {} (hard limit): fewer than the {} connections allowed",
        static_cast<unsigned long long>(r.rlim_cur), want);
}

}  // namespace

struct gateway::impl : std::enable_shared_from_this<impl> {
  caf::actor_system& sys;
  gateway_options opt;
  std::shared_ptr<net::io_context> ctx;
  tcp::acceptor acceptor;
  net::thread_pool pool;
  std::shared_ptr<metrics> stats = std::make_shared<metrics>(opt.model_name);  // after opt
  int bound_port = 0;
  std::atomic<bool> stopping{false};
  std::atomic<bool> serving{false};
  std::atomic<std::int64_t> connections{0}, streams{0};

  std::mutex conns_mtx;
  std::map<net::ip::address, std::int64_t> per_peer;  ///< open connections by client address
  std::unordered_map<std::uint64_t, std::weak_ptr<conn_state>> conns;
  std::uint64_t next_conn = 0;

  // The head: its door and the client of it, replaced on reconnection.
  mutable std::mutex head_mtx;
  actors::frontdoor_actor door;
  std::shared_ptr<actors::client> jobs;
  std::mutex reconnector_mtx;
  std::thread reconnector;
  std::atomic<bool> reconnecting{false};

  std::atomic<bool> canary_ok{false};
  std::mutex canary_mtx;

  impl(caf::actor_system& s, actors::frontdoor_actor d, gateway_options o)
      : sys(s),
        opt(std::move(o)),
        ctx(std::make_shared<net::io_context>(std::max(1, opt.io_threads))),
        acceptor(*ctx),
        pool(static_cast<std::size_t>(std::max(1, opt.blocking_threads))),
        door(d),
        jobs(make_client(d)) {}

  std::shared_ptr<actors::client> make_client(const actors::frontdoor_actor& d) {
    if (opt.failover_window.count() > 0 && opt.reconnect)
      return std::make_shared<actors::client>(
          sys, d, actors::client::failover{opt.reconnect, opt.failover_window});
    return std::make_shared<actors::client>(sys, d);
  }

  ~impl() {
    pool.join();
    if (reconnector.joinable()) reconnector.join();
  }

  // -- the head ------------------------------------------------------------------------------

  std::pair<actors::frontdoor_actor, std::shared_ptr<actors::client>> head() const {
    std::lock_guard lock(head_mtx);
    // After a failover the client's door is the head that took over.
    auto d = jobs->door();
    return {d ? d : door, jobs};
  }

  // The head went away: look for it again in the background (reconnect
  // given), replacing the client once its door answers.
  void ensure_reconnect() {
    std::lock_guard lock(reconnector_mtx);
    if (!opt.reconnect || stopping || reconnecting.exchange(true)) return;
    if (reconnector.joinable()) reconnector.join();  // it ended: reconnecting was false
    reconnector = std::thread([this] {
      auto log = actors::logging::of("gateway");
      log.warn("the head went away; reconnecting every {} ms", opt.reconnect_every.count());
      while (!stopping) {
        auto d = opt.reconnect();
        if (d) {
          {
            std::lock_guard lock(head_mtx);
            door = *d;
            jobs = make_client(*d);
          }
          canary_ok = false;
          log.info("reconnected to the head");
          break;
        }
        log.debug("reconnect: {}", d.error());
        for (auto t = steady::now() + opt.reconnect_every; !stopping && steady::now() < t;)
          std::this_thread::sleep_for(20ms);
      }
      reconnecting = false;
    });
  }

  std::optional<actors::cluster_status> status(std::chrono::milliseconds timeout) {
    auto [d, j] = head();
    if (!j->gone().empty()) return std::nullopt;
    auto s = actors::query_status(sys, d, timeout);
    return s ? std::optional<actors::cluster_status>(std::move(*s)) : std::nullopt;
  }

  // A one-token decode, once, the first time the cluster says it is ready.
  bool canary() {
    if (canary_ok) return true;
    std::lock_guard lock(canary_mtx);
    if (canary_ok) return true;
    auto [d, j] = head();
    actors::job_request job;
    job.id = actors::random_job_id();
    job.prompt = "Hello";
    job.max_tokens = 1;
    job.ignore_eos = true;
    auto finished = std::make_shared<std::promise<actors::finish_event>>();
    auto ended = finished->get_future();
    auto submitted = std::make_shared<std::promise<bool>>();
    auto acked = submitted->get_future();
    actors::client::callbacks cb;
    cb.on_finish = [finished](const actors::finish_event& f) { finished->set_value(f); };
    j->submit_async(
        job, std::move(cb), [submitted](auto r) { submitted->set_value(r.has_value()); },
        opt.submit_timeout);
    if (!acked.get()) return false;
    if (ended.wait_for(30s) != std::future_status::ready) {
      j->cancel_async(job.id);
      return false;
    }
    const auto f = ended.get();
    canary_ok = f.reason == actors::finish_reason::length && f.tokens.size() == 1;
    return canary_ok;
  }

  // -- helpers -------------------------------------------------------------------------------

  // A response being streamed, counted in `streams` while it lasts.
  struct open_stream {
    explicit open_stream(std::atomic<std::int64_t>& n) : n(n) { ++n; }
    ~open_stream() { --n; }
    open_stream(const open_stream&) = delete;
    open_stream& operator=(const open_stream&) = delete;
    std::atomic<std::int64_t>& n;
  };

  // Submits a job without waiting: the head's answer lands in js->ack and
  // wakes the connection.
  void submit_to(actors::client& client, actors::job_request job, actors::client::callbacks cb,
                 const std::shared_ptr<job_stream>& js, const std::weak_ptr<conn_state>& wc) {
    client.submit_async(
        std::move(job), std::move(cb),
        [js, wc](std::expected<actors::submit_ack, actors::client::rejection> a) {
          {
            std::lock_guard lock(js->m);
            js->ack = std::move(a);
          }
          conn_state::notify(wc);
        },
        opt.submit_timeout);
  }

  // Runs `f` on the blocking pool; the coroutine resumes on its strand.
  template <class F>
  task<std::invoke_result_t<F>> on_pool(F f) {
    using R = std::invoke_result_t<F>;
    auto run = [f = std::move(f)]() mutable -> task<R> { co_return f(); };
    co_return co_await net::co_spawn(pool.get_executor(), std::move(run), net::use_awaitable);
  }

  // Waits on the connection's strand until `ready()`, or `until`; whether ready.
  template <class Ready>
  static task<bool> wait_for(conn_state& c, Ready ready, steady::time_point until) {
    for (;;) {
      if (ready()) co_return true;
      if (steady::now() >= until) co_return false;
      c.wake.expires_at(until);
      error_code ec;
      co_await c.wake.async_wait(use_ec(ec));
    }
  }

  // Watches for the client hanging up while its request runs: the socket
  // turns readable with nothing to read. Bytes of a pipelined request end
  // the watch (they are read after this response).
  static void watch_peer(const std::shared_ptr<conn_state>& c, tcp::socket& sock) {
    const auto gen = ++c->watch;
    sock.async_wait(tcp::socket::wait_read,
                    net::bind_executor(c->strand, [c, gen, &sock](error_code ec) {
                      if (ec || gen != c->watch) return;
                      char b = 0;
                      const auto n = ::recv(sock.native_handle(), &b, 1, MSG_PEEK | MSG_DONTWAIT);
                      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
                        watch_peer(c, sock);
                        return;
                      }
                      if (n <= 0) {
                        c->peer_closed = true;
                        c->wake.cancel();
                      }
                    }));
  }
  static void unwatch_peer(conn_state& c) {
    ++c.watch;
    if (c.stream) {
      error_code ec;
      c.stream->socket().cancel(ec);
    }
  }

  std::optional<api_error> authorized(const exchange& ex) const {
    if (opt.api_key.empty()) return std::nullopt;
    if (ex.req[http::field::authorization] == "Bearer " + opt.api_key) return std::nullopt;
    api_error e;
    e.status = 401;
    e.type = "authentication_error";
    e.message = "a missing or wrong API key (Authorization: Bearer KEY)";
    e.code = "invalid_api_key";
    return e;
  }

  reply error_reply(const api_error& e) {
    stats->failed_http(e.status);
    reply r;
    r.status = static_cast<unsigned>(e.status);
    r.body = error_json(e);
    if (e.status == 429 || e.status == 503) r.headers.emplace_back("Retry-After", "1");
    return r;
  }

  // A request that failed after it was accepted: its code says whether the
  // request was at fault (an image that does not decode) or the head went
  // away.
  static api_error finish_error(const actors::finish_event& f) {
    api_error e;
    e.message = f.error;
    if (f.code == actors::error_code::invalid_request) {
      e.status = 400;
    } else if (f.code == actors::error_code::context_length) {
      e.status = 400;
      e.code = "context_length_exceeded";
    } else if (f.code == actors::error_code::unavailable) {
      e.status = 503;
      e.type = "server_error";
    } else {
      e.status = 500;
      e.type = "server_error";
    }
    return e;
  }

  static api_error shutting_down(bool cancelled) {
    api_error e;
    e.status = 503;
    e.type = "server_error";
    e.message = cancelled ? "the server is shutting down: the request was cancelled"
                          : "the server is shutting down";
    return e;
  }

  api_error body_too_large() const {
    api_error e;
    e.status = 413;
    e.message = "the body is larger than " + std::to_string(opt.max_body_bytes >> 20) + " MiB";
    return e;
  }

  static api_error rejection_error(const actors::client::rejection& r, bool chat) {
    api_error e;
    e.message = r.message;
    switch (r.code) {
      case actors::error_code::invalid_request:
      case actors::error_code::duplicate_id:
      case actors::error_code::kv_exhausted:
        e.status = 400;
        break;
      case actors::error_code::context_length:  // OpenAI's shape for it
        e.status = 400;
        e.code = "context_length_exceeded";
        e.param = chat ? "messages" : "prompt";
        break;
      case actors::error_code::overloaded:
        e.status = 429;
        e.type = "rate_limit_error";
        break;
      default:  // unavailable (not ready, shutting down, no answer), or the head is gone
        e.status = 503;
        e.type = "server_error";
    }
    return e;
  }

  template <class Response>
  void common_headers(Response& res, const exchange& ex) const {
    res.set(http::field::server, "troupe/" + opt.version);
    if (!ex.request_id.empty()) res.set("X-Request-Id", ex.request_id);
    if (!ex.allow_origin.empty()) {
      res.set(http::field::access_control_allow_origin, ex.allow_origin);
      if (ex.allow_origin != "*") res.set(http::field::vary, "Origin");
    }
  }

  // (Replies and chunks are named locals at every co_await: GCC 12 destroyed
  // a temporary with a destructor in a co_await expression twice.)
  task<bool> write_reply(beast::tcp_stream& s, exchange& ex, reply& r) {
    http::response<http::string_body> res{static_cast<http::status>(r.status), 11};
    res.set(http::field::content_type, r.content_type);
    for (auto& [k, v] : r.headers) res.set(k, v);
    common_headers(res, ex);
    res.keep_alive(ex.keep_alive);
    res.body() = std::move(r.body);
    res.prepare_payload();
    ex.status = r.status;
    s.expires_after(opt.io_timeout);
    error_code ec;
    co_await http::async_write(s, res, use_ec(ec));
    co_return !ec;
  }

  void log_access(const exchange& ex) const {
    if (ex.status > 0) stats->responded(static_cast<int>(ex.status));
    if (!opt.access_log) return;
    const double ms = std::chrono::duration<double, std::milli>(steady::now() - ex.t0).count();
    actors::logging::of("gateway").info("{} {} {} prompt={} completion={} {:.1f} ms id={}",
                                        ex.method, ex.path.substr(0, 256), ex.status,
                                        ex.prompt_tokens, ex.completion_tokens, ms, ex.request_id);
  }

  // -- the endpoints -------------------------------------------------------------------------

  std::string models_json() const {
    nlohmann::json card{{"id", opt.model_name},
                        {"object", "model"},
                        {"created", unix_now()},
                        {"owned_by", "troupe"}};
    return card.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }

  task<bool> route(const std::shared_ptr<conn_state>& c, beast::tcp_stream& s, exchange& ex) {
    const auto method = ex.req.method();
    const auto& path = ex.path;
    const bool completion = path == "/v1/chat/completions" || path == "/v1/completions" ||
                            path == "/v1/audio/transcriptions" || path == "/tokenize" ||
                            path == "/detokenize" || path == "/reset_prefix_cache";
    if (method == http::verb::options) {
      reply r;
      r.status = 204;
      r.content_type = "text/plain";
      r.headers = {{"Allow", completion ? "POST, OPTIONS" : "GET, OPTIONS"}};
      if (!ex.allow_origin.empty()) {
        r.headers.emplace_back("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
        r.headers.emplace_back("Access-Control-Allow-Headers",
                               "Authorization, Content-Type, X-Request-Id");
        r.headers.emplace_back("Access-Control-Max-Age", "600");
      }
      co_return co_await write_reply(s, ex, r);
    }
    if (completion) {
      if (method != http::verb::post) co_return co_await not_allowed(s, ex, "POST");
      if (path == "/tokenize" || path == "/detokenize" || path == "/reset_prefix_cache")
        co_return co_await tokens(s, ex,
                                  path == "/tokenize"     ? head_call::tokenize
                                  : path == "/detokenize" ? head_call::detokenize
                                                          : head_call::reset_cache);
      if (path == "/v1/audio/transcriptions") co_return co_await transcribe(c, s, ex);
      co_return co_await complete(c, s, ex, path == "/v1/chat/completions");
    }
    if (path == "/v1/audio/stream") {
      api_error e;
      e.message =
          "/v1/audio/stream is a WebSocket: connect with an Upgrade: websocket request "
          "(docs/serve.md)";
      auto out_ = error_reply(e);
      co_return co_await write_reply(s, ex, out_);
    }
    if (path == "/v1/responses" || path.starts_with("/v1/responses/")) {
      // Refused by name, not a bare 404: a client of the Responses API
      // learns what to use instead.
      api_error e;
      e.status = 404;
      e.type = "not_found_error";
      e.message =
          "the Responses API is not supported by troupe: use /v1/chat/completions (docs/serve.md)";
      auto out_ = error_reply(e);
      co_return co_await write_reply(s, ex, out_);
    }
    const bool get = method == http::verb::get || method == http::verb::head;
    auto known = [&](std::string_view p) { return path == p; };
    if (!(known("/live") || known("/health") || known("/ready") || known("/version") ||
          known("/metrics") || known("/v1/models") || path.starts_with("/v1/models/"))) {
      api_error e;
      e.status = 404;
      e.type = "not_found_error";
      e.message = "no such endpoint";
      {
        auto out_ = error_reply(e);
        co_return co_await write_reply(s, ex, out_);
      }
    }
    if (!get) co_return co_await not_allowed(s, ex, "GET");
    reply r;
    r.content_type = "text/plain";
    if (path == "/live") {
      r.body = "live\n";
    } else if (path == "/version") {
      r.content_type = "application/json";
      r.body = nlohmann::json{{"version", opt.version}}.dump();
    } else if (path == "/health") {
      // vLLM's: 200 while the engine (here: the head) answers.
      auto ask = [this] { return status(2000ms).has_value(); };
      const bool up = co_await on_pool(std::move(ask));
      if (!up) ensure_reconnect();
      r.status = up ? 200 : 503;
      r.body = up ? "" : "the head does not answer\n";
    } else if (path == "/ready") {
      auto ask = [this]() -> std::string {
        auto st = status(5000ms);
        if (!st) return "the head does not answer";
        if (!st->ready) return "the model is not placed (" + st->last_event + ")";
        if (!canary()) return "the canary decode failed";
        return "";
      };
      auto why = co_await on_pool(std::move(ask));
      if (why == "the head does not answer") ensure_reconnect();
      r.status = why.empty() ? 200 : 503;
      r.body = why.empty() ? "ready\n" : "not ready: " + why + "\n";
    } else {
      // Behind the API key when one is set (Prometheus sends it as a
      // bearer token): the figures tell who uses the cluster how much.
      // /live, /health and /ready stay open for health checks.
      if (auto e = authorized(ex)) {
        auto out_ = error_reply(*e);
        co_return co_await write_reply(s, ex, out_);
      }
      if (path == "/metrics") {
        r.content_type = "text/plain; version=0.0.4";
        // Fast when the head is gone: no query to wait on.
        auto render = [this] {
          auto st = status(2000ms);
          return stats->render(st ? &*st : nullptr);
        };
        r.body = co_await on_pool(std::move(render));
        r.body +=
            "# HELP troupe:gateway_open_connections HTTP connections open now.\n"
            "# TYPE troupe:gateway_open_connections gauge\n"
            "troupe:gateway_open_connections " +
            std::to_string(connections.load()) +
            "\n# HELP troupe:gateway_open_streams Requests waiting for their tokens now.\n"
            "# TYPE troupe:gateway_open_streams gauge\n"
            "troupe:gateway_open_streams " +
            std::to_string(streams.load()) + "\n";
      } else if (path == "/v1/models") {
        r.content_type = "application/json";
        r.body = "{\"object\":\"list\",\"data\":[" + models_json() + "]}";
      } else {
        if (auto e =
                check_model(path.substr(std::string_view("/v1/models/").size()), opt.model_name)) {
          auto out_ = error_reply(*e);
          co_return co_await write_reply(s, ex, out_);
        }
        r.content_type = "application/json";
        r.body = models_json();
      }
    }
    if (method == http::verb::head) r.body.clear();
    co_return co_await write_reply(s, ex, r);
  }

  task<bool> not_allowed(beast::tcp_stream& s, exchange& ex, const char* allow) {
    api_error e;
    e.status = 405;
    e.message = ex.method + " is not allowed here (" + allow + ")";
    auto r = error_reply(e);
    r.headers.emplace_back("Allow", allow);
    co_return co_await write_reply(s, ex, r);
  }

  // vLLM's /tokenize, /detokenize and /reset_prefix_cache: the head holds
  // the tokenizer (and the chat template) and the scheduler's cache; the
  // question waits on the pool, not on an I/O thread.
  enum class head_call { tokenize, detokenize, reset_cache };
  task<bool> tokens(beast::tcp_stream& s, exchange& ex, head_call what) {
    if (auto e = authorized(ex)) {
      auto out_ = error_reply(*e);
      co_return co_await write_reply(s, ex, out_);
    }
    auto work = [this, what,
                 body = std::move(ex.req.body())]() -> std::expected<std::string, api_error> {
      auto [d, client] = head();
      auto refused = [](actors::error_code code, std::string why) {
        return std::unexpected(rejection_error({code, std::move(why)}, false));
      };
      if (auto gone = client->gone(); !gone.empty()) {
        ensure_reconnect();
        return refused(actors::error_code::unavailable, "the cluster's head is gone: " + gone);
      }
      std::expected<std::string, api_error> out =
          refused(actors::error_code::unavailable, "the head did not answer");
      auto on_error = [&](caf::error& e) {
        const auto code = actors::troupe_code(e);
        out = refused(code ? static_cast<actors::error_code>(code) : actors::error_code::internal,
                      actors::describe(sys, e));
      };
      caf::scoped_actor self{sys};
      if (what == head_call::reset_cache) {
        self->request(d, opt.submit_timeout, actors::reset_cache_atom::value)
            .receive(
                [&](std::int64_t freed) {
                  out = nlohmann::json{{"status", "ok"}, {"freed_blocks", freed}}.dump();
                },
                on_error);
      } else if (what == head_call::tokenize) {
        auto r = parse_tokenize_request(body, opt.limits);
        if (!r) return std::unexpected(r.error());
        if (auto e = check_model(r->model, opt.model_name)) return std::unexpected(*e);
        self->request(d, opt.submit_timeout, actors::tokenize_atom::value, std::move(r->job))
            .receive(
                [&](actors::tokenize_reply& t) {
                  nlohmann::json j{{"count", t.tokens.size()},
                                   {"max_model_len", t.context_length},
                                   {"tokens", t.tokens}};
                  out = j.dump();
                },
                on_error);
      } else {
        auto r = parse_detokenize_request(body, opt.limits);
        if (!r) return std::unexpected(r.error());
        if (auto e = check_model(r->model, opt.model_name)) return std::unexpected(*e);
        self->request(d, opt.submit_timeout, actors::detokenize_atom::value, std::move(r->tokens))
            .receive(
                [&](std::string& text) {
                  out = nlohmann::json{{"prompt", text}}.dump(
                      -1, ' ', false, nlohmann::json::error_handler_t::replace);
                },
                on_error);
      }
      return out;
    };
    auto res = co_await on_pool(std::move(work));
    if (!res) {
      auto out_ = error_reply(res.error());
      co_return co_await write_reply(s, ex, out_);
    }
    reply out;
    out.body = std::move(*res);
    co_return co_await write_reply(s, ex, out);
  }

  // /v1/audio/transcriptions: the upload parsed (and, for the formats
  // with times, the clip's duration read) off the I/O threads, then a
  // chat completion with the clip, answered in the format asked for.
  task<bool> transcribe(const std::shared_ptr<conn_state>& c, beast::tcp_stream& s, exchange& ex) {
    if (auto e = authorized(ex)) {
      auto out_ = error_reply(*e);
      co_return co_await write_reply(s, ex, out_);
    }
    auto parse = [this, type = std::string(ex.req[http::field::content_type]),
                  body = std::move(ex.req.body())]()
        -> std::expected<std::pair<api_request, double>, api_error> {
      auto r = parse_transcription_request(type, body, opt.limits);
      if (!r) return std::unexpected(r.error());
      double seconds = 0;
      if (r->transcription_format != "json" && r->transcription_format != "text") {
        auto a = models::decode_audio(r->job.audios.front().bytes);
        if (!a) {
          api_error e;
          e.message = "file: " + a.error().message;
          e.param = "file";
          return std::unexpected(e);
        }
        seconds = a->seconds();
      }
      return std::pair{std::move(*r), seconds};
    };
    auto parsed = co_await on_pool(std::move(parse));
    if (!parsed) {
      auto out_ = error_reply(parsed.error());
      co_return co_await write_reply(s, ex, out_);
    }
    co_return co_await complete(
        c, s, ex, true, std::make_shared<api_request>(std::move(parsed->first)), parsed->second);
  }

  // A chat or text completion: parse, fetch images, submit, then answer
  // whole or stream. `pre`: a request already parsed (a transcription of
  // a clip of `seconds`).
  task<bool> complete(const std::shared_ptr<conn_state>& c, beast::tcp_stream& s, exchange& ex,
                      bool chat, std::shared_ptr<api_request> pre = {}, double seconds = 0) {
    std::shared_ptr<api_request> r = std::move(pre);
    if (!r) {
      if (auto e = authorized(ex)) {
        auto out_ = error_reply(*e);
        co_return co_await write_reply(s, ex, out_);
      }
      // Parsing a large body (base64 images) takes milliseconds: off the I/O threads.
      auto parse = [this, chat, body = std::move(ex.req.body())] {
        return chat ? parse_chat_request(body, opt.limits)
                    : parse_completion_request(body, opt.limits);
      };
      auto parsed = co_await on_pool(std::move(parse));
      if (!parsed) {
        auto out_ = error_reply(parsed.error());
        co_return co_await write_reply(s, ex, out_);
      }
      r = std::make_shared<api_request>(std::move(*parsed));
    }
    if (!r->remote_images.empty()) {
      auto fetch = [this, r]() -> std::optional<api_error> {
        for (const auto& ri : r->remote_images) {
          auto f = opt.fetch;
          f.max_bytes = ri.video ? opt.limits.max_video_bytes : opt.limits.max_image_bytes;
          if (ri.video) f.accept = "video/*";
          auto bytes = fetch_image(ri.url, f);
          if (!bytes) {
            api_error e;
            e.message = ri.param + ": " + bytes.error().message;
            e.param = ri.param;
            e.status = status_of(bytes.error().code);
            return e;
          }
          (ri.video ? r->job.videos : r->job.images)[ri.index].bytes = std::move(*bytes);
        }
        return std::nullopt;
      };
      auto failed = co_await on_pool(std::move(fetch));
      if (failed) {
        auto out_ = error_reply(*failed);
        co_return co_await write_reply(s, ex, out_);
      }
    }
    if (auto e = check_model(r->model, opt.model_name)) {
      auto out_ = error_reply(*e);
      co_return co_await write_reply(s, ex, out_);
    }
    if (r->model.empty()) r->model = opt.model_name;
    if (c->draining) {
      ex.keep_alive = false;
      {
        auto out_ = error_reply(shutting_down(false));
        co_return co_await write_reply(s, ex, out_);
      }
    }

    // Submit without waiting, one job per choice; the answers and the
    // tokens wake this strand.
    const auto n = static_cast<std::size_t>(std::max<std::int64_t>(1, r->n));
    std::vector<std::shared_ptr<job_stream>> jobs;
    std::vector<std::uint64_t> job_ids;
    for (std::size_t i = 0; i < n; ++i) {
      jobs.push_back(std::make_shared<job_stream>());
      job_ids.push_back(actors::random_job_id());
    }
    const auto id = std::string(chat ? "chatcmpl-" : "cmpl-") + std::to_string(job_ids[0]);
    const auto created = unix_now();
    const std::weak_ptr<conn_state> wc = c;
    auto [d, client] = head();
    if (auto gone = client->gone(); !gone.empty()) ensure_reconnect();
    const open_stream counted{streams};
    for (std::size_t i = 0; i < n; ++i) {
      auto js = jobs[i];
      actors::client::callbacks cb;
      cb.on_token = [js, wc](const actors::token_event& e) {
        {
          std::lock_guard lock(js->m);
          const auto now = steady::now();
          if (js->any && !e.tokens.empty()) {
            const double gap = std::chrono::duration<double>(now - js->last).count() /
                               static_cast<double>(e.tokens.size());
            for (std::size_t k = 0; k < e.tokens.size(); ++k) js->gaps.push_back(gap);
          }
          js->any = js->any || !e.tokens.empty();
          js->last = now;
          js->tokens += static_cast<std::int64_t>(e.tokens.size());
          if (!e.text.empty()) js->texts.push_back(e.text);
          for (const auto& lp : e.logprobs) js->logprobs.push_back(lp);
        }
        conn_state::notify(wc);
      };
      cb.on_finish = [js, wc, st = stats](const actors::finish_event& f) {
        // Every end is counted here, also of a request whose client left.
        std::vector<double> gaps;
        {
          std::lock_guard lock(js->m);
          gaps = js->gaps;
        }
        st->finished(f, gaps);
        {
          std::lock_guard lock(js->m);
          js->done = f;
        }
        conn_state::notify(wc);
      };
      // Choice i samples with seed + i: n choices differ, and each is
      // reproducible on its own.
      auto job = i + 1 == n ? std::move(r->job) : r->job;
      if (i + 1 == n) r->job.logprobs = job.logprobs;  // the JSON writers read it
      job.id = job_ids[i];
      job.seed += i;
      submit_to(*client, std::move(job), std::move(cb), js, wc);
    }
    auto locked = [](job_stream& js, auto f) {
      std::lock_guard lock(js.m);
      return f();
    };
    auto all = [&](auto pred) {
      for (auto& js : jobs)
        if (!locked(*js, [&] { return pred(*js); })) return false;
      return true;
    };
    auto cancel_open = [&] {  // their KV blocks are freed
      for (std::size_t i = 0; i < n; ++i)
        if (!locked(*jobs[i], [&] { return jobs[i]->done.has_value(); }))
          client->cancel_async(job_ids[i]);
    };
    // The head answers within submit_timeout, or the client says it did not.
    co_await wait_for(
        *c, [&] { return all([](job_stream& js) { return js.ack.has_value(); }); },
        steady::now() + opt.submit_timeout + 5s);
    std::int64_t prompt_tokens = 0;
    for (std::size_t i = 0; i < n; ++i) {
      auto ack = locked(*jobs[i], [&] { return jobs[i]->ack; });
      if (ack && *ack) {
        prompt_tokens = (*ack)->prompt_tokens;
        continue;
      }
      const auto rej = ack ? ack->error()
                           : actors::client::rejection{actors::error_code::unavailable,
                                                       "the head did not answer"};
      if (rej.code == actors::error_code::unavailable) ensure_reconnect();
      for (std::size_t k = 0; k < n; ++k)  // the choices that were accepted stop
        if (auto a = locked(*jobs[k], [&] { return jobs[k]->ack; }); a && *a)
          client->cancel_async(job_ids[k]);
      auto out_ = error_reply(rejection_error(rej, chat));
      co_return co_await write_reply(s, ex, out_);
    }
    watch_peer(c, s.socket());
    auto count_usage = [&](std::optional<actors::finish_event>& failed) {
      ex.prompt_tokens = prompt_tokens;
      ex.completion_tokens = 0;
      for (auto& js : jobs) {
        auto done = locked(*js, [&] { return js->done; });
        if (!done) continue;
        ex.prompt_tokens = done->prompt_tokens;
        ex.cached_tokens = std::max(ex.cached_tokens.value_or(0), done->cached_tokens);
        ex.completion_tokens += static_cast<std::int64_t>(done->tokens.size());
        if (done->reason == actors::finish_reason::error && !failed) failed = done;
      }
    };

    if (!r->stream) {
      co_await wait_for(
          *c,
          [&] {
            return c->draining || c->peer_closed ||
                   all([](job_stream& js) { return js.done.has_value(); });
          },
          steady::time_point::max());
      unwatch_peer(*c);
      if (!all([](job_stream& js) { return js.done.has_value(); })) {
        cancel_open();
        ex.keep_alive = false;
        if (c->peer_closed) {
          ex.status = 499;  // nginx's "client closed request", for the log
          co_return false;
        }
        {
          auto out_ = error_reply(shutting_down(true));
          co_return co_await write_reply(s, ex, out_);
        }
      }
      std::optional<actors::finish_event> failed;
      count_usage(failed);
      if (failed) {
        auto out_ = error_reply(finish_error(*failed));
        co_return co_await write_reply(s, ex, out_);
      }
      std::vector<choice_output> choices;
      for (auto& js : jobs)
        locked(*js, [&] {
          choices.push_back({*js->done, {js->logprobs.begin(), js->logprobs.end()}});
          return 0;
        });
      reply out;
      if (!r->transcription_format.empty()) {
        auto [body, type] = transcription_body(*r, choices.front().done, seconds);
        out.body = std::move(body);
        out.content_type = std::move(type);
      } else {
        out.body = completion_json(*r, id, created, choices);
      }
      co_return co_await write_reply(s, ex, out);
    }

    // Streamed: Server-Sent Events in HTTP chunks.
    http::response<http::empty_body> head_res{http::status::ok, 11};
    head_res.set(http::field::content_type, "text/event-stream");
    head_res.set(http::field::cache_control, "no-cache");
    head_res.set("X-Accel-Buffering", "no");
    common_headers(head_res, ex);
    head_res.keep_alive(ex.keep_alive);
    head_res.chunked(true);
    ex.status = 200;
    http::response_serializer<http::empty_body> sr{head_res};
    error_code ec;
    s.expires_after(opt.io_timeout);
    co_await http::async_write_header(s, sr, use_ec(ec));
    auto send = [&](const std::string& data) -> task<bool> {
      s.expires_after(opt.io_timeout);
      error_code wec;
      auto chunk = http::make_chunk(net::buffer(data));
      co_await net::async_write(s, chunk, use_ec(wec));
      co_return !wec;
    };
    std::string ev;  // the event being sent (a named local: see write_reply)
    auto event = [](const std::string& json) { return "data: " + json + "\n\n"; };
    bool ok = !ec;
    // Per choice: whether its end was sent, and where its logprobs' text
    // offsets stand.
    std::vector<bool> ended(n, false);
    std::vector<std::int64_t> offset(n, static_cast<std::int64_t>(r->echo.size()));
    auto usage_now = [&] {
      usage_counts u{prompt_tokens, 0, std::nullopt};
      for (auto& js : jobs) u.completion += locked(*js, [&] { return js->tokens; });
      return u;
    };
    for (std::size_t i = 0; ok && i < n; ++i) {
      if (chat) {
        ev = event(role_chunk_json(*r, id, created, static_cast<std::int64_t>(i)));
        ok = co_await send(ev);
      }
      if (ok && !r->echo.empty()) {  // /v1/completions with echo: the prompt comes first
        ev = event(chunk_json(*r, id, created, static_cast<std::int64_t>(i), r->echo, ""));
        ok = co_await send(ev);
      }
    }
    bool failed_sent = false;
    while (ok) {
      const bool woke = co_await wait_for(
          *c,
          [&] {
            if (c->draining || c->peer_closed) return true;
            for (std::size_t i = 0; i < n; ++i)
              if (locked(*jobs[i], [&] {
                    return !jobs[i]->texts.empty() || (jobs[i]->done.has_value() && !ended[i]);
                  }))
                return true;
            return false;
          },
          steady::now() + opt.sse_ping);
      if (c->peer_closed) {
        ok = false;
        break;
      }
      bool sent = false;
      for (std::size_t i = 0; ok && i < n && !failed_sent; ++i) {
        if (ended[i]) continue;
        std::string text;
        std::vector<models::token_logprob> lps;
        std::optional<actors::finish_event> done;
        locked(*jobs[i], [&] {
          auto& js = *jobs[i];
          while (!js.texts.empty()) {
            text += js.texts.front();
            js.texts.pop_front();
          }
          done = js.done;
          if (r->tools_active) {  // the reply goes whole, once it is known
            js.held += text;
            text.clear();
          }
          // Logprobs go with the text of their tokens (text a stop string
          // may still take is held back; the end carries the rest).
          if (!text.empty() || done) {
            lps.assign(js.logprobs.begin() + static_cast<std::ptrdiff_t>(js.sent_logprobs),
                       js.logprobs.end());
            js.sent_logprobs = js.logprobs.size();
          }
          return 0;
        });
        const auto index = static_cast<std::int64_t>(i);
        const auto at = offset[i];
        for (const auto& lp : lps) offset[i] += static_cast<std::int64_t>(lp.piece.size());
        if (done && done->reason == actors::finish_reason::error) {
          const auto e = finish_error(*done);
          stats->failed_http(e.status);
          ev = event(error_json(e));
          ok = co_await send(ev);
          failed_sent = true;
          break;
        }
        std::optional<usage_counts> u;
        if (r->continuous_usage) u = usage_now();
        if (!text.empty() || (done && !lps.empty())) {
          ev = event(chunk_json(*r, id, created, index, text, "", lps, u ? &*u : nullptr, at));
          ok = co_await send(ev);
          sent = true;
        }
        std::string finish = done ? finish_reason(done->reason) : "";
        if (ok && done && r->tools_active) {
          bool calls = false;
          ev = event(tools_chunk_json(*r, id, created, index, jobs[i]->held, calls));
          ok = co_await send(ev);
          if (calls && done->reason == actors::finish_reason::stop) finish = "tool_calls";
        }
        if (ok && done) {
          ev = event(chunk_json(*r, id, created, index, "", finish, {}, u ? &*u : nullptr));
          ok = co_await send(ev);
          ended[i] = true;
          sent = true;
        }
      }
      if (ok && !sent && !woke) {
        ev = ": ping\n\n";  // a quiet stream (a long prefill) stays open
        ok = co_await send(ev);
      }
      if (!ok) break;
      const bool all_ended = std::all_of(ended.begin(), ended.end(), [](bool b) { return b; });
      if (!all_ended && !failed_sent && c->draining) {
        cancel_open();
        const auto e = shutting_down(true);
        stats->failed_http(e.status);
        ev = event(error_json(e));
        ok = co_await send(ev);
        ev = event("[DONE]");
        if (ok) ok = co_await send(ev);
        ex.keep_alive = false;
        break;
      }
      if (!all_ended && !failed_sent) continue;
      std::optional<actors::finish_event> failed;
      count_usage(failed);
      if (failed_sent) {
        cancel_open();
      } else if (r->include_usage) {
        usage_counts u{ex.prompt_tokens, ex.completion_tokens, ex.cached_tokens};
        ev = event(usage_chunk_json(*r, id, created, u));
        ok = co_await send(ev);
      }
      ev = event("[DONE]");
      if (ok) ok = co_await send(ev);
      if (ok) {
        s.expires_after(opt.io_timeout);
        error_code lec;
        auto last = http::make_chunk_last();
        co_await net::async_write(s, last, use_ec(lec));
        ok = !lec;
      }
      unwatch_peer(*c);
      co_return ok&& ex.keep_alive;
    }
    // The client went away (or could not be written to): its requests stop
    // and free their KV blocks.
    unwatch_peer(*c);
    cancel_open();
    if (c->peer_closed) ex.status = 499;
    ex.keep_alive = false;
    co_return false;
  }

  // -- /v1/audio/stream: a chat and a clip streamed into it, over a WebSocket ----------------

  // The socket's protocol (docs/serve.md): the client's first message is a
  // chat completion request (JSON text; the clip follows its last message),
  // then binary messages carry the clip (mono 16 kHz, signed 16-bit
  // little-endian PCM), each answered {"type": "audio.ack", ...} once its
  // windows are encoded, and {"type": "audio.end"} ends it. The answer comes
  // as the chat.completion.chunk objects of a streamed completion, then the
  // socket closes normally. Any error is an {"error": ...} message, then a
  // close.
  task<void> audio_socket(const std::shared_ptr<conn_state>& c, beast::tcp_stream& s,
                          exchange& ex) {
    ex.keep_alive = false;
    if (auto e = authorized(ex)) {
      auto out_ = error_reply(*e);
      co_await write_reply(s, ex, out_);
      co_return;
    }
    if (c->draining) {
      auto out_ = error_reply(shutting_down(false));
      co_await write_reply(s, ex, out_);
      co_return;
    }
    websocket::stream<beast::tcp_stream&> ws(s);  // the session closes `s` after
    s.expires_never();                            // the socket's own timeouts (below) from here on
    ws.set_option(websocket::stream_base::timeout::suggested(beast::role_type::server));
    ws.read_message_max(opt.max_body_bytes);
    error_code ec;
    co_await ws.async_accept(ex.req, use_ec(ec));
    if (ec) co_return;
    ex.status = 101;
    std::string out;  // the message being written (alive across the write)
    auto say = [&](std::string m) -> task<bool> {
      out = std::move(m);
      ws.text(true);
      error_code wec;
      co_await ws.async_write(net::buffer(out), use_ec(wec));
      co_return !wec;
    };
    auto fail = [&](const api_error& e) -> task<void> {
      stats->failed_http(e.status);
      if (co_await say(error_json(e))) {
        error_code cec;
        co_await ws.async_close(websocket::close_code::policy_error, use_ec(cec));
      }
    };
    auto bad = [](std::string why, std::string param = "") {
      api_error e;
      e.message = std::move(why);
      e.param = std::move(param);
      return e;
    };
    // 1. The request.
    beast::flat_buffer b;
    co_await ws.async_read(b, use_ec(ec));
    if (ec) co_return;
    if (!ws.got_text()) {
      co_await fail(bad("the first message is the chat request, as JSON text"));
      co_return;
    }
    auto parse = [this, body = beast::buffers_to_string(b.data())] {
      return parse_chat_request(body, opt.limits);
    };
    b.consume(b.size());
    auto parsed = co_await on_pool(std::move(parse));
    if (!parsed) {
      co_await fail(parsed.error());
      co_return;
    }
    auto r = std::make_shared<api_request>(std::move(*parsed));
    if (!r->remote_images.empty()) {
      co_await fail(
          bad("the audio socket takes images as data: URLs only", r->remote_images.front().param));
      co_return;
    }
    if (r->n != 1) {
      co_await fail(bad("the audio socket gives one choice (n = 1)", "n"));
      co_return;
    }
    if (r->job.turns.empty()) {
      co_await fail(bad("the audio socket takes a chat (messages)", "messages"));
      co_return;
    }
    if (auto e = check_model(r->model, opt.model_name)) {
      co_await fail(*e);
      co_return;
    }
    if (r->model.empty()) r->model = opt.model_name;
    add_streamed_clip(*r);
    // 2. The job, submitted now.
    auto js = std::make_shared<job_stream>();
    const auto job_id = actors::random_job_id();
    const auto id = "chatcmpl-" + std::to_string(job_id);
    const auto created = unix_now();
    const std::weak_ptr<conn_state> wc = c;
    auto [d, client] = head();
    if (auto gone = client->gone(); !gone.empty()) ensure_reconnect();
    const open_stream counted{streams};
    actors::client::callbacks cb;
    cb.on_token = [js, wc](const actors::token_event& e) {
      {
        std::lock_guard lock(js->m);
        js->tokens += static_cast<std::int64_t>(e.tokens.size());
        if (!e.text.empty()) js->texts.push_back(e.text);
      }
      conn_state::notify(wc);
    };
    cb.on_finish = [js, wc, st = stats](const actors::finish_event& f) {
      st->finished(f, {});
      {
        std::lock_guard lock(js->m);
        js->done = f;
      }
      conn_state::notify(wc);
    };
    auto job = r->job;
    job.id = job_id;
    submit_to(*client, std::move(job), std::move(cb), js, wc);
    auto locked = [&](auto f) {
      std::lock_guard lock(js->m);
      return f();
    };
    co_await wait_for(
        *c, [&] { return locked([&] { return js->ack.has_value(); }); },
        steady::now() + opt.submit_timeout + 5s);
    auto ack = locked([&] { return js->ack; });
    if (!ack || !*ack) {
      const auto rej = ack ? ack->error()
                           : actors::client::rejection{actors::error_code::unavailable,
                                                       "the head did not answer"};
      co_await fail(rejection_error(rej, true));
      co_return;
    }
    auto give_up = [&](const api_error& e) -> task<void> {
      client->cancel_async(job_id);  // its KV blocks are freed
      co_await fail(e);
    };
    // 3. The clip, piece by piece: each answered once its windows are encoded.
    struct piece_answer {
      std::mutex m;
      std::optional<std::expected<actors::stream_progress, actors::client::rejection>> got;
    };
    std::int64_t bytes = 0;
    for (;;) {
      co_await ws.async_read(b, use_ec(ec));
      if (ec) {  // the client went away: the job stops
        client->cancel_async(job_id);
        co_return;
      }
      bool last = false;
      std::vector<std::uint8_t> pcm;
      if (ws.got_text()) {
        const auto m = nlohmann::json::parse(beast::buffers_to_string(b.data()), nullptr, false);
        if (m.is_discarded() || !m.is_object() || m.value("type", "") != "audio.end") {
          b.consume(b.size());
          co_await give_up(bad("after the request, text messages are {\"type\": \"audio.end\"}"));
          co_return;
        }
        last = true;
      } else {
        const auto* p = static_cast<const std::uint8_t*>(b.data().data());
        pcm.assign(p, p + b.size());
        bytes += static_cast<std::int64_t>(pcm.size());
        if (bytes > static_cast<std::int64_t>(opt.limits.max_audio_bytes)) {
          b.consume(b.size());
          co_await give_up(bad("the streamed audio is larger than " +
                               std::to_string(opt.limits.max_audio_bytes >> 20) + " MiB"));
          co_return;
        }
      }
      b.consume(b.size());
      auto pa = std::make_shared<piece_answer>();
      client->send_audio_async(
          job_id, std::move(pcm), last,
          [pa, wc](std::expected<actors::stream_progress, actors::client::rejection> a) {
            {
              std::lock_guard lock(pa->m);
              pa->got = std::move(a);
            }
            conn_state::notify(wc);
          });
      co_await wait_for(
          *c,
          [&] {
            std::lock_guard lock(pa->m);
            return pa->got.has_value();
          },
          steady::time_point::max());
      std::optional<std::expected<actors::stream_progress, actors::client::rejection>> got;
      {
        std::lock_guard lock(pa->m);
        got = pa->got;
      }
      if (!*got) {
        co_await give_up(rejection_error(got->error(), true));
        co_return;
      }
      nlohmann::json a{{"type", "audio.ack"},
                       {"samples", (*got)->samples},
                       {"tokens", (*got)->rows},
                       {"done", (*got)->done}};
      if (!co_await say(a.dump())) {
        client->cancel_async(job_id);
        co_return;
      }
      if (last) break;
    }
    // 4. The answer, as a streamed chat completion's chunks.
    if (!co_await say(role_chunk_json(*r, id, created, 0))) {
      client->cancel_async(job_id);
      co_return;
    }
    for (;;) {
      co_await wait_for(
          *c, [&] { return c->draining || locked([&] { return !js->texts.empty() || js->done; }); },
          steady::time_point::max());
      std::string text;
      std::optional<actors::finish_event> done;
      locked([&] {
        while (!js->texts.empty()) {
          text += js->texts.front();
          js->texts.pop_front();
        }
        done = js->done;
        return 0;
      });
      if (!done && c->draining) {
        co_await give_up(shutting_down(true));
        co_return;
      }
      if (done && done->reason == actors::finish_reason::error) {
        co_await fail(finish_error(*done));
        co_return;
      }
      if (!text.empty() && !co_await say(chunk_json(*r, id, created, 0, text, ""))) {
        client->cancel_async(job_id);
        co_return;
      }
      if (!done) continue;
      ex.prompt_tokens = done->prompt_tokens;
      ex.completion_tokens = static_cast<std::int64_t>(done->tokens.size());
      if (!co_await say(chunk_json(*r, id, created, 0, "", finish_reason(done->reason)))) co_return;
      if (r->include_usage) {
        usage_counts u{ex.prompt_tokens, ex.completion_tokens, done->cached_tokens};
        if (!co_await say(usage_chunk_json(*r, id, created, u))) co_return;
      }
      break;
    }
    co_await ws.async_close(websocket::close_code::normal, use_ec(ec));
  }

  // -- connections ---------------------------------------------------------------------------

  task<void> session(tcp::socket sock, net::ip::address peer) {
    auto c = std::make_shared<conn_state>(ctx, strand_t(sock.get_executor()));
    std::uint64_t key = 0;
    {
      std::lock_guard lock(conns_mtx);
      key = ++next_conn;
      conns[key] = c;
    }
    beast::tcp_stream stream(std::move(sock));
    c->stream = &stream;
    beast::flat_buffer buf;
    bool first = true;
    while (!c->draining) {
      http::request_parser<http::string_body> parser;
      parser.header_limit(static_cast<std::uint32_t>(opt.max_header_bytes));
      parser.body_limit(opt.max_body_bytes);
      exchange ex;
      // The first request gets io_timeout to arrive; later ones keep_alive.
      stream.expires_after(first ? opt.io_timeout : opt.keep_alive);
      error_code ec;
      co_await http::async_read_header(stream, buf, parser, use_ec(ec));
      if (ec) {
        // A client that closed, went quiet or was cut by stop() ends here;
        // anything else was a malformed request: said, then closed.
        const bool quiet = ec == http::error::end_of_stream || ec == beast::error::timeout ||
                           ec == net::error::operation_aborted ||
                           ec == net::error::connection_reset || ec == net::error::eof ||
                           ec == http::error::partial_message;
        if (!quiet) {
          ex.keep_alive = false;
          ex.method = "-";
          api_error e;
          if (ec == http::error::header_limit) {
            e.status = 431;
            e.message = "request headers over the limit (" +
                        std::to_string(opt.max_header_bytes >> 10) + " KiB in all)";
          } else if (ec == http::error::body_limit) {  // a Content-Length past it
            e = body_too_large();
          } else {
            e.message = "malformed HTTP request: " + ec.message();
          }
          {
            auto out_ = error_reply(e);
            co_await write_reply(stream, ex, out_);
          }
          log_access(ex);
        }
        break;
      }
      first = false;
      c->busy = true;
      ex.t0 = steady::now();
      const auto& h = parser.get();
      ex.method = std::string(h.method_string());
      ex.path = std::string(h.target().substr(0, h.target().find('?')));
      if (auto rid = h["X-Request-Id"]; valid_request_id(rid))
        ex.request_id = std::string(rid);
      else
        ex.request_id = random_hex(16);
      if (auto origin = h[http::field::origin]; !origin.empty())
        for (const auto& o : opt.cors_origins)
          if (o == "*" || o == origin) {
            ex.allow_origin = o == "*" ? "*" : std::string(origin);
            break;
          }
      std::size_t count = 0;
      for (auto it = h.begin(); it != h.end(); ++it) ++count;
      if (count > opt.max_headers) {
        ex.keep_alive = false;
        api_error e;
        e.status = 431;
        e.message = "request headers over the limit (" + std::to_string(opt.max_headers) +
                    " headers, " + std::to_string(opt.max_header_bytes >> 10) +
                    " KiB in all); this request has " + std::to_string(count) + " headers";
        {
          auto out_ = error_reply(e);
          co_await write_reply(stream, ex, out_);
        }
        log_access(ex);
        break;
      }
      // The audio socket (a WebSocket upgrade; it has no body): the
      // connection is its own from here on.
      if (ex.path == "/v1/audio/stream" && websocket::is_upgrade(parser.get())) {
        ex.req = parser.release();
        try {
          co_await audio_socket(c, stream, ex);
        } catch (const std::exception& e) {
          actors::logging::of("gateway").error("{}: {}", ex.path, e.what());
        }
        log_access(ex);
        c->busy = false;
        break;
      }
      // A client that asks first (curl does past 1 MiB) is told now.
      if (beast::iequals(h[http::field::expect], "100-continue")) {
        if (parser.content_length() && *parser.content_length() > opt.max_body_bytes) {
          ex.keep_alive = false;
          {
            auto out_ = error_reply(body_too_large());
            co_await write_reply(stream, ex, out_);
          }
          log_access(ex);
          break;
        }
        http::response<http::empty_body> cont{http::status::continue_, 11};
        stream.expires_after(opt.io_timeout);
        co_await http::async_write(stream, cont, use_ec(ec));
        if (ec) break;
      }
      // ACK the header now: a client without TCP_NODELAY holds the body
      // until its header is acknowledged, and a delayed ACK costs ~40 ms.
      const int quick = 1;
      (void)::setsockopt(stream.socket().native_handle(), IPPROTO_TCP, TCP_QUICKACK, &quick,
                         sizeof quick);
      stream.expires_after(opt.io_timeout);
      co_await http::async_read(stream, buf, parser, use_ec(ec));
      if (ec) {
        ex.keep_alive = false;
        if (ec == http::error::body_limit) {
          {
            auto out_ = error_reply(body_too_large());
            co_await write_reply(stream, ex, out_);
          }
          log_access(ex);
        }
        break;
      }
      ex.req = parser.release();
      ex.keep_alive = ex.req.keep_alive() && !stopping;
      bool keep = false, failed = false;
      try {
        keep = co_await route(c, stream, ex);
      } catch (const std::exception& e) {
        // Nothing a request holds may take the process down.
        actors::logging::of("gateway").error("{} {}: {}", ex.method, ex.path.substr(0, 256),
                                             e.what());
        failed = true;
      }
      if (failed) {
        ex.keep_alive = false;
        api_error err;
        err.status = 500;
        err.type = "server_error";
        err.message = "internal error";
        if (!c->peer_closed && ex.status == 0) {
          auto out_ = error_reply(err);
          co_await write_reply(stream, ex, out_);
        }
      }
      log_access(ex);
      c->busy = false;
      if (!keep || !ex.keep_alive) break;
    }
    error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_send, ec);
    stream.close();
    c->stream = nullptr;
    {
      std::lock_guard lock(conns_mtx);
      conns.erase(key);
      if (auto it = per_peer.find(peer); it != per_peer.end() && --it->second <= 0)
        per_peer.erase(it);
    }
    --connections;
  }

  // Answers a connection it will not serve with a 503 and closes it.
  void refuse(tcp::socket& sock, const std::string& why) {
    api_error e;
    e.status = 503;
    e.type = "server_error";
    e.message = why;
    stats->failed_http(503);
    const auto body = error_json(e);
    const auto msg =
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "
        "1\r\nConnection: close\r\nContent-Length: " +
        std::to_string(body.size()) + "\r\n\r\n" + body;
    (void)::send(sock.native_handle(), msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    error_code ec;
    sock.close(ec);
  }

  task<void> accept_loop() {
    bool said_full = false;
    while (!stopping) {
      error_code ec;
      auto strand = net::make_strand(*ctx);  // the connection's
      tcp::socket sock = co_await acceptor.async_accept(strand, use_ec(ec));
      if (ec) {
        if (stopping || ec == net::error::operation_aborted) co_return;
        // Out of files: wait a little instead of spinning on the error.
        actors::logging::of("gateway").warn("accept: {}", ec.message());
        net::steady_timer t(co_await net::this_coro::executor, 100ms);
        co_await t.async_wait(use_ec(ec));
        continue;
      }
      if (connections.load() >= static_cast<std::int64_t>(opt.max_connections)) {
        // Told, not queued: a 503 the client can retry.
        if (!std::exchange(said_full, true))
          actors::logging::of("gateway").warn("{} connections open: refusing more",
                                              opt.max_connections);
        refuse(sock, "too many open connections (" + std::to_string(opt.max_connections) + ")");
        continue;
      }
      said_full = false;
      // One client (an address) may not hold every connection.
      const auto peer = sock.remote_endpoint(ec).address();
      if (ec) {
        sock.close(ec);
        continue;
      }
      {
        std::unique_lock lock(conns_mtx);
        auto& mine = per_peer[peer];
        if (opt.max_connections_per_client > 0 &&
            mine >= static_cast<std::int64_t>(opt.max_connections_per_client)) {
          lock.unlock();
          refuse(sock, "too many open connections from " + peer.to_string() + " (" +
                           std::to_string(opt.max_connections_per_client) + ")");
          continue;
        }
        ++mine;
      }
      // Tokens go out as they come: without this, Nagle's algorithm held a
      // stream's second small write until the client's delayed ACK (about
      // 40 ms added to every time to first token).
      sock.set_option(tcp::no_delay(true), ec);
      ++connections;
      auto ex = sock.get_executor();
      net::co_spawn(ex, session(std::move(sock), peer), net::detached);
    }
  }

  // The head went away: reconnect before a request finds out.
  task<void> watch_head() {
    net::steady_timer t(co_await net::this_coro::executor);
    for (auto last = steady::now(); !stopping;) {
      t.expires_after(200ms);  // short: stop() does not wait on it
      error_code ec;
      co_await t.async_wait(use_ec(ec));
      if (stopping || steady::now() - last < opt.reconnect_every) continue;
      last = steady::now();
      if (!head().second->gone().empty()) ensure_reconnect();
    }
  }
};

gateway::gateway(caf::actor_system& sys, actors::frontdoor_actor door, gateway_options opt)
    : impl_(std::make_shared<impl>(sys, std::move(door), std::move(opt))) {}

gateway::~gateway() {
  stop();
}

bool gateway::bind(std::string& why) {
  auto& d = *impl_;
  error_code ec;
  auto addr = net::ip::make_address(d.opt.host, ec);
  if (ec) {
    why = "cannot listen on " + d.opt.host + ": not an IP address";
    return false;
  }
  const tcp::endpoint ep(addr, static_cast<unsigned short>(d.opt.port));
  // SO_REUSEADDR (Asio's default) lets a restart bind at once past
  // TIME_WAIT; without SO_REUSEPORT a port another process listens on is
  // refused instead of shared.
  d.acceptor.open(ep.protocol(), ec);
  if (!ec) d.acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) d.acceptor.bind(ep, ec);
  if (!ec) d.acceptor.listen(SOMAXCONN, ec);
  if (ec) {
    why = "cannot listen on " + d.opt.host + ":" + std::to_string(d.opt.port) + ": " +
          (ec == net::error::address_in_use
               ? std::string("the port is in use (another troupe serve?)")
               : ec.message());
    error_code ignored;
    d.acceptor.close(ignored);
    return false;
  }
  d.bound_port = d.acceptor.local_endpoint().port();
  raise_file_limit(d.opt.max_connections);
  return true;
}

int gateway::port() const {
  return impl_->bound_port;
}

gateway::load gateway::current() const {
  return {impl_->connections.load(), impl_->streams.load()};
}

void gateway::serve() {
  auto& d = *impl_;
  if (d.stopping || !d.acceptor.is_open()) return;
  d.serving = true;
  auto work = net::make_work_guard(*d.ctx);
  net::co_spawn(*d.ctx, d.accept_loop(), net::detached);
  net::co_spawn(*d.ctx, d.watch_head(), net::detached);
  std::vector<std::thread> threads;
  for (int i = 1; i < std::max(1, d.opt.io_threads); ++i)
    threads.emplace_back([&d] { d.ctx->run(); });
  d.ctx->run();
  for (auto& t : threads) t.join();
  d.serving = false;
}

void gateway::stop() {
  if (!impl_) return;
  auto& d = *impl_;
  if (d.stopping.exchange(true)) return;
  // No new connections; every open one ends what it runs (streams get an
  // error chunk and [DONE], their requests are cancelled) and closes.
  net::post(*d.ctx, [&d] {
    error_code ec;
    d.acceptor.close(ec);
  });
  {
    std::lock_guard lock(d.conns_mtx);
    for (auto& [key, w] : d.conns)
      if (auto c = w.lock())
        net::post(c->strand, [c] {
          c->draining = true;
          c->wake.cancel();
          if (!c->busy && c->stream) c->stream->cancel();  // an idle keep-alive read
        });
  }
  const auto until = steady::now() + d.opt.drain;
  while (d.serving && d.connections.load() > 0 && steady::now() < until)
    std::this_thread::sleep_for(10ms);
  d.ctx->stop();
  while (d.serving) std::this_thread::sleep_for(5ms);
  // What outlived the drain is cut, and its coroutines unwind here (a
  // suspended one would hold its connection, and the io_context, forever).
  d.ctx->restart();
  {
    std::lock_guard lock(d.conns_mtx);
    for (auto& [key, w] : d.conns)
      if (auto c = w.lock())
        net::post(c->strand, [c] {
          c->draining = c->peer_closed = true;
          c->wake.cancel();
          if (c->stream) c->stream->close();
        });
  }
  d.ctx->run_for(std::chrono::seconds(2));
  std::lock_guard lock(d.reconnector_mtx);
  if (d.reconnector.joinable()) d.reconnector.join();
}

}  // namespace troupe::serve
