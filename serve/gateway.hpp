#pragma once

// The OpenAI-compatible HTTP gateway (`troupe serve`): a client of the
// cluster's head (its client certificate, the head's door) that serves
// /v1/chat/completions, /v1/completions, /v1/models, /live, /ready and
// /metrics over HTTP (cpp-httplib), on loopback unless told otherwise.

#include <memory>
#include <string>

#include "actors/protocol.hpp"
#include "serve/fetch.hpp"
#include "serve/openai.hpp"

namespace troupe::serve {

struct gateway_options {
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string api_key;  ///< empty: no key needed
  std::string model_name = "troupe";
  std::size_t max_body_bytes = 64u << 20;
  request_limits limits;                     ///< limits.remote_images: fetch http(s) image URLs
  fetch_options fetch;                       ///< how they are fetched
  std::size_t max_headers = 64;              ///< more request headers: 431
  std::size_t max_header_bytes = 32u << 10;  ///< all header names and values together: 431
  int threads = 16;                          ///< HTTP worker threads (each stream holds one)
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
  void stop();

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::serve
