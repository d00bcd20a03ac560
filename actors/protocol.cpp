#include "actors/protocol.hpp"

namespace troupe::actors {

caf::error make_error(error_code code, std::string message) {
  return caf::error(static_cast<std::uint8_t>(code), error_category,
                    caf::make_message(std::move(message)));
}

std::uint8_t troupe_code(const caf::error& e) {
  return e.category() == error_category ? e.code() : 0;
}

namespace {
std::string render(std::uint8_t code, const caf::message& ctx) {
  std::string s = to_string(static_cast<error_code>(code));
  if (ctx.match_elements<std::string>()) s += ": " + ctx.get_as<std::string>(0);
  return s;
}
}  // namespace

std::string describe(caf::actor_system& sys, const caf::error& e) {
  if (e.category() == error_category) return render(e.code(), e.context());
  return sys.render(e);
}

void register_protocol(caf::actor_system_config& cfg) {
  cfg.add_message_type<tensor_ref>("troupe::tensor_ref");
  cfg.add_message_type<media_data>("troupe::media_data");
  cfg.add_message_type<models::sampling_params>("troupe::sampling_params");
  cfg.add_message_type<generate_request>("troupe::generate_request");
  cfg.add_message_type<submit_ack>("troupe::submit_ack");
  cfg.add_message_type<token_event>("troupe::token_event");
  cfg.add_message_type<finish_event>("troupe::finish_event");
  cfg.add_message_type<sample_work>("troupe::sample_work");
  cfg.add_message_type<seq_work>("troupe::seq_work");
  cfg.add_message_type<kv_block_event>("troupe::kv_block_event");
  cfg.add_message_type<kv_events>("troupe::kv_events");
  cfg.add_message_type<vault_blocks>("troupe::vault_blocks");
  cfg.add_message_type<vault_info>("troupe::vault_info");
  cfg.add_message_type<kv_vault_actor>("troupe::kv_vault_actor");
  cfg.add_message_type<vault_order>("troupe::vault_order");
  cfg.add_message_type<step_batch>("troupe::step_batch");
  cfg.add_message_type<step_output>("troupe::step_output");
  cfg.add_message_type<shard_info>("troupe::shard_info");
  cfg.add_message_type<kv_usage_info>("troupe::kv_usage_info");
  cfg.add_message_type<kv_export>("troupe::kv_export");
  cfg.add_message_type<encode_request>("troupe::encode_request");
  cfg.add_message_type<encode_reply>("troupe::encode_reply");
  cfg.add_message_type<audio_chunk>("troupe::audio_chunk");
  cfg.add_message_type<stream_progress>("troupe::stream_progress");
  cfg.add_message_type<media_rows_request>("troupe::media_rows_request");
  cfg.add_message_type<scheduler_stats>("troupe::scheduler_stats");
  cfg.add_message_type<std::vector<std::int64_t>>("troupe::i64_vector");
  cfg.add_message_type<node_status>("troupe::node_status");
  cfg.add_message_type<client_sink_actor>("troupe::client_sink_actor");
  cfg.add_message_type<shard_actor>("troupe::shard_actor");
  cfg.add_message_type<kv_store_actor>("troupe::kv_store_actor");
  cfg.add_message_type<encoder_actor>("troupe::encoder_actor");
  cfg.add_message_type<std::vector<shard_actor>>("troupe::shard_actors");
  cfg.add_message_type<std::vector<kv_store_actor>>("troupe::kv_store_actors");
  cfg.add_message_type<stage_handles>("troupe::stage_handles");
  cfg.add_message_type<stage_host_actor>("troupe::stage_host_actor");
  cfg.add_message_type<std::vector<std::uint8_t>>("troupe::u8_vector");
  cfg.add_message_type<tp_ring_addresses>("troupe::tp_ring_addresses");
  cfg.add_message_type<gate_hello>("troupe::gate_hello");
  cfg.add_message_type<gate_pass>("troupe::gate_pass");
  cfg.add_message_type<gatekeeper_actor>("troupe::gatekeeper_actor");
  cfg.add_message_type<stage_order>("troupe::stage_order");
  cfg.add_message_type<device_probe>("troupe::device_probe");
  cfg.add_message_type<placement_decision>("troupe::placement_decision");
  cfg.add_message_type<std::vector<placement_decision>>("troupe::placement_decisions");
  cfg.add_message_type<node_report>("troupe::node_report");
  cfg.add_message_type<encoder_order>("troupe::encoder_order");
  cfg.add_message_type<node_agent_actor>("troupe::node_agent_actor");
  cfg.add_message_type<chat_turn>("troupe::chat_turn");
  cfg.add_message_type<std::vector<chat_turn>>("troupe::chat_turns");
  cfg.add_message_type<job_request>("troupe::job_request");
  cfg.add_message_type<member_view>("troupe::member_view");
  cfg.add_message_type<replica_view>("troupe::replica_view");
  cfg.add_message_type<std::vector<replica_view>>("troupe::replica_views");
  cfg.add_message_type<std::vector<member_view>>("troupe::member_views");
  cfg.add_message_type<cluster_status>("troupe::cluster_status");
  cfg.add_message_type<frontdoor_actor>("troupe::frontdoor_actor");
  cfg.add_message_type<tokenize_reply>("troupe::tokenize_reply");
  cfg.add_message_type<std::vector<std::int32_t>>("troupe::int32_vector");
  cfg.add_message_type<migrate_request>("troupe::migrate_request");
  cfg.add_message_type<migrate_report>("troupe::migrate_report");
  cfg.add_message_type<journal_entry>("troupe::journal_entry");
  cfg.add_message_type<std::vector<journal_entry>>("troupe::journal_entries");
  cfg.add_message_type<journal_state>("troupe::journal_state");
  cfg.add_message_type<std::vector<std::uint64_t>>("troupe::u64_vector");
  cfg.add_error_category(error_category, [](std::uint8_t code, caf::atom_value,
                                            const caf::message& ctx) { return render(code, ctx); });
}

void configure_runtime(caf::actor_system_config& cfg) {
  register_protocol(cfg);
  cfg.set("scheduler.max-threads", 1);
  cfg.set("work-stealing.aggressive-poll-attempts", 10);
  // No moderate polling: it wakes every 50 us for a while after each
  // message, preempting the device threads in the middle of a step; an idle
  // worker waits on its condition variable instead.
  cfg.set("work-stealing.moderate-poll-attempts", 0);
}

}  // namespace troupe::actors
