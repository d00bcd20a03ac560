// A stage's KV store exports a sequence to host memory and imports it back
// (swap out / swap in, later migration): the shard then continues it with
// logits bit-identical to a sequence that never left.
#include <gtest/gtest.h>

#include "actor_test.hpp"

#include "actors/stage.hpp"
#include "actors/tensor_registry.hpp"

namespace troupe::actors {
namespace {

struct kv_store_test : ::testing::Test {
  caf::actor_system sys{test::actor_config()};
  caf::scoped_actor self{sys};

  std::vector<float> step(const shard_actor& shard, std::int64_t seq, std::int64_t start,
                          std::vector<std::int32_t> tokens) {
    step_batch b;
    b.step = 1;
    seq_work w;
    w.seq = seq;
    w.start = start;
    w.tokens = std::move(tokens);
    b.seqs.push_back(std::move(w));
    std::vector<float> out;
    self->request(shard, caf::infinite, step_atom::value, b)
        .receive(
            [&](step_output& o) {
              auto t = tensor_registry::local().take(o.logits);
              EXPECT_TRUE(t);
              out.assign(t->data_as<float>(), t->data_as<float>() + t->shape().numel());
            },
            [&](caf::error& e) { ADD_FAILURE() << describe(sys, e); });
    return out;
  }
};

TEST_F(kv_store_test, export_free_import_then_continue_bit_identically) {
  for (auto type : {kernels::dtype::f32, kernels::dtype::i8}) {
    models::kv_options kv;
    kv.type = type;
    kv.capacity_tokens = 16 * 32;
    auto dev = parse_devices("cpu");
    ASSERT_TRUE(dev);
    auto res = make_stage((*dev)[0], TROUPE_BUNDLED_MODEL, {}, {}, kv);
    ASSERT_TRUE(res) << res.error().message;
    auto shard = spawn_shard(sys, *res, {});
    auto store = spawn_kv_store(sys, *res);
    const std::vector<std::int32_t> prompt = {1,  20, 21, 22, 23, 24, 25, 26, 27, 28,
                                              29, 30, 31, 32, 33, 34, 35, 36, 37};
    // Two sequences with the same tokens: 7 stays, 8 is swapped out and in.
    step(shard, 7, 0, prompt);
    step(shard, 8, 0, prompt);
    kv_export ex;
    self->request(store, caf::infinite, export_atom::value, std::int64_t{8})
        .receive([&](kv_export& x) { ex = x; }, [&](caf::error& e) { FAIL() << describe(sys, e); });
    EXPECT_EQ(ex.length, static_cast<std::int64_t>(prompt.size()));
    EXPECT_EQ(ex.live.size(), 2u);  // 19 tokens in blocks of 16
    std::int64_t freed = 0;
    self->request(store, caf::infinite, free_atom::value, std::vector<std::int64_t>{8})
        .receive([&](std::int64_t n) { freed = n; },
                 [&](caf::error& e) { FAIL() << describe(sys, e); });
    EXPECT_EQ(freed, 2);
    self->request(store, caf::infinite, import_atom::value, ex)
        .receive([&](std::int64_t len) { EXPECT_EQ(len, ex.length); },
                 [&](caf::error& e) { FAIL() << describe(sys, e); });
    self->request(store, caf::infinite, usage_atom::value)
        .receive(
            [&](const kv_usage_info& u) {
              EXPECT_EQ(u.sequences, 2);
              EXPECT_EQ(u.tokens, 2 * static_cast<std::int64_t>(prompt.size()));
              EXPECT_EQ(u.total_blocks - u.free_blocks, 4);
            },
            [&](caf::error& e) { FAIL() << describe(sys, e); });
    // Both continue with the same tokens: the same logits, bit for bit.
    std::int64_t pos = static_cast<std::int64_t>(prompt.size());
    for (std::int32_t t : {40, 41, 42}) {
      const auto a = step(shard, 7, pos, {t});
      const auto b = step(shard, 8, pos, {t});
      ASSERT_FALSE(a.empty());
      EXPECT_EQ(a, b) << "at position " << pos;
      ++pos;
    }
    // A second import of a live sequence, or a snapshot with a lying length, is refused.
    self->request(store, caf::infinite, export_atom::value, std::int64_t{8})
        .receive([&](kv_export& x) { ex = x; }, [&](caf::error& e) { FAIL() << describe(sys, e); });
    self->request(store, caf::infinite, import_atom::value, ex)
        .receive([&](std::int64_t) { ADD_FAILURE() << "imported a sequence twice"; },
                 [&](caf::error& e) {
                   EXPECT_EQ(troupe_code(e),
                             static_cast<std::uint8_t>(error_code::invalid_request));
                 });
    self->request(store, caf::infinite, clear_atom::value)
        .receive([&](std::int64_t n) { EXPECT_EQ(n, 2); },
                 [&](caf::error& e) { FAIL() << describe(sys, e); });
    self->request(store, caf::infinite, usage_atom::value)
        .receive([&](const kv_usage_info& u) { EXPECT_EQ(u.free_blocks, u.total_blocks); },
                 [&](caf::error& e) { FAIL() << describe(sys, e); });
    EXPECT_EQ(tensor_registry::local().pending(), 0u);
    caf::anon_send_exit(shard, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(store, caf::exit_reason::user_shutdown);
  }
}

}  // namespace
}  // namespace troupe::actors
