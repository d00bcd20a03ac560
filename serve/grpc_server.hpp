#pragma once

// troupe's gRPC request layer (proto/troupe_generate.proto): Generate
// (unary), GenerateStream (server streaming) and GenerateFromChunks
// (bidirectional: the prompt arrives in chunks, tokens stream back), with
// grpc.health.v1. Requests are checked by the same parsers and limits as
// the HTTP gateway's, and need the same API key (metadata `authorization:
// Bearer KEY`). grpc++ from Debian (1.51), its synchronous server: a call
// in progress holds one of at most `max_threads` threads; past them a call
// gets RESOURCE_EXHAUSTED.

#include <memory>
#include <string>

#include "actors/client.hpp"
#include "serve/openai.hpp"

namespace troupe::serve {

struct grpc_options {
  std::string host = "127.0.0.1";
  int port = 0;  ///< 0: any free port (port() says which)
  std::string api_key;
  std::string model_name = "troupe";
  request_limits limits;
  std::size_t max_message_bytes = 64u << 20;
  int max_threads = 256;
};

class grpc_server {
 public:
  /// Serves jobs through `jobs` (a client of the head's door).
  grpc_server(std::shared_ptr<actors::client> jobs, grpc_options opt);
  ~grpc_server();
  grpc_server(const grpc_server&) = delete;
  grpc_server& operator=(const grpc_server&) = delete;

  /// Binds and starts serving (false with the reason when it cannot).
  bool start(std::string& why);
  int port() const;
  /// Ends every call and stops.
  void stop();

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::serve
