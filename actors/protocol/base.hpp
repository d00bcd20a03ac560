#pragma once

// The protocol's ground: its version, the atoms, troupe's error category
// and the inspect functions of types declared below actors/ (in core/ and
// models/). Part of actors/protocol.hpp.

#include <caf/all.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "actors/core/errors.hpp"
#include "actors/core/scheduler_stats.hpp"
#include "models/kv_tiers.hpp"
#include "models/sampling.hpp"

namespace troupe::actors {

using core::error_code;
using core::finish_reason;
using core::scheduler_stats;
using core::to_string;

inline constexpr std::uint32_t protocol_version = 30;

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
using pause_atom = caf::atom_constant<caf::atom("pause")>;
using migrate_atom = caf::atom_constant<caf::atom("migrate")>;
using probe_atom = caf::atom_constant<caf::atom("probe")>;
using render_atom = caf::atom_constant<caf::atom("render")>;
// Each atom names one operation of one interface (a stale or misrouted
// message can never be read as another operation).
using forward_atom = caf::atom_constant<caf::atom("forward")>;    ///< shard: forward steps to
using push_kv_atom = caf::atom_constant<caf::atom("pushkv")>;     ///< KV store: export to a peer
using merge_kv_atom = caf::atom_constant<caf::atom("mergekv")>;   ///< KV store: import a delta
using clear_atom = caf::atom_constant<caf::atom("clear")>;        ///< KV store: drop everything
using pipeline_atom = caf::atom_constant<caf::atom("pipeline")>;  ///< scheduler: new stages
using encoder_atom = caf::atom_constant<caf::atom("encoder")>;    ///< scheduler: new encoder
using handover_atom = caf::atom_constant<caf::atom("handover")>;  ///< scheduler: encoder moved
using encoders_atom = caf::atom_constant<caf::atom("encoders")>;  ///< scheduler: the encoder pool
using reroute_atom = caf::atom_constant<caf::atom("reroute")>;    ///< scheduler: stage moved
using resume_atom = caf::atom_constant<caf::atom("resume")>;      ///< scheduler: steps go on
using notify_atom = caf::atom_constant<caf::atom("notify")>;      ///< node: whom to tell
using relink_atom = caf::atom_constant<caf::atom("relink")>;      ///< agent: stage's next
using connect_atom = caf::atom_constant<caf::atom("connect")>;    ///< agent: reach a node
using drop_stage_atom = caf::atom_constant<caf::atom("dropstage")>;  ///< agent: one stage
using load_enc_atom = caf::atom_constant<caf::atom("loadenc")>;      ///< agent: spawn an encoder
using drop_enc_atom = caf::atom_constant<caf::atom("dropenc")>;      ///< agent: stop an encoder
using rows_atom = caf::atom_constant<caf::atom("rows")>;             ///< encoder: send image rows
using forget_atom = caf::atom_constant<caf::atom("forget")>;         ///< encoder: drop held rows
using discard_atom = caf::atom_constant<caf::atom("discard")>;       ///< KV store: take, throw away
using tokenize_atom = caf::atom_constant<caf::atom("tokenize")>;     ///< door: a prompt's tokens
using detokenize_atom = caf::atom_constant<caf::atom("detokenize")>;  ///< door: tokens' text
/// Door and scheduler: empty the prefix cache (answers the blocks freed).
using reset_cache_atom = caf::atom_constant<caf::atom("resetcache")>;
using kv_events_atom = caf::atom_constant<caf::atom("kvevents")>;  ///< scheduler: block events
using vault_put_atom = caf::atom_constant<caf::atom("vaultput")>;  ///< vault: take blocks' rows
using vault_get_atom = caf::atom_constant<caf::atom("vaultget")>;  ///< vault: send blocks' rows
using vault_ok_atom = caf::atom_constant<caf::atom("vaultok")>;    ///< scheduler: blocks confirmed
using vault_atom = caf::atom_constant<caf::atom("vault")>;         ///< scheduler: the remote tier
using load_vault_atom = caf::atom_constant<caf::atom("loadvault")>;  ///< agent: spawn the KV store
using scale_atom = caf::atom_constant<caf::atom("scale")>;  ///< head: run this many replicas
/// A standby head: follow the head's jobs (and its heartbeat).
using follow_atom = caf::atom_constant<caf::atom("follow")>;
using journal_atom =
    caf::atom_constant<caf::atom("journal")>;  ///< head -> standby: jobs begun, ended
/// A client, after a head was lost: go on streaming this job to me.
using attach_atom = caf::atom_constant<caf::atom("attach")>;
using live_atom = caf::atom_constant<caf::atom("live")>;  ///< scheduler: the ids it holds
/// Door, scheduler and encoder: a piece of a streamed audio clip.
using chunk_atom = caf::atom_constant<caf::atom("chunk")>;

// -- errors -------------------------------------------------------------------

inline const caf::atom_value error_category = caf::atom("troupe");
/// A caf::error of troupe's category with a human-readable message.
caf::error make_error(error_code code, std::string message);
/// The code of a troupe error (0 for an error of another category).
std::uint8_t troupe_code(const caf::error& e);
/// "overloaded: the queue holds 64 requests (limit 64)" for troupe errors,
/// CAF's rendering otherwise.
std::string describe(caf::actor_system& sys, const caf::error& e);

}  // namespace troupe::actors

// Types declared below actors/ are inspected in their own namespaces (CAF
// finds inspect by argument-dependent lookup).
namespace troupe::actors::core {
template <class I>
typename I::result_type inspect(I& f, scheduler_stats& x) {
  return f(caf::meta::type_name("scheduler_stats"), x.queued, x.running, x.accepted, x.rejected,
           x.finished, x.preemptions, x.steps, x.kv_total_blocks, x.kv_used_blocks,
           x.kv_peak_blocks, x.prompt_tokens, x.generated_tokens, x.tokens_out, x.prefix_queries,
           x.prefix_hits, x.kv_cached_blocks, x.kv_cached_free, x.kv_evictions, x.kv_host_blocks,
           x.kv_host_used, x.kv_disk_blocks, x.kv_disk_used, x.kv_to_host, x.kv_from_host,
           x.kv_to_disk, x.kv_from_disk, x.kv_dropped, x.kv_remote_blocks, x.kv_remote_used,
           x.kv_remote_pending, x.kv_to_remote, x.kv_from_remote, x.kv_remote_confirmed,
           x.kv_slot_bytes, x.recomputed_tokens, x.restored_tokens, x.images, x.image_cache_hits,
           x.encode_waiting, x.encodes, x.encode_wait_ms, x.clips, x.clip_cache_hits,
           x.clips_waiting, x.clip_encodes, x.clip_encode_wait_ms, x.videos, x.video_cache_hits,
           x.videos_waiting, x.video_encodes, x.video_encode_wait_ms, x.stages, x.step_rows,
           x.round_trip_ms, x.compute_ms, x.stage_compute_ms, x.in_flight_ms, x.scheduler_ms);
}
}  // namespace troupe::actors::core

namespace troupe::models {
template <class I>
typename I::result_type inspect(I& f, kv_move& x) {
  return f(caf::meta::type_name("kv_move"), x.from, x.from_index, x.to, x.to_index, x.name);
}

template <class I>
typename I::result_type inspect(I& f, sampling_params& x) {
  return f(caf::meta::type_name("sampling_params"), x.temperature, x.top_k, x.top_p, x.min_p,
           x.repetition_penalty, x.presence_penalty, x.frequency_penalty, x.seed, x.max_tokens,
           x.stop_token_ids, x.stop_strings, x.bias_ids, x.bias_values, x.min_tokens, x.logprobs);
}

template <class I>
typename I::result_type inspect(I& f, token_logprob& x) {
  return f(caf::meta::type_name("token_logprob"), x.token, x.logprob, x.top_ids, x.top_logprobs,
           x.piece, x.top_pieces);
}
}  // namespace troupe::models
