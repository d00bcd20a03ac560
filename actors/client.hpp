#pragma once

// The one client of troupe's actors: submit, stream, cancel, for a
// scheduler in this process (`troupe generate`, `troupe bench`) and for a
// cluster's door (`troupe submit`, the HTTP gateway) alike. Events arrive
// on the client's own actor thread through the callbacks given at submit.
// The client watches its target: when the scheduler or the head goes away,
// every request still open ends at once with an `unavailable` error
// (nothing waits forever), and later submits are refused.

#include <chrono>
#include <cstdint>
#include <expected>
#include <functional>
#include <memory>
#include <string>
#include <variant>

#include "actors/protocol.hpp"

namespace troupe::actors {

class client {
 public:
  struct callbacks {
    std::function<void(const token_event&)> on_token;
    /// Called exactly once per accepted request.
    std::function<void(const finish_event&)> on_finish;
  };
  /// Why a request was not accepted: its code (overloaded, unavailable,
  /// invalid request, ...) and the readable message.
  struct rejection {
    error_code code = error_code::internal;
    std::string message;
  };

  /// A cluster with a standby head: when the door goes away, the client
  /// looks for a door again (`reconnect`: the head, else its standby) for
  /// up to `window`, and asks it to go on with each open job from the
  /// tokens already received (attach_atom). Its callbacks see one stream:
  /// no token twice, none missing. Events from any other head are
  /// ignored after that. Without a door by then, open jobs end as
  /// `unavailable`.
  struct failover {
    std::function<std::expected<frontdoor_actor, std::string>()> reconnect;
    std::chrono::milliseconds window{30000};
    std::chrono::milliseconds retry_every{250};
  };

  client(caf::actor_system& sys, scheduler_actor scheduler);
  client(caf::actor_system& sys, frontdoor_actor door);
  client(caf::actor_system& sys, frontdoor_actor door, failover fo);
  ~client();
  client(const client&) = delete;
  client& operator=(const client&) = delete;

  /// Submits a request to a scheduler (its id must be unique: next_id()).
  std::expected<submit_ack, rejection> submit(generate_request req, callbacks cb);
  /// Submits a job to a cluster's door (id: random_job_id()).
  std::expected<submit_ack, rejection> submit(job_request job, callbacks cb);
  /// Submits and blocks until the request ends (tokens go to `on_token`).
  std::expected<finish_event, rejection> run(generate_request req,
                                             std::function<void(const token_event&)> on_token = {});
  std::expected<finish_event, rejection> run(job_request job,
                                             std::function<void(const token_event&)> on_token = {});
  /// Submits a job to a cluster's door without waiting: `done` gets the
  /// door's answer, or `unavailable` when none comes within `timeout` (the
  /// job is then cancelled, in case the answer was only late). `done` and
  /// the callbacks run on actor threads, never in this call.
  using submitted = std::function<void(std::expected<submit_ack, rejection>)>;
  void submit_async(job_request job, callbacks cb, submitted done,
                    std::chrono::milliseconds timeout);
  /// Sends a piece of request `id`'s streamed audio clip (mono 16 kHz,
  /// signed 16-bit little-endian samples; `last` ends the clip) and waits
  /// until the windows it completes are encoded (at most `timeout`): how
  /// much of the clip the model has then, or why not (the request then
  /// fails too, with the same reason).
  std::expected<stream_progress, rejection> send_audio(
      std::uint64_t id, std::vector<std::uint8_t> pcm, bool last,
      std::chrono::milliseconds timeout = std::chrono::seconds(60));
  /// send_audio without waiting: `done` gets the answer (on an actor
  /// thread, never in this call).
  using audio_sent = std::function<void(std::expected<stream_progress, rejection>)>;
  void send_audio_async(std::uint64_t id, std::vector<std::uint8_t> pcm, bool last, audio_sent done,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60));
  /// Cancels a request; false when it is unknown or already finished.
  bool cancel(std::uint64_t id);
  /// Cancels without waiting for the answer.
  void cancel_async(std::uint64_t id);
  /// The target went away (every later submit is refused): why, or empty.
  std::string gone() const;
  /// The scheduler's counters (a scheduler target only; empty otherwise).
  scheduler_stats stats();
  /// The door jobs go to now (a failover replaces it; invalid for a scheduler).
  frontdoor_actor door() const;
  /// Jobs carried over to another head so far (failover), and failovers.
  std::int64_t reattached() const;
  std::int64_t failovers() const;

  /// A fresh request id (unique within this process).
  static std::uint64_t next_id();

  struct shared;  ///< callbacks by request id, shared with the sink actor

 private:
  template <class Request>
  std::expected<submit_ack, rejection> submit_to(Request req, callbacks cb);
  template <class Request>
  std::expected<finish_event, rejection> run_to(Request req,
                                                std::function<void(const token_event&)> on_token);

  /// The door now (a failover replaces it), or the scheduler.
  std::variant<scheduler_actor, frontdoor_actor> target() const;

  caf::actor_system& sys_;
  std::variant<scheduler_actor, frontdoor_actor> target_;
  std::shared_ptr<shared> shared_;
  client_sink_actor sink_;
};

/// A random job id (a cluster's scheduler refuses a duplicate).
std::uint64_t random_job_id();

}  // namespace troupe::actors
