// The actor system configuration every actors test uses.
#pragma once

#include <gtest/gtest.h>
#include <caf/all.hpp>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "actors/client.hpp"
#include "actors/protocol.hpp"

namespace troupe::test {

/// A config with troupe's protocol registered, built once per process.
inline caf::actor_system_config& actor_config() {
  static caf::actor_system_config cfg = [] {
    caf::actor_system_config c;
    actors::register_protocol(c);
    return c;
  }();
  return cfg;
}

/// A scheduler that accepts every request and never answers it, and
/// hands every store confirmation (vault_ok_atom) to `on_vault_ok`.
inline actors::scheduler_actor idle_scheduler(
    caf::actor_system& sys, std::function<void(const actors::vault_blocks&)> on_vault_ok = {}) {
  using namespace actors;
  return sys.spawn([on_vault_ok]() -> scheduler_actor::behavior_type {
    return {
        [](submit_atom, generate_request& r, client_sink_actor&) {
          return submit_ack{r.id, 0, 0};
        },
        [](cancel_atom, std::uint64_t) { return false; },
        [](chunk_atom, audio_chunk&) -> caf::result<stream_progress> {
          return make_error(error_code::not_found, "no stream here");
        },
        [](chunk_atom, std::uint64_t) {},
        [](stats_atom) { return scheduler_stats{}; },
        [](live_atom) { return std::vector<std::uint64_t>{}; },
        [](version_atom) { return protocol_version; },
        [](tick_atom) {},
        [](reset_cache_atom) { return std::int64_t{0}; },
        [](kv_events_atom, std::uint64_t) { return kv_events{}; },
        [](vault_atom, kv_vault_actor&, std::vector<std::uint8_t>&) {},
        [on_vault_ok](vault_ok_atom, const vault_blocks& b) {
          if (on_vault_ok) on_vault_ok(b);
        },
        [](pipeline_atom, std::vector<shard_actor>&, std::vector<kv_store_actor>&) {},
        [](encoder_atom, encoder_actor&) {},
        [](encoders_atom, std::vector<encoder_actor>&, std::vector<encoder_actor>&) {
          return std::int64_t{0};
        },
        [](handover_atom, encoder_actor&, encoder_actor&, bool) { return true; },
        [](pause_atom) { return std::int64_t{0}; },
        [](reroute_atom, std::int32_t, shard_actor&, kv_store_actor&) {},
        [](resume_atom) {},
    };
  });
}

/// Submits every request at once through `c` and waits (15 minutes at
/// most) for the finish of each accepted one: the finishes in the
/// requests' order (an empty one for a request refused or unfinished).
inline std::vector<actors::finish_event> run_all(
    actors::client& c, const std::vector<actors::generate_request>& reqs) {
  std::mutex m;
  std::condition_variable cv;
  std::map<std::uint64_t, actors::finish_event> done;
  std::size_t accepted = 0;
  for (const auto& r : reqs) {
    actors::client::callbacks cb;
    cb.on_finish = [&](const actors::finish_event& f) {
      std::lock_guard lock(m);
      done.emplace(f.id, f);
      cv.notify_all();
    };
    auto ack = c.submit(r, cb);
    EXPECT_TRUE(ack) << (ack ? "" : ack.error().message);
    if (ack) ++accepted;
  }
  std::unique_lock lock(m);
  cv.wait_for(lock, std::chrono::minutes(15), [&] { return done.size() == accepted; });
  std::vector<actors::finish_event> out;
  for (const auto& r : reqs) out.push_back(done.count(r.id) ? done[r.id] : actors::finish_event{});
  return out;
}

}  // namespace troupe::test
