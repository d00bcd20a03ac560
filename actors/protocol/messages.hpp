#pragma once

// Requests, their streams, pipeline steps, KV and encoder messages, and the
// typed interfaces of the actors that exchange them. Part of
// actors/protocol.hpp.

#include "actors/protocol/base.hpp"
#include "actors/protocol/jobs.hpp"

namespace troupe::actors {

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

template <class I>
typename I::result_type inspect(I& f, tensor_ref& x) {
  return f(caf::meta::type_name("tensor_ref"), x.device, x.dtype, x.shape, x.transfer_id);
}

template <class I>
typename I::result_type inspect(I& f, media_data& x) {
  return f(caf::meta::type_name("media_data"), x.name, x.bytes, x.kind, x.num_frames, x.fps,
           x.audio, x.stream);
}

/// A piece of request `id`'s streamed clip (media_data::stream): mono
/// 16 kHz PCM, signed 16-bit little-endian samples; `last` ends the clip
/// (it may carry samples too). `index` is the clip's place among the
/// request's media (the scheduler sets it for the encoder).
struct audio_chunk {
  std::uint64_t id = 0;
  std::int32_t index = -1;
  std::vector<std::uint8_t> pcm;
  bool last = false;
  bool operator==(const audio_chunk&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, audio_chunk& x) {
  return f(caf::meta::type_name("audio_chunk"), x.id, x.index, x.pcm, x.last);
}

/// A streamed clip so far: the samples taken, and the rows of its leading
/// windows that are encoded (the prompt holds that many of its tokens);
/// `done`: the last chunk came and every window is encoded.
struct stream_progress {
  std::int64_t samples = 0;
  std::int64_t rows = 0;
  bool done = false;
  bool operator==(const stream_progress&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, stream_progress& x) {
  return f(caf::meta::type_name("stream_progress"), x.samples, x.rows, x.done);
}

/// A generation request as the scheduler receives it.
struct generate_request {
  std::uint64_t id = 0;                     ///< unique per scheduler; never runs twice
  std::string prompt;                       ///< final prompt text (chat template already applied)
  std::vector<std::int32_t> prompt_tokens;  ///< used instead of `prompt` when not empty
  /// One per media placeholder of the prompt (<image>, <audio>, <video>), in the
  /// prompt's order.
  std::vector<media_data> media;
  /// The tokens (rows) of each audio clip of `media`, in order: the prompt
  /// worker decoded the clips to count them (the encoder's rows must agree).
  std::vector<std::int64_t> audio_tokens;
  /// The tokens (rows) of each video of `media`, in order: its sampled
  /// frames (the prompt worker read the file's headers) x the model's
  /// tokens per frame, plus its audio track's tokens when asked for.
  std::vector<std::int64_t> video_tokens;
  models::sampling_params params;
  std::int64_t deadline_ms = 0;  ///< 0 = none; else milliseconds after admission
  std::string grammar;           ///< GBNF the output must follow (empty: none)
  std::string cache_salt;        ///< prefix caching: requests share KV only with the same salt
  std::int32_t priority = 0;     ///< vLLM's: a lower value is admitted first, and may preempt
  /// Resumed after a head's loss: the tokens already generated, which the
  /// client has (core::request_spec::resumed); events carry only later ones.
  std::vector<std::int32_t> resumed;
};

template <class I>
typename I::result_type inspect(I& f, generate_request& x) {
  return f(caf::meta::type_name("generate_request"), x.id, x.prompt, x.prompt_tokens, x.media,
           x.audio_tokens, x.video_tokens, x.params, x.deadline_ms, x.grammar, x.cache_salt,
           x.priority, x.resumed);
}

/// Admission answer to a submit.
struct submit_ack {
  std::uint64_t id = 0;
  std::int64_t queued = 0;         ///< requests waiting ahead of this one
  std::int64_t prompt_tokens = 0;  ///< the prompt's tokens (images' rows included)
  bool operator==(const submit_ack&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, submit_ack& x) {
  return f(caf::meta::type_name("submit_ack"), x.id, x.queued, x.prompt_tokens);
}

/// Newly generated tokens and the text now safe to show.
struct token_event {
  std::uint64_t id = 0;
  std::vector<std::int32_t> tokens;
  std::string text;
  /// With logprobs asked for: one per token of `tokens`, with its pieces.
  std::vector<models::token_logprob> logprobs;
  bool operator==(const token_event&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, token_event& x) {
  return f(caf::meta::type_name("token_event"), x.id, x.tokens, x.text, x.logprobs);
}

template <class I>
typename I::result_type inspect(I& f, finish_event& x) {
  return f(caf::meta::type_name("finish_event"), x.id, x.reason, x.code, x.error, x.tokens, x.text,
           x.prompt_tokens, x.preemptions, x.queue_ms, x.ttft_ms, x.total_ms, x.stop_string,
           x.preprocess_ms, x.encode_ms, x.cached_tokens);
}

/// How the last stage picks a sequence's next tokens: it samples on its own
/// device, so logits never leave it.
struct sample_work {
  models::sampling_params params;  ///< the request's (stop_token_ids end a multi-step run early)
  std::uint64_t draws = 0;         ///< the sampler's draw counter at the first token sampled here
  std::int64_t max_new = 1;  ///< tokens it may sample in this step (more than 1: multi-step decode)
  std::vector<std::int64_t> history;  ///< prompt and generated ids; only with a penalty
  /// A grammar's mask for this token: a bit per vocabulary id (64 a word);
  /// empty: every token may come. Only with max_new 1.
  std::vector<std::uint64_t> allowed;
  bool operator==(const sample_work& o) const {
    const auto& a = params;
    const auto& b = o.params;
    return a.temperature == b.temperature && a.top_k == b.top_k && a.top_p == b.top_p &&
           a.min_p == b.min_p && a.repetition_penalty == b.repetition_penalty &&
           a.presence_penalty == b.presence_penalty && a.frequency_penalty == b.frequency_penalty &&
           a.seed == b.seed && a.max_tokens == b.max_tokens &&
           a.stop_token_ids == b.stop_token_ids && a.stop_strings == b.stop_strings &&
           a.bias_ids == b.bias_ids && a.bias_values == b.bias_values &&
           a.min_tokens == b.min_tokens && a.logprobs == b.logprobs && draws == o.draws &&
           max_new == o.max_new && history == o.history && allowed == o.allowed;
  }
};

template <class I>
typename I::result_type inspect(I& f, sample_work& x) {
  return f(caf::meta::type_name("sample_work"), x.params, x.draws, x.max_new, x.history, x.allowed);
}

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
  /// The scheduler names the blocks (prefix caching): the sequence's block
  /// table from entry `blocks_from` on is `blocks` (-1: unchanged). A new
  /// sequence then may start at `start` > 0: cached blocks hold those tokens.
  std::int32_t blocks_from = -1;
  std::vector<std::int32_t> blocks;
  bool operator==(const seq_work&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, seq_work& x) {
  return f(caf::meta::type_name("seq_work"), x.seq, x.start, x.tokens, x.all_logits, x.embed_token,
           x.embeddings, x.sample, x.sampling, x.blocks_from, x.blocks);
}

/// Blocks of the remote KV tier (actors/kv_vault.hpp): remote slots, the
/// name of the block each holds, and a run of layers. A stage puts the rows
/// of its layers of each block (layer-major, as kv_cache::read_block lays
/// them out) and gets them back; the vault confirms to the scheduler the
/// slots whose every layer it holds under one name (no data then).
struct vault_blocks {
  std::vector<std::int32_t> slots;
  std::vector<std::array<std::uint8_t, 32>> names;  ///< one per slot
  std::int32_t first_layer = 0;
  std::int32_t layers = 0;
  tensor_ref data;   ///< put: u8 [slots x layers x bytes of a layer's block]
  std::string dest;  ///< get: the data-plane key of the process to send the rows to
  std::vector<std::uint8_t> dest_address;  ///< ... and its engine address (connected once)
  bool operator==(const vault_blocks&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, vault_blocks& x) {
  return f(caf::meta::type_name("vault_blocks"), x.slots, x.names, x.first_layer, x.layers, x.data,
           x.dest, x.dest_address);
}

/// What a vault holds and did.
struct vault_info {
  std::int64_t slots = 0;
  std::int32_t layers = 0;
  std::int64_t layer_bytes = 0;  ///< one layer's rows of one block (0: nothing stored yet)
  std::int64_t bytes = 0;        ///< held now
  std::int64_t complete = 0;     ///< slots holding every layer under one name
  std::int64_t puts = 0, gets = 0, refused = 0;
  bool operator==(const vault_info&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, vault_info& x) {
  return f(caf::meta::type_name("vault_info"), x.slots, x.layers, x.layer_bytes, x.bytes,
           x.complete, x.puts, x.gets, x.refused);
}

/// The remote KV tier's store: copies of full blocks, per layer, on a node
/// apart from the stages (actors/kv_vault.hpp).
using kv_vault_actor =
    caf::typed_actor<caf::reacts_to<vault_put_atom, vault_blocks>,
                     caf::replies_to<vault_get_atom, vault_blocks>::with<tensor_ref>,
                     caf::replies_to<usage_atom>::with<vault_info>>;

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
  /// Block copies between the KV tiers (the scheduler's books decide them),
  /// carried out by every stage, in order, before it computes the step.
  std::vector<models::kv_move> moves;
  /// With moves to or from the remote tier: its store, and the data-plane
  /// address of the store's process (a stage connects to it once).
  kv_vault_actor vault;
  std::vector<std::uint8_t> vault_address;
  bool operator==(const step_batch&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, step_batch& x) {
  return f(caf::meta::type_name("step_batch"), x.step, x.seqs, x.hidden, x.compute_ms, x.stage_ms,
           x.decode_steps, x.return_logits, x.moves, x.vault, x.vault_address);
}

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
  /// Per sequence that asked for logprobs, one per sampled token (else empty).
  std::vector<std::vector<models::token_logprob>> logprobs;
  bool operator==(const step_output&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, step_output& x) {
  return f(caf::meta::type_name("step_output"), x.step, x.logits, x.compute_ms, x.stage_ms,
           x.sampled, x.passes, x.logprobs);
}

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

template <class I>
typename I::result_type inspect(I& f, shard_info& x) {
  return f(caf::meta::type_name("shard_info"), x.device, x.first_layer, x.last_layer, x.embed,
           x.head, x.hidden, x.vocab);
}

/// A KV store's occupancy.
struct kv_usage_info {
  std::string device;
  std::int64_t block_size = 0;
  std::int64_t total_blocks = 0;
  std::int64_t free_blocks = 0;
  std::int64_t sequences = 0;
  std::int64_t tokens = 0;
  std::int64_t slot_bytes = 0;  ///< bytes of one block over this stage's layers
  std::int64_t host_slots = 0;  ///< lower tiers (blocks)
  std::int64_t disk_slots = 0;
  std::int64_t tier_moves = 0;  ///< blocks moved between tiers here so far
  std::int64_t tier_bytes = 0;  ///< ... bytes
  bool operator==(const kv_usage_info&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, kv_usage_info& x) {
  return f(caf::meta::type_name("kv_usage_info"), x.device, x.block_size, x.total_blocks,
           x.free_blocks, x.sequences, x.tokens, x.slot_bytes, x.host_slots, x.disk_slots,
           x.tier_moves, x.tier_bytes);
}

/// A sequence's KV blocks exported to host memory (swap or migration):
/// metadata here, the bytes behind `data`.
struct kv_export {
  std::int64_t seq = 0;
  std::int64_t length = 0;
  std::vector<std::int32_t> live;  ///< block positions that hold data
  tensor_ref data;                 ///< u8 [bytes]
  std::vector<std::int32_t> ids;   ///< block ids of `live`, where the scheduler names blocks
  bool operator==(const kv_export&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, kv_export& x) {
  return f(caf::meta::type_name("kv_export"), x.seq, x.length, x.live, x.data, x.ids);
}

/// The kinds of modality encoder. The one encoder of a model serves its
/// towers: the vision tower, and the audio tower when the model hears.
enum class encoder_kind : std::uint8_t { vision = 0 };
inline const char* to_string(encoder_kind k) {
  return k == encoder_kind::vision ? "vision" : "?";
}

/// A media item to encode: item `index` of request `request` (an image or
/// an audio clip). The encoder keeps its rows until the request is
/// forgotten, and sends them (or a chunk's part of them) straight to the
/// first stage's process when asked.
struct encode_request {
  std::uint64_t request = 0;
  std::int32_t index = 0;  ///< the item's place among the request's media (prompt order)
  media_data item;
  bool operator==(const encode_request&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, encode_request& x) {
  return f(caf::meta::type_name("encode_request"), x.request, x.index, x.item);
}

/// A media item encoded and held by the encoder: projected features of
/// [rows, hidden], ready for the first decoder stage.
struct encode_reply {
  std::int64_t rows = 0;
  std::int64_t hidden = 0;
  double preprocess_ms = 0;
  double encode_ms = 0;
  std::int64_t batch = 0;  ///< size of the batch it was encoded in (0: from the cache)
  /// The item's name: SHA-256 of the tower's identity and the preprocessed
  /// pixels or the decoded samples (the encoder cache's key, and what names
  /// its rows' KV blocks).
  std::vector<std::uint8_t> hash;
  bool cached = false;  ///< the rows came from the encoder cache
  bool operator==(const encode_reply&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, encode_reply& x) {
  return f(caf::meta::type_name("encode_reply"), x.rows, x.hidden, x.preprocess_ms, x.encode_ms,
           x.batch, x.hash, x.cached);
}

/// Rows [first_row, first_row + rows) of a request's media, taken in
/// order (item k's rows follow those of items 0..k-1: an image's
/// tokens_per_image, a clip's own count), sent to the process whose data-plane key is `dest`
/// (the first stage's; the encoder's own key or "" parks them there).
struct media_rows_request {
  std::uint64_t request = 0;
  std::int64_t first_row = 0;
  std::int64_t rows = 0;
  std::string dest;
  bool operator==(const media_rows_request&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, media_rows_request& x) {
  return f(caf::meta::type_name("media_rows_request"), x.request, x.first_row, x.rows, x.dest);
}

/// A node's supervision report.
struct node_status {
  std::int64_t restarts = 0;  ///< pipeline restarts so far
  bool failed = false;        ///< the restart limit was hit: the node gave up
  std::string last_failure;
  bool operator==(const node_status&) const = default;
};

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
                     caf::replies_to<forward_atom, caf::strong_actor_ptr>::with<bool>>;

/// The paged KV blocks of one shard's layers, on the shard's device.
using kv_store_actor = caf::typed_actor<
    caf::replies_to<usage_atom>::with<kv_usage_info>,
    caf::replies_to<free_atom, std::vector<std::int64_t>>::with<std::int64_t>,
    caf::replies_to<export_atom, std::int64_t>::with<kv_export>,
    caf::replies_to<import_atom, kv_export>::with<std::int64_t>,
    caf::replies_to<clear_atom>::with<std::int64_t>,
    // Live migration: the sequences held, as (id, length) pairs flattened.
    caf::replies_to<list_atom>::with<std::vector<std::int64_t>>,
    // A sequence's blocks from a first block on, pushed to the process
    // whose data-plane key is given ("" or this one's: parked here).
    caf::replies_to<push_kv_atom, std::int64_t, std::int32_t, std::string>::with<kv_export>,
    // Such an export: a new sequence (first block 0) or a delta
    // (import_tail) of one already here.
    caf::replies_to<merge_kv_atom, kv_export, std::int32_t>::with<std::int64_t>,
    // A tensor sent to this process that no step will take (image rows of
    // a step the scheduler dropped): received and thrown away.
    caf::reacts_to<discard_atom, tensor_ref>>;

/// A modality encoder (vision now) with dynamic, length-bucketed batching.
using encoder_actor =
    caf::typed_actor<caf::replies_to<encode_atom, encode_request>::with<encode_reply>,
                     // A piece of a streamed clip (started by an encode_request
                     // whose item is a stream): answered once the windows it
                     // completes are encoded.
                     caf::replies_to<chunk_atom, audio_chunk>::with<stream_progress>,
                     caf::replies_to<rows_atom, media_rows_request>::with<tensor_ref>,
                     caf::reacts_to<forget_atom, std::uint64_t>,
                     caf::reacts_to<flush_atom, std::int64_t>,
                     caf::replies_to<version_atom>::with<std::uint32_t>>;

/// Admission, continuous batching and streaming for one model.
/// One block event (core::kv_books::event): what (0 stored, 1 removed,
/// 2 cleared), the tier (0 device, 1 host, 2 disk) and the block's name
/// (32 bytes; empty for cleared).
struct kv_block_event {
  std::uint8_t what = 0;
  std::uint8_t tier = 0;
  std::vector<std::uint8_t> name;
  bool operator==(const kv_block_event&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, kv_block_event& x) {
  return f(caf::meta::type_name("kv_block_event"), x.what, x.tier, x.name);
}

/// A scheduler's block events from a sequence number on: `events` carry
/// numbers [next - events.size(), next). With `resync` the follower's
/// number was too old (or new): the events are a `cleared` and then every
/// block the cache holds, as `stored`.
struct kv_events {
  std::uint64_t next = 0;
  bool resync = false;
  std::vector<kv_block_event> events;
  bool operator==(const kv_events&) const = default;
};

template <class I>
typename I::result_type inspect(I& f, kv_events& x) {
  return f(caf::meta::type_name("kv_events"), x.next, x.resync, x.events);
}

using scheduler_actor = caf::typed_actor<
    caf::replies_to<submit_atom, generate_request, client_sink_actor>::with<submit_ack>,
    caf::replies_to<cancel_atom, std::uint64_t>::with<bool>,
    // A piece of a request's streamed clip: answered once the encoder has
    // its windows (their rows then join the prompt).
    caf::replies_to<chunk_atom, audio_chunk>::with<stream_progress>,
    // Its own timer: has request id's stream sent nothing for too long?
    caf::reacts_to<chunk_atom, std::uint64_t>, caf::replies_to<stats_atom>::with<scheduler_stats>,
    caf::replies_to<version_atom>::with<std::uint32_t>, caf::reacts_to<tick_atom>,
    // The ids of the requests it holds (the head's journal forgets the others).
    caf::replies_to<live_atom>::with<std::vector<std::uint64_t>>,
    // Empty the prefix cache; answers the cached blocks that became free.
    caf::replies_to<reset_cache_atom>::with<std::int64_t>,
    // Block events from this sequence number on (a router's view).
    caf::replies_to<kv_events_atom, std::uint64_t>::with<kv_events>,
    // The remote tier: its store and the store's data-plane address; from
    // the store, the blocks it now holds whole (slots and names).
    caf::reacts_to<vault_atom, kv_vault_actor, std::vector<std::uint8_t>>,
    caf::reacts_to<vault_ok_atom, vault_blocks>,
    // From the node: the pipeline was restarted (every stage's KV is gone;
    // running requests recompute) or, with no stages, given up on.
    caf::reacts_to<pipeline_atom, std::vector<shard_actor>, std::vector<kv_store_actor>>,
    // From the node: the vision encoder was replaced (every one before is gone).
    caf::reacts_to<encoder_atom, encoder_actor>,
    // From the head: the encoder replicas to send images to (the first
    // list), and those lost (the second: their rows and their unanswered
    // images are gone). One left out and not lost keeps the rows it holds
    // until their requests end; the answer counts the requests whose rows
    // such encoders still hold (0: they may stop).
    caf::replies_to<encoders_atom, std::vector<encoder_actor>,
                    std::vector<encoder_actor>>::with<std::int64_t>,
    // Live migration: use the second encoder instead of the first from
    // now on; with `true`, the old one is flushed and the answer comes
    // once it has answered every request sent to it.
    caf::replies_to<handover_atom, encoder_actor, encoder_actor, bool>::with<bool>,
    // Live migration: stop issuing steps; the answer (the running count)
    // comes once no step is in flight.
    caf::replies_to<pause_atom>::with<std::int64_t>,
    // Stage i is now this shard and KV store; steps resume.
    caf::reacts_to<reroute_atom, std::int32_t, shard_actor, kv_store_actor>,
    // Resume without a change (a migration that gave up).
    caf::reacts_to<resume_atom>>;

/// Supervises one node's actors: restarts the pipeline when a stage or KV
/// store dies (up to a limit, then gives up and fails the requests).
using node_actor =
    caf::typed_actor<caf::replies_to<stats_atom>::with<node_status>,
                     caf::reacts_to<notify_atom, scheduler_actor>>;  ///< whom to tell about
                                                                     ///< restarts

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

}  // namespace troupe::actors
