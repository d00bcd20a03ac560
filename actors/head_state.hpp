#pragma once

// The head's state and what its files share (head.cpp, head_placement.cpp,
// migration.cpp, head_status.cpp). Internal to them, not for use elsewhere.

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "actors/clock.hpp"
#include "actors/cluster_common.hpp"
#include "actors/core/block_index.hpp"
#include "actors/core/encoder_scaler.hpp"
#include "actors/encoder.hpp"
#include "actors/head.hpp"
#include "actors/placement_control.hpp"
#include "actors/prompt.hpp"
#include "actors/prompt_worker.hpp"
#include "actors/protocol.hpp"
#include "actors/scheduler.hpp"
#include "cluster/membership.hpp"

namespace troupe::actors::head_detail {

using cluster_detail::device_for;
using cluster_detail::forget_joined_node;
using cluster_detail::joined_node_is;
using cluster_detail::joined_nodes;
using cluster_detail::ms_since;

using head_core_actor = frontdoor_actor::extend<
    caf::reacts_to<tick_atom>, caf::reacts_to<joined_atom, std::string, gate_pass>,
    caf::reacts_to<joined_atom, std::string, std::string>,
    // A standby's join of the head it follows.
    caf::reacts_to<follow_atom, gate_pass>, caf::reacts_to<follow_atom, std::string>>;

struct member_rt {
  node_agent_actor agent;
  node_report report;
  bool joining = false;  ///< a join attempt is under way
  std::string why;       ///< the last failed join's reason
  int loading = 0;       ///< loads asked of it and not answered: its agent is busy, not gone
};

/// One copy of the model's pipeline (parallelism.replicas): the nodes it
/// places its stages on, its stages and its scheduler. The router sends
/// each job to one; a replica that loses a node is placed again on its
/// other nodes while the others serve on.
struct replica_rt {
  int index = 0;
  /// Its nodes (replicas > 1: a share of the nodes with stages; empty with
  /// one replica: every node).
  std::vector<std::string> nodes;
  scheduler_actor scheduler;
  std::vector<cluster::stage_slot> plan;
  std::uint64_t epoch = 0;  ///< its placement's (numbered across replicas)
  bool placing = false, ready = false, placement_ok = false;
  std::int64_t replacements = 0;
  std::int32_t stages_total = 0, stages_loaded = 0;  ///< the placement under way
  std::vector<stage_handles> handles;                ///< the placed stages' actors, in order
  /// Per stage, its tensor-parallel ranks 1, 2, ... (empty for a stage on
  /// one node): their actors (live migration of a rank).
  std::vector<std::vector<stage_handles>> rank_handles;
  double detect_ms = -1, resume_ms = -1;
  std::optional<steady::time_point> lost_at;
  bool resume_after_placement = false;  ///< a re-split paused the scheduler
  // Its cached blocks, followed from the scheduler's block events at each
  // heartbeat (the router: which prefixes are where).
  core::block_index blocks;
  std::uint64_t block_events_next = 0;
  std::uint64_t block_events = 0;  // taken in so far
  bool block_events_asked = false;
  steady::time_point last_stats_line = steady::now();
  scheduler_stats last_stats;
  token_rate tokens;
  /// The scheduler's counters at each heartbeat, the last minute of them
  /// (status: where the pipeline's time went; the router: its load).
  std::deque<std::pair<steady::time_point, scheduler_stats>> stat_samples;
  /// Scaled away (troupe scale): the router sends it nothing; once its
  /// requests have finished it retires: its stages and scheduler go, its
  /// nodes become another replica's spares. A retired replica's slot is
  /// taken again by the next scale up.
  bool retiring = false, retired = false;
  steady::time_point retiring_since{};
  /// The full blocks of the prompts the router sent it lately, before its
  /// block events name them (a prompt repeated at once goes where the
  /// first went): each name with when it was sent, oldest first.
  std::unordered_map<core::block_hash, steady::time_point, core::block_hash_hasher> sent_blocks;
  std::deque<std::pair<core::block_hash, steady::time_point>> sent_order;
  std::int64_t routed = 0;           ///< jobs the router sent it
  std::int64_t routed_at_stats = 0;  ///< ... when its stats last came
  std::int64_t answered = 0;         ///< ... whose submission it has answered
  /// The requests its scheduler holds, as it last planned (its scheduler
  /// runs in the head's process): with the jobs routed and not yet
  /// answered, its load at this instant.
  load_gauge held;
  /// Serves now: placed, its scheduler running, not being placed again.
  bool serving() const { return scheduler && ready && !placing && !retiring && !retired; }
};

/// A replica of the vision encoder beyond the first (`[encoders.vision]`
/// max > 1), on a node's agent. The first (st.encoder) is the head's own
/// or where a migration moved it.
struct encoder_replica_rt {
  encoder_actor actor;  ///< invalid while loading
  std::string node;     ///< the node whose agent runs it
  std::string where;    ///< "node device"
  enum class phase : std::uint8_t { loading, serving, draining } state = phase::loading;
  steady::time_point since = steady::now();  ///< in this phase
};

struct head_state {
  head_config cfg;
  std::shared_ptr<const prompt_setup> prompt;  // shared with the prompt workers
  std::int64_t rendering = 0;                  // jobs with a prompt worker now
  model_frontend frontend;
  int layers = 0;
  std::optional<cluster::membership> members;
  std::map<std::string, member_rt> rt;
  /// The model's pipelines (parallelism.replicas): one unless replicas > 1.
  std::vector<replica_rt> reps;
  std::uint64_t epochs = 0;  ///< placements so far, every replica's (a node's epoch only grows)
  bool grouped = false;      ///< the replicas' nodes are chosen (at the first placement)
  std::string cache_ns;      ///< the schedulers' prefix-cache namespace (the router names blocks)
  std::int64_t routed_by_load = 0, routed_by_prefix = 0;  ///< the router's choices
  std::uint64_t route_turn = 0;  ///< shares jobs among equally loaded replicas
  /// Jobs with a streamed audio clip still open: the scheduler their chunks
  /// go to, and when one last went (bounded: max_streams, pruned by age).
  struct open_stream {
    scheduler_actor scheduler;
    steady::time_point touched;
  };
  std::map<std::uint64_t, open_stream> streams;
  /// The remote KV tier's store (kv.store_tokens): copies of every full
  /// block, on kv.store_node (this process, or a node's), outliving the
  /// stages' nodes.
  kv_vault_actor vault;
  std::string vault_on;  ///< its node
  std::int64_t vault_slots = 0;
  std::int64_t vault_layer_bytes = 0;
  bool vault_loading = false;
  steady::time_point vault_tried{};
  std::int64_t vault_stores = 0;  ///< ordered so far
  encoder_actor encoder;
  std::string encoder_where;
  bool draining = false, retry_queued = false;
  bool stepped_down = false;        // a node follows a newer head (step_down)
  std::int64_t actor_restarts = 0;  ///< stages loaded again after a loss
  std::int64_t migrations = 0;
  bool migrating = false;  ///< one live migration at a time
  /// What it is doing (troupe migrate's progress bar) and how far, 0 to 1;
  /// a stage's migration sets both from its phases (migration.cpp).
  std::string migration_phase;
  double migration_done = 0;
  std::string encoder_owner;  ///< the node whose agent spawned the encoder ("": the head did)
  /// The head's own encoder (its weights, loaded at start): spawned again
  /// here when the node an encoder moved to is lost.
  std::shared_ptr<encoder_resources> encoder_home;
  /// Node names by CAF node id (data-plane link labels), kept after a loss.
  std::map<std::string, std::string> node_names;
  std::string last_event;
  double detect_ms = -1, resume_ms = -1;  ///< the latest loss of any replica's node
  steady::time_point started = steady::now(), last_heartbeat;
  std::vector<caf::typed_response_promise<bool>> drain_waiters;
  steady::time_point drain_since;
  bool drain_checking = false;

  // -- placement (actors/placement_control.hpp) --
  bool auto_place = false;  ///< pipeline_stages = "auto": the planner places and re-plans
  std::optional<placement::model_profile> model_prof;
  placement::precision precision = placement::precision::f32;
  placement::workload work;
  placement::policy_options policy_opt;
  placement::policy_state policy;
  struct link_state {
    bool measuring = false, done = false;
    caf::node_id of;  ///< the node incarnation it was measured to
    placement::link_profile link;
  };
  std::map<std::string, link_state> links;  ///< head <-> node, by node
  std::vector<placement_decision> decisions;
  struct pending_measure {
    std::size_t index;
    steady::time_point applied;
    /// Requests the scheduler had accepted when it took effect: once as
    /// many have finished, those that were running then (and recomputed
    /// after a re-split) are done.
    std::int64_t accepted = -1;
    std::optional<steady::time_point> settled;
  };
  std::vector<pending_measure> to_measure;
  std::vector<std::string>
      joined_since;  ///< nodes that joined after the first placement, not yet re-planned for
  steady::time_point next_policy = steady::now();
  bool rebalancing = false;  ///< a decision's moves are under way
  std::optional<std::size_t>
      placing_decision;         ///< the decision the placement under way carries out
  std::string want_encoder_on;  ///< the planner's node for the encoder, moved there after placing

  // -- the vision encoder's replicas (head_encoders.cpp) --
  std::vector<encoder_replica_rt> enc_extra;  ///< beyond st.encoder
  std::optional<actor_clock_source> enc_clock;
  std::optional<core::encoder_scaler> enc_scaler;  ///< with a vision encoder
  std::int64_t enc_seen_encodes = 0;               ///< the schedulers' counters, last read
  double enc_seen_wait_ms = 0;
  std::int64_t enc_waiting = 0;  ///< images waiting at the last heartbeat
  double enc_mean_wait_ms = -1;  ///< ... their mean wait since the one before (-1: none answered)
  std::int64_t enc_scale_ups = 0, enc_scale_downs = 0;
  std::map<std::string, steady::time_point> enc_failed;  ///< nodes where a load failed, and when
  bool enc_drain_asking = false;  ///< the schedulers are asked whether a drained one is free
  std::string enc_no_room;        ///< the last "no node has room" said (said once)

  // -- the standby head (head_standby.cpp) --
  /// The other of the manifest's head and standby ("" without a standby):
  /// whom a standby follows, and whose follow a head answers.
  std::string partner;
  bool standby_mode = false;  ///< following the partner's journal; serving nothing
  /// The manifest's head, started while its standby may have taken over
  /// (a restart after a takeover): it follows the partner if the partner
  /// serves, else it becomes the head (the partner is a standby, or does
  /// not answer by probe_until).
  bool probing = false;
  steady::time_point probe_until{};
  frontdoor_actor followed;  ///< the partner's door
  bool follow_joining = false, follow_asking = false, followed_once = false;
  steady::time_point follow_heard{};  ///< its last answer
  std::uint64_t followed_term = 0;
  std::string follow_why;  ///< why it does not follow now (status)
  /// The followed head's jobs (its journal): after a takeover, each waits
  /// for its client to attach, then resumes from the client's tokens.
  std::map<std::uint64_t, generate_request> adoptable;
  std::optional<steady::time_point> took_over_at;
  struct pending_attach {
    std::uint64_t id = 0;
    std::vector<std::int32_t> tokens;
    client_sink_actor sink;
    caf::typed_response_promise<submit_ack> rp;
    steady::time_point since;
  };
  std::vector<pending_attach> attaches;  ///< waiting for a replica to serve
  std::int64_t resumed_jobs = 0, dropped_jobs = 0;
  /// As a head with a standby: its door, and every job accepted and not
  /// ended (pruned against the schedulers' live ids each second).
  frontdoor_actor follower;
  struct journal_rec {
    generate_request req;
    steady::time_point at;
  };
  std::map<std::uint64_t, journal_rec> journal;
  bool journal_asking = false;
  steady::time_point journal_pruned{};
};

using head_ptr = head_core_actor::stateful_pointer<head_state>;

/// Replica `r` (an index into reps).
inline replica_rt& rep(head_ptr self, int r) {
  return self->state.reps[static_cast<std::size_t>(r)];
}

/// Replica `r`'s scheduler answered a job's submission (taken or refused).
inline void answered(head_ptr self, int r) {
  if (r >= 0 && static_cast<std::size_t>(r) < self->state.reps.size()) ++rep(self, r).answered;
}

/// Whether `node` is one of replica `p`'s nodes (with one replica, every node is).
inline bool in_replica(const replica_rt& p, const std::string& node) {
  if (p.retired) return false;
  return p.nodes.empty() || std::find(p.nodes.begin(), p.nodes.end(), node) != p.nodes.end();
}

// -- head_encoders.cpp: the vision encoder's replicas ---------------------------

/// The encoders images go to: the first, then the other serving ones.
std::vector<encoder_actor> encoder_pool(head_ptr self);
/// Tells every scheduler the pool, and the encoders `lost` with their rows.
void push_encoder_pool(head_ptr self, const std::vector<encoder_actor>& lost = {});
/// At each heartbeat: the service's load, a replica more or fewer, drained ones stopped.
void encoder_service_tick(head_ptr self);
/// Node `name` was lost: its encoder replica with it.
void encoder_node_lost(head_ptr self, const std::string& name);
/// Replica `r` was placed: every encoder replica reaches its first stage.
void connect_encoders_to(head_ptr self, int r);
/// Each placed replica's first stage (its handles and node) not on `node`:
/// where an encoder there must reach over the data plane.
std::vector<std::pair<stage_handles, std::string>> first_stages_away_from(head_ptr self,
                                                                          const std::string& node);
/// Whether an encoder replica beyond the first runs (or loads) on `node`.
bool hosts_encoder_replica(head_ptr self, const std::string& node);

// -- head_standby.cpp: the standby head and the journal it follows ---------------

/// A standby's heartbeat: follow the partner; take over when it is lost.
void standby_tick(head_ptr self);
/// The partner's door went down (a standby: take over).
bool standby_partner_down(head_ptr self, const caf::actor_addr& source);
/// A join of the partner (as its standby) ended.
void follow_joined(head_ptr self, gate_pass* pass, const std::string& why);
/// An active head's heartbeat: prune the journal, resume attached jobs,
/// drop those whose clients did not come back.
void journal_tick(head_ptr self);
/// A job is accepted (before its scheduler has it) / refused or ended.
void journal_begin(head_ptr self, const generate_request& req);
void journal_end(head_ptr self, std::uint64_t id);
caf::result<journal_state> on_follow(head_ptr self, bool first);
void on_journal(head_ptr self, std::vector<journal_entry>& entries);
caf::result<submit_ack> on_attach(head_ptr self, std::uint64_t id,
                                  std::vector<std::int32_t>& tokens, client_sink_actor& sink);

// -- head.cpp -----------------------------------------------------------------

/// The replica for a job (-1: none serves).
int route(head_ptr self, const generate_request& req);

// Records `what` as the last event (`troupe status` shows it) and logs it.
void event(head_ptr self, const std::string& what, bool warn = false);

// Counts a load under way on `node` until the returned guard goes: a node
// agent busy loading weights (seconds, for a big model) does not answer
// heartbeats, and is not lost for that while its connection holds.
std::shared_ptr<void> loading_on(head_ptr self, const std::string& node);

// Places replica `r` afresh (a new placement epoch): `forced` stages, or
// those choose_slots picks for `trigger`.
void replace(head_ptr self, int r, const std::string& trigger = "retry",
             std::optional<std::vector<cluster::stage_slot>> forced = std::nullopt);

// One heartbeat (every heartbeat_every, and after a placement or a
// migration): membership, the nodes' reports, the measurements, the
// policy, and the first placement once the nodes are up.
void heartbeat(head_ptr self);

}  // namespace troupe::actors::head_detail
