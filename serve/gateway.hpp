#pragma once

// The OpenAI-compatible HTTP gateway (`troupe serve`): a client of the
// cluster's head (its client certificate, the head's door) that serves
// /v1/chat/completions, /v1/completions, /v1/models, /health, /live, /ready,
// /version and /metrics over HTTP/1.1, on loopback unless told otherwise.
//
// Asynchronous (Boost.Beast over Asio, C++20 coroutines): a connection or
// a stream costs a coroutine frame and its buffers, not a thread. A few I/O
// threads run every connection; nothing on them blocks. What blocks (the
// head's status, the canary decode, fetching a remote image, parsing a
// large body) runs on a small separate pool. Jobs go to the head without
// waiting (actors::client::submit_async); their tokens come back on actor
// threads and wake the connection's coroutine on its strand.

#include <chrono>
#include <expected>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/protocol.hpp"
#include "serve/fetch.hpp"
#include "serve/openai.hpp"

namespace troupe::serve {

struct gateway_options {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;  ///< empty: no key needed
  std::string model_name = "troupe";
  std::string version;  ///< /version and the Server header
  std::size_t max_body_bytes = 64u << 20;
  request_limits limits;                     ///< limits.remote_images: fetch http(s) image URLs
  fetch_options fetch;                       ///< how they are fetched
  std::size_t max_headers = 64;              ///< more request headers: 431
  std::size_t max_header_bytes = 32u << 10;  ///< the whole header block: 431
  int io_threads = 2;        ///< threads that run every connection (none of them blocks)
  int blocking_threads = 4;  ///< status queries, the canary, image fetches, body parsing
  /// Connections open at once; one more is answered 503 and closed. The
  /// gateway raises its open-file limit to fit (as far as the hard limit
  /// allows).
  std::size_t max_connections = 8192;
  /// Of them, from one client address at most (0: no limit); one more is
  /// answered 503 and closed.
  std::size_t max_connections_per_client = 2048;
  std::chrono::seconds keep_alive{5};   ///< an idle connection closes after this
  std::chrono::seconds io_timeout{30};  ///< to read a request, or write a response part
  std::chrono::seconds sse_ping{15};    ///< a quiet stream gets a comment line this often
  std::chrono::milliseconds submit_timeout{10000};  ///< no answer from the head: 503
  std::chrono::seconds drain{10};  ///< stop(): streams end, then connections are cut
  /// Origins allowed to call the API from a browser ("*": any); empty: no
  /// CORS headers.
  std::vector<std::string> cors_origins;
  /// A new door when the head went away (a client of it reconnects); empty:
  /// the gateway answers 503 until it is restarted.
  std::function<std::expected<actors::frontdoor_actor, std::string>()> reconnect;
  std::chrono::milliseconds reconnect_every{2000};
  /// With a standby head: when the head goes away, open streams wait for
  /// `reconnect` to find the head that took over and go on there
  /// (actors::client::failover), for up to this long; 0: they end.
  std::chrono::milliseconds failover_window{0};
  bool access_log = true;  ///< one line per request (method, path, status, tokens, ms, id)
};

class gateway {
 public:
  gateway(caf::actor_system& sys, actors::frontdoor_actor door, gateway_options opt);
  ~gateway();
  gateway(const gateway&) = delete;
  gateway& operator=(const gateway&) = delete;

  /// Binds (false with the reason in `why` when it cannot).
  bool bind(std::string& why);
  /// The bound port.
  int port() const;
  /// Serves until stop() (blocks).
  void serve();
  /// Stops accepting, ends every stream with an error chunk and [DONE]
  /// (their requests are cancelled on the cluster), answers waiting
  /// requests 503, and returns once every connection closed or the drain
  /// time passed. serve() returns then.
  void stop();

  /// What is open now (for tests and /metrics).
  struct load {
    std::int64_t connections = 0;
    std::int64_t streams = 0;  ///< requests waiting for their job's tokens
  };
  load current() const;

  struct impl;

 private:
  std::shared_ptr<impl> impl_;
};

}  // namespace troupe::serve
