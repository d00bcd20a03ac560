// Every protocol message survives CAF's binary serialization, inside a
// caf::message as it travels between nodes, with all its fields. Each type
// is sent with a value that differs from the default in every field, so a
// field that an inspect() leaves out comes back different. A coverage test
// holds the list below to every registered type and to every struct the
// protocol headers declare.
#include "actors/protocol.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <typeindex>
#include <vector>

#include "actor_test.hpp"

namespace troupe::actors {
namespace {

// -- one value per message type, every field set --------------------------------

/// Distinct actors for the handle fields (a handle read into the wrong
/// field comes back as another actor).
struct actors_for_handles {
  caf::actor a, b, c, d;
};

template <class T>
struct tag {};

template <class Handle>
Handle handle(const caf::actor& a) {
  return caf::actor_cast<Handle>(a);
}

tensor_ref make(tag<tensor_ref>, const actors_for_handles&) {
  return {.device = "cuda:1", .dtype = 3, .shape = {7, 128}, .transfer_id = 42};
}

tensor_ref a_ref(std::uint64_t id) {
  return {.device = "cpu:1",
          .dtype = 2,
          .shape = {static_cast<std::int64_t>(id), 64},
          .transfer_id = id};
}

media_data make(tag<media_data>, const actors_for_handles&) {
  return {.name = "a.png", .bytes = {0x89, 'P', 'N', 'G', 0, 255}, .kind = media_kind::image};
}

media_data clip_data() {
  return {.name = "q.wav", .bytes = {'R', 'I', 'F', 'F', 9}, .kind = media_kind::audio};
}

media_data video_data() {
  return {.name = "v.mp4",
          .bytes = {0, 0, 0, 0x18, 'f', 't', 'y', 'p'},
          .kind = media_kind::video,
          .num_frames = 12,
          .fps = 2.5};
}

models::sampling_params make(tag<models::sampling_params>, const actors_for_handles&) {
  models::sampling_params p;
  p.temperature = 0.7;
  p.top_k = 40;
  p.top_p = 0.9;
  p.min_p = 0.05;
  p.repetition_penalty = 1.1;
  p.seed = 1234567890123ull;
  p.max_tokens = 77;
  p.stop_token_ids = {2, 9};
  p.stop_strings = {"\n\n", "END"};
  p.presence_penalty = 0.5;
  p.frequency_penalty = -0.25;
  p.bias_ids = {5, 300};
  p.bias_values = {-100, 2.5};
  p.min_tokens = 3;
  p.logprobs = 7;
  return p;
}

generate_request make(tag<generate_request>, const actors_for_handles& h) {
  return {.id = 99,
          .prompt = "USER: <image>\nWhat shape is on the left? ASSISTANT:",
          .prompt_tokens = {1, 5, 6},
          .media = {make(tag<media_data>{}, h),
                    clip_data(),
                    {"b.jpg", {0xff, 0xd8}},
                    video_data(),
                    {.name = "live",
                     .bytes = {},
                     .kind = media_kind::audio,
                     .num_frames = 0,
                     .fps = 0,
                     .audio = false,
                     .stream = true}},
          .audio_tokens = {13, 0},
          .video_tokens = {68},
          .params = make(tag<models::sampling_params>{}, h),
          .deadline_ms = 2500,
          .grammar = "root ::= \"a\"",
          .cache_salt = "tenant-a",
          .priority = -7,
          .resumed = {17, 4, 4}};
}

submit_ack make(tag<submit_ack>, const actors_for_handles&) {
  return {.id = 7, .queued = 3, .prompt_tokens = 12};
}

models::token_logprob a_logprob(std::int32_t token, float lp) {
  models::token_logprob x;
  x.token = token;
  x.logprob = lp;
  x.top_ids = {token};
  x.top_logprobs = {lp};
  x.piece = "p" + std::to_string(token);
  x.top_pieces = {x.piece};
  return x;
}

token_event make(tag<token_event>, const actors_for_handles&) {
  return {.id = 7,
          .tokens = {10, 11},
          .text = "h\xC3\xA9llo",
          .logprobs = {{.token = 10,
                        .logprob = -0.25f,
                        .top_ids = {10, 3},
                        .top_logprobs = {-0.25f, -1.5f},
                        .piece = "h\xC3",
                        .top_pieces = {"h\xC3", "x"}},
                       a_logprob(11, -3.0f)}};
}

finish_event make(tag<finish_event>, const actors_for_handles&) {
  return {.id = 7,
          .reason = finish_reason::deadline,
          .code = error_code::stage_failed,
          .error = "stage failed: x",
          .tokens = {10, 11, 2},
          .text = "h\xC3\xA9llo",
          .prompt_tokens = 12,
          .preemptions = 1,
          .cached_tokens = 48,
          .queue_ms = 0.5,
          .ttft_ms = 3.25,
          .total_ms = 9.125,
          .stop_string = true,
          .preprocess_ms = 1.5,
          .encode_ms = 2.5};
}

sample_work make(tag<sample_work>, const actors_for_handles& h) {
  return {.params = make(tag<models::sampling_params>{}, h),
          .draws = 11,
          .max_new = 6,
          .history = {1, 2, 3},
          .allowed = {0x5, ~std::uint64_t{0}}};
}

seq_work make(tag<seq_work>, const actors_for_handles& h) {
  return {.seq = 3,
          .start = 17,
          .tokens = {1, 2, 3},
          .all_logits = true,
          .embed_token = 3,
          .embeddings = a_ref(8),
          .sample = true,
          .sampling = make(tag<sample_work>{}, h),
          .blocks_from = 2,
          .blocks = {7, 9, 4}};
}

std::array<std::uint8_t, 32> a_name(std::uint8_t v) {
  std::array<std::uint8_t, 32> n{};
  for (std::size_t i = 0; i < n.size(); ++i) n[i] = static_cast<std::uint8_t>(v + i);
  return n;
}

vault_blocks make(tag<vault_blocks>, const actors_for_handles&) {
  return {.slots = {3, 0},
          .names = {a_name(1), a_name(2)},
          .first_layer = 2,
          .layers = 5,
          .data = a_ref(11),
          .dest = "node-7",
          .dest_address = {9, 8, 7}};
}

vault_order make(tag<vault_order>, const actors_for_handles& h) {
  return {.slots = 128, .layers = 22, .layer_bytes = 65536, .notify = handle<scheduler_actor>(h.a)};
}

vault_info make(tag<vault_info>, const actors_for_handles&) {
  return {.slots = 64,
          .layers = 22,
          .layer_bytes = 32768,
          .bytes = 1 << 20,
          .complete = 9,
          .puts = 40,
          .gets = 3,
          .refused = 1};
}

kv_vault_actor make(tag<kv_vault_actor>, const actors_for_handles& h) {
  return handle<kv_vault_actor>(h.d);
}

step_batch make(tag<step_batch>, const actors_for_handles& h) {
  seq_work second;
  second.seq = 4;
  second.tokens = {9};
  return {.step = 5,
          .seqs = {make(tag<seq_work>{}, h), second},
          .hidden = a_ref(9),
          .compute_ms = 1.5,
          .stage_ms = {0.5, 1.0},
          .decode_steps = 8,
          .return_logits = false,
          .moves = {{0, 5, 1, 2, {}}, {1, 3, 2, 7, {}}, {3, 4, 0, 9, a_name(0x41)}},
          .vault = handle<kv_vault_actor>(h.d),
          .vault_address = {1, 2, 3}};
}

step_output make(tag<step_output>, const actors_for_handles&) {
  return {.step = 5,
          .logits = a_ref(10),
          .compute_ms = 2.5,
          .stage_ms = {1.0, 1.5},
          .sampled = {{}, {4, 5, 6}},
          .passes = 3,
          .logprobs = {{}, {a_logprob(4, -1.0f), a_logprob(5, -2.0f), a_logprob(6, -0.5f)}}};
}

shard_info make(tag<shard_info>, const actors_for_handles&) {
  return {.device = "cpu:0",
          .first_layer = 2,
          .last_layer = 4,
          .embed = true,
          .head = true,
          .hidden = 128,
          .vocab = 397};
}

kv_usage_info make(tag<kv_usage_info>, const actors_for_handles&) {
  return {.device = "cpu:0",
          .block_size = 16,
          .total_blocks = 255,
          .free_blocks = 200,
          .sequences = 3,
          .tokens = 700,
          .slot_bytes = 360448,
          .host_slots = 64,
          .disk_slots = 1024,
          .tier_moves = 12,
          .tier_bytes = 4325376};
}

kv_export make(tag<kv_export>, const actors_for_handles&) {
  return {.seq = 12, .length = 300, .live = {0, 17, 18}, .data = a_ref(11), .ids = {3, 5, 8}};
}

encode_request make(tag<encode_request>, const actors_for_handles&) {
  return {.request = 4, .index = 2, .item = clip_data()};
}

encode_reply make(tag<encode_reply>, const actors_for_handles&) {
  return {.rows = 576,
          .hidden = 4096,
          .preprocess_ms = 0.25,
          .encode_ms = 1.75,
          .batch = 4,
          .hash = std::vector<std::uint8_t>(32, 0xab),
          .cached = true};
}

audio_chunk make(tag<audio_chunk>, const actors_for_handles&) {
  return {.id = 77, .index = 3, .pcm = {0x01, 0x80, 0xff, 0x7f}, .last = true};
}

stream_progress make(tag<stream_progress>, const actors_for_handles&) {
  return {.samples = 48000, .rows = 39, .done = true};
}

media_rows_request make(tag<media_rows_request>, const actors_for_handles&) {
  return {.request = 9, .first_row = 500, .rows = 100, .dest = "node-b"};
}

scheduler_stats make(tag<scheduler_stats>, const actors_for_handles&) {
  return {.queued = 1,
          .running = 2,
          .accepted = 3,
          .rejected = 4,
          .finished = 5,
          .preemptions = 6,
          .steps = 7,
          .kv_total_blocks = 8,
          .kv_used_blocks = 9,
          .kv_peak_blocks = 10,
          .prompt_tokens = 11,
          .generated_tokens = 12,
          .tokens_out = 13,
          .prefix_queries = 400,
          .prefix_hits = 320,
          .kv_cached_blocks = 21,
          .kv_cached_free = 5,
          .kv_evictions = 2,
          .kv_host_blocks = 64,
          .kv_host_used = 10,
          .kv_disk_blocks = 256,
          .kv_disk_used = 30,
          .kv_to_host = 40,
          .kv_from_host = 11,
          .kv_to_disk = 30,
          .kv_from_disk = 3,
          .kv_dropped = 1,
          .kv_remote_blocks = 512,
          .kv_remote_used = 200,
          .kv_remote_pending = 4,
          .kv_to_remote = 210,
          .kv_from_remote = 80,
          .kv_remote_confirmed = 206,
          .kv_slot_bytes = 1441792,
          .recomputed_tokens = 17,
          .restored_tokens = 900,
          .images = 6,
          .image_cache_hits = 4,
          .stages = 3,
          .step_rows = 77,
          .round_trip_ms = 12.5,
          .compute_ms = 9.25,
          .stage_compute_ms = {3, 4, 2.25},
          .in_flight_ms = 20.5,
          .scheduler_ms = 0.75};
}

std::vector<std::int64_t> make(tag<std::vector<std::int64_t>>, const actors_for_handles&) {
  return {1, -2, 3, std::int64_t{1} << 40};
}

std::vector<std::int32_t> make(tag<std::vector<std::int32_t>>, const actors_for_handles&) {
  return {1, -2, 3, 1 << 30};
}

kv_block_event make(tag<kv_block_event>, const actors_for_handles&) {
  return {.what = 1, .tier = 2, .name = std::vector<std::uint8_t>(32, 0x3c)};
}

kv_events make(tag<kv_events>, const actors_for_handles&) {
  return {.next = 77,
          .resync = true,
          .events = {{.what = 2, .tier = 0, .name = {}},
                     {.what = 0, .tier = 1, .name = std::vector<std::uint8_t>(32, 0x5a)}}};
}

tokenize_reply make(tag<tokenize_reply>, const actors_for_handles&) {
  return {.tokens = {1, 15043, 3186}, .context_length = 2048};
}

node_status make(tag<node_status>, const actors_for_handles&) {
  return {.restarts = 4, .failed = true, .last_failure = "stage 2 died"};
}

client_sink_actor make(tag<client_sink_actor>, const actors_for_handles& h) {
  return handle<client_sink_actor>(h.a);
}

shard_actor make(tag<shard_actor>, const actors_for_handles& h) {
  return handle<shard_actor>(h.b);
}

kv_store_actor make(tag<kv_store_actor>, const actors_for_handles& h) {
  return handle<kv_store_actor>(h.c);
}

encoder_actor make(tag<encoder_actor>, const actors_for_handles& h) {
  return handle<encoder_actor>(h.d);
}

std::vector<shard_actor> make(tag<std::vector<shard_actor>>, const actors_for_handles& h) {
  return {handle<shard_actor>(h.b), handle<shard_actor>(h.a)};
}

std::vector<kv_store_actor> make(tag<std::vector<kv_store_actor>>, const actors_for_handles& h) {
  return {handle<kv_store_actor>(h.c), handle<kv_store_actor>(h.d)};
}

stage_handles make(tag<stage_handles>, const actors_for_handles& h) {
  return {.shard = handle<shard_actor>(h.a),
          .kv = handle<kv_store_actor>(h.b),
          .first_layer = 2,
          .last_layer = 4,
          .engine_address = {9, 8, 7, 0, 255},
          .tp_rank = 1,
          .tp_size = 3};
}

stage_host_actor make(tag<stage_host_actor>, const actors_for_handles& h) {
  return handle<stage_host_actor>(h.c);
}

std::vector<std::uint8_t> make(tag<std::vector<std::uint8_t>>, const actors_for_handles&) {
  return {0, 1, 254, 255};
}

tp_ring_addresses make(tag<tp_ring_addresses>, const actors_for_handles&) {
  return {{1, 2}, {}, {3, 4, 5}};
}

gate_hello make(tag<gate_hello>, const actors_for_handles&) {
  return {.node = "n1",
          .version = protocol_version,
          .certificate_pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
          .signature = {1, 2, 3, 0, 255}};
}

gate_pass make(tag<gate_pass>, const actors_for_handles& h) {
  return {.cluster = "c1",
          .node = "n0",
          .version = protocol_version,
          .agent = handle<node_agent_actor>(h.c),
          .door = handle<frontdoor_actor>(h.d)};
}

gatekeeper_actor make(tag<gatekeeper_actor>, const actors_for_handles& h) {
  return handle<gatekeeper_actor>(h.d);
}

stage_order make(tag<stage_order>, const actors_for_handles& h) {
  return {.first_layer = 1,
          .last_layer = 3,
          .embed = true,
          .head = true,
          .epoch = 7,
          .has_next = true,
          .next = make(tag<stage_handles>{}, h),
          .next_node = "n2",
          .tp_rank = 0,
          .tp_size = 2,
          .tp_peers = {make(tag<stage_handles>{}, h)},
          .tp_peer_nodes = {"n3"}};
}

device_probe make(tag<device_probe>, const actors_for_handles&) {
  return {.device = "cpu:0-3",
          .cores = 4,
          .gemv_f32 = 1e9,
          .gemv_f16 = 2e9,
          .gemv_q8_0 = 3e9,
          .gemv_q4_0 = 4e9,
          .gemm_f32 = 5e9,
          .gemm_f16 = 6e9,
          .gemm_q8_0 = 7e9,
          .gemm_q4_0 = 8e9,
          .memory_bytes = std::int64_t{1} << 30,
          .probe_ms = 123.5};
}

placement_decision make(tag<placement_decision>, const actors_for_handles&) {
  return {.at_s = 12.5,
          .trigger = "node n2 joined",
          .action = "move layers 2-3",
          .plan = "n0 [0,2) -> n2 [2,4)",
          .predicted_step_ms_before = 9.5,
          .predicted_step_ms_after = 5.25,
          .predicted_gain = 0.8,
          .measured_tps_before = 100,
          .measured_tps_after = 170,
          .state = "measured"};
}

std::vector<placement_decision> make(tag<std::vector<placement_decision>>,
                                     const actors_for_handles& h) {
  auto second = make(tag<placement_decision>{}, h);
  second.trigger = "start";
  return {make(tag<placement_decision>{}, h), second};
}

node_report make(tag<node_report>, const actors_for_handles& h) {
  return {.node = "n1",
          .devices = "cpu:0-0 (2 GiB)",
          .stages = "layers [0,2) on cpu:0-0",
          .epoch = 3,
          .rss_bytes = 1 << 28,
          .weight_bytes = 1 << 27,
          .memory_limit = std::int64_t{1} << 31,
          .kv_used_blocks = 12,
          .kv_total_blocks = 64,
          .kv_tokens = 190,
          .failure = "shard [0,2) exited",
          .link_peers = {"node-a", "node-b"},
          .link_bytes = {4096, 8192},
          .probe = make(tag<device_probe>{}, h),
          .load = 0.375,
          .engine_address = {1, 2, 3},
          .pool_in_use_bytes = 1 << 20,
          .pool_cached_bytes = 1 << 21,
          .malloc_bytes = 1 << 25};
}

node_agent_actor make(tag<node_agent_actor>, const actors_for_handles& h) {
  return handle<node_agent_actor>(h.a);
}

chat_turn make(tag<chat_turn>, const actors_for_handles&) {
  return {.role = "user", .content = "What is in <image>?", .images = 2, .audios = 3, .videos = 1};
}

std::vector<chat_turn> make(tag<std::vector<chat_turn>>, const actors_for_handles& h) {
  return {{.role = "system", .content = "Be brief.", .images = 0}, make(tag<chat_turn>{}, h)};
}

job_request make(tag<job_request>, const actors_for_handles& h) {
  return {.id = 0xfeedbeef,
          .prompt = "Describe <image>",
          .system = "You are terse.",
          .images = {make(tag<media_data>{}, h)},
          .audios = {clip_data()},
          .videos = {video_data()},
          .chat = true,
          .ignore_eos = true,
          .has_temperature = true,
          .temperature = 0.25,
          .max_tokens = 64,
          .seed = 31337,
          .stop_strings = {"</s>", "\n\n"},
          .deadline_ms = 1500,
          .turns = make(tag<std::vector<chat_turn>>{}, h),
          .has_top_p = true,
          .top_p = 0.5,
          .has_repetition_penalty = true,
          .repetition_penalty = 1.15,
          .presence_penalty = 0.75,
          .frequency_penalty = 1.5,
          .logit_bias_ids = {7, 11},
          .logit_bias_values = {3.0, -50.0},
          .min_tokens = 4,
          .stop_token_ids = {2, 13},
          .logprobs = 5,
          .prompt_ids = {1, 2, 3},
          .grammar = "root ::= [0-9]+",
          .cache_salt = "salt",
          .priority = 3};
}

member_view make(tag<member_view>, const actors_for_handles& h) {
  return {.name = "n1",
          .host = "10.78.1.2",
          .port = 4242,
          .state = cluster::member_state::suspect,
          .last_seen_ms = 250.5,
          .joins = 2,
          .report = make(tag<node_report>{}, h)};
}

std::vector<member_view> make(tag<std::vector<member_view>>, const actors_for_handles& h) {
  auto second = make(tag<member_view>{}, h);
  second.name = "n2";
  return {make(tag<member_view>{}, h), second};
}

replica_view make(tag<replica_view>, const actors_for_handles&) {
  return {.index = 1,
          .nodes = {"n2", "n3"},
          .placement = "n2 [0,4)",
          .ready = true,
          .state = "serving",
          .epoch = 7,
          .running = 3,
          .queued = 2,
          .kv_total_blocks = 512,
          .kv_used_blocks = 40,
          .finished = 99,
          .routed = 104,
          .replacements = 1,
          .resume_ms = 321.5,
          .cached_blocks = 77};
}

std::vector<replica_view> make(tag<std::vector<replica_view>>, const actors_for_handles& h) {
  auto second = make(tag<replica_view>{}, h);
  second.index = 0;
  second.nodes = {"n0"};
  return {second, make(tag<replica_view>{}, h)};
}

cluster_status make(tag<cluster_status>, const actors_for_handles& h) {
  return {.cluster = "c1",
          .head = "n0",
          .ready = true,
          .draining = true,
          .epoch = 3,
          .placement = "node0 [0,2) -> node1 [2,4)",
          .encoder = "n1",
          .nodes = make(tag<std::vector<member_view>>{}, h),
          .scheduler = make(tag<scheduler_stats>{}, h),
          .replacements = 1,
          .last_event = "node n2 lost",
          .detect_ms = 1200.5,
          .resume_ms = 850.25,
          .actor_restarts = 2,
          .migrations = 5,
          .migration = "copying KV, round 2",
          .migration_done = 0.5,
          .stages_total = 3,
          .stages_loaded = 2,
          .links = {"n0->n1", "n1->n2"},
          .link_bytes = {1 << 20, 1 << 21},
          .plan_detail = "plan: 2 stages",
          .decisions = make(tag<std::vector<placement_decision>>{}, h),
          .pipeline_detail = "  over 10.0 s: 4.0 steps/s",
          .indexed_blocks = {120, 64, 900, 30},
          .block_events = 4242,
          .kv_store = "n3",
          .kv_stores = 2,
          .replicas = make(tag<std::vector<replica_view>>{}, h),
          .routed_by_prefix = 60,
          .routed_by_load = 44,
          .encoder_replicas = {"n0 cpu", "n2 cpu:0-0 (1 GiB)"},
          .encoder_states = {"serving", "draining"},
          .encoder_waiting = 7,
          .encoder_wait_ms = 312.5,
          .encoder_scale_ups = 3,
          .encoder_scale_downs = 2,
          .encoder_min = 1,
          .encoder_max = 4,
          .standby = "n4: following",
          .term = 1765000000123,
          .journal_jobs = 5};
}

journal_entry make(tag<journal_entry>, const actors_for_handles& h) {
  return {.id = 99, .ended = false, .req = make(tag<generate_request>{}, h)};
}

std::vector<journal_entry> make(tag<std::vector<journal_entry>>, const actors_for_handles& h) {
  return {make(tag<journal_entry>{}, h), {.id = 5, .ended = true, .req = {}}};
}

journal_state make(tag<journal_state>, const actors_for_handles& h) {
  return {.term = 1765000000999, .jobs = make(tag<std::vector<journal_entry>>{}, h)};
}

std::vector<std::uint64_t> make(tag<std::vector<std::uint64_t>>, const actors_for_handles&) {
  return {3, 1ull << 40, 7};
}

frontdoor_actor make(tag<frontdoor_actor>, const actors_for_handles& h) {
  return handle<frontdoor_actor>(h.b);
}

encoder_order make(tag<encoder_order>, const actors_for_handles&) {
  return {.kind = encoder_kind::vision, .head_address = {9, 8, 7}};
}

migrate_request make(tag<migrate_request>, const actors_for_handles&) {
  return {.shard = "[1,2)", .to = "node2", .replica = 2, .rank = 1};
}

migrate_report make(tag<migrate_report>, const actors_for_handles&) {
  return {.what = "layers [1,2)",
          .from = "node1",
          .to = "node2",
          .total_ms = 75.5,
          .load_ms = 27.25,
          .pause_ms = 4.5,
          .rounds = 2,
          .sequences = 8,
          .kv_bytes = 1 << 20,
          .final_kv_bytes = 4096,
          .weight_bytes = 123456};
}

// -- comparison: operator== where the struct has one, else every field --------

template <class T>
bool same(const T& a, const T& b) {
  return a == b;
}

bool same(const models::sampling_params& a, const models::sampling_params& b) {
  return a.temperature == b.temperature && a.top_k == b.top_k && a.top_p == b.top_p &&
         a.min_p == b.min_p && a.repetition_penalty == b.repetition_penalty && a.seed == b.seed &&
         a.max_tokens == b.max_tokens && a.stop_token_ids == b.stop_token_ids &&
         a.stop_strings == b.stop_strings && a.presence_penalty == b.presence_penalty &&
         a.frequency_penalty == b.frequency_penalty && a.bias_ids == b.bias_ids &&
         a.bias_values == b.bias_values && a.min_tokens == b.min_tokens;
}

bool same(const generate_request& a, const generate_request& b) {
  return a.id == b.id && a.prompt == b.prompt && a.prompt_tokens == b.prompt_tokens &&
         a.media == b.media && a.audio_tokens == b.audio_tokens && same(a.params, b.params) &&
         a.deadline_ms == b.deadline_ms && a.grammar == b.grammar && a.cache_salt == b.cache_salt &&
         a.priority == b.priority && a.resumed == b.resumed;
}

bool same(const journal_entry& a, const journal_entry& b) {
  return a.id == b.id && a.ended == b.ended && same(a.req, b.req);
}

bool same(const std::vector<journal_entry>& a, const std::vector<journal_entry>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!same(a[i], b[i])) return false;
  return true;
}

bool same(const journal_state& a, const journal_state& b) {
  return a.term == b.term && same(a.jobs, b.jobs);
}

bool same(const stage_handles& a, const stage_handles& b) {
  return a.shard == b.shard && a.kv == b.kv && a.first_layer == b.first_layer &&
         a.last_layer == b.last_layer && a.engine_address == b.engine_address &&
         a.tp_rank == b.tp_rank && a.tp_size == b.tp_size;
}

bool same(const stage_order& a, const stage_order& b) {
  return a.first_layer == b.first_layer && a.last_layer == b.last_layer && a.embed == b.embed &&
         a.head == b.head && a.epoch == b.epoch && a.has_next == b.has_next &&
         same(a.next, b.next) && a.next_node == b.next_node && a.tp_rank == b.tp_rank &&
         a.tp_size == b.tp_size && a.tp_peers.size() == b.tp_peers.size() &&
         std::equal(a.tp_peers.begin(), a.tp_peers.end(), b.tp_peers.begin(),
                    [](const auto& x, const auto& y) { return same(x, y); }) &&
         a.tp_peer_nodes == b.tp_peer_nodes;
}

// -- the types: every one that register_protocol registers ----------------------

template <class... Ts>
struct type_list {
  using gtest = ::testing::Types<Ts...>;
  static std::set<std::type_index> indexes() { return {std::type_index(typeid(Ts))...}; }
};

using messages =
    type_list<tensor_ref, media_data, models::sampling_params, generate_request, submit_ack,
              token_event, finish_event, sample_work, seq_work, step_batch, step_output, shard_info,
              kv_usage_info, kv_export, encode_request, encode_reply, audio_chunk, stream_progress,
              media_rows_request, scheduler_stats, std::vector<std::int64_t>, node_status,
              client_sink_actor, shard_actor, kv_store_actor, encoder_actor,
              std::vector<shard_actor>, std::vector<kv_store_actor>, stage_handles,
              stage_host_actor, std::vector<std::uint8_t>, tp_ring_addresses, gate_hello, gate_pass,
              gatekeeper_actor, stage_order, device_probe, placement_decision,
              std::vector<placement_decision>, node_report, encoder_order, node_agent_actor,
              chat_turn, std::vector<chat_turn>, job_request, member_view, std::vector<member_view>,
              replica_view, std::vector<replica_view>, cluster_status, frontdoor_actor,
              migrate_request, migrate_report, tokenize_reply, std::vector<std::int32_t>,
              kv_block_event, kv_events, vault_blocks, vault_info, kv_vault_actor, vault_order,
              journal_entry, std::vector<journal_entry>, journal_state, std::vector<std::uint64_t>>;

/// The types register_protocol registers, by the names it gives them
/// ("troupe::..."; CAF also files each under "std::vector<...>" and
/// "stream<...>", which type_names_by_rtti then reports for some).
std::map<std::type_index, std::string> troupe_types(const caf::actor_system_config& cfg) {
  std::map<std::type_index, std::string> out;
  for (const auto& [name, factory] : cfg.value_factories_by_name) {
    if (name.rfind("troupe::", 0) != 0) continue;
    const auto value = factory();
    out.emplace(std::type_index(*value->type().second), name);
  }
  return out;
}

/// Test names from the registered names ("troupe::job_request" ->
/// "job_request").
struct registered_name {
  template <class T>
  static std::string GetName(int i) {
    const auto types = troupe_types(test::actor_config());
    const auto it = types.find(std::type_index(typeid(T)));
    return it == types.end() ? "unregistered_" + std::to_string(i) : it->second.substr(8);
  }
};

struct protocol_test : ::testing::Test {
  caf::actor_system sys{test::actor_config()};
  actors_for_handles actors;

  protocol_test() {
    for (caf::actor* a : {&actors.a, &actors.b, &actors.c, &actors.d})
      *a = sys.spawn([]() -> caf::behavior { return {[](std::int32_t) {}}; });
  }
  ~protocol_test() override {
    for (const caf::actor& a : {actors.a, actors.b, actors.c, actors.d})
      caf::anon_send_exit(a, caf::exit_reason::kill);
  }

  /// Serializes `x` in a caf::message (type-erased, as on the wire) and
  /// reads it back.
  template <class T>
  T round_trip(const T& x) {
    std::vector<char> buf;
    {
      caf::binary_serializer sink{sys, buf};
      auto msg = caf::make_message(x);
      auto e = sink(msg);
      EXPECT_FALSE(e) << sys.render(e);
    }
    EXPECT_GT(buf.size(), 0u);
    caf::message back;
    caf::binary_deserializer source{sys, buf};
    auto e = source(back);
    EXPECT_FALSE(e) << sys.render(e);
    EXPECT_EQ(source.remaining(), 0u) << "bytes left unread";
    if (!back.match_elements<T>()) {
      ADD_FAILURE() << "type lost on the way";
      return T{};
    }
    return back.get_as<T>(0);
  }
};

template <class T>
struct round_trip_test : protocol_test {};
TYPED_TEST_SUITE(round_trip_test, messages::gtest, registered_name);

TYPED_TEST(round_trip_test, every_field_survives) {
  const TypeParam sent = make(tag<TypeParam>{}, this->actors);
  ASSERT_FALSE(same(sent, TypeParam{})) << "the sample is the default value";
  const TypeParam back = this->round_trip(sent);
  // (A field an inspect() leaves out prints alike on both lines.)
  EXPECT_TRUE(same(back, sent)) << "sent " << caf::deep_to_string(sent) << "\nread "
                                << caf::deep_to_string(back);
}

TEST_F(protocol_test, every_registered_type_and_declared_struct_is_round_tripped) {
  const auto covered = messages::indexes();
  const auto registered = troupe_types(sys.config());
  EXPECT_GE(registered.size(), 40u);
  std::set<std::string> registered_names;
  for (const auto& [type, name] : registered) {
    registered_names.insert(name);
    EXPECT_TRUE(covered.count(type)) << name << " is registered but not round-tripped here";
  }
  for (const auto& type : covered)
    EXPECT_TRUE(registered.count(type)) << type.name() << " is round-tripped but not registered";
  // Every struct the protocol headers declare is registered, under its name.
  namespace fs = std::filesystem;
  const fs::path actors_dir = fs::path(TROUPE_FIXTURES_DIR) / ".." / ".." / "actors";
  std::vector<fs::path> headers{actors_dir / "protocol.hpp"};
  if (fs::is_directory(actors_dir / "protocol"))
    for (const auto& e : fs::directory_iterator(actors_dir / "protocol"))
      if (e.path().extension() == ".hpp") headers.push_back(e.path());
  const std::regex declaration(R"(^struct (\w+) \{)");
  int declared = 0;
  for (const auto& h : headers) {
    std::ifstream in(h);
    ASSERT_TRUE(in) << "cannot read " << h;
    std::smatch m;
    for (std::string line; std::getline(in, line);) {
      if (!std::regex_search(line, m, declaration)) continue;
      ++declared;
      EXPECT_TRUE(registered_names.count("troupe::" + m[1].str()))
          << m[1] << " (" << h.filename() << ") is declared but not registered as troupe::" << m[1];
    }
  }
  EXPECT_GE(declared, 25) << "the protocol headers moved? found " << declared << " structs";
}

TEST_F(protocol_test, every_finish_reason_survives) {
  for (finish_reason r : {finish_reason::stop, finish_reason::length, finish_reason::cancelled,
                          finish_reason::deadline, finish_reason::error}) {
    finish_event f;
    f.id = 1;
    f.reason = r;
    EXPECT_EQ(round_trip(f).reason, r) << to_string(r);
  }
}

TEST_F(protocol_test, errors_carry_code_and_message) {
  auto e = make_error(error_code::overloaded, "the queue holds 64 requests (limit 64)");
  EXPECT_EQ(troupe_code(e), static_cast<std::uint8_t>(error_code::overloaded));
  EXPECT_EQ(describe(sys, e), "overloaded: the queue holds 64 requests (limit 64)");
  // Through serialization the code and the text survive.
  auto back = round_trip(e);
  EXPECT_EQ(troupe_code(back), static_cast<std::uint8_t>(error_code::overloaded));
  EXPECT_EQ(describe(sys, back), describe(sys, e));
  EXPECT_EQ(troupe_code(caf::make_error(caf::sec::request_timeout)), 0);
}

}  // namespace
}  // namespace troupe::actors
