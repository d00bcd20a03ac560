#include "actors/core/errors.hpp"

namespace troupe::actors::core {

const char* to_string(error_code c) {
  switch (c) {
    case error_code::overloaded:
      return "overloaded";
    case error_code::duplicate_id:
      return "duplicate request id";
    case error_code::invalid_request:
      return "invalid request";
    case error_code::not_found:
      return "not found";
    case error_code::cancelled:
      return "cancelled";
    case error_code::deadline_exceeded:
      return "deadline exceeded";
    case error_code::kv_exhausted:
      return "KV cache exhausted";
    case error_code::stage_failed:
      return "stage failed";
    case error_code::version_mismatch:
      return "protocol version mismatch";
    case error_code::internal:
      return "internal error";
    case error_code::peer_lost:
      return "peer lost";
    case error_code::unavailable:
      return "unavailable";
    case error_code::not_the_head:
      return "not the head";
    case error_code::context_length:
      return "context length exceeded";
  }
  return "unknown error";
}

const char* to_string(finish_reason r) {
  switch (r) {
    case finish_reason::stop:
      return "stop";
    case finish_reason::length:
      return "length";
    case finish_reason::cancelled:
      return "cancelled";
    case finish_reason::deadline:
      return "deadline";
    case finish_reason::error:
      return "error";
  }
  return "unknown";
}

}  // namespace troupe::actors::core
