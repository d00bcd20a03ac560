#pragma once

#include <cstdint>
#include <vector>

namespace troupe::actors::core {

/// Scheduler counters.
struct scheduler_stats {
  std::int64_t queued = 0;
  std::int64_t running = 0;
  std::int64_t accepted = 0;
  std::int64_t rejected = 0;
  std::int64_t finished = 0;
  std::int64_t preemptions = 0;
  std::int64_t steps = 0;
  std::int64_t kv_total_blocks = 0;
  std::int64_t kv_used_blocks = 0;
  std::int64_t kv_peak_blocks = 0;
  std::int64_t prompt_tokens = 0;     ///< of finished requests
  std::int64_t generated_tokens = 0;  ///< of finished requests
  std::int64_t tokens_out = 0;        ///< every token streamed so far, finished or not
  // Prefix caching (vLLM's prefix_cache_queries / prefix_cache_hits: tokens).
  std::int64_t prefix_queries = 0;    ///< tokens of the prompts admitted
  std::int64_t prefix_hits = 0;       ///< of those, tokens whose KV came from the cache
  std::int64_t kv_cached_blocks = 0;  ///< named blocks now (held or not)
  std::int64_t kv_cached_free = 0;    ///< named blocks nobody holds (evictable, count as free)
  std::int64_t kv_evictions = 0;      ///< cached blocks evicted for a booking
  // KV tiers (blocks; bytes = blocks * kv_slot_bytes).
  std::int64_t kv_host_blocks = 0;       ///< host tier slots
  std::int64_t kv_host_used = 0;         ///< ... holding a block
  std::int64_t kv_disk_blocks = 0;       ///< disk tier slots
  std::int64_t kv_disk_used = 0;         ///< ... holding a block
  std::int64_t kv_to_host = 0;           ///< blocks moved device -> host
  std::int64_t kv_from_host = 0;         ///< host -> device
  std::int64_t kv_to_disk = 0;           ///< device or host -> disk
  std::int64_t kv_from_disk = 0;         ///< disk -> device
  std::int64_t kv_dropped = 0;           ///< cached blocks lost past the lowest tier
  std::int64_t kv_remote_blocks = 0;     ///< remote tier slots (a store on another node)
  std::int64_t kv_remote_used = 0;       ///< ... holding a confirmed copy
  std::int64_t kv_remote_pending = 0;    ///< ... a copy on its way
  std::int64_t kv_to_remote = 0;         ///< blocks copied device -> remote
  std::int64_t kv_from_remote = 0;       ///< remote -> device
  std::int64_t kv_remote_confirmed = 0;  ///< copies the store confirmed
  std::int64_t kv_slot_bytes = 0;        ///< bytes of one block over every stage
  /// Tokens whose KV a request had and lost (a preemption, a reset) and
  /// computed again; restored ones came back from the cache or a tier.
  std::int64_t recomputed_tokens = 0;
  std::int64_t restored_tokens = 0;
  std::int64_t images = 0;            ///< media items (images, videos, clips) of admitted requests
  std::int64_t image_cache_hits = 0;  ///< of those, taken from the encoder cache
  // The encoders' load as this scheduler sees it (the head scales the
  // encoder service from these).
  std::int64_t encode_waiting = 0;  ///< items sent to an encoder, not yet answered
  std::int64_t encodes = 0;         ///< items answered so far
  double encode_wait_ms = 0;        ///< their waits (sent until answered), summed
  // The audio clips among them (the audio tower's own queue).
  std::int64_t clips = 0;            ///< clips of admitted requests
  std::int64_t clip_cache_hits = 0;  ///< of those, taken from the encoder cache
  std::int64_t clips_waiting = 0;    ///< clips sent to an encoder, not yet answered
  std::int64_t clip_encodes = 0;     ///< clips answered so far
  double clip_encode_wait_ms = 0;    ///< their waits, summed
  // The videos among them (each one item: its frames go to the encoder
  // together).
  std::int64_t videos = 0;            ///< videos of admitted requests
  std::int64_t video_cache_hits = 0;  ///< of those, taken from the encoder cache
  std::int64_t videos_waiting = 0;    ///< videos sent to an encoder, not yet answered
  std::int64_t video_encodes = 0;     ///< videos answered so far
  double video_encode_wait_ms = 0;    ///< their waits, summed
  // Where the pipeline's time goes (cumulative; actors/pipeline_stats.hpp
  // turns two samples into a breakdown).
  std::int64_t stages = 0;     ///< stages in the pipeline now
  std::int64_t step_rows = 0;  ///< tokens put through the stages: prompt chunks and decode passes
  double round_trip_ms = 0;    ///< over steps: sent to the first stage until its output is back
  double compute_ms = 0;       ///< over steps: the stages' compute, summed over the stages
  std::vector<double> stage_compute_ms;  ///< the same per stage (index = position in the pipeline)
  double in_flight_ms = 0;               ///< wall time with at least one step in flight
  double scheduler_ms = 0;  ///< the scheduler's own work: building steps, handling outputs
  bool operator==(const scheduler_stats&) const = default;

  /// Adds another pipeline's counters (the cluster's are its replicas'
  /// sum). kv_slot_bytes is one block's, alike in every replica; stage
  /// times add up position by position.
  scheduler_stats& operator+=(const scheduler_stats& o);
};

}  // namespace troupe::actors::core
