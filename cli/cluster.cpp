// The cluster commands, each given the manifest:
//   troupe up MANIFEST [--detach]   starts every node, waits until the model is placed
//   troupe status MANIFEST [--json] nodes, devices, stages, memory, requests
//   troupe submit MANIFEST --prompt TEXT [--image FILE]... [--stream] [--json]
//   troupe down MANIFEST            drains and stops everything
// status, submit and down (and up, to watch) talk to the head as the
// cluster's client (its client certificate, mutual TLS).
#include <signal.h>
#include <spdlog/spdlog.h>
#include <unistd.h>
#include <algorithm>

#include <caf/io/all.hpp>
#include <caf/openssl/all.hpp>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "actors/cluster.hpp"
#include "actors/gatekeeper.hpp"
#include "actors/pipeline_stats.hpp"
#include "cli/cluster_setup.hpp"
#include "cli/commands.hpp"
#include "cli/daemon.hpp"
#include "cli/progress.hpp"
#include "cluster/certs.hpp"
#include "cluster/launcher.hpp"
#include "models/audio.hpp"
#include "models/mapped_file.hpp"
#include "models/video.hpp"

namespace troupe::cli {

namespace {

using namespace std::chrono_literals;
using steady = std::chrono::steady_clock;
using nlohmann::json;

struct cluster_args {
  std::string manifest;
  bool detach = false, json = false, stream = false, ignore_eos = false, chat = false;
  int http_port = -1;   // up --http: also start `troupe serve` on this port
  std::string api_key;  // up --http: its key
  int timeout_s = 300;
  std::string prompt, system;
  std::vector<std::string> images, audios, videos;
  std::int32_t num_frames = 0;  // each video's (0: the default)
  double fps = 0;
  bool video_audio = false;  // each video's audio track too
  std::string audio_stream;  // a clip streamed while the job runs (its last)
  int stream_piece_ms = 500;
  double stream_speed = 1;
  std::int64_t max_tokens = 128;
  double temperature = 0;
  bool set_temperature = false;
  std::uint64_t seed = 0;
  std::int32_t priority = 0;
  std::string shard, to;  // migrate
  int replica = 0;
  int rank = -1;  // migrate: of a tensor-parallel stage
};

/// A CAF system that acts as the cluster's client.
std::unique_ptr<caf::actor_system> client_system(const cluster::manifest& m,
                                                 caf::actor_system_config& cfg) {
  actors::configure_runtime(cfg);
  if (auto t = actors::configure_cluster_tls(cfg, m, cluster::client_identity); !t) {
    spdlog::error("{} (make them with `troupe certs {}`)", t.error(), m.path);
    return nullptr;
  }
  return std::make_unique<caf::actor_system>(cfg);
}

std::string mib(std::int64_t b) {
  return std::to_string(b >> 20) + " MiB";
}

/// One media kind's encoder queue in `troupe status --json`.
json media_queue(const char* items, std::int64_t n, std::int64_t hits, std::int64_t waiting,
                 std::int64_t encodes, double wait_ms) {
  return {{items, n},
          {"cache_hits", hits},
          {"waiting", waiting},
          {"encodes", encodes},
          {"wait_ms", wait_ms}};
}

json status_json(const actors::cluster_status& s) {
  json nodes = json::array();
  for (const auto& n : s.nodes)
    nodes.push_back({{"name", n.name},
                     {"address", n.host + ":" + std::to_string(n.port)},
                     {"state", cluster::to_string(n.state)},
                     {"last_seen_ms", n.last_seen_ms},
                     {"joins", n.joins},
                     {"devices", n.report.devices},
                     {"stages", n.report.stages},
                     {"placement", n.report.epoch},
                     {"rss_bytes", n.report.rss_bytes},
                     {"pool_in_use_bytes", n.report.pool_in_use_bytes},
                     {"pool_cached_bytes", n.report.pool_cached_bytes},
                     {"malloc_bytes", n.report.malloc_bytes},
                     {"memory_limit_bytes", n.report.memory_limit},
                     {"weight_bytes", n.report.weight_bytes},
                     {"kv_used_blocks", n.report.kv_used_blocks},
                     {"kv_total_blocks", n.report.kv_total_blocks},
                     {"kv_tokens", n.report.kv_tokens},
                     {"problem", n.report.failure}});
  for (std::size_t i = 0; i < s.nodes.size(); ++i) {
    const auto& p = s.nodes[i].report.probe;
    if (p.cores > 0)
      nodes[i]["measured"] = {{"gemv_bytes_per_s",
                               {{"f32", p.gemv_f32},
                                {"f16", p.gemv_f16},
                                {"q8_0", p.gemv_q8_0},
                                {"q4_0", p.gemv_q4_0}}},
                              {"gemm_flop_per_s",
                               {{"f32", p.gemm_f32},
                                {"f16", p.gemm_f16},
                                {"q8_0", p.gemm_q8_0},
                                {"q4_0", p.gemm_q4_0}}},
                              {"memory_bytes", p.memory_bytes},
                              {"load", s.nodes[i].report.load}};
  }
  json decisions = json::array();
  for (const auto& d : s.decisions)
    decisions.push_back({{"at_s", d.at_s},
                         {"trigger", d.trigger},
                         {"action", d.action},
                         {"plan", d.plan},
                         {"predicted_step_ms_before", d.predicted_step_ms_before},
                         {"predicted_step_ms_after", d.predicted_step_ms_after},
                         {"predicted_gain", d.predicted_gain},
                         {"measured_tokens_per_s_before", d.measured_tps_before},
                         {"measured_tokens_per_s_after", d.measured_tps_after},
                         {"state", d.state}});
  json replicas = json::array();
  for (const auto& r : s.replicas)
    replicas.push_back({{"index", r.index},
                        {"nodes", r.nodes},
                        {"placement", r.placement},
                        {"ready", r.ready},
                        {"placement_epoch", r.epoch},
                        {"running", r.running},
                        {"queued", r.queued},
                        {"kv_used_blocks", r.kv_used_blocks},
                        {"kv_total_blocks", r.kv_total_blocks},
                        {"finished", r.finished},
                        {"routed", r.routed},
                        {"replacements", r.replacements},
                        {"resume_ms", r.resume_ms},
                        {"cached_blocks", r.cached_blocks}});
  const auto& q = s.scheduler;
  json enc_list = json::array();
  for (std::size_t i = 0; i < s.encoder_replicas.size() && i < s.encoder_states.size(); ++i)
    enc_list.push_back({{"where", s.encoder_replicas[i]}, {"state", s.encoder_states[i]}});
  json encoders = {{"vision",
                    {{"replicas", enc_list},
                     {"min", s.encoder_min},
                     {"max", s.encoder_max},
                     {"images_waiting", s.encoder_waiting},
                     {"mean_wait_ms", s.encoder_wait_ms},
                     {"scale_ups", s.encoder_scale_ups},
                     {"scale_downs", s.encoder_scale_downs}}}};
  json links = json::object();
  for (std::size_t i = 0; i < s.links.size() && i < s.link_bytes.size(); ++i)
    links[s.links[i]] = s.link_bytes[i];
  return {{"cluster", s.cluster},
          {"head", s.head},
          {"term", s.term},
          {"standby", {{"state", s.standby}, {"journal_jobs", s.journal_jobs}}},
          {"ready", s.ready},
          {"draining", s.draining},
          {"placement", s.placement},
          {"placements", s.epoch},
          {"encoder", s.encoder},
          {"replacements", s.replacements},
          {"last_event", s.last_event},
          {"detect_ms", s.detect_ms},
          {"resume_ms", s.resume_ms},
          {"actor_restarts", s.actor_restarts},
          {"migrations", s.migrations},
          {"transfer_bytes", links},
          {"plan", s.plan_detail},
          {"pipeline", s.pipeline_detail},
          {"decisions", decisions},
          {"nodes", nodes},
          {"requests",
           {{"queued", q.queued},
            {"running", q.running},
            {"accepted", q.accepted},
            {"rejected", q.rejected},
            {"finished", q.finished},
            {"preemptions", q.preemptions},
            {"steps", q.steps}}},
          {"prefix_cache",
           {{"queries", q.prefix_queries},
            {"hits", q.prefix_hits},
            {"hit_rate", q.prefix_queries > 0 ? static_cast<double>(q.prefix_hits) /
                                                    static_cast<double>(q.prefix_queries)
                                              : 0.0},
            {"cached_blocks", q.kv_cached_blocks},
            {"cached_free_blocks", q.kv_cached_free},
            {"evictions", q.kv_evictions}}},
          {"kv_tiers",
           {{"slot_bytes", q.kv_slot_bytes},
            {"host_blocks", q.kv_host_blocks},
            {"host_used", q.kv_host_used},
            {"disk_blocks", q.kv_disk_blocks},
            {"disk_used", q.kv_disk_used},
            {"to_host", q.kv_to_host},
            {"from_host", q.kv_from_host},
            {"to_disk", q.kv_to_disk},
            {"from_disk", q.kv_from_disk},
            {"dropped", q.kv_dropped},
            {"store_blocks", q.kv_remote_blocks},
            {"store_used", q.kv_remote_used},
            {"store_pending", q.kv_remote_pending},
            {"to_store", q.kv_to_remote},
            {"from_store", q.kv_from_remote},
            {"restored_tokens", q.restored_tokens},
            {"recomputed_tokens", q.recomputed_tokens}}},
          {"block_index", {{"blocks", s.indexed_blocks}, {"events", s.block_events}}},
          {"kv_store", {{"node", s.kv_store}, {"ordered", s.kv_stores}}},
          {"replicas", replicas},
          {"router", {{"by_prefix", s.routed_by_prefix}, {"by_load", s.routed_by_load}}},
          {"encoders", encoders},
          {"encoder_cache", {{"images", q.images}, {"hits", q.image_cache_hits}}},
          {"audio", media_queue("clips", q.clips, q.clip_cache_hits, q.clips_waiting,
                                q.clip_encodes, q.clip_encode_wait_ms)},
          {"video", media_queue("videos", q.videos, q.video_cache_hits, q.videos_waiting,
                                q.video_encodes, q.video_encode_wait_ms)}};
}

/// One media kind's encoder queue in `troupe status`, once it had any.
void print_media_queue(const char* kind, const char* noun, std::int64_t n, std::int64_t hits,
                       std::int64_t waiting, std::int64_t encodes, double wait_ms) {
  if (n <= 0) return;
  std::printf("%s: %lld %s (%lld from the cache), %lld waiting now, mean wait %.1f ms\n", kind,
              static_cast<long long>(n), noun, static_cast<long long>(hits),
              static_cast<long long>(waiting),
              encodes > 0 ? wait_ms / static_cast<double>(encodes) : 0.0);
}

void print_status(const actors::cluster_status& s) {
  std::printf("cluster %s: %s%s, head %s, placement %llu: %s\n", s.cluster.c_str(),
              s.ready ? "ready" : "not ready", s.draining ? " (draining)" : "", s.head.c_str(),
              static_cast<unsigned long long>(s.epoch),
              s.placement.empty() ? "-" : s.placement.c_str());
  if (!s.standby.empty())
    std::printf("standby head: %s (term %llu, %lld job(s) in the journal)\n", s.standby.c_str(),
                static_cast<unsigned long long>(s.term), static_cast<long long>(s.journal_jobs));
  if (s.encoder_replicas.size() > 1 || s.encoder_max > 1) {
    std::string list;
    for (std::size_t i = 0; i < s.encoder_replicas.size() && i < s.encoder_states.size(); ++i)
      list += (list.empty() ? "" : ", ") + s.encoder_replicas[i] +
              (s.encoder_states[i] == "serving" ? "" : " (" + s.encoder_states[i] + ")");
    std::printf(
        "vision encoder: %zu of %d-%d replicas: %s; %lld images waiting",
        std::count(s.encoder_states.begin(), s.encoder_states.end(), std::string("serving")),
        s.encoder_min, s.encoder_max, list.c_str(), static_cast<long long>(s.encoder_waiting));
    if (s.encoder_wait_ms >= 0) std::printf(", %.0f ms mean wait", s.encoder_wait_ms);
    std::printf("; %lld added, %lld drained so far\n", static_cast<long long>(s.encoder_scale_ups),
                static_cast<long long>(s.encoder_scale_downs));
  } else if (!s.encoder.empty()) {
    std::printf("vision encoder: %s\n", s.encoder.c_str());
  }
  std::printf("%-10s %-22s %-8s %-14s %-22s %-10s %-18s %s\n", "NODE", "ADDRESS", "STATE", "DEVICE",
              "STAGES", "MEMORY", "KV (used/total)", "PROBLEM");
  for (const auto& n : s.nodes) {
    const auto addr = n.host + ":" + std::to_string(n.port);
    const auto kv = std::to_string(n.report.kv_used_blocks) + "/" +
                    std::to_string(n.report.kv_total_blocks) + " blocks";
    std::printf("%-10s %-22s %-8s %-14s %-22s %-10s %-18s %s\n", n.name.c_str(), addr.c_str(),
                cluster::to_string(n.state), n.report.devices.c_str(),
                n.report.stages.empty() ? "-" : n.report.stages.c_str(),
                n.report.rss_bytes ? mib(n.report.rss_bytes).c_str() : "-", kv.c_str(),
                n.report.failure.c_str());
  }
  if (s.replicas.size() > 1) {
    std::printf("%-8s %-10s %-24s %-9s %-8s %-8s %-16s %-8s %s\n", "REPLICA", "STATE", "NODES",
                "RUNNING", "QUEUED", "ROUTED", "KV (used/total)", "LOSSES", "PLACEMENT");
    for (const auto& r : s.replicas) {
      std::string nodes;
      for (const auto& n : r.nodes) nodes += (nodes.empty() ? "" : ",") + n;
      const auto kv = std::to_string(r.kv_used_blocks) + "/" + std::to_string(r.kv_total_blocks);
      std::printf("%-8d %-10s %-24s %-9lld %-8lld %-8lld %-16s %-8lld %s\n", r.index,
                  r.state.c_str(), nodes.c_str(), static_cast<long long>(r.running),
                  static_cast<long long>(r.queued), static_cast<long long>(r.routed), kv.c_str(),
                  static_cast<long long>(r.replacements),
                  r.placement.empty() ? "-" : r.placement.c_str());
    }
    std::printf("router: %lld jobs sent where their prefix was cached, %lld by load\n",
                static_cast<long long>(s.routed_by_prefix),
                static_cast<long long>(s.routed_by_load));
  }
  const auto& q = s.scheduler;
  std::printf(
      "requests: %lld running, %lld queued, %lld finished, %lld refused; %lld re-placements",
      static_cast<long long>(q.running), static_cast<long long>(q.queued),
      static_cast<long long>(q.finished), static_cast<long long>(q.rejected),
      static_cast<long long>(s.replacements));
  if (s.replacements > 0)
    std::printf(" (last: detected %.0f ms after the last heartbeat, resumed in %.0f ms)",
                s.detect_ms, s.resume_ms);
  std::printf("; %lld migrations\n", static_cast<long long>(s.migrations));
  if (q.prefix_queries > 0 || q.kv_cached_blocks > 0)
    std::printf(
        "prefix cache: %lld of %lld prompt tokens hit (%.1f%%); %lld blocks cached, %lld "
        "of them free; %lld evicted\n",
        static_cast<long long>(q.prefix_hits), static_cast<long long>(q.prefix_queries),
        q.prefix_queries > 0
            ? 100.0 * static_cast<double>(q.prefix_hits) / static_cast<double>(q.prefix_queries)
            : 0.0,
        static_cast<long long>(q.kv_cached_blocks), static_cast<long long>(q.kv_cached_free),
        static_cast<long long>(q.kv_evictions));
  if (const auto t = actors::describe_kv_tiers(q); !t.empty()) std::printf("%s\n", t.c_str());
  if (q.kv_remote_blocks > 0)
    std::printf("KV store: %s\n", s.kv_store.empty() ? "none running (its node is not up)"
                                                     : ("on " + s.kv_store).c_str());
  if (s.indexed_blocks.size() >= 3 && s.block_events > 0)
    std::printf(
        "block index (the head's, from %llu block events): %lld on the device, %lld in host "
        "memory, %lld on disk\n",
        static_cast<unsigned long long>(s.block_events),
        static_cast<long long>(s.indexed_blocks[0]), static_cast<long long>(s.indexed_blocks[1]),
        static_cast<long long>(s.indexed_blocks[2]));
  if (q.restored_tokens + q.recomputed_tokens > 0)
    std::printf("tokens whose KV a preemption or node loss took: %lld restored, %lld recomputed\n",
                static_cast<long long>(q.restored_tokens),
                static_cast<long long>(q.recomputed_tokens));
  if (q.images > 0)
    std::printf("encoder cache: %lld of %lld images and clips taken from it\n",
                static_cast<long long>(q.image_cache_hits), static_cast<long long>(q.images));
  print_media_queue("audio", "clips", q.clips, q.clip_cache_hits, q.clips_waiting, q.clip_encodes,
                    q.clip_encode_wait_ms);
  print_media_queue("video", "videos", q.videos, q.video_cache_hits, q.videos_waiting,
                    q.video_encodes, q.video_encode_wait_ms);
  if (!s.links.empty()) {
    std::printf("data plane:");
    for (std::size_t i = 0; i < s.links.size() && i < s.link_bytes.size(); ++i)
      std::printf("%s %s %.2f MiB", i ? "," : "", s.links[i].c_str(),
                  static_cast<double>(s.link_bytes[i]) / (1 << 20));
    std::printf("\n");
  }
  if (!s.plan_detail.empty())
    std::printf("predicted (measured devices and links, cost model):\n%s", s.plan_detail.c_str());
  if (!s.pipeline_detail.empty())
    std::printf("measured (the scheduler's counters):\n%s", s.pipeline_detail.c_str());
  for (std::size_t i = s.decisions.size() > 5 ? s.decisions.size() - 5 : 0; i < s.decisions.size();
       ++i) {
    const auto& d = s.decisions[i];
    std::printf("decision at %.0f s, %s: %s [%s]", d.at_s, d.trigger.c_str(), d.action.c_str(),
                d.state.c_str());
    if (d.predicted_step_ms_after > 0)
      std::printf("; predicted step %.3f -> %.3f ms (throughput %+.0f%%)",
                  d.predicted_step_ms_before, d.predicted_step_ms_after, 100 * d.predicted_gain);
    if (d.measured_tps_before >= 0 || d.measured_tps_after >= 0) {
      std::printf("; measured %.1f -> %.1f tokens/s", d.measured_tps_before, d.measured_tps_after);
      if (d.measured_tps_before > 0 && d.measured_tps_after >= 0)
        std::printf(" (%+.0f%%)", 100 * (d.measured_tps_after / d.measured_tps_before - 1));
    }
    std::printf("\n");
  }
  std::printf("last event: %s\n", s.last_event.c_str());
}

std::string self_exe() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("troupe") : p.string();
}

// -- up ----------------------------------------------------------------------

void stop_launched(const std::vector<cluster::launched_node>& nodes, std::chrono::seconds grace) {
  for (const auto& n : nodes)
    if (cluster::process_alive(n.pid)) ::kill(n.pid, SIGTERM);
  const auto until = steady::now() + grace;
  auto any_alive = [&] {
    return std::any_of(nodes.begin(), nodes.end(),
                       [](const auto& n) { return cluster::process_alive(n.pid); });
  };
  while (any_alive() && steady::now() < until) std::this_thread::sleep_for(50ms);
  for (const auto& n : nodes)
    if (cluster::process_alive(n.pid)) ::kill(n.pid, SIGKILL);
}

int ask_down(caf::actor_system& sys, const cluster::manifest& m, int timeout_s) {
  auto door = actors::connect_client(sys, m, 5s);
  const auto nodes = cluster::read_launched(m);
  for (const auto& n : nodes)  // the gateway (up --http) first: it does not end with the head
    if (n.node == "+serve" && n.local && cluster::process_alive(n.pid)) stop_launched({n}, 5s);
  if (door) {
    caf::scoped_actor self{sys};
    std::string why;
    self->request(*door, std::chrono::seconds(timeout_s), actors::down_atom::value)
        .receive([](bool) {}, [&](caf::error& e) { why = actors::describe(sys, e); });
    if (!why.empty())
      spdlog::warn("down: the head did not confirm ({}); stopping the local processes", why);
  } else {
    spdlog::warn(
        "down: the head of cluster {} is not reachable ({}); stopping the local node processes",
        m.name, door.error());
  }
  // The nodes end by themselves once told; make sure of it.
  const auto until = steady::now() + 15s;
  auto alive = [&] {
    return std::count_if(nodes.begin(), nodes.end(),
                         [](const auto& n) { return n.local && cluster::process_alive(n.pid); });
  };
  while (alive() > 0 && steady::now() < until) std::this_thread::sleep_for(100ms);
  std::vector<cluster::launched_node> left;
  for (const auto& n : nodes)
    if (n.local && cluster::process_alive(n.pid)) left.push_back(n);
  if (!left.empty()) {
    spdlog::warn("down: {} node process(es) still running; sending SIGTERM", left.size());
    stop_launched(left, 5s);
  }
  std::error_code ec;
  std::filesystem::remove(std::filesystem::path(cluster::run_dir(m)) / "nodes.pid", ec);
  std::printf("troupe: cluster %s is down\n", m.name.c_str());
  return 0;
}

int run_up(const cluster_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  for (const auto& n : m->nodes)
    if (auto c = node_config_of(*m, n.name); !c) {
      spdlog::error("up: {}", c.error().message);
      return 2;
    }
  auto wrote = cluster::ensure_certificates(*m);
  if (!wrote) {
    spdlog::error("up: certificates: {}", wrote.error());
    return 1;
  }
  if (!wrote->empty())
    std::printf("troupe: made %zu certificate(s) in %s\n", wrote->size(), m->certs_dir.c_str());
  for (const auto& n : cluster::read_launched(*m))
    if (n.local && cluster::process_alive(n.pid)) {
      spdlog::error(
          "up: cluster {} is already running here (node {} is pid {}); `troupe down {}` first",
          m->name, n.node, n.pid, a.manifest);
      return 1;
    }
  const sigset_t sigs = block_stop_signals();
  std::vector<cluster::launched_node> nodes;
  const auto exe = self_exe();
  for (const auto& n : m->nodes) {
    auto l = cluster::launch_node(*m, n, exe);
    if (!l) {
      spdlog::error("up: node {}: {}", n.name, l.error());
      stop_launched(nodes, 5s);
      return 1;
    }
    std::printf("troupe: started node %s (%s:%d, %s, pid %d, log %s)\n", n.name.c_str(),
                n.host.c_str(), n.port, l->local ? "local" : "launch command",
                static_cast<int>(l->pid), l->log.c_str());
    nodes.push_back(*l);
  }
  std::fflush(stdout);
  if (auto w = cluster::write_launched(*m, nodes); !w) spdlog::warn("up: {}", w.error());

  caf::actor_system_config cfg;
  auto sys = client_system(*m, cfg);
  if (!sys) {
    stop_launched(nodes, 5s);
    return 1;
  }
  const auto t0 = steady::now();
  const auto deadline = t0 + std::chrono::seconds(a.timeout_s);
  std::optional<actors::frontdoor_actor> door;
  std::string last_line, why;
  bool ready = false;
  progress prog(stdout);
  while (steady::now() < deadline) {
    for (const auto& n : nodes)
      if (n.local && !cluster::process_alive(n.pid)) {
        spdlog::error("up: node {} exited while starting; the end of {}:\n{}", n.node, n.log,
                      cluster::log_tail(n.log));
        stop_launched(nodes, 5s);
        return 1;
      }
    if (!door) {
      auto d = actors::connect_client(*sys, *m, 2s);
      if (d)
        door = *d;
      else
        why = d.error();
    }
    if (door) {
      auto s = actors::query_status(*sys, *door, 10s);
      if (!s) {
        why = s.error();
        door.reset();
      } else {
        const auto up = std::count_if(s->nodes.begin(), s->nodes.end(), [](const auto& n) {
          return n.state == cluster::member_state::up;
        });
        char buf[512];
        std::snprintf(buf, sizeof buf, "troupe: %.1f s: %zd/%zu nodes up; %s",
                      std::chrono::duration<double>(steady::now() - t0).count(),
                      static_cast<std::ptrdiff_t>(up), s->nodes.size(), s->last_event.c_str());
        const std::string line = buf;
        if (prog.tty()) {
          // In a terminal: one line redrawn, with a bar for the nodes
          // joining, then for the stages loading.
          if (s->stages_total > 0)
            prog.update("troupe: loading weights",
                        static_cast<double>(s->stages_loaded) / s->stages_total,
                        std::to_string(s->stages_loaded) + "/" + std::to_string(s->stages_total) +
                            " stages; " + s->last_event.substr(0, 80));
          else
            prog.update("troupe: nodes joining",
                        static_cast<double>(up) / static_cast<double>(s->nodes.size()),
                        std::to_string(up) + "/" + std::to_string(s->nodes.size()) + " up");
          last_line = line;
        } else if (line.substr(line.find(':', 8)) !=
                   (last_line.empty() ? "" : last_line.substr(last_line.find(':', 8)))) {
          // Otherwise a line whenever something changed.
          std::printf("%s\n", line.c_str());
          std::fflush(stdout);
          last_line = line;
        }
        // Every replica placed (a replica whose nodes are all down waits:
        // --timeout says how long).
        const bool all = std::all_of(
            s->replicas.begin(), s->replicas.end(),
            [](const actors::replica_view& r) { return r.ready || r.state == "retired"; });
        if (s->ready && all) {
          const auto& h = m->head_node();
          char done[1024];
          std::snprintf(done, sizeof done,
                        "troupe: cluster %s ready in %.1f s: %zu nodes, head %s at %s:%d; model "
                        "placed %s%s%s",
                        m->name.c_str(), std::chrono::duration<double>(steady::now() - t0).count(),
                        s->nodes.size(), h.name.c_str(), h.host.c_str(), h.port,
                        s->placement.c_str(), s->encoder.empty() ? "" : ", vision encoder on ",
                        s->encoder.c_str());
          prog.line(done);
          ready = true;
          break;
        }
      }
    }
    std::this_thread::sleep_for(250ms);
  }
  if (!ready) {
    prog.finish();
    spdlog::error("up: cluster {} not ready after {} s ({}); logs in {}", m->name, a.timeout_s,
                  why.empty() ? last_line : why, cluster::run_dir(*m));
    for (const auto& n : nodes)
      std::fprintf(stderr, "  the end of %s:\n%s", n.log.c_str(), cluster::log_tail(n.log).c_str());
    ask_down(*sys, *m, 10);
    return 1;
  }
  if (a.http_port >= 0) {
    std::vector<std::string> argv{exe, "serve", std::filesystem::absolute(m->path).string(),
                                  "--port", std::to_string(a.http_port)};
    if (!a.api_key.empty()) {
      argv.push_back("--api-key");
      argv.push_back(a.api_key);
    }
    auto g = cluster::launch_local(*m, "+serve", argv);
    if (!g) {
      spdlog::error("up: the HTTP gateway: {}", g.error());
      ask_down(*sys, *m, 10);
      return 1;
    }
    nodes.push_back(*g);
    if (auto w = cluster::write_launched(*m, nodes); !w) spdlog::warn("up: {}", w.error());
    // Wait for its line (it prints the URL once it listens).
    std::string line;
    for (auto until = steady::now() + 30s; steady::now() < until && line.empty();
         std::this_thread::sleep_for(100ms)) {
      if (!cluster::process_alive(g->pid)) break;
      std::ifstream f(g->log);
      for (std::string l; std::getline(f, l);)
        if (l.rfind("troupe serve:", 0) == 0) line = l;
    }
    if (line.empty()) {
      spdlog::error("up: the HTTP gateway did not start; the end of {}:\n{}", g->log,
                    cluster::log_tail(g->log));
      ask_down(*sys, *m, 10);
      return 1;
    }
    std::printf("%s\n", line.c_str());
  }
  if (a.detach) {
    std::printf("troupe: running in the background; `troupe down %s` stops it\n",
                a.manifest.c_str());
    return 0;
  }
  std::printf("troupe: Ctrl-C stops the cluster\n");
  std::fflush(stdout);
  wait_for_stop_signal(sigs);
  return ask_down(*sys, *m, 60);
}

// -- status, submit, down ---------------------------------------------------------

int run_status(const cluster_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  auto c = open_client(*m, "status");
  if (!c) return 1;
  auto s = actors::query_status(*c->sys, c->door, 10s);
  if (!s) {
    spdlog::error("status: {}", s.error());
    return 1;
  }
  if (a.json)
    std::printf("%s\n", status_json(*s).dump().c_str());
  else
    print_status(*s);
  return 0;
}

/// Submits `job` (its last clip streamed) and sends the clip's samples in
/// pieces of `piece_ms`, each when it has been spoken (`speed` times real
/// time) and its predecessor was answered; then waits for the job's end.
/// `after_audio_ms`: from the last piece to the first token.
std::expected<actors::finish_event, actors::client::rejection> stream_job(
    actors::client& client, actors::job_request job, const std::vector<std::int16_t>& spoken,
    int piece_ms, double speed, std::function<void(const actors::token_event&)> on_token,
    double& after_audio_ms) {
  using steady = std::chrono::steady_clock;
  std::mutex m;
  std::condition_variable cv;
  std::optional<actors::finish_event> end;
  std::optional<steady::time_point> first;
  actors::client::callbacks cb;
  cb.on_token = [&](const actors::token_event& e) {
    {
      std::lock_guard lock(m);
      if (!first) first = steady::now();
    }
    if (on_token) on_token(e);
  };
  cb.on_finish = [&](const actors::finish_event& e) {
    std::lock_guard lock(m);
    if (!first && !e.tokens.empty()) first = steady::now();
    end = e;
    cv.notify_all();
  };
  const auto id = job.id;
  auto ack = client.submit(std::move(job), cb);
  if (!ack) return std::unexpected(ack.error());
  const auto piece = static_cast<std::size_t>(std::max(1, 16 * piece_ms));
  const auto start = steady::now();
  steady::time_point last_sent{};
  for (std::size_t at = 0; at < spoken.size() || at == 0; at += piece) {
    const auto n = std::min(piece, spoken.size() - at);
    std::this_thread::sleep_until(
        start + std::chrono::duration_cast<steady::duration>(
                    std::chrono::duration<double>(static_cast<double>(at + n) / 16000.0 / speed)));
    std::vector<std::uint8_t> pcm;
    for (std::size_t i = at; i < at + n; ++i) {
      const auto v = static_cast<std::uint16_t>(spoken[i]);
      pcm.push_back(static_cast<std::uint8_t>(v & 0xff));
      pcm.push_back(static_cast<std::uint8_t>(v >> 8));
    }
    const bool last = at + n >= spoken.size();
    if (last) last_sent = steady::now();
    // A refused piece ends the job too (its end says why).
    if (!client.send_audio(id, std::move(pcm), last)) break;
    if (last) break;
  }
  std::unique_lock lock(m);
  cv.wait(lock, [&] { return end.has_value(); });
  if (first && last_sent != steady::time_point{})
    after_audio_ms = std::chrono::duration<double, std::milli>(*first - last_sent).count();
  return *end;
}

int run_submit(const cluster_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  actors::job_request job;
  job.id = actors::random_job_id();
  job.prompt = a.prompt;
  job.system = a.system;
  job.chat = a.chat;
  job.ignore_eos = a.ignore_eos;
  job.has_temperature = a.set_temperature;
  job.temperature = a.temperature;
  job.max_tokens = a.max_tokens;
  job.seed = a.seed;
  job.priority = a.priority;
  constexpr std::uintmax_t max_image = 32u << 20;
  for (const auto& f : a.images) {
    auto bytes = models::read_file_bytes(f, max_image);
    if (!bytes) {
      spdlog::error("submit: --image {}", bytes.error().message);
      return 2;
    }
    actors::media_data img;
    img.name = std::filesystem::path(f).filename().string();
    img.bytes = std::move(*bytes);
    job.images.push_back(std::move(img));
  }
  for (const auto& f : a.audios) {
    auto bytes = models::read_file_bytes(f, models::audio_limits{}.max_bytes);
    if (!bytes) {
      spdlog::error("submit: --audio {}", bytes.error().message);
      return 2;
    }
    actors::media_data clip;
    clip.name = std::filesystem::path(f).filename().string();
    clip.bytes = std::move(*bytes);
    clip.kind = actors::media_kind::audio;
    job.audios.push_back(std::move(clip));
  }
  // The streamed clip: decoded here, sent as 16 kHz 16-bit PCM in pieces
  // while the job runs, as if it were being spoken (--stream-speed).
  std::vector<std::int16_t> spoken;
  if (!a.audio_stream.empty()) {
    auto clip = models::load_audio(a.audio_stream);
    auto at16 = clip ? models::resample(clip->samples, clip->sample_rate, 16000)
                     : std::unexpected(clip.error());
    if (!at16) {
      spdlog::error("submit: --audio-stream {}: {}", a.audio_stream, at16.error().message);
      return 2;
    }
    for (float x : *at16)
      spoken.push_back(  // 16-bit PCM's scale (x / 32768), so such a file's samples come back exact
          static_cast<std::int16_t>(std::lround(std::clamp(x * 32768.f, -32768.f, 32767.f))));
    actors::media_data clip_item;
    clip_item.name = std::filesystem::path(a.audio_stream).filename().string();
    clip_item.kind = actors::media_kind::audio;
    clip_item.stream = true;
    job.audios.push_back(std::move(clip_item));
  }
  if (a.videos.empty() && (a.num_frames > 0 || a.fps > 0 || a.video_audio)) {
    spdlog::error("submit: --num-frames, --fps and --video-audio apply to videos: give --video");
    return 2;
  }
  for (const auto& f : a.videos) {
    auto bytes = models::read_file_bytes(f, models::video_limits{}.max_bytes);
    if (!bytes) {
      spdlog::error("submit: --video {}", bytes.error().message);
      return 2;
    }
    actors::media_data v;
    v.name = std::filesystem::path(f).filename().string();
    v.bytes = std::move(*bytes);
    v.kind = actors::media_kind::video;
    v.num_frames = a.num_frames;
    v.fps = a.fps;
    v.audio = a.video_audio;
    job.videos.push_back(std::move(v));
  }
  caf::actor_system_config cfg;
  auto sys = client_system(*m, cfg);
  if (!sys) return 1;
  auto door = actors::connect_client(*sys, *m, 10s);
  if (!door) {
    spdlog::error("submit: {}", door.error());
    return 1;
  }
  std::function<void(const actors::token_event&)> on_token;
  if (a.stream && !a.json)
    on_token = [](const actors::token_event& e) {
      std::fwrite(e.text.data(), 1, e.text.size(), stdout);
      std::fflush(stdout);
    };
  // With a standby head, a job outlives the head: the client finds the
  // standby once it took over and the stream goes on from there.
  std::optional<actors::client::failover> fo;
  if (!m->standby.empty())
    fo = actors::client::failover{[&sys, &m] { return actors::connect_client(*sys, *m, 2s); }};
  actors::client client = fo ? actors::client(*sys, *door, *fo) : actors::client(*sys, *door);
  double after_audio_ms = -1;
  auto f = spoken.empty() ? client.run(std::move(job), on_token)
                          : stream_job(client, std::move(job), spoken, a.stream_piece_ms,
                                       a.stream_speed, on_token, after_audio_ms);
  if (!f) {
    spdlog::error("submit: {}", f.error().message);
    return 1;
  }
  if (a.json) {
    json j{{"text", f->text},
           {"tokens", f->tokens},
           {"finish_reason", actors::to_string(f->reason)},
           {"error", f->error},
           {"prompt_tokens", f->prompt_tokens},
           {"ttft_ms", f->ttft_ms},
           {"total_ms", f->total_ms},
           {"queue_ms", f->queue_ms},
           {"preemptions", f->preemptions}};
    if (after_audio_ms >= 0) j["ttft_after_audio_ms"] = after_audio_ms;
    std::printf("%s\n", j.dump().c_str());
  } else {
    if (!a.stream) std::printf("%s", f->text.c_str());
    std::printf("\n");
  }
  if (f->reason == actors::finish_reason::error) {
    spdlog::error("submit: {}", f->error);
    return 1;
  }
  return 0;
}

int run_down(const cluster_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  caf::actor_system_config cfg;
  auto sys = client_system(*m, cfg);
  if (!sys) {
    stop_launched(cluster::read_launched(*m), 5s);
    return 1;
  }
  return ask_down(*sys, *m, a.timeout_s);
}

int run_scale(const cluster_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  auto c = open_client(*m, "scale");
  if (!c) return 1;
  auto r = actors::scale_replicas(*c->sys, c->door, a.replica, 30s);
  if (!r) {
    spdlog::error("scale: {}", r.error());
    return 1;
  }
  std::printf("troupe: %s\n", r->c_str());
  std::fflush(stdout);
  if (a.timeout_s <= 0) return 0;
  // Until as many serve, and none is left draining.
  const auto until = steady::now() + std::chrono::seconds(a.timeout_s);
  while (steady::now() < until) {
    if (auto s = actors::query_status(*c->sys, c->door, 5s)) {
      int serving = 0;
      bool draining = false;
      for (const auto& v : s->replicas) {
        serving += v.state == "serving";
        draining = draining || v.state == "draining";
      }
      if (serving == a.replica && !draining) {
        std::printf("troupe: %d replicas serving\n", serving);
        return 0;
      }
    }
    std::this_thread::sleep_for(250ms);
  }
  spdlog::error("scale: not {} replicas serving after {} s (troupe status shows why)", a.replica,
                a.timeout_s);
  return 1;
}

int run_migrate(const cluster_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  auto c = open_client(*m, "migrate");
  if (!c) return 1;
  auto& sys = c->sys;
  auto* door = &c->door;
  // The migration runs in its own thread; this one draws its progress from
  // the head's status (a bar in a terminal, a line per phase otherwise).
  std::string to = a.to;
  if (const auto c = to.find(':'); c != std::string::npos) {
    // NODE:DEVICE: the device must be the one the node runs its stages on.
    const auto device = to.substr(c + 1);
    to = to.substr(0, c);
    auto s = actors::query_status(*sys, *door, 10s);
    if (!s) {
      spdlog::error("migrate: {}", s.error());
      return 1;
    }
    const auto n =
        std::find_if(s->nodes.begin(), s->nodes.end(), [&](const auto& v) { return v.name == to; });
    if (n != s->nodes.end() && n->report.devices != device) {
      spdlog::error(
          "migrate: node {} runs its stages on {}, not {} (moving to another device of a node is "
          "not supported)",
          to, n->report.devices.empty() ? "its manifest device" : n->report.devices, device);
      return 1;
    }
  }
  progress prog(stdout);
  std::optional<std::expected<actors::migrate_report, std::string>> got;
  std::mutex mtx;
  std::thread worker([&] {
    auto x =
        actors::migrate_shard(*sys, *door, actors::migrate_request{a.shard, to, a.replica, a.rank},
                              std::chrono::seconds(a.timeout_s));
    std::lock_guard lock(mtx);
    got = std::move(x);
  });
  for (;;) {
    {
      std::lock_guard lock(mtx);
      if (got) break;
    }
    if (auto s = actors::query_status(*sys, *door, 2s); s && !s->migration.empty())
      prog.update("troupe: migrating " + a.shard + " to " + to, s->migration_done, s->migration);
    std::this_thread::sleep_for(std::chrono::milliseconds(prog.tty() ? 50 : 100));
  }
  worker.join();
  prog.finish();
  auto r = std::move(*got);
  if (!r) {
    spdlog::error("migrate: {}", r.error());
    return 1;
  }
  if (a.json) {
    std::printf("%s\n", json{{"what", r->what},
                             {"from", r->from},
                             {"to", r->to},
                             {"total_ms", r->total_ms},
                             {"load_ms", r->load_ms},
                             {"pause_ms", r->pause_ms},
                             {"rounds", r->rounds},
                             {"sequences", r->sequences},
                             {"kv_bytes", r->kv_bytes},
                             {"final_kv_bytes", r->final_kv_bytes}}
                            .dump()
                            .c_str());
  } else if (r->sequences == 0 && r->kv_bytes == 0 && r->rounds == 0 && r->pause_ms == 0) {
    std::printf(
        "troupe: migrated %s from %s to %s in %.0f ms: loaded in %.0f ms; nothing paused (no KV to "
        "move)\n",
        r->what.c_str(), r->from.c_str(), r->to.c_str(), r->total_ms, r->load_ms);
  } else {
    std::printf(
        "troupe: migrated %s from %s to %s in %.0f ms: loaded in %.0f ms, %lld sequences' KV (%.2f "
        "MiB) copied in "
        "%d rounds while decoding, then steps held %.1f ms for the last %.3f MiB\n",
        r->what.c_str(), r->from.c_str(), r->to.c_str(), r->total_ms, r->load_ms,
        static_cast<long long>(r->sequences), static_cast<double>(r->kv_bytes) / (1 << 20),
        r->rounds, r->pause_ms, static_cast<double>(r->final_kv_bytes) / (1 << 20));
  }
  return 0;
}

}  // namespace

command_runner add_cluster(CLI::App& app, const std::string& which) {
  auto a = std::make_shared<cluster_args>();
  if (which == "up") {
    auto* cmd = app.add_subcommand(
        "up", "Start a cluster from its manifest and place the model (docs/manifest.md)");
    cmd->add_option("manifest", a->manifest, "The cluster's manifest")->required();
    cmd->add_flag("--detach,-d", a->detach,
                  "Return once the cluster is ready (stop it with troupe down)");
    cmd->add_option("--timeout", a->timeout_s, "Seconds to wait for the cluster to be ready")
        ->check(CLI::Range(1, 86400));
    cmd->add_option("--http", a->http_port,
                    "Also start the OpenAI-compatible gateway (troupe serve) on this port")
        ->check(CLI::Range(0, 65535));
    cmd->add_option("--api-key", a->api_key, "With --http: the gateway's API key");
    return [a] { return run_up(*a); };
  }
  if (which == "status") {
    auto* cmd =
        app.add_subcommand("status", "Show a running cluster: nodes, stages, memory, requests");
    cmd->add_option("manifest", a->manifest, "The cluster's manifest")->required();
    cmd->add_flag("--json", a->json, "One JSON object");
    return [a] { return run_status(*a); };
  }
  if (which == "submit") {
    auto* cmd =
        app.add_subcommand("submit", "Submit a job to a running cluster and print the answer");
    cmd->add_option("manifest", a->manifest, "The cluster's manifest")->required();
    cmd->add_option("--prompt,-p", a->prompt, "The prompt")->required();
    cmd->add_option("--image", a->images,
                    "An image (PNG or JPEG) for the prompt; repeat for several");
    cmd->add_option("--audio", a->audios,
                    "An audio clip (WAV, FLAC or MP3) for a model that hears; repeat for several");
    cmd->add_option("--video", a->videos,
                    "A video (MP4, WebM or AVI) for a model that sees video; repeat for several");
    cmd->add_option("--num-frames", a->num_frames,
                    "Frames sampled from each video, uniformly (default 8, at most 64)")
        ->check(CLI::Range(1, 64));
    cmd->add_option("--fps", a->fps,
                    "Sample one frame per 1/FPS seconds of each video instead (at most "
                    "--num-frames)")
        ->check(CLI::Range(0.0, 240.0));
    cmd->add_flag("--video-audio", a->video_audio,
                  "Also hear each video's audio track (a model that hears)");
    cmd->add_option("--audio-stream", a->audio_stream,
                    "An audio clip (WAV, FLAC or MP3) streamed while the job runs, as if spoken: "
                    "the model hears each piece as it comes (the job's last clip)");
    cmd->add_option("--stream-piece-ms", a->stream_piece_ms,
                    "Milliseconds of audio per streamed piece")
        ->check(CLI::Range(10, 60000))
        ->capture_default_str();
    cmd->add_option("--stream-speed", a->stream_speed,
                    "How much faster than real time the streamed clip is sent")
        ->check(CLI::Range(0.01, 1000.0))
        ->capture_default_str();
    cmd->add_option("--system", a->system, "A system prompt (chat)");
    cmd->add_flag("--chat", a->chat,
                  "Apply the model's chat template (implied with images or audio clips)");
    cmd->add_option("--max-tokens,-n", a->max_tokens, "Tokens to generate at most")
        ->check(CLI::Range(1, 1 << 20));
    cmd->add_option("--temperature", a->temperature,
                    "Sampling temperature (default: the model's; 0 = greedy)")
        ->each([a](const std::string&) { a->set_temperature = true; });
    cmd->add_option("--seed", a->seed, "Sampling seed");
    cmd->add_option("--priority", a->priority,
                    "A lower value is admitted first, and may preempt a running job of a higher "
                    "one (vLLM's priority)")
        ->capture_default_str();
    cmd->add_flag("--ignore-eos", a->ignore_eos,
                  "Generate --max-tokens tokens, past end-of-sequence tokens");
    cmd->add_flag("--stream", a->stream, "Print tokens as they come");
    cmd->add_flag("--json", a->json, "One JSON object: text, tokens, timings");
    return [a] { return run_submit(*a); };
  }
  if (which == "scale") {
    auto* cmd = app.add_subcommand(
        "scale",
        "Run this many replicas of the model: new ones take nodes that hold nothing, fewer "
        "retire the newest once their requests are done");
    cmd->add_option("manifest", a->manifest, "The cluster's manifest")->required();
    cmd->add_option("--replicas", a->replica, "How many replicas to run")
        ->required()
        ->check(CLI::Range(1, 256));
    cmd->add_option("--wait", a->timeout_s,
                    "Seconds to wait for the new replicas to serve (or the retired ones to "
                    "finish); 0: answer at once")
        ->check(CLI::Range(0, 86400));
    return [a] { return run_scale(*a); };
  }
  if (which == "migrate") {
    auto* cmd = app.add_subcommand(
        "migrate",
        "Move a decoder stage (with its KV) to another node while requests keep flowing");
    cmd->add_option("manifest", a->manifest, "The cluster's manifest")->required();
    cmd->add_option("--shard", a->shard,
                    "The stage: its index from 0 (\"1\", \"stage1\") or its layers as status "
                    "prints them (\"[1,2)\")")
        ->required();
    cmd->add_option(
           "--to", a->to,
           "The node to move it to (NODE or NODE:DEVICE; the node's manifest device is used)")
        ->required();
    cmd->add_option("--replica", a->replica,
                    "The stage's replica (parallelism.replicas), as status numbers them")
        ->check(CLI::Range(0, 255))
        ->capture_default_str();
    cmd->add_option("--rank", a->rank,
                    "Of a tensor-parallel stage (parallelism.tensor_parallel): the rank that "
                    "moves, from 0 (required there; refused for other stages)")
        ->check(CLI::Range(0, 255));
    cmd->add_option("--timeout", a->timeout_s, "Seconds to wait for the migration")
        ->check(CLI::Range(1, 86400));
    cmd->add_flag("--json", a->json, "One JSON object");
    return [a] { return run_migrate(*a); };
  }
  auto* cmd = app.add_subcommand(
      "down", "Drain a running cluster (finish accepted jobs) and stop every node");
  cmd->add_option("manifest", a->manifest, "The cluster's manifest")->required();
  cmd->add_option("--timeout", a->timeout_s, "Seconds to wait for accepted jobs to finish")
      ->check(CLI::Range(1, 86400));
  return [a] { return run_down(*a); };
}

}  // namespace troupe::cli
