#pragma once

// Every message and every typed actor interface of troupe's runtime, in one
// place. Messages are small control structs; tensors never travel inside
// them: a message carries a `tensor_ref` that names a buffer held by the
// data plane (in one process: actors/tensor_registry.hpp).
//
// Bump `protocol_version` whenever a message's fields or an interface change.

#include <caf/all.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "models/sampling.hpp"

namespace troupe::actors {

inline constexpr std::uint32_t protocol_version = 13;

// -- atoms (CAF 0.17: at most 10 characters) ---------------------------------

using submit_atom = caf::atom_constant<caf::atom("submit")>;
using cancel_atom = caf::atom_constant<caf::atom("cancel")>;
using step_atom = caf::atom_constant<caf::atom("step")>;
using encode_atom = caf::atom_constant<caf::atom("encode")>;
using flush_atom = caf::atom_constant<caf::atom("flush")>;
using usage_atom = caf::atom_constant<caf::atom("usage")>;
using free_atom = caf::atom_constant<caf::atom("free")>;
using export_atom = caf::atom_constant<caf::atom("export")>;
using import_atom = caf::atom_constant<caf::atom("import")>;
using stats_atom = caf::atom_constant<caf::atom("stats")>;
using version_atom = caf::atom_constant<caf::atom("version")>;
using tick_atom = caf::atom_constant<caf::atom("tick")>;
using info_atom = caf::atom_constant<caf::atom("info")>;
using reset_atom = caf::atom_constant<caf::atom("reset")>;
using stage_atom = caf::atom_constant<caf::atom("stage")>;
using tp_atom = caf::atom_constant<caf::atom("tp")>;
using challenge_atom = caf::atom_constant<caf::atom("challenge")>;
using hello_atom = caf::atom_constant<caf::atom("hello")>;
using load_atom = caf::atom_constant<caf::atom("load")>;
using drop_atom = caf::atom_constant<caf::atom("drop")>;
using ping_atom = caf::atom_constant<caf::atom("ping")>;
using down_atom = caf::atom_constant<caf::atom("down")>;
using status_atom = caf::atom_constant<caf::atom("status")>;
using joined_atom = caf::atom_constant<caf::atom("joined")>;
using list_atom = caf::atom_constant<caf::atom("list")>;
using route_atom = caf::atom_constant<caf::atom("route")>;
using pause_atom = caf::atom_constant<caf::atom("pause")>;
using migrate_atom = caf::atom_constant<caf::atom("migrate")>;
using probe_atom = caf::atom_constant<caf::atom("probe")>;

// -- errors -------------------------------------------------------------------

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
  unavailable,  ///< the cluster is not serving now (placing the model, or shutting down)
};
const char* to_string(error_code c);
inline const caf::atom_value error_category = caf::atom("troupe");
/// A caf::error of troupe's category with a human-readable message.
caf::error make_error(error_code code, std::string message);
/// The code of a troupe error (0 for an error of another category).
std::uint8_t troupe_code(const caf::error& e);
/// "overloaded: the queue holds 64 requests (limit 64)" for troupe errors,
/// CAF's rendering otherwise.
std::string describe(caf::actor_system& sys, const caf::error& e);

// -- messages -----------------------------------------------------------------

/// Names a tensor held by the data plane: where it lives, what it is, and
/// the transfer that delivers it. transfer_id 0 = no tensor.
struct tensor_ref {
  std::string device;
  std::uint8_t dtype = 0;  ///< kernels::dtype
  std::vector<std::int64_t> shape;
  std::uint64_t transfer_id = 0;
  bool empty() const { return transfer_id == 0; }
  bool operator==(const tensor_ref&) const = default;
};

/// One encoded image (PNG or JPEG file bytes) of a request.
struct image_data {
  std::string name;  ///< for error messages (a file name)
  std::vector<std::uint8_t> bytes;
  bool operator==(const image_data&) const = default;
};

/// A generation request as the scheduler receives it.
struct generate_request {
  std::uint64_t id = 0;                     ///< unique per scheduler; never runs twice
  std::string prompt;                       ///< final prompt text (chat template already applied)
  std::vector<std::int32_t> prompt_tokens;  ///< used instead of `prompt` when not empty
  std::vector<image_data> images;           ///< one per <image> in the prompt
  models::sampling_params params;
  std::int64_t deadline_ms = 0;  ///< 0 = none; else milliseconds after admission
};

/// Admission answer to a submit.
struct submit_ack {
  std::uint64_t id = 0;
  std::int64_t queued = 0;  ///< requests waiting ahead of this one
  bool operator==(const submit_ack&) const = default;
};

/// Newly generated tokens and the text now safe to show.
struct token_event {
  std::uint64_t id = 0;
  std::vector<std::int32_t> tokens;
  std::string text;
  bool operator==(const token_event&) const = default;
};

/// The end of a request: why it ended and what it produced.
struct finish_event {
  std::uint64_t id = 0;
  std::string reason;  ///< stop | length | cancelled | deadline | error
  std::string error;   ///< message when reason == error
  std::vector<std::int32_t> tokens;
  std::string text;
  std::int64_t prompt_tokens = 0;
  std::int64_t preemptions = 0;
  double queue_ms = 0;       ///< submission to admission
  double ttft_ms = 0;        ///< submission to first token
  double total_ms = 0;       ///< submission to end
  bool stop_string = false;  ///< reason == stop because of a stop string (not a stop token)
  double preprocess_ms = 0;  ///< image decoding and preprocessing (all images)
  double encode_ms = 0;      ///< vision encoder batches this request's images were in
  bool operator==(const finish_event&) const = default;
};

/// How the last stage picks a sequence's next tokens: it samples on its own
/// device, so logits never leave it.
struct sample_work {
  models::sampling_params params;  ///< the request's (stop_token_ids end a multi-step run early)
  std::uint64_t draws = 0;         ///< the sampler's draw counter at the first token sampled here
  std::int64_t max_new = 1;  ///< tokens it may sample in this step (more than 1: multi-step decode)
  std::vector<std::int64_t> history;  ///< prompt and generated ids; only with a repetition penalty
  bool operator==(const sample_work& o) const {
    const auto& a = params;
    const auto& b = o.params;
    return a.temperature == b.temperature && a.top_k == b.top_k && a.top_p == b.top_p &&
           a.min_p == b.min_p && a.repetition_penalty == b.repetition_penalty && a.seed == b.seed &&
           a.max_tokens == b.max_tokens && a.stop_token_ids == b.stop_token_ids &&
           a.stop_strings == b.stop_strings && draws == o.draws && max_new == o.max_new &&
           history == o.history;
  }
};

/// One sequence's part of a pipeline step.
struct seq_work {
  std::int64_t seq = 0;              ///< scheduler's sequence id (same on every stage)
  std::int64_t start = 0;            ///< tokens already in the sequence's KV cache
  std::vector<std::int32_t> tokens;  ///< new tokens
  bool all_logits = false;
  std::int32_t embed_token = -1;  ///< tokens equal to it take rows of `embeddings`
  tensor_ref embeddings;          ///< f32 [count(embed_token), hidden]
  bool sample = false;            ///< the last stage samples its next token(s) (see `sampling`)
  sample_work sampling;
  bool operator==(const seq_work&) const = default;
};

/// A step for one stage: the sequences and, past the first stage, the
/// previous stage's activations.
struct step_batch {
  std::uint64_t step = 0;
  std::vector<seq_work> seqs;
  tensor_ref hidden;             ///< f32 [tokens, hidden] (none for the first stage)
  double compute_ms = 0;         ///< accumulated over the stages so far
  std::vector<double> stage_ms;  ///< each stage's own part of compute_ms, in pipeline order
  /// Multi-step decode: a stage that is the whole model (embedding and head)
  /// runs up to this many steps, feeding each sampled token back in, before
  /// it answers; every sequence must then sample, with a one-token input
  /// and no embeddings. Other stages refuse more than 1. It saves the round
  /// trip to the scheduler per token where steps are short (vLLM's
  /// multi-step scheduling).
  std::int32_t decode_steps = 1;
  bool return_logits = true;  ///< the last stage also returns the logits rows
  bool operator==(const step_batch&) const = default;
};

/// What the last stage returns: per sequence the tokens it sampled (empty
/// for a sequence that did not sample) and, when asked, the logits rows
/// (per sequence its last token, or all tokens when all_logits; of the
/// step's first pass).
struct step_output {
  std::uint64_t step = 0;
  tensor_ref logits;
  double compute_ms = 0;
  std::vector<double> stage_ms;  ///< each stage's part of compute_ms, in pipeline order
  std::vector<std::vector<std::int32_t>> sampled;
  std::int32_t passes = 1;  ///< decode passes run (multi-step)
  bool operator==(const step_output&) const = default;
};

/// What a shard holds.
struct shard_info {
  std::string device;
  std::int32_t first_layer = 0;
  std::int32_t last_layer = 0;
  bool embed = false;
  bool head = false;
  std::int64_t hidden = 0;
  std::int64_t vocab = 0;
  bool operator==(const shard_info&) const = default;
};

/// A KV store's occupancy.
struct kv_usage_info {
  std::string device;
  std::int64_t block_size = 0;
  std::int64_t total_blocks = 0;
  std::int64_t free_blocks = 0;
  std::int64_t sequences = 0;
  std::int64_t tokens = 0;
  bool operator==(const kv_usage_info&) const = default;
};

/// A sequence's KV blocks exported to host memory (swap or migration):
/// metadata here, the bytes behind `data`.
struct kv_export {
  std::int64_t seq = 0;
  std::int64_t length = 0;
  std::vector<std::int32_t> live;  ///< block positions that hold data
  tensor_ref data;                 ///< u8 [bytes]
  bool operator==(const kv_export&) const = default;
};

/// An image to encode.
struct encode_request {
  std::uint64_t request = 0;  ///< for logs and errors
  image_data image;
  bool operator==(const encode_request&) const = default;
};

/// An encoded image: projected features, ready for the first decoder stage.
struct encode_reply {
  tensor_ref embeddings;  ///< f32 [tokens, hidden]
  double preprocess_ms = 0;
  double encode_ms = 0;
  std::int64_t batch = 0;  ///< size of the batch it was encoded in
  bool operator==(const encode_reply&) const = default;
};

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
};

/// A node's supervision report.
struct node_status {
  std::int64_t restarts = 0;  ///< pipeline restarts so far
  bool failed = false;        ///< the restart limit was hit: the node gave up
  std::string last_failure;
  bool operator==(const node_status&) const = default;
};

// -- inspect (CAF 0.17 form) ----------------------------------------------------

template <class I>
typename I::result_type inspect(I& f, tensor_ref& x) {
  return f(caf::meta::type_name("tensor_ref"), x.device, x.dtype, x.shape, x.transfer_id);
}
template <class I>
typename I::result_type inspect(I& f, image_data& x) {
  return f(caf::meta::type_name("image_data"), x.name, x.bytes);
}
template <class I>
typename I::result_type inspect(I& f, generate_request& x) {
  return f(caf::meta::type_name("generate_request"), x.id, x.prompt, x.prompt_tokens, x.images,
           x.params, x.deadline_ms);
}
template <class I>
typename I::result_type inspect(I& f, submit_ack& x) {
  return f(caf::meta::type_name("submit_ack"), x.id, x.queued);
}
template <class I>
typename I::result_type inspect(I& f, token_event& x) {
  return f(caf::meta::type_name("token_event"), x.id, x.tokens, x.text);
}
template <class I>
typename I::result_type inspect(I& f, finish_event& x) {
  return f(caf::meta::type_name("finish_event"), x.id, x.reason, x.error, x.tokens, x.text,
           x.prompt_tokens, x.preemptions, x.queue_ms, x.ttft_ms, x.total_ms, x.stop_string,
           x.preprocess_ms, x.encode_ms);
}
template <class I>
typename I::result_type inspect(I& f, seq_work& x) {
  return f(caf::meta::type_name("seq_work"), x.seq, x.start, x.tokens, x.all_logits, x.embed_token,
           x.embeddings, x.sample, x.sampling);
}
template <class I>
typename I::result_type inspect(I& f, sample_work& x) {
  return f(caf::meta::type_name("sample_work"), x.params, x.draws, x.max_new, x.history);
}
template <class I>
typename I::result_type inspect(I& f, step_batch& x) {
  return f(caf::meta::type_name("step_batch"), x.step, x.seqs, x.hidden, x.compute_ms, x.stage_ms,
           x.decode_steps, x.return_logits);
}
template <class I>
typename I::result_type inspect(I& f, step_output& x) {
  return f(caf::meta::type_name("step_output"), x.step, x.logits, x.compute_ms, x.stage_ms,
           x.sampled, x.passes);
}
template <class I>
typename I::result_type inspect(I& f, shard_info& x) {
  return f(caf::meta::type_name("shard_info"), x.device, x.first_layer, x.last_layer, x.embed,
           x.head, x.hidden, x.vocab);
}
template <class I>
typename I::result_type inspect(I& f, kv_usage_info& x) {
  return f(caf::meta::type_name("kv_usage_info"), x.device, x.block_size, x.total_blocks,
           x.free_blocks, x.sequences, x.tokens);
}
template <class I>
typename I::result_type inspect(I& f, kv_export& x) {
  return f(caf::meta::type_name("kv_export"), x.seq, x.length, x.live, x.data);
}
template <class I>
typename I::result_type inspect(I& f, encode_request& x) {
  return f(caf::meta::type_name("encode_request"), x.request, x.image);
}
template <class I>
typename I::result_type inspect(I& f, encode_reply& x) {
  return f(caf::meta::type_name("encode_reply"), x.embeddings, x.preprocess_ms, x.encode_ms,
           x.batch);
}
template <class I>
typename I::result_type inspect(I& f, scheduler_stats& x) {
  return f(caf::meta::type_name("scheduler_stats"), x.queued, x.running, x.accepted, x.rejected,
           x.finished, x.preemptions, x.steps, x.kv_total_blocks, x.kv_used_blocks,
           x.kv_peak_blocks, x.prompt_tokens, x.generated_tokens, x.tokens_out, x.stages,
           x.step_rows, x.round_trip_ms, x.compute_ms, x.stage_compute_ms, x.in_flight_ms,
           x.scheduler_ms);
}

template <class I>
typename I::result_type inspect(I& f, node_status& x) {
  return f(caf::meta::type_name("node_status"), x.restarts, x.failed, x.last_failure);
}

// -- typed actor interfaces ----------------------------------------------------

/// Receives a request's stream (the scheduler sends these to the submitter).
using client_sink_actor =
    caf::typed_actor<caf::reacts_to<token_event>, caf::reacts_to<finish_event>>;

/// A contiguous range of decoder layers on one device. A non-last stage
/// forwards the step to the next stage; the last one answers with logits.
using shard_actor =
    caf::typed_actor<caf::replies_to<step_atom, step_batch>::with<step_output>,
                     caf::replies_to<info_atom>::with<shard_info>,
                     caf::replies_to<version_atom>::with<std::uint32_t>,
                     // Live migration: forward steps to this shard (a shard_actor) from now on.
                     caf::replies_to<route_atom, caf::strong_actor_ptr>::with<bool>>;

/// The paged KV blocks of one shard's layers, on the shard's device.
using kv_store_actor = caf::typed_actor<
    caf::replies_to<usage_atom>::with<kv_usage_info>,
    caf::replies_to<free_atom, std::vector<std::int64_t>>::with<std::int64_t>,
    caf::replies_to<export_atom, std::int64_t>::with<kv_export>,
    caf::replies_to<import_atom, kv_export>::with<std::int64_t>,
    caf::replies_to<reset_atom>::with<std::int64_t>,
    // Live migration: the sequences held, as (id, length) pairs flattened.
    caf::replies_to<list_atom>::with<std::vector<std::int64_t>>,
    // A sequence's blocks from a first block on, pushed to the process
    // whose data-plane key is given ("" or this one's: parked here).
    caf::replies_to<export_atom, std::int64_t, std::int32_t, std::string>::with<kv_export>,
    // Such an export: a new sequence (first block 0) or a delta
    // (import_tail) of one already here.
    caf::replies_to<import_atom, kv_export, std::int32_t>::with<std::int64_t>>;

/// A modality encoder (vision now) with dynamic, length-bucketed batching.
using encoder_actor =
    caf::typed_actor<caf::replies_to<encode_atom, encode_request>::with<encode_reply>,
                     caf::reacts_to<flush_atom, std::int64_t>,
                     caf::replies_to<version_atom>::with<std::uint32_t>>;

/// Admission, continuous batching and streaming for one model.
using scheduler_actor = caf::typed_actor<
    caf::replies_to<submit_atom, generate_request, client_sink_actor>::with<submit_ack>,
    caf::replies_to<cancel_atom, std::uint64_t>::with<bool>,
    caf::replies_to<stats_atom>::with<scheduler_stats>,
    caf::replies_to<version_atom>::with<std::uint32_t>, caf::reacts_to<tick_atom>,
    // From the node: the pipeline was restarted (every stage's KV is gone;
    // running requests recompute) or, with no stages, given up on.
    caf::reacts_to<reset_atom, std::vector<shard_actor>, std::vector<kv_store_actor>>,
    // From the node: the vision encoder was replaced.
    caf::reacts_to<reset_atom, encoder_actor>,
    // Live migration: use this encoder from now on; with `true`, the old
    // one is flushed and the answer comes once it has answered every
    // request sent to it.
    caf::replies_to<reset_atom, encoder_actor, bool>::with<bool>,
    // Live migration: stop issuing steps; the answer (the running count)
    // comes once no step is in flight.
    caf::replies_to<pause_atom>::with<std::int64_t>,
    // Stage i is now this shard and KV store; steps resume.
    caf::reacts_to<route_atom, std::int32_t, shard_actor, kv_store_actor>,
    // Resume without a change (a migration that gave up).
    caf::reacts_to<route_atom>>;

/// Supervises one node's actors: restarts the pipeline when a stage or KV
/// store dies (up to a limit, then gives up and fails the requests).
using node_actor =
    caf::typed_actor<caf::replies_to<stats_atom>::with<node_status>,
                     caf::reacts_to<reset_atom, scheduler_actor>>;  ///< whom to tell about restarts

/// A stage served by another process (`troupe worker`): its shard and KV
/// store, the layers it holds, and that process's transfer-engine address
/// (activations for the shard are pushed there). A tensor-parallel rank
/// (tp_size > 1) holds slice tp_rank of every layer in [first, last).
struct stage_handles {
  shard_actor shard;
  kv_store_actor kv;
  std::int32_t first_layer = 0;
  std::int32_t last_layer = 0;
  std::vector<std::uint8_t> engine_address;
  std::int32_t tp_rank = 0;
  std::int32_t tp_size = 1;
};

template <class I>
typename I::result_type inspect(I& f, stage_handles& x) {
  return f(caf::meta::type_name("stage_handles"), x.shard, x.kv, x.first_layer, x.last_layer,
           x.engine_address, x.tp_rank, x.tp_size);
}

/// The engine addresses of a tensor-parallel group's ranks, in rank order:
/// each rank connects its all-reduce ring to rank (r + 1) % size.
using tp_ring_addresses = std::vector<std::vector<std::uint8_t>>;

/// Hosts a stage for other processes (published by `troupe worker`). A
/// tensor-parallel rank also takes its group's ring (tp_atom; answers its
/// rank once connected).
using stage_host_actor =
    caf::typed_actor<caf::replies_to<stage_atom>::with<stage_handles>,
                     caf::replies_to<tp_atom, tp_ring_addresses>::with<std::int32_t>,
                     caf::replies_to<version_atom>::with<std::uint32_t>>;

// -- the cluster's gatekeeper ---------------------------------------------------

/// A node introducing itself to another node's gatekeeper: its name, its
/// protocol version, its certificate and its signature over the challenge
/// the gatekeeper gave this connection (cluster::verify_identity).
struct gate_hello {
  std::string node;
  std::uint32_t version = 0;
  std::string certificate_pem;
  std::vector<std::uint8_t> signature;
  bool operator==(const gate_hello&) const = default;
};

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
};

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
  bool operator==(const node_report&) const = default;
};

/// A node's agent, handed to the head in the gatekeeper's pass: it loads
/// and drops the stages the head places on the node, answers heartbeats,
/// and stops the node.
using node_agent_actor = caf::typed_actor<
    caf::replies_to<load_atom, stage_order>::with<stage_handles>,
    caf::replies_to<drop_atom>::with<std::int32_t>, caf::replies_to<ping_atom>::with<node_report>,
    caf::reacts_to<down_atom>,
    // Live migration: the stage starting at this layer forwards to
    // `next` (on node `name`) from now on.
    caf::replies_to<route_atom, std::int32_t, stage_handles, std::string>::with<bool>,
    // Live migration: makes the node of `handles` (named) reachable over
    // the data plane from this one.
    caf::replies_to<route_atom, stage_handles, std::string>::with<bool>,
    // Drops the stage starting at this layer (the others stay).
    caf::replies_to<drop_atom, std::int32_t>::with<std::int32_t>,
    // Live migration of an encoder: spawns it here ("vision") and
    // connects the data plane to the sender (the head) at this engine
    // address, where its embeddings go.
    caf::replies_to<load_atom, std::string, std::vector<std::uint8_t>>::with<encoder_actor>,
    // Stops the encoder spawned here.
    caf::replies_to<drop_atom, std::string>::with<std::int32_t>,
    // Link measurement: receives a tensor the head pushed over the
    // data plane and answers its size in bytes.
    caf::replies_to<probe_atom, tensor_ref>::with<std::int64_t>>;

/// One message of a chat (OpenAI's messages): its role, text and how many
/// of the job's images belong to it (in order).
struct chat_turn {
  std::string role;
  std::string content;
  std::int32_t images = 0;
  bool operator==(const chat_turn&) const = default;
};

/// A job as a client submits it: the user's prompt (the head applies the
/// model's chat template when there are images or `chat` is set), its
/// images and sampling. `id` is the client's (random; unique per cluster).
struct job_request {
  std::uint64_t id = 0;
  std::string prompt;
  std::string system;
  std::vector<image_data> images;
  bool chat = false;
  bool ignore_eos = false;       ///< decode max_tokens tokens whatever they are
  bool has_temperature = false;  ///< else the model's generation_config decides
  double temperature = 0.0;
  std::int64_t max_tokens = 128;
  std::uint64_t seed = 0;
  std::vector<std::string> stop_strings;
  std::int64_t deadline_ms = 0;
  /// A whole chat instead of prompt/system (always through the template).
  std::vector<chat_turn> turns;
  bool has_top_p = false;
  double top_p = 1.0;
  bool operator==(const job_request&) const = default;
};

/// One node as the head sees it.
struct member_view {
  std::string name;
  std::string host;
  std::int32_t port = 0;
  std::string state;         ///< joining | up | suspect | lost
  double last_seen_ms = -1;  ///< since its last heartbeat answer (-1: never)
  std::int64_t joins = 0;    ///< times it (re)joined
  node_report report;        ///< its last heartbeat answer
  bool operator==(const member_view&) const = default;
};

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
  bool operator==(const cluster_status&) const = default;
};

/// `troupe migrate`: what to move where. `shard` is a stage index
/// ("1", "stage1"), a layer range as `troupe status` prints it ("[1,2)")
/// or "vision" (the encoder); `to` is a node name.
struct migrate_request {
  std::string shard;
  std::string to;
  bool operator==(const migrate_request&) const = default;
};

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
typename I::result_type inspect(I& f, migrate_request& x) {
  return f(caf::meta::type_name("migrate_request"), x.shard, x.to);
}
template <class I>
typename I::result_type inspect(I& f, migrate_report& x) {
  return f(caf::meta::type_name("migrate_report"), x.what, x.from, x.to, x.total_ms, x.load_ms,
           x.pause_ms, x.rounds, x.sequences, x.kv_bytes, x.final_kv_bytes, x.weight_bytes);
}

/// The head's door for clients (handed out in the gatekeeper's pass to a
/// holder of the cluster's client certificate).
using frontdoor_actor =
    caf::typed_actor<caf::replies_to<submit_atom, job_request, client_sink_actor>::with<submit_ack>,
                     caf::replies_to<cancel_atom, std::uint64_t>::with<bool>,
                     caf::replies_to<status_atom>::with<cluster_status>,
                     caf::replies_to<down_atom>::with<bool>,
                     caf::replies_to<migrate_atom, migrate_request>::with<migrate_report>>;

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
typename I::result_type inspect(I& f, gate_hello& x) {
  return f(caf::meta::type_name("gate_hello"), x.node, x.version, x.certificate_pem, x.signature);
}
template <class I>
typename I::result_type inspect(I& f, gate_pass& x) {
  return f(caf::meta::type_name("gate_pass"), x.cluster, x.node, x.version, x.agent, x.door);
}
template <class I>
typename I::result_type inspect(I& f, stage_order& x) {
  return f(caf::meta::type_name("stage_order"), x.first_layer, x.last_layer, x.embed, x.head,
           x.epoch, x.has_next, x.next, x.next_node);
}
template <class I>
typename I::result_type inspect(I& f, device_probe& x) {
  return f(caf::meta::type_name("device_probe"), x.device, x.cores, x.gemv_f32, x.gemv_f16,
           x.gemv_q8_0, x.gemv_q4_0, x.gemm_f32, x.gemm_f16, x.gemm_q8_0, x.gemm_q4_0,
           x.memory_bytes, x.probe_ms);
}
template <class I>
typename I::result_type inspect(I& f, placement_decision& x) {
  return f(caf::meta::type_name("placement_decision"), x.at_s, x.trigger, x.action, x.plan,
           x.predicted_step_ms_before, x.predicted_step_ms_after, x.predicted_gain,
           x.measured_tps_before, x.measured_tps_after, x.state);
}
template <class I>
typename I::result_type inspect(I& f, node_report& x) {
  return f(caf::meta::type_name("node_report"), x.node, x.devices, x.stages, x.epoch, x.rss_bytes,
           x.weight_bytes, x.memory_limit, x.kv_used_blocks, x.kv_total_blocks, x.kv_tokens,
           x.failure, x.link_peers, x.link_bytes, x.probe, x.load, x.engine_address);
}
template <class I>
typename I::result_type inspect(I& f, job_request& x) {
  return f(caf::meta::type_name("job_request"), x.id, x.prompt, x.system, x.images, x.chat,
           x.ignore_eos, x.has_temperature, x.temperature, x.max_tokens, x.seed, x.stop_strings,
           x.deadline_ms, x.turns, x.has_top_p, x.top_p);
}
template <class I>
typename I::result_type inspect(I& f, chat_turn& x) {
  return f(caf::meta::type_name("chat_turn"), x.role, x.content, x.images);
}
template <class I>
typename I::result_type inspect(I& f, member_view& x) {
  return f(caf::meta::type_name("member_view"), x.name, x.host, x.port, x.state, x.last_seen_ms,
           x.joins, x.report);
}
template <class I>
typename I::result_type inspect(I& f, cluster_status& x) {
  return f(caf::meta::type_name("cluster_status"), x.cluster, x.head, x.ready, x.draining, x.epoch,
           x.placement, x.encoder, x.nodes, x.scheduler, x.replacements, x.last_event, x.detect_ms,
           x.resume_ms, x.actor_restarts, x.migrations, x.migration, x.migration_done,
           x.stages_total, x.stages_loaded, x.links, x.link_bytes, x.plan_detail, x.decisions,
           x.pipeline_detail);
}

/// The one actor a node publishes (over mutual TLS): it hands out a fresh
/// challenge per connecting node, and a pass (later: the node's actor
/// handles) only to a node of the manifest that signed that challenge with
/// the key of its certificate, speaking this protocol version.
using gatekeeper_actor =
    caf::typed_actor<caf::replies_to<challenge_atom>::with<std::vector<std::uint8_t>>,
                     caf::replies_to<hello_atom, gate_hello>::with<gate_pass>>;

/// Registers every message type above (needed to serialize them: between
/// processes, and in the round-trip test).
void register_protocol(caf::actor_system_config& cfg);

/// register_protocol plus the runtime's scheduler settings: one CAF worker
/// thread (the scheduler and client sinks are light; compute runs on the
/// device actors' own pinned threads) that polls briefly before sleeping, so
/// idle CAF workers do not take cycles from the devices' cores.
void configure_runtime(caf::actor_system_config& cfg);

}  // namespace troupe::actors

namespace troupe::models {
template <class I>
typename I::result_type inspect(I& f, sampling_params& x) {
  return f(caf::meta::type_name("sampling_params"), x.temperature, x.top_k, x.top_p, x.min_p,
           x.repetition_penalty, x.seed, x.max_tokens, x.stop_token_ids, x.stop_strings);
}
}  // namespace troupe::models
