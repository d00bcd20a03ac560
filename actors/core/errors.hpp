#pragma once

// The codes that cross layer boundaries instead of message text: why a
// request was refused or failed (error_code: a caf::error's code at the
// actor boundary, an HTTP status at the gateway) and why it ended
// (finish_reason). Plain enums, no CAF: the pure cores use them too.

#include <cstdint>
#include <ostream>
#include <string>

namespace troupe::actors::core {

/// Error codes of troupe's actors (category atom "troupe").
enum class error_code : std::uint8_t {
  overloaded = 1,   ///< the admission queue is full; retry later
  duplicate_id,     ///< a request id that was already used
  invalid_request,  ///< bad prompt, image or sampling parameters
  not_found,        ///< no such request / sequence
  cancelled,
  deadline_exceeded,
  kv_exhausted,  ///< a request that can never fit in the KV cache
  stage_failed,  ///< a pipeline stage failed (its message says why)
  version_mismatch,
  internal,
  peer_lost,  ///< a stage's peer process is gone mid-step: the step may run again once the pipeline
              ///< is restored
  unavailable,     ///< the cluster is not serving now (placing the model, or shutting down)
  not_the_head,    ///< a node refused an order: another head (a higher term) holds it
  context_length,  ///< prompt plus max_tokens past the model's context length
};
const char* to_string(error_code c);

/// Why a request ended. The wire carries the number; `to_string` gives
/// OpenAI's and the CLI's word ("stop", "length", ...).
enum class finish_reason : std::uint8_t {
  stop = 0,   ///< a stop token or stop string
  length,     ///< max_tokens generated
  cancelled,  ///< the client cancelled it
  deadline,   ///< its deadline passed
  error,      ///< it failed: finish_event::error says why
};
const char* to_string(finish_reason r);

inline std::ostream& operator<<(std::ostream& os, error_code c) {
  return os << to_string(c);
}
inline std::ostream& operator<<(std::ostream& os, finish_reason r) {
  return os << to_string(r);
}

/// A refusal or failure from a core: the code decides what a caller does,
/// the message says to a person what was wrong.
struct core_error {
  error_code code = error_code::internal;
  std::string message;
};

}  // namespace troupe::actors::core
