#include "serve/metrics.hpp"

#include <cstdio>
#include <tuple>

namespace troupe::serve {

namespace {
std::string num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}
std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '\\' || c == '"') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o;
}
void head(std::string& out, const std::string& name, const char* type, const char* help) {
  out += "# HELP " + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
}

/// One media kind's own encoder queue (audio clips, videos): the metric
/// names and the nouns of its help texts.
struct media_queue_names {
  const char* items;    ///< admitted, a counter
  const char* prefix;   ///< of cache_hits_total, encodes_total, encode_wait_seconds_total
  const char* waiting;  ///< a gauge
  const char* what;     ///< "Audio clips"
  const char* noun;     ///< "clips"
};

void media_queue(std::string& out, const std::string& label, const media_queue_names& n,
                 std::int64_t items, std::int64_t hits, std::int64_t waiting, std::int64_t encodes,
                 double wait_ms) {
  const std::string p = std::string("troupe:") + n.prefix;
  const auto line = [&](const std::string& name, const std::string& value) {
    out += name + "{" + label + "} " + value + "\n";
  };
  head(out, std::string("troupe:") + n.items, "counter",
       (std::string(n.what) + " of admitted requests.").c_str());
  line(std::string("troupe:") + n.items, std::to_string(items));
  head(out, p + "_cache_hits_total", "counter",
       ("Of those, " + std::string(n.noun) + " whose rows came from the encoder cache.").c_str());
  line(p + "_cache_hits_total", std::to_string(hits));
  head(out, std::string("troupe:") + n.waiting, "gauge",
       (std::string(n.what) + " sent to an encoder and not yet answered (at the head's last "
                              "heartbeat).")
           .c_str());
  line(std::string("troupe:") + n.waiting, std::to_string(waiting));
  head(out, p + "_encodes_total", "counter",
       (std::string(n.what) + " the encoders answered.").c_str());
  line(p + "_encodes_total", std::to_string(encodes));
  head(out, p + "_encode_wait_seconds_total", "counter",
       ("Their waits, sent to answered, summed (divide by " + std::string(n.prefix) +
        "_encodes_total for the mean).")
           .c_str());
  line(p + "_encode_wait_seconds_total", std::to_string(wait_ms / 1e3));
}
}  // namespace

void histogram::observe(double v) {
  std::size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

void histogram::render(std::string& out, const std::string& name, const std::string& labels) const {
  const std::string pre = labels.empty() ? "" : labels + ",";
  const std::string own = labels.empty() ? "" : "{" + labels + "}";
  std::uint64_t cum = 0;
  for (std::size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out +=
        name + "_bucket{" + pre + "le=\"" + num(bounds_[i]) + "\"} " + std::to_string(cum) + "\n";
  }
  cum += counts_.back();
  out += name + "_bucket{" + pre + "le=\"+Inf\"} " + std::to_string(cum) + "\n";
  out += name + "_sum" + own + " " + num(sum_) + "\n" + name + "_count" + own + " " +
         std::to_string(count_) + "\n";
}

namespace {
const std::vector<double> token_bounds = {1,   2,    5,    10,   20,    50,    100,   200,
                                          500, 1000, 2000, 5000, 10000, 20000, 50000, 100000};
const std::vector<double> request_seconds = {0.3,  0.5,  0.8,  1.0,   1.5,   2.0,
                                             2.5,  5.0,  10.0, 15.0,  20.0,  30.0,
                                             40.0, 50.0, 60.0, 120.0, 240.0, 480.0};
}  // namespace

metrics::metrics(std::string model_name)
    : label_("model_name=\"" + escape(model_name) + "\""),
      ttft_({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
             10.0, 20.0, 40.0, 80.0}),
      itl_({0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
            5.0, 7.5, 10.0, 20.0}),
      e2e_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
            240.0, 480.0}),
      queue_({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0}),
      prompt_hist_(token_bounds),
      generation_hist_(token_bounds),
      prefill_(request_seconds),
      decode_(request_seconds),
      inference_(request_seconds) {}

void metrics::finished(const actors::finish_event& f, const std::vector<double>& gaps) {
  std::lock_guard lock(mtx_);
  // A request that failed is not a success (vLLM's request_success_total
  // counts finished requests by their reason; an error is not one).
  if (f.reason == actors::finish_reason::error)
    ++failures_[actors::to_string(f.code)];
  else
    ++success_[actors::to_string(f.reason)];
  prompt_tokens_ += static_cast<std::uint64_t>(std::max<std::int64_t>(0, f.prompt_tokens));
  generation_tokens_ += f.tokens.size();
  preemptions_ += static_cast<std::uint64_t>(std::max<std::int64_t>(0, f.preemptions));
  if (!f.tokens.empty()) ttft_.observe(f.ttft_ms / 1e3);
  for (double g : gaps) itl_.observe(g);
  e2e_.observe(f.total_ms / 1e3);
  queue_.observe(f.queue_ms / 1e3);
  if (f.reason == actors::finish_reason::error) return;
  prompt_hist_.observe(static_cast<double>(std::max<std::int64_t>(0, f.prompt_tokens)));
  generation_hist_.observe(static_cast<double>(f.tokens.size()));
  // vLLM's phases: admission to first token, first token to end, and both.
  inference_.observe(std::max(0.0, f.total_ms - f.queue_ms) / 1e3);
  if (!f.tokens.empty()) {
    prefill_.observe(std::max(0.0, f.ttft_ms - f.queue_ms) / 1e3);
    decode_.observe(std::max(0.0, f.total_ms - f.ttft_ms) / 1e3);
  }
}

void metrics::failed_http(int status) {
  std::lock_guard lock(mtx_);
  ++http_errors_[status];
}

void metrics::responded(int status) {
  std::lock_guard lock(mtx_);
  ++responses_[status];
}

std::string metrics::render(const actors::cluster_status* s) const {
  std::string out;
  std::lock_guard lock(mtx_);
  if (s) {
    head(out, "troupe:num_requests_running", "gauge", "Requests running on the cluster (with KV).");
    out += "troupe:num_requests_running{" + label_ + "} " + std::to_string(s->scheduler.running) +
           "\n";
    head(out, "troupe:num_requests_waiting", "gauge", "Requests waiting for admission.");
    out +=
        "troupe:num_requests_waiting{" + label_ + "} " + std::to_string(s->scheduler.queued) + "\n";
    std::int64_t used = 0, total = 0;
    for (const auto& n : s->nodes) {
      used += n.report.kv_used_blocks;
      total += n.report.kv_total_blocks;
    }
    head(out, "troupe:kv_cache_usage_perc", "gauge",
         "KV cache blocks in use over all stages, 0 to 1.");
    out += "troupe:kv_cache_usage_perc{" + label_ + "} " +
           num(total > 0 ? static_cast<double>(used) / static_cast<double>(total) : 0.0) + "\n";
    head(out, "troupe:prefix_cache_queries_total", "counter",
         "Prompt tokens looked up in the prefix cache (at each admission).");
    out += "troupe:prefix_cache_queries_total{" + label_ + "} " +
           std::to_string(s->scheduler.prefix_queries) + "\n";
    head(out, "troupe:prefix_cache_hits_total", "counter",
         "Of those, tokens whose KV came from the prefix cache.");
    out += "troupe:prefix_cache_hits_total{" + label_ + "} " +
           std::to_string(s->scheduler.prefix_hits) + "\n";
    head(out, "troupe:kv_cached_blocks", "gauge",
         "KV blocks with a prefix-cache name (per stage), held by a request or not.");
    out += "troupe:kv_cached_blocks{" + label_ + "} " +
           std::to_string(s->scheduler.kv_cached_blocks) + "\n";
    head(out, "troupe:kv_cached_free_blocks", "gauge",
         "Cached KV blocks no request holds (evictable; they count as free).");
    out += "troupe:kv_cached_free_blocks{" + label_ + "} " +
           std::to_string(s->scheduler.kv_cached_free) + "\n";
    head(out, "troupe:prefix_cache_evictions_total", "counter",
         "Cached KV blocks evicted (least recently used) to make room.");
    out += "troupe:prefix_cache_evictions_total{" + label_ + "} " +
           std::to_string(s->scheduler.kv_evictions) + "\n";
    // KV tiers: slots and use per tier, blocks and bytes moved between
    // tiers, tokens a preemption or reset lost (restored or recomputed).
    const auto& q = s->scheduler;
    head(out, "troupe:kv_tier_blocks", "gauge",
         "Slots of each KV tier (per stage; device: the compute pool).");
    head(out, "troupe:kv_tier_used_blocks", "gauge", "Of those, slots holding a block.");
    for (const auto& [tier, slots, used] :
         {std::tuple{"device", q.kv_total_blocks, q.kv_used_blocks + q.kv_cached_free},
          std::tuple{"host", q.kv_host_blocks, q.kv_host_used},
          std::tuple{"disk", q.kv_disk_blocks, q.kv_disk_used},
          std::tuple{"store", q.kv_remote_blocks, q.kv_remote_used}}) {
      const std::string l = "{" + label_ + ",tier=\"" + tier + "\"} ";
      out += "troupe:kv_tier_blocks" + l + std::to_string(slots) + "\n";
      out += "troupe:kv_tier_used_blocks" + l + std::to_string(used) + "\n";
    }
    head(out, "troupe:kv_tier_moved_blocks_total", "counter",
         "KV blocks copied from one tier to another (every stage's part of a block).");
    head(out, "troupe:kv_tier_moved_bytes_total", "counter",
         "Bytes of those copies over every stage.");
    for (const auto& [from, to, n] :
         {std::tuple{"device", "host", q.kv_to_host}, std::tuple{"host", "device", q.kv_from_host},
          std::tuple{"upper", "disk", q.kv_to_disk}, std::tuple{"disk", "device", q.kv_from_disk},
          std::tuple{"device", "store", q.kv_to_remote},
          std::tuple{"store", "device", q.kv_from_remote}}) {
      const std::string l = "{" + label_ + ",from=\"" + from + "\",to=\"" + to + "\"} ";
      out += "troupe:kv_tier_moved_blocks_total" + l + std::to_string(n) + "\n";
      out += "troupe:kv_tier_moved_bytes_total" + l + std::to_string(n * q.kv_slot_bytes) + "\n";
    }
    head(out, "troupe:kv_tier_dropped_blocks_total", "counter",
         "Cached KV blocks evicted past the lowest tier (lost).");
    out += "troupe:kv_tier_dropped_blocks_total{" + label_ + "} " + std::to_string(q.kv_dropped) +
           "\n";
    head(out, "troupe:kv_store_pending_blocks", "gauge",
         "Blocks copied to the KV store whose every layer has not arrived yet.");
    out += "troupe:kv_store_pending_blocks{" + label_ + "} " + std::to_string(q.kv_remote_pending) +
           "\n";
    head(out, "troupe:kv_restored_tokens_total", "counter",
         "Tokens whose KV a preempted or reset request got back from the cache or a tier.");
    out += "troupe:kv_restored_tokens_total{" + label_ + "} " + std::to_string(q.restored_tokens) +
           "\n";
    head(out, "troupe:kv_recomputed_tokens_total", "counter",
         "Tokens whose KV a preempted or reset request lost and computed again.");
    out += "troupe:kv_recomputed_tokens_total{" + label_ + "} " +
           std::to_string(q.recomputed_tokens) + "\n";
    head(out, "troupe:encoder_cache_queries_total", "counter",
         "Images, videos and audio clips of admitted requests (each looked up in the encoder "
         "cache).");
    out += "troupe:encoder_cache_queries_total{" + label_ + "} " +
           std::to_string(s->scheduler.images) + "\n";
    head(out, "troupe:encoder_cache_hits_total", "counter",
         "Of those, items whose rows came from the encoder cache (not encoded again).");
    out += "troupe:encoder_cache_hits_total{" + label_ + "} " +
           std::to_string(s->scheduler.image_cache_hits) + "\n";
    // The audio tower's own queue (the clips among the items above), and
    // the videos' (each one item: its frames are encoded together).
    media_queue(out, label_,
                {"audio_clips_total", "audio", "audio_clips_waiting", "Audio clips", "clips"},
                q.clips, q.clip_cache_hits, q.clips_waiting, q.clip_encodes, q.clip_encode_wait_ms);
    media_queue(out, label_, {"video_items_total", "video", "videos_waiting", "Videos", "videos"},
                q.videos, q.video_cache_hits, q.videos_waiting, q.video_encodes,
                q.video_encode_wait_ms);
    head(out, "troupe:num_preemptions_total", "counter",
         "Requests preempted (recomputed), by the head's scheduler.");
    out += "troupe:num_preemptions_total{" + label_ + "} " +
           std::to_string(s->scheduler.preemptions) + "\n";
    head(out, "troupe:stage_replacements_total", "counter",
         "Times the head placed the model again after losing a node.");
    out += "troupe:stage_replacements_total " + std::to_string(s->replacements) + "\n";
    head(out, "troupe:actor_restarts_total", "counter",
         "Stage actors (shard and KV store pairs) spawned again after a node loss.");
    out += "troupe:actor_restarts_total " + std::to_string(s->actor_restarts) + "\n";
    head(out, "troupe:shard_migrations_total", "counter",
         "Live migrations of a shard or encoder to another node.");
    out += "troupe:shard_migrations_total " + std::to_string(s->migrations) + "\n";
    head(out, "troupe:transfer_bytes_total", "counter",
         "Data-plane bytes sent between node processes, by link (from->to).");
    for (std::size_t i = 0; i < s->links.size() && i < s->link_bytes.size(); ++i)
      out += "troupe:transfer_bytes_total{link=\"" + escape(s->links[i]) + "\"} " +
             std::to_string(s->link_bytes[i]) + "\n";
    head(out, "troupe:replica_up", "gauge",
         "1 while a replica of the model's pipeline is placed and serving, else 0.");
    for (const auto& r : s->replicas)
      out += "troupe:replica_up{replica=\"" + std::to_string(r.index) + "\"} " +
             (r.ready ? "1" : "0") + "\n";
    head(out, "troupe:replica_requests_running", "gauge",
         "Requests running on each replica (at the head's last heartbeat).");
    for (const auto& r : s->replicas)
      out += "troupe:replica_requests_running{replica=\"" + std::to_string(r.index) + "\"} " +
             std::to_string(r.running) + "\n";
    head(out, "troupe:replica_requests_waiting", "gauge",
         "Requests waiting on each replica (at the head's last heartbeat).");
    for (const auto& r : s->replicas)
      out += "troupe:replica_requests_waiting{replica=\"" + std::to_string(r.index) + "\"} " +
             std::to_string(r.queued) + "\n";
    head(out, "troupe:replica_kv_used_blocks", "gauge", "KV blocks in use on each replica.");
    for (const auto& r : s->replicas)
      out += "troupe:replica_kv_used_blocks{replica=\"" + std::to_string(r.index) + "\"} " +
             std::to_string(r.kv_used_blocks) + "\n";
    head(out, "troupe:replica_routed_total", "counter", "Jobs the router sent each replica.");
    for (const auto& r : s->replicas)
      out += "troupe:replica_routed_total{replica=\"" + std::to_string(r.index) + "\"} " +
             std::to_string(r.routed) + "\n";
    head(out, "troupe:router_decisions_total", "counter",
         "The router's choices, by reason: prefix (the replica with the longest cached prefix of "
         "the prompt) or load (the least loaded).");
    out += "troupe:router_decisions_total{reason=\"prefix\"} " +
           std::to_string(s->routed_by_prefix) + "\n";
    out += "troupe:router_decisions_total{reason=\"load\"} " + std::to_string(s->routed_by_load) +
           "\n";
    if (!s->encoder_replicas.empty()) {
      head(out, "troupe:encoder_replicas", "gauge",
           "Replicas of each modality encoder, by state (serving, loading, draining).");
      for (const char* state : {"serving", "loading", "draining"})
        out += std::string("troupe:encoder_replicas{kind=\"vision\",state=\"") + state + "\"} " +
               std::to_string(std::count(s->encoder_states.begin(), s->encoder_states.end(),
                                         std::string(state))) +
               "\n";
      head(out, "troupe:encoder_images_waiting", "gauge",
           "Images sent to an encoder and not yet answered (at the head's last heartbeat).");
      out += "troupe:encoder_images_waiting{kind=\"vision\"} " +
             std::to_string(s->encoder_waiting) + "\n";
      head(out, "troupe:encoder_scale_total", "counter",
           "Encoder replicas added (up) and drained (down) by the autoscaler.");
      out += "troupe:encoder_scale_total{kind=\"vision\",direction=\"up\"} " +
             std::to_string(s->encoder_scale_ups) + "\n";
      out += "troupe:encoder_scale_total{kind=\"vision\",direction=\"down\"} " +
             std::to_string(s->encoder_scale_downs) + "\n";
    }
    head(out, "troupe:node_up", "gauge", "1 while the node is up (answers heartbeats), else 0.");
    for (const auto& n : s->nodes)
      out += "troupe:node_up{node=\"" + escape(n.name) + "\"} " +
             (n.state == cluster::member_state::up ? "1" : "0") + "\n";
    head(out, "troupe:node_resident_memory_bytes", "gauge",
         "Resident memory of each node process.");
    for (const auto& n : s->nodes)
      out += "troupe:node_resident_memory_bytes{node=\"" + escape(n.name) + "\"} " +
             std::to_string(n.report.rss_bytes) + "\n";
  }
  head(out, "troupe:request_success_total", "counter", "Requests that ended, by finish reason.");
  for (const auto& [reason, n] : success_)
    out += "troupe:request_success_total{" + label_ + ",finished_reason=\"" + escape(reason) +
           "\"} " + std::to_string(n) + "\n";
  head(out, "troupe:http_errors_total", "counter", "Requests the gateway refused, by HTTP status.");
  for (const auto& [status, n] : http_errors_)
    out += "troupe:http_errors_total{status=\"" + std::to_string(status) + "\"} " +
           std::to_string(n) + "\n";
  head(out, "troupe:request_failure_total", "counter",
       "Requests that ended in an error after they were accepted, by error code.");
  for (const auto& [code, n] : failures_)
    out += "troupe:request_failure_total{" + label_ + ",code=\"" + escape(code) + "\"} " +
           std::to_string(n) + "\n";
  head(out, "troupe:http_requests_total", "counter", "HTTP responses sent, by status.");
  for (const auto& [status, n] : responses_)
    out += "troupe:http_requests_total{status=\"" + std::to_string(status) + "\"} " +
           std::to_string(n) + "\n";
  head(out, "troupe:prompt_tokens_total", "counter", "Prompt tokens of finished requests.");
  out += "troupe:prompt_tokens_total{" + label_ + "} " + std::to_string(prompt_tokens_) + "\n";
  head(out, "troupe:generation_tokens_total", "counter", "Generated tokens of finished requests.");
  out +=
      "troupe:generation_tokens_total{" + label_ + "} " + std::to_string(generation_tokens_) + "\n";
  head(out, "troupe:time_to_first_token_seconds", "histogram", "Time to first token.");
  ttft_.render(out, "troupe:time_to_first_token_seconds", label_);
  head(out, "troupe:inter_token_latency_seconds", "histogram",
       "Time between tokens as the gateway received them.");
  itl_.render(out, "troupe:inter_token_latency_seconds", label_);
  head(out, "troupe:e2e_request_latency_seconds", "histogram",
       "Submission to end of each request.");
  e2e_.render(out, "troupe:e2e_request_latency_seconds", label_);
  head(out, "troupe:request_queue_time_seconds", "histogram", "Submission to admission.");
  queue_.render(out, "troupe:request_queue_time_seconds", label_);
  head(out, "troupe:request_prompt_tokens", "histogram", "Prompt tokens per finished request.");
  prompt_hist_.render(out, "troupe:request_prompt_tokens", label_);
  head(out, "troupe:request_generation_tokens", "histogram",
       "Generated tokens per finished request.");
  generation_hist_.render(out, "troupe:request_generation_tokens", label_);
  head(out, "troupe:request_prefill_time_seconds", "histogram",
       "Admission to first token of each finished request.");
  prefill_.render(out, "troupe:request_prefill_time_seconds", label_);
  head(out, "troupe:request_decode_time_seconds", "histogram",
       "First token to end of each finished request.");
  decode_.render(out, "troupe:request_decode_time_seconds", label_);
  head(out, "troupe:request_inference_time_seconds", "histogram",
       "Admission to end of each finished request.");
  inference_.render(out, "troupe:request_inference_time_seconds", label_);
  return out;
}

}  // namespace troupe::serve
