// The cluster's KV store (a vault) on its own: it confirms a slot only
// when every layer of the model holds the same block, gives back exactly
// the rows put for the layers asked, refuses a get whose layers hold
// another block (or none), and refuses puts that would not fit its slots.
#include "actors/kv_vault.hpp"

#include <gtest/gtest.h>

#include <memory>
#include <mutex>
#include <numeric>
#include <vector>

#include "actors/data_plane.hpp"
#include "tests/actors/actor_test.hpp"

namespace troupe::actors {
namespace {

using namespace std::chrono_literals;
using name_t = std::array<std::uint8_t, 32>;

name_t name_of(std::uint8_t v) {
  name_t n{};
  n.fill(v);
  return n;
}

/// What the vault confirmed, as a scheduler would be told.
struct confirmations {
  std::mutex mtx;
  std::vector<std::pair<std::int32_t, name_t>> got;
  std::size_t size() {
    std::lock_guard lock(mtx);
    return got.size();
  }
};

struct kv_vault_test : ::testing::Test {
  caf::actor_system sys{test::actor_config()};
  caf::scoped_actor self{sys};
  std::shared_ptr<confirmations> seen = std::make_shared<confirmations>();
  static constexpr std::int64_t layer_bytes = 8;
  kv_vault_actor vault;

  void SetUp() override {
    kv_vault_options o;
    o.slots = 4;
    o.layers = 3;
    o.layer_bytes = layer_bytes;
    o.notify = test::idle_scheduler(sys, [c = seen](const vault_blocks& b) {
      std::lock_guard lock(c->mtx);
      for (std::size_t i = 0; i < b.slots.size(); ++i) c->got.emplace_back(b.slots[i], b.names[i]);
    });
    vault = spawn_kv_vault(sys, o);
  }
  void TearDown() override { self->send_exit(vault, caf::exit_reason::user_shutdown); }

  /// Rows whose bytes say which slot, layer and block they are of.
  static std::vector<std::uint8_t> rows(std::int32_t slot, std::int32_t first, std::int32_t n,
                                        std::uint8_t block) {
    std::vector<std::uint8_t> out;
    for (std::int32_t l = first; l < first + n; ++l)
      for (std::int64_t b = 0; b < layer_bytes; ++b)
        out.push_back(static_cast<std::uint8_t>(slot * 64 + l * 8 + b + block));
    return out;
  }
  void put(std::int32_t slot, std::uint8_t block, std::int32_t first, std::int32_t n,
           std::vector<std::uint8_t> bytes) {
    static const auto pool = kernels::memory_pool::create();
    auto t = kernels::tensor::empty(*pool, kernels::dtype::u8, {std::ssize(bytes)});
    ASSERT_TRUE(t);
    std::memcpy(t->data(), bytes.data(), bytes.size());
    vault_blocks b;
    b.slots = {slot};
    b.names = {name_of(block)};
    b.first_layer = first;
    b.layers = n;
    b.data = data_plane::local().park("host", std::move(*t));
    self->send(vault, vault_put_atom::value, b);
  }
  /// The rows of layers [first, first + n) of `slot` as block `block`, or the error.
  std::expected<std::vector<std::uint8_t>, std::string> get(std::int32_t slot, std::uint8_t block,
                                                            std::int32_t first, std::int32_t n) {
    vault_blocks b;
    b.slots = {slot};
    b.names = {name_of(block)};
    b.first_layer = first;
    b.layers = n;
    std::expected<std::vector<std::uint8_t>, std::string> out = std::unexpected("no answer");
    self->request(vault, 10s, vault_get_atom::value, b)
        .receive(
            [&](tensor_ref& ref) {
              static const auto pool = kernels::memory_pool::create();
              auto t = data_plane::local().take(ref, *pool);
              if (!t) {
                out = std::unexpected(t.error().message);
                return;
              }
              const auto* p = static_cast<const std::uint8_t*>(t->data());
              out = std::vector<std::uint8_t>(p, p + t->shape().numel());
            },
            [&](caf::error& e) { out = std::unexpected(describe(sys, e)); });
    return out;
  }
  vault_info info() {
    vault_info i;
    self->request(vault, 10s, usage_atom::value)
        .receive([&](vault_info& v) { i = v; }, [](caf::error&) {});
    return i;
  }
  void settle() { (void)info(); }  // the vault handles messages in order
};

TEST_F(kv_vault_test, a_slot_is_confirmed_once_every_layer_holds_the_block) {
  put(1, 7, 0, 2, rows(1, 0, 2, 7));  // a first stage's layers
  settle();
  EXPECT_EQ(seen->size(), 0u) << "confirmed with a layer missing";
  put(1, 7, 2, 1, rows(1, 2, 1, 7));  // the last stage's
  settle();
  for (int i = 0; i < 100 && seen->size() == 0; ++i) std::this_thread::sleep_for(5ms);
  ASSERT_EQ(seen->size(), 1u);
  EXPECT_EQ(seen->got[0].first, 1);
  EXPECT_EQ(seen->got[0].second, name_of(7));
  // Back for another split of the layers: exactly what was put.
  auto back = get(1, 7, 1, 2);
  ASSERT_TRUE(back) << back.error();
  auto want = rows(1, 0, 2, 7);
  want.erase(want.begin(), want.begin() + layer_bytes);
  const auto last = rows(1, 2, 1, 7);
  want.insert(want.end(), last.begin(), last.end());
  EXPECT_EQ(*back, want);
  const auto i = info();
  EXPECT_EQ(i.complete, 1);
  EXPECT_EQ(i.bytes, 3 * layer_bytes);
}

TEST_F(kv_vault_test, a_get_for_another_block_or_a_half_overwritten_slot_is_refused) {
  put(2, 7, 0, 3, rows(2, 0, 3, 7));
  settle();
  EXPECT_TRUE(get(2, 7, 0, 3));
  auto other = get(2, 9, 0, 3);
  ASSERT_FALSE(other);
  EXPECT_NE(other.error().find("does not hold the block"), std::string::npos) << other.error();
  EXPECT_FALSE(get(3, 7, 0, 1)) << "an empty slot";
  // Layer 0 now holds another block: block 7 is no longer whole there.
  put(2, 9, 0, 1, rows(2, 0, 1, 9));
  settle();
  EXPECT_FALSE(get(2, 7, 0, 3));
  EXPECT_TRUE(get(2, 7, 1, 2)) << "its other layers still hold it";
}

TEST_F(kv_vault_test, puts_that_do_not_fit_are_refused_and_hold_nothing) {
  put(9, 1, 0, 1, rows(0, 0, 1, 1));                  // no slot 9
  put(0, 1, 2, 2, rows(0, 2, 2, 1));                  // layers [2, 4) of 3
  put(0, 1, 0, 1, std::vector<std::uint8_t>(12, 3));  // 12 bytes for a layer of 8
  put(0, 1, 0, 2, std::vector<std::uint8_t>(3, 3));   // not whole layers
  settle();
  const auto i = info();
  EXPECT_EQ(i.refused, 4);
  EXPECT_EQ(i.bytes, 0);
  EXPECT_EQ(seen->size(), 0u);
  EXPECT_FALSE(get(0, 1, 0, 1));
  EXPECT_FALSE(get(0, 1, 0, 4)) << "layers outside the model";
  // More slots than the vault has (its answer would be sized by them).
  put(3, 5, 0, 3, rows(3, 0, 3, 5));
  vault_blocks many;
  many.slots.assign(5, 3);
  many.names.assign(5, name_of(5));
  many.layers = 3;
  bool refused = false;
  self->request(vault, 10s, vault_get_atom::value, many)
      .receive([](tensor_ref&) {}, [&](caf::error&) { refused = true; });
  EXPECT_TRUE(refused);
  EXPECT_TRUE(get(3, 5, 0, 3));
}

}  // namespace
}  // namespace troupe::actors
