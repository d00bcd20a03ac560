#pragma once

// The cluster's messages: the gatekeeper's handshake, the head's orders to
// nodes and their reports, jobs from clients, status and migration, and
// the typed interfaces of the node agent, the door and the gatekeeper.
// Part of actors/protocol.hpp.

#include "actors/protocol/messages.hpp"
#include "cluster/membership.hpp"

namespace troupe::actors {

// -- the cluster's gatekeeper ---------------------------------------------------

/// A node introducing itself to another node's gatekeeper: its name, its
/// protocol version, its certificate and its signature over the challenge
/// the gatekeeper gave this connection (cluster::verify_identity).
struct gate_hello {
  std::string node;
  std::uint32_t version = 0;
  std::string certificate_pem;
  std::vector<std::uint8_t> signature;
  /// The head's term (cluster/head_lease.hpp); 0 from other nodes.
  std::uint64_t term = 0;
  bool operator==(const gate_hello&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, gate_hello& x) {
  return f(caf::meta::type_name("gate_hello"), x.node, x.version, x.certificate_pem, x.signature,
           x.term);
}

// -- the cluster -----------------------------------------------------------------

/// The head's order to a node: hold decoder layers [first, last) of the
/// cluster's model for placement `epoch`. `next` is the following stage
/// (has_next false for the last one, which samples); `next_node` names its
/// node, which this node joins first (control and data plane) when it is
/// another one.
struct stage_order {
  std::int32_t first_layer = 0;
  std::int32_t last_layer = 0;
  bool embed = false;
  bool head = false;
  std::uint64_t epoch = 0;
  bool has_next = false;
  stage_handles next;
  std::string next_node;
  /// A tensor-parallel stage (tp_size > 1): this node holds slice tp_rank
  /// of every layer. Rank 0 is the stage's face (it has `next`, and the
  /// other ranks: their handles and nodes, loaded before it); the others
  /// have no next. Each rank's ring is connected by a tp_atom order once
  /// all are loaded.
  std::int32_t tp_rank = 0;
  std::int32_t tp_size = 1;
  std::vector<stage_handles> tp_peers;     ///< rank 0: ranks 1..tp_size-1
  std::vector<std::string> tp_peer_nodes;  ///< ... and their nodes
};

template <class I>
typename I::result_type inspect(I& f, stage_order& x) {
  return f(caf::meta::type_name("stage_order"), x.first_layer, x.last_layer, x.embed, x.head,
           x.epoch, x.has_next, x.next, x.next_node, x.tp_rank, x.tp_size, x.tp_peers,
           x.tp_peer_nodes);
}

/// A node's device as the node measured it when it started (placement's
/// device profile): GEMV weight bandwidth per format with the kernels the
/// stages run, GEMM throughput, and the memory troupe may use.
struct device_probe {
  std::string device;      ///< "cpu:0-0"
  std::int32_t cores = 0;  ///< worker threads (0: not measured)
  double gemv_f32 = 0, gemv_f16 = 0, gemv_q8_0 = 0, gemv_q4_0 = 0;  ///< weight bytes/s, one token
  /// Matrix-multiply FLOP/s per weight format, 16 rows (a decode batch).
  double gemm_f32 = 0, gemm_f16 = 0, gemm_q8_0 = 0, gemm_q4_0 = 0;
  std::int64_t memory_bytes =
      0;  ///< the manifest's limit (else available memory) less the node's own use at start
  double probe_ms = 0;  ///< how long measuring took
  bool operator==(const device_probe&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, device_probe& x) {
  return f(caf::meta::type_name("device_probe"), x.device, x.cores, x.gemv_f32, x.gemv_f16,
           x.gemv_q8_0, x.gemv_q4_0, x.gemm_f32, x.gemm_f16, x.gemm_q8_0, x.gemm_q4_0,
           x.memory_bytes, x.probe_ms);
}

/// What a node reports to the head's heartbeat.
struct node_report {
  std::string node;
  std::string devices;            ///< "cpu:0-0 (2 GiB)"
  std::string stages;             ///< "layers [0,2) on cpu:0-0" or empty
  std::uint64_t epoch = 0;        ///< placement its stages belong to
  std::int64_t rss_bytes = 0;     ///< the node process's resident memory
  std::int64_t weight_bytes = 0;  ///< weights its stages hold
  std::int64_t memory_limit = 0;  ///< the manifest's limit (0: none)
  std::int64_t kv_used_blocks = 0;
  std::int64_t kv_total_blocks = 0;
  std::int64_t kv_tokens = 0;  ///< tokens held in its KV caches
  std::string failure;         ///< a stage actor that stopped abnormally
  /// Data-plane bytes this process pushed, per peer process (keyed by the
  /// peer's CAF node id; the head names them).
  std::vector<std::string> link_peers;
  std::vector<std::int64_t> link_bytes;
  device_probe probe;  ///< measured at the node's start
  /// Share of its device's cores busy with work other than this node's,
  /// since the last report, in [0, 1].
  double load = 0;
  std::vector<std::uint8_t> engine_address;  ///< its data plane's address
  /// Where its resident memory goes: the device pool's blocks in use and
  /// cached (free, kept for reuse), and what malloc has handed out in all
  /// (the rest of the resident set is the binary, stacks, and heap pages
  /// malloc holds free).
  std::int64_t pool_in_use_bytes = 0;
  std::int64_t pool_cached_bytes = 0;
  std::int64_t malloc_bytes = 0;
  bool operator==(const node_report&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, node_report& x) {
  return f(caf::meta::type_name("node_report"), x.node, x.devices, x.stages, x.epoch, x.rss_bytes,
           x.weight_bytes, x.memory_limit, x.kv_used_blocks, x.kv_total_blocks, x.kv_tokens,
           x.failure, x.link_peers, x.link_bytes, x.probe, x.load, x.engine_address,
           x.pool_in_use_bytes, x.pool_cached_bytes, x.malloc_bytes);
}

/// The head's order to run (or stop) a modality encoder on a node.
struct encoder_order {
  encoder_kind kind = encoder_kind::vision;
  std::vector<std::uint8_t> head_address;  ///< load: the head's data-plane address
  bool operator==(const encoder_order&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, encoder_order& x) {
  return f(caf::meta::type_name("encoder_order"), x.kind, x.head_address);
}

/// A node's agent, handed to the head in the gatekeeper's pass: it loads
/// and drops the stages the head places on the node, answers heartbeats,
/// and stops the node.
/// The head's order for the cluster's KV store (a vault) on a node: its
/// size and whom it confirms whole blocks to (actors/kv_vault.hpp).
struct vault_order {
  std::int64_t slots = 0;
  std::int32_t layers = 0;
  std::int64_t layer_bytes = 0;
  scheduler_actor notify;
  bool operator==(const vault_order&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, vault_order& x) {
  return f(caf::meta::type_name("vault_order"), x.slots, x.layers, x.layer_bytes, x.notify);
}

using node_agent_actor = caf::typed_actor<
    caf::replies_to<load_atom, stage_order>::with<stage_handles>,
    caf::replies_to<drop_atom>::with<std::int32_t>, caf::replies_to<ping_atom>::with<node_report>,
    caf::reacts_to<down_atom>,
    // Live migration: the stage starting at this layer forwards to
    // `next` (on node `name`) from now on.
    caf::replies_to<relink_atom, std::int32_t, stage_handles, std::string>::with<bool>,
    // Live migration: makes the node of `handles` (named) reachable over
    // the data plane from this one.
    caf::replies_to<connect_atom, stage_handles, std::string>::with<bool>,
    // Drops the stage starting at this layer (the others stay).
    caf::replies_to<drop_stage_atom, std::int32_t>::with<std::int32_t>,
    // Live migration of an encoder: spawns one of the order's kind here
    // and connects the data plane to the sender (the head) at the order's
    // engine address, where its embeddings go.
    caf::replies_to<load_enc_atom, encoder_order>::with<encoder_actor>,
    // Stops the encoder of that kind spawned here.
    caf::replies_to<drop_enc_atom, encoder_order>::with<std::int32_t>,
    // Link measurement: receives a tensor the head pushed over the
    // data plane and answers its size in bytes.
    caf::replies_to<probe_atom, tensor_ref>::with<std::int64_t>,
    // Spawns the cluster's KV store here (replacing one spawned before).
    caf::replies_to<load_vault_atom, vault_order>::with<kv_vault_actor>,
    // A tensor-parallel stage (starting at this layer): its rank here sends
    // its all-reduces to `next` (the next rank, on node `name`).
    caf::replies_to<tp_atom, std::int32_t, stage_handles, std::string>::with<bool>,
    // Live migration of a rank: rank 0 of the stage at this layer finds
    // rank R at `peer` (on node `name`) from now on.
    caf::replies_to<tp_atom, std::int32_t, std::int32_t, stage_handles, std::string>::with<bool>>;

template <class I>
typename I::result_type inspect(I& f, chat_turn& x) {
  return f(caf::meta::type_name("chat_turn"), x.role, x.content, x.images, x.audios, x.videos);
}

template <class I>
typename I::result_type inspect(I& f, job_request& x) {
  return f(caf::meta::type_name("job_request"), x.id, x.prompt, x.system, x.images, x.audios,
           x.videos, x.chat, x.ignore_eos, x.has_temperature, x.temperature, x.max_tokens, x.seed,
           x.stop_strings, x.deadline_ms, x.turns, x.has_top_p, x.top_p, x.has_repetition_penalty,
           x.repetition_penalty, x.presence_penalty, x.frequency_penalty, x.logit_bias_ids,
           x.logit_bias_values, x.min_tokens, x.stop_token_ids, x.logprobs, x.prompt_ids, x.grammar,
           x.cache_salt, x.priority);
}

/// One node as the head sees it.
struct member_view {
  std::string name;
  std::string host;
  std::int32_t port = 0;
  cluster::member_state state = cluster::member_state::joining;
  double last_seen_ms = -1;  ///< since its last heartbeat answer (-1: never)
  std::int64_t joins = 0;    ///< times it (re)joined
  node_report report;        ///< its last heartbeat answer
  bool operator==(const member_view&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, member_view& x) {
  return f(caf::meta::type_name("member_view"), x.name, x.host, x.port, x.state, x.last_seen_ms,
           x.joins, x.report);
}

/// One placement decision of the head, with what it predicted and what it
/// measured (`troupe status`). Throughputs are generated tokens per second
/// over the window before the decision and a window after it settled; -1
/// until measured.
struct placement_decision {
  double at_s = 0;      ///< seconds since the head started
  std::string trigger;  ///< "start", "node n2 joined", "load", "memory", "node n1 lost"
  std::string action;   ///< what was done ("stay" when nothing moved)
  std::string plan;     ///< the plan in force afterwards
  double predicted_step_ms_before = -1, predicted_step_ms_after = -1;
  double predicted_gain = 0;  ///< throughput: before step / after step - 1
  double measured_tps_before = -1, measured_tps_after = -1;
  std::string state;  ///< "measuring", "measured", "applied", "failed: ..."
  bool operator==(const placement_decision&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, placement_decision& x) {
  return f(caf::meta::type_name("placement_decision"), x.at_s, x.trigger, x.action, x.plan,
           x.predicted_step_ms_before, x.predicted_step_ms_after, x.predicted_gain,
           x.measured_tps_before, x.measured_tps_after, x.state);
}

/// One replica of the model's pipeline (parallelism.replicas) as the head
/// sees it: where it runs and how loaded it is.
struct replica_view {
  std::int32_t index = 0;
  std::vector<std::string> nodes;  ///< the nodes it places on
  std::string placement;           ///< its stages, "" while it has none
  bool ready = false;              ///< placed and serving
  /// "serving", "placing", "waiting" (none of its nodes is up), "draining"
  /// (scaled away: finishing its requests) or "retired".
  std::string state;
  std::uint64_t epoch = 0;  ///< its placement's number
  std::int64_t running = 0, queued = 0;
  std::int64_t kv_total_blocks = 0, kv_used_blocks = 0;
  std::int64_t finished = 0;
  std::int64_t routed = 0;         ///< jobs the router sent it
  std::int64_t replacements = 0;   ///< placed again after losing a node
  double resume_ms = -1;           ///< its last loss: "lost" to serving again
  std::int64_t cached_blocks = 0;  ///< blocks in the head's index of its cache
  bool operator==(const replica_view&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, replica_view& x) {
  return f(caf::meta::type_name("replica_view"), x.index, x.nodes, x.placement, x.ready, x.state,
           x.epoch, x.running, x.queued, x.kv_total_blocks, x.kv_used_blocks, x.finished, x.routed,
           x.replacements, x.resume_ms, x.cached_blocks);
}

/// The cluster as the head sees it (`troupe status`).
struct cluster_status {
  std::string cluster;
  std::string head;
  bool ready = false;       ///< the model is placed and the scheduler runs
  bool draining = false;    ///< `troupe down` is under way
  std::uint64_t epoch = 0;  ///< placements so far
  std::string placement;    ///< "node0 [0,2) -> node1 [2,4)"
  std::string encoder;      ///< where the vision encoder runs
  std::vector<member_view> nodes;
  scheduler_stats scheduler;
  std::int64_t replacements = 0;  ///< re-placements after a node loss
  std::string last_event;
  double detect_ms = -1;            ///< last loss: last heartbeat answer to "lost"
  double resume_ms = -1;            ///< last loss: "lost" to the new pipeline running
  std::int64_t actor_restarts = 0;  ///< stage actors spawned again after a loss
  std::int64_t migrations = 0;      ///< live shard migrations done
  std::string migration;            ///< the live migration under way ("" when none): its phase
  double migration_done = 0;        ///< its progress, 0 to 1
  std::int32_t stages_total = 0;    ///< stages of the placement under way (or done)
  std::int32_t stages_loaded = 0;   ///< of those, loaded so far
  /// Data-plane bytes sent per link, "from->to" by node name.
  std::vector<std::string> links;
  std::vector<std::int64_t> link_bytes;
  /// The planner's view (pipeline_stages = "auto"): the plan in force with
  /// its predicted stage times, and every decision so far.
  std::string plan_detail;
  std::vector<placement_decision> decisions;
  /// Where the pipeline's time went over the last ~10 s (measured;
  /// pipeline_stats.hpp), "" before there are two samples.
  std::string pipeline_detail;
  /// The head's index of the pipeline's cached KV blocks (followed from the
  /// scheduler's block events, for routing): blocks per tier (device, host,
  /// disk, store), and the events taken in.
  std::vector<std::int64_t> indexed_blocks;
  std::uint64_t block_events = 0;
  /// The cluster's KV store (kv.store_tokens): its node ("" when none runs
  /// now), and how many were ordered so far (one more after its node came back).
  std::string kv_store;
  std::int64_t kv_stores = 0;
  /// Each replica (one entry with one), and the router's choices so far:
  /// jobs sent where their prefix was cached, and by load alone.
  std::vector<replica_view> replicas;
  std::int64_t routed_by_prefix = 0;
  std::int64_t routed_by_load = 0;
  /// The vision encoder's replicas ([encoders.vision]): where each runs
  /// ("node device") and its state ("serving", "loading", "draining"),
  /// the first being `encoder`; images waiting at an encoder and their
  /// mean wait over the last heartbeat (-1: none answered); replicas
  /// added and drained so far; the manifest's bounds.
  std::vector<std::string> encoder_replicas;
  std::vector<std::string> encoder_states;
  std::int64_t encoder_waiting = 0;
  double encoder_wait_ms = -1;
  std::int64_t encoder_scale_ups = 0, encoder_scale_downs = 0;
  std::int32_t encoder_min = 0, encoder_max = 0;
  /// The standby head ([cluster] standby): "" none; else what it does
  /// ("following", "not connected: why", ...); the head's term and the jobs
  /// its journal holds now.
  std::string standby;
  std::uint64_t term = 0;
  std::int64_t journal_jobs = 0;
  bool operator==(const cluster_status&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, cluster_status& x) {
  return f(caf::meta::type_name("cluster_status"), x.cluster, x.head, x.ready, x.draining, x.epoch,
           x.placement, x.encoder, x.nodes, x.scheduler, x.replacements, x.last_event, x.detect_ms,
           x.resume_ms, x.actor_restarts, x.migrations, x.migration, x.migration_done,
           x.stages_total, x.stages_loaded, x.links, x.link_bytes, x.plan_detail, x.decisions,
           x.pipeline_detail, x.indexed_blocks, x.block_events, x.kv_store, x.kv_stores, x.replicas,
           x.routed_by_prefix, x.routed_by_load, x.encoder_replicas, x.encoder_states,
           x.encoder_waiting, x.encoder_wait_ms, x.encoder_scale_ups, x.encoder_scale_downs,
           x.encoder_min, x.encoder_max, x.standby, x.term, x.journal_jobs);
}

/// The head's journal, for its standby: a job accepted (with what its
/// scheduler was given: tokens, images, parameters) or ended.
struct journal_entry {
  std::uint64_t id = 0;
  bool ended = false;
  generate_request req;  ///< when begun
};

template <class I>
typename I::result_type inspect(I& f, journal_entry& x) {
  return f(caf::meta::type_name("journal_entry"), x.id, x.ended, x.req);
}

/// The head's answer to its standby: its term and (on the first ask)
/// every job it holds.
struct journal_state {
  std::uint64_t term = 0;
  std::vector<journal_entry> jobs;
};

template <class I>
typename I::result_type inspect(I& f, journal_state& x) {
  return f(caf::meta::type_name("journal_state"), x.term, x.jobs);
}

/// `troupe migrate`: what to move where. `shard` is a stage index
/// ("1", "stage1"), a layer range as `troupe status` prints it ("[1,2)")
/// or "vision" (the encoder); `to` is a node name; `replica` the stage's
/// replica (parallelism.replicas; 0 with one).
struct migrate_request {
  std::string shard;
  std::string to;
  std::int32_t replica = 0;
  /// Of a tensor-parallel stage: the rank that moves (-1: none named).
  std::int32_t rank = -1;
  bool operator==(const migrate_request&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, migrate_request& x) {
  return f(caf::meta::type_name("migrate_request"), x.shard, x.to, x.replica, x.rank);
}

/// What a migration did and what it cost.
struct migrate_report {
  std::string what;         ///< "layers [1,2)" or "vision encoder"
  std::string from, to;     ///< node names
  double total_ms = 0;      ///< the request to the old actor's stop
  double load_ms = 0;       ///< the new actor's weights loaded (target's own files)
  double pause_ms = 0;      ///< steps held: pause to resume
  std::int32_t rounds = 0;  ///< KV copy rounds while decoding went on (the final delta not counted)
  std::int64_t sequences = 0;       ///< sequences whose KV moved
  std::int64_t kv_bytes = 0;        ///< KV bytes copied, all rounds
  std::int64_t final_kv_bytes = 0;  ///< of those, copied during the pause
  std::int64_t weight_bytes = 0;    ///< weights the new actor holds
  bool operator==(const migrate_report&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, migrate_report& x) {
  return f(caf::meta::type_name("migrate_report"), x.what, x.from, x.to, x.total_ms, x.load_ms,
           x.pause_ms, x.rounds, x.sequences, x.kv_bytes, x.final_kv_bytes, x.weight_bytes);
}

/// The head's door for clients (handed out in the gatekeeper's pass to a
/// holder of the cluster's client certificate).
/// A prompt's tokens as the head renders them (the chat template applied
/// for a chat), and the context length served.
struct tokenize_reply {
  std::vector<std::int32_t> tokens;
  std::int64_t context_length = 0;  ///< 0: no limit but the KV cache's
  bool operator==(const tokenize_reply&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, tokenize_reply& x) {
  return f(caf::meta::type_name("tokenize_reply"), x.tokens, x.context_length);
}

using frontdoor_actor =
    caf::typed_actor<caf::replies_to<submit_atom, job_request, client_sink_actor>::with<submit_ack>,
                     caf::replies_to<tokenize_atom, job_request>::with<tokenize_reply>,
                     caf::replies_to<detokenize_atom, std::vector<std::int32_t>>::with<std::string>,
                     caf::replies_to<reset_cache_atom>::with<std::int64_t>,
                     caf::replies_to<cancel_atom, std::uint64_t>::with<bool>,
                     // A piece of a job's streamed audio clip (job_request's
                     // last clip with media_data::stream): answered once its
                     // windows are encoded.
                     caf::replies_to<chunk_atom, audio_chunk>::with<stream_progress>,
                     caf::replies_to<status_atom>::with<cluster_status>,
                     caf::replies_to<down_atom>::with<bool>,
                     caf::replies_to<migrate_atom, migrate_request>::with<migrate_report>,
                     caf::replies_to<scale_atom, std::int32_t>::with<std::string>,
                     // The standby (its node only): follow this head; `true` the
                     // first time (the answer then holds every job), then as a
                     // heartbeat. The head then sends it journal entries.
                     caf::replies_to<follow_atom, bool>::with<journal_state>,
                     caf::reacts_to<journal_atom, std::vector<journal_entry>>,
                     // A client whose head was lost: stream job `id` to this sink
                     // from the tokens it already has on (a standby that took over).
                     caf::replies_to<attach_atom, std::uint64_t, std::vector<std::int32_t>,
                                     client_sink_actor>::with<submit_ack>>;

/// The gatekeeper's answer once the caller proved who it is: to another
/// node, the node's agent; to a client, the head's door.
struct gate_pass {
  std::string cluster;
  std::string node;  ///< the gatekeeper's node
  std::uint32_t version = 0;
  node_agent_actor agent;
  frontdoor_actor door;
  bool operator==(const gate_pass&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, gate_pass& x) {
  return f(caf::meta::type_name("gate_pass"), x.cluster, x.node, x.version, x.agent, x.door);
}

/// The one actor a node publishes (over mutual TLS): it hands out a fresh
/// challenge per connecting node, and a pass (later: the node's actor
/// handles) only to a node of the manifest that signed that challenge with
/// the key of its certificate, speaking this protocol version.
using gatekeeper_actor =
    caf::typed_actor<caf::replies_to<challenge_atom>::with<std::vector<std::uint8_t>>,
                     caf::replies_to<hello_atom, gate_hello>::with<gate_pass>>;

}  // namespace troupe::actors
