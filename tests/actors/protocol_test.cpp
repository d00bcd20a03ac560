// Every protocol message survives CAF's binary serialization, inside a
// caf::message as it travels between nodes.
#include "actors/protocol.hpp"

#include <gtest/gtest.h>

#include "actor_test.hpp"

namespace troupe::actors {
namespace {

struct protocol_test : ::testing::Test {
  caf::actor_system sys{test::actor_config()};

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
    EXPECT_TRUE(back.match_elements<T>()) << "type lost on the way";
    return back.get_as<T>(0);
  }
};

tensor_ref a_ref(std::uint64_t id) {
  return {"cpu:1", 3, {7, 128}, id};
}

models::sampling_params a_sampling() {
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
  return p;
}

TEST_F(protocol_test, tensor_ref) {
  auto x = a_ref(42);
  EXPECT_EQ(round_trip(x), x);
}

TEST_F(protocol_test, generate_request_with_images_and_sampling) {
  generate_request x;
  x.id = 99;
  x.prompt = "USER: <image>\nWhat shape is on the left? ASSISTANT:";
  x.prompt_tokens = {1, 5, 6};
  x.images = {{"a.png", {0x89, 'P', 'N', 'G', 0, 255}}, {"b.jpg", {0xff, 0xd8}}};
  x.params = a_sampling();
  x.deadline_ms = 2500;
  auto y = round_trip(x);
  EXPECT_EQ(y.id, x.id);
  EXPECT_EQ(y.prompt, x.prompt);
  EXPECT_EQ(y.prompt_tokens, x.prompt_tokens);
  EXPECT_EQ(y.images, x.images);
  EXPECT_EQ(y.deadline_ms, x.deadline_ms);
  EXPECT_EQ(y.params.temperature, x.params.temperature);
  EXPECT_EQ(y.params.top_k, x.params.top_k);
  EXPECT_EQ(y.params.top_p, x.params.top_p);
  EXPECT_EQ(y.params.min_p, x.params.min_p);
  EXPECT_EQ(y.params.repetition_penalty, x.params.repetition_penalty);
  EXPECT_EQ(y.params.seed, x.params.seed);
  EXPECT_EQ(y.params.max_tokens, x.params.max_tokens);
  EXPECT_EQ(y.params.stop_token_ids, x.params.stop_token_ids);
  EXPECT_EQ(y.params.stop_strings, x.params.stop_strings);
}

TEST_F(protocol_test, stream_messages) {
  submit_ack a{7, 3};
  EXPECT_EQ(round_trip(a), a);
  token_event t{7, {10, 11}, "héllo"};
  EXPECT_EQ(round_trip(t), t);
  finish_event f{
      7, "error", "stage failed: x", {10, 11, 2}, "héllo", 12, 1, 0.5, 3.25, 9.125, true, 1.5, 2.5};
  EXPECT_EQ(round_trip(f), f);
}

TEST_F(protocol_test, step_messages) {
  step_batch b;
  b.step = 5;
  b.seqs.resize(2);
  b.seqs[0].seq = 3;
  b.seqs[0].tokens = {1, 2, 3};
  b.seqs[0].all_logits = true;
  b.seqs[0].embed_token = 3;
  b.seqs[0].embeddings = a_ref(8);
  b.seqs[1].seq = 4;
  b.seqs[1].start = 17;
  b.seqs[1].tokens = {9};
  b.hidden = a_ref(9);
  b.compute_ms = 1.5;
  b.stage_ms = {0.5, 1.0};
  b.decode_steps = 8;
  b.return_logits = false;
  b.seqs[1].sample = true;
  b.seqs[1].sampling.params.temperature = 0.5;
  b.seqs[1].sampling.params.stop_strings = {"x", "yz"};
  b.seqs[1].sampling.params.stop_token_ids = {2};
  b.seqs[1].sampling.draws = 11;
  b.seqs[1].sampling.max_new = 6;
  b.seqs[1].sampling.history = {1, 2, 3};
  EXPECT_EQ(round_trip(b), b);
  step_output o{5, a_ref(10), 2.5, {1.0, 1.5}, {{}, {4, 5, 6}}, 3};
  EXPECT_EQ(round_trip(o), o);
  shard_info s{"cpu:0", 2, 4, false, true, 128, 397};
  EXPECT_EQ(round_trip(s), s);
}

TEST_F(protocol_test, kv_and_encoder_messages) {
  kv_usage_info u{"cpu:0", 16, 255, 200, 3, 700};
  EXPECT_EQ(round_trip(u), u);
  kv_export k{12, 300, {0, 17, 18}, a_ref(11)};
  EXPECT_EQ(round_trip(k), k);
  encode_request r{4, {"x.png", {1, 2, 3}}};
  EXPECT_EQ(round_trip(r), r);
  encode_reply e{a_ref(12), 0.25, 1.75, 4};
  EXPECT_EQ(round_trip(e), e);
  scheduler_stats st{
      1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 3, 77, 12.5, 9.25, {3, 4, 2.25}, 20.5, 0.75};
  EXPECT_EQ(round_trip(st), st);
  migrate_request mq{"[1,2)", "node2"};
  EXPECT_EQ(round_trip(mq), mq);
  migrate_report mr{"layers [1,2)", "node1", "node2", 75.5, 27.25, 4.5, 2, 8,
                    1 << 20,        4096,    123456};
  EXPECT_EQ(round_trip(mr), mr);
  device_probe dp{"cpu:0-3", 4, 1e9, 2e9, 3e9, 4e9, 5e9, 6e9, 7e9, 8e9, 1 << 30, 123.5};
  EXPECT_EQ(round_trip(dp), dp);
  node_report nr;
  nr.node = "n1";
  nr.probe = dp;
  nr.load = 0.375;
  nr.engine_address = {1, 2, 3};
  EXPECT_EQ(round_trip(nr), nr);
  placement_decision pd{
      12.5, "node n2 joined", "move layers 2-3", "n0 [0,2) -> n2 [2,4)", 9.5, 5.25, 0.8, 100,
      170,  "measured"};
  EXPECT_EQ(round_trip(pd), pd);
  cluster_status cs;
  cs.plan_detail = "plan: 2 stages";
  cs.pipeline_detail = "  over 10.0 s: 4.0 steps/s";
  cs.decisions = {pd, pd};
  EXPECT_EQ(round_trip(cs), cs);
}

TEST_F(protocol_test, stage_handles_carry_actor_handles_and_the_engine_address) {
  auto shard = sys.spawn([]() -> shard_actor::behavior_type {
    return {[](step_atom, step_batch&) { return step_output{}; },
            [](info_atom) { return shard_info{}; }, [](version_atom) { return protocol_version; },
            [](route_atom, caf::strong_actor_ptr) { return true; }};
  });
  auto kv = sys.spawn([]() -> kv_store_actor::behavior_type {
    return {[](usage_atom) { return kv_usage_info{}; },
            [](free_atom, const std::vector<std::int64_t>&) { return std::int64_t{0}; },
            [](export_atom, std::int64_t) { return kv_export{}; },
            [](import_atom, const kv_export&) { return std::int64_t{0}; },
            [](reset_atom) { return std::int64_t{0}; },
            [](list_atom) { return std::vector<std::int64_t>{}; },
            [](export_atom, std::int64_t, std::int32_t, const std::string&) { return kv_export{}; },
            [](import_atom, const kv_export&, std::int32_t) { return std::int64_t{0}; }};
  });
  stage_handles h{shard, kv, 2, 4, {9, 8, 7, 0, 255}, 1, 3};
  auto back = round_trip(h);
  EXPECT_EQ(back.tp_rank, 1);
  EXPECT_EQ(back.tp_size, 3);
  tp_ring_addresses ring{{1, 2}, {}, {3, 4, 5}};
  EXPECT_EQ(round_trip(ring), ring);
  EXPECT_EQ(back.shard, shard);
  EXPECT_EQ(back.kv, kv);
  EXPECT_EQ(back.first_layer, 2);
  EXPECT_EQ(back.last_layer, 4);
  EXPECT_EQ(back.engine_address, h.engine_address);
  caf::anon_send_exit(shard, caf::exit_reason::kill);
  caf::anon_send_exit(kv, caf::exit_reason::kill);
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
