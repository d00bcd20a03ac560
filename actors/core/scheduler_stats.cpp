#include <algorithm>

#include "actors/core/scheduler_stats.hpp"

namespace troupe::actors::core {

scheduler_stats& scheduler_stats::operator+=(const scheduler_stats& o) {
  queued += o.queued;
  running += o.running;
  accepted += o.accepted;
  rejected += o.rejected;
  finished += o.finished;
  preemptions += o.preemptions;
  steps += o.steps;
  kv_total_blocks += o.kv_total_blocks;
  kv_used_blocks += o.kv_used_blocks;
  kv_peak_blocks += o.kv_peak_blocks;
  prompt_tokens += o.prompt_tokens;
  generated_tokens += o.generated_tokens;
  tokens_out += o.tokens_out;
  prefix_queries += o.prefix_queries;
  prefix_hits += o.prefix_hits;
  kv_cached_blocks += o.kv_cached_blocks;
  kv_cached_free += o.kv_cached_free;
  kv_evictions += o.kv_evictions;
  kv_host_blocks += o.kv_host_blocks;
  kv_host_used += o.kv_host_used;
  kv_disk_blocks += o.kv_disk_blocks;
  kv_disk_used += o.kv_disk_used;
  kv_to_host += o.kv_to_host;
  kv_from_host += o.kv_from_host;
  kv_to_disk += o.kv_to_disk;
  kv_from_disk += o.kv_from_disk;
  kv_dropped += o.kv_dropped;
  kv_remote_blocks += o.kv_remote_blocks;
  kv_remote_used += o.kv_remote_used;
  kv_remote_pending += o.kv_remote_pending;
  kv_to_remote += o.kv_to_remote;
  kv_from_remote += o.kv_from_remote;
  kv_remote_confirmed += o.kv_remote_confirmed;
  kv_slot_bytes = std::max(kv_slot_bytes, o.kv_slot_bytes);
  recomputed_tokens += o.recomputed_tokens;
  restored_tokens += o.restored_tokens;
  images += o.images;
  image_cache_hits += o.image_cache_hits;
  encode_waiting += o.encode_waiting;
  encodes += o.encodes;
  encode_wait_ms += o.encode_wait_ms;
  clips += o.clips;
  clip_cache_hits += o.clip_cache_hits;
  clips_waiting += o.clips_waiting;
  clip_encodes += o.clip_encodes;
  clip_encode_wait_ms += o.clip_encode_wait_ms;
  videos += o.videos;
  video_cache_hits += o.video_cache_hits;
  videos_waiting += o.videos_waiting;
  video_encodes += o.video_encodes;
  video_encode_wait_ms += o.video_encode_wait_ms;
  stages += o.stages;
  step_rows += o.step_rows;
  round_trip_ms += o.round_trip_ms;
  compute_ms += o.compute_ms;
  in_flight_ms += o.in_flight_ms;
  scheduler_ms += o.scheduler_ms;
  if (stage_compute_ms.size() < o.stage_compute_ms.size())
    stage_compute_ms.resize(o.stage_compute_ms.size());
  for (std::size_t i = 0; i < o.stage_compute_ms.size(); ++i)
    stage_compute_ms[i] += o.stage_compute_ms[i];
  return *this;
}

}  // namespace troupe::actors::core
