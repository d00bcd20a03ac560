#pragma once

// The node manifest: a TOML file that describes a cluster (its name, head
// node, certificate directory, nodes with their devices, the model,
// parallelism, scheduler limits and transport settings). Parsed and
// validated here, as plain data; docs/manifest.md is the reference and
// examples/local.toml a commented example.
//
// Validation reports every problem at once, each with the file, line and
// key ("local.toml:14: nodes[1].devices[0].type: expected cpu, cuda or
// npu, got 'gpu'"); unknown keys are errors, so a typo never passes
// silently.

#include <cstdint>
#include <expected>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace troupe::cluster {

enum class device_type { cpu, cuda, npu };
const char* to_string(device_type t);

struct device_entry {
  device_type type = device_type::cpu;
  /// cpu: a core or an inclusive range of cores ("3", "0-7"); empty: every
  /// core of the node.
  std::string cores;
  /// cuda / npu: the device index.
  int index = 0;
  /// Memory this device may use for weights and KV, bytes (0: no limit).
  std::uint64_t memory_bytes = 0;
  int line = 0;
  /// "cpu", "cpu:0-3", "cuda:1" (the form --device takes).
  std::string spec() const;
};

struct node_entry {
  std::string name;
  std::string host;  ///< address the node binds and is reached at
  int port = 0;      ///< its control-plane (CAF, TLS) port
  std::vector<device_entry> devices;
  std::string model_path;  ///< the model on this node (empty: the cluster's)
  /// "stages" (the default): it may hold stages and encoders; "kv": it
  /// holds neither, only the cluster's KV store (kv.store_node); "head"
  /// (the head only): it holds no stage, only what the head runs (the
  /// schedulers, the router, the first vision encoder replica).
  std::string role = "stages";
  int line = 0;
  bool holds_stages() const { return role == "stages"; }
};

struct model_entry {
  /// A Hugging Face folder or GGUF file; "bundled" is the bundled tiny
  /// LLaVA. Relative paths are relative to the manifest's directory.
  std::string path = "bundled";
  std::string quant;  ///< default weight format (empty: as stored)
  std::vector<std::pair<std::string, std::string>> overrides;  ///< tensor-name pattern -> format
  std::string kv_type = "f32";
  std::int64_t ctx_tokens = 8192;  ///< KV capacity per stage, tokens
};

/// Lower tiers of every stage's KV store (docs/kv-cache.md), in tokens
/// like model.ctx.
struct kv_entry {
  std::int64_t host_tokens = 0;
  std::int64_t disk_tokens = 0;
  std::string disk_dir;  ///< resolved against the manifest's directory; empty: the temp folder
  /// The remote tier: a KV store holding a copy of every full block, so
  /// that a lost stage's KV is restored, not recomputed.
  std::int64_t store_tokens = 0;
  /// The node whose process runs the store: empty: the node of role "kv",
  /// if there is one, else the head.
  std::string store_node;
};

struct parallelism_entry {
  /// Pipeline stages; 0 = "auto" (the placement decides).
  int pipeline_stages = 0;
  int tensor_parallel = 1;
  /// Copies of the model's pipeline, each on its own nodes; 0 = "auto"
  /// (as many as the nodes hold).
  int replicas = 1;
};

/// How the head chooses a replica for each job (docs/manifest.md).
struct router_entry {
  /// Send a job where the longest prefix of its prompt is cached...
  bool prefix = true;
  /// ... unless that replica has this many more requests (waiting and
  /// running) than the least loaded one.
  int max_imbalance = 4;
  /// ... and only when it holds at least this share of the prompt's full
  /// blocks more than the least loaded replica (a chat template's few
  /// blocks, which every prompt shares, do not pull jobs together).
  double min_prefix_share = 0.5;
};

/// A modality encoder's replicas (docs/manifest.md, [encoders.vision]):
/// between min and max of them, one per node at most, added when images
/// queue or wait too long, drained after a quiet cooldown.
struct encoder_service_entry {
  int min = 1;
  int max = 1;
  double up_queue = 4;          ///< images waiting per replica past which it is overloaded
  double up_latency_ms = 1000;  ///< ... or the mean wait of an image past which it is
  double up_after_s = 2;        ///< overloaded this long: one replica more
  double down_after_s = 60;     ///< quiet this long: one replica fewer
};

struct encoders_entry {
  encoder_service_entry vision;
};

/// How the head places the model and re-plans (docs/manifest.md). The
/// policy runs with parallelism.pipeline_stages = "auto".
struct placement_entry {
  double wait_for_nodes_s =
      60;  ///< first placement: wait this long for every node, then place on those up
  bool rebalance = true;         ///< let the policy move shards (load, memory, a node joining)
  double interval_s = 5;         ///< how often the policy looks
  double gain_threshold = 0.15;  ///< move only for this much faster predicted steps
  double cooldown_s = 60;        ///< a shard that moved stays this long
  double memory_pressure =
      0.9;  ///< a device needing more than this share of its memory sheds shards
  double measure_s =
      20;  ///< a decision's effect: tokens/s over this long before it and after it settled
  double load_half_life_s =
      30;  ///< measured loads are smoothed with this half-life (0: taken as they come)
};

struct scheduler_entry {
  std::int64_t queue_limit = 64;
  std::int64_t max_running = 64;
  std::int64_t token_budget = 512;
  int micro_batches = 0;            ///< 0: one per pipeline stage
  std::int64_t max_model_len = 0;   ///< 0: the model's positions
  bool allow_long_context = false;  ///< max_model_len past the model's positions
  bool prefix_caching = true;       ///< keep and share full KV blocks between requests
  double stream_idle_s = 30;        ///< a streamed audio clip silent this long fails its request
};

struct transport_entry {
  std::string tls;          ///< UCX transports (UCX_TLS); empty: UCX's choice
  std::string net_devices;  ///< UCX network devices; empty: UCX's choice
  std::int64_t timeout_ms = 30000;
};

/// What a request's media may be (docs/audio.md): how many of each kind a
/// request may hold (vLLM's limit_mm_per_prompt), and what a video may be.
struct media_entry {
  std::int64_t max_images = 16;  ///< per request
  std::int64_t max_audios = 16;
  std::int64_t max_videos = 4;
  std::int64_t video_frames = 8;       ///< frames sampled from a video the request says nothing of
  std::int64_t max_video_frames = 64;  ///< frames a request may ask for
  double max_video_seconds = 600;      ///< a video's duration
  std::int64_t max_video_side = 4096;  ///< its frames' width and height
};

struct manifest {
  std::string path;  ///< the file it came from
  std::string dir;   ///< its directory (relative paths resolve here)
  std::string name;
  std::string head;  ///< name of the head node
  /// A standby head (empty: none): the node that follows the head's jobs
  /// and takes over, with a higher term, when the head is lost.
  std::string standby;
  std::string certs_dir;  ///< resolved against dir
  /// Command that starts a node on another host; {host}, {name},
  /// {manifest} are replaced. Loopback hosts run as local processes.
  std::string launch = "ssh {host} troupe node --manifest {manifest} --name {name}";
  model_entry model;
  kv_entry kv;
  parallelism_entry parallelism;
  router_entry router;
  encoders_entry encoders;
  media_entry media;
  placement_entry placement;
  scheduler_entry scheduler;
  transport_entry transport;
  std::vector<node_entry> nodes;

  const node_entry* node(std::string_view name) const;
  const node_entry& head_node() const { return *node(head); }
  /// The model path node `n` loads, resolved ("bundled" stays as is).
  std::string model_path_of(const node_entry& n) const;
};

/// Every problem found, one message each, "FILE:LINE: KEY: what".
struct manifest_error {
  std::vector<std::string> messages;
  std::string text() const;  ///< the messages, one per line
};

/// Reads and validates a manifest file.
std::expected<manifest, manifest_error> load_manifest(const std::string& path);
/// Validates manifest text; `path` names it in messages and anchors
/// relative paths.
std::expected<manifest, manifest_error> parse_manifest(std::string_view text,
                                                       const std::string& path);

/// Whether a node at `host` runs on this machine (started as a local
/// process rather than through the launch command).
bool is_loopback(std::string_view host);

/// "16GiB", "512 MiB", "2G", "1000000": bytes; nothing for anything else.
std::optional<std::uint64_t> parse_bytes(std::string_view s);

}  // namespace troupe::cluster
