#include "actors/kv_vault.hpp"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "actors/data_plane.hpp"
#include "actors/log.hpp"

namespace troupe::actors {

namespace {

using name_t = std::array<std::uint8_t, 32>;

struct vault_state {
  kv_vault_options opts;
  std::int64_t layer_bytes = 0;
  /// By slot, by layer: the name of the block whose rows it holds (all
  /// zero: none) and the rows.
  std::vector<std::vector<name_t>> names;
  std::vector<std::vector<std::vector<std::byte>>> rows;
  vault_info info;
  std::shared_ptr<kernels::memory_pool> pool = kernels::memory_pool::create();
};

bool whole(const vault_state& st, std::size_t slot, const name_t& name) {
  for (const auto& n : st.names[slot])
    if (n != name) return false;
  return true;
}

/// Checks a request's shape: slots in range, one name per slot, layers in
/// the model. Empty string when it is sound.
std::string check(const vault_state& st, const vault_blocks& b) {
  if (b.slots.size() != b.names.size()) return "one name per slot is needed";
  if (b.first_layer < 0 || b.layers < 1 || b.first_layer + b.layers > st.opts.layers)
    return "layers [" + std::to_string(b.first_layer) + ", " +
           std::to_string(b.first_layer + b.layers) + ") are outside the model's " +
           std::to_string(st.opts.layers);
  for (auto s : b.slots)
    if (s < 0 || s >= st.opts.slots)
      return "slot " + std::to_string(s) + " is outside the vault's " +
             std::to_string(st.opts.slots);
  return {};
}

}  // namespace

kv_vault_actor spawn_kv_vault(caf::actor_system& sys, kv_vault_options opts) {
  auto impl = [](kv_vault_actor::stateful_pointer<vault_state> self,
                 kv_vault_options opts) -> kv_vault_actor::behavior_type {
    auto& st = self->state;
    st.opts = opts;
    st.layer_bytes = opts.layer_bytes;
    st.info.slots = opts.slots;
    st.info.layers = opts.layers;
    st.names.assign(static_cast<std::size_t>(opts.slots),
                    std::vector<name_t>(static_cast<std::size_t>(opts.layers), name_t{}));
    st.rows.resize(static_cast<std::size_t>(opts.slots));
    for (auto& r : st.rows) r.resize(static_cast<std::size_t>(opts.layers));
    return {
        [=](vault_put_atom, const vault_blocks& b) {
          auto& st = self->state;
          ++st.info.puts;
          auto data = data_plane::local().take(b.data, *st.pool);
          auto refuse = [&](const std::string& why) {
            ++st.info.refused;
            logging::of("vault").warn("KV vault: a put refused: {}", why);
          };
          if (!data) return refuse(data.error().message);
          if (auto why = check(st, b); !why.empty()) return refuse(why);
          const auto n = static_cast<std::int64_t>(b.slots.size()) * b.layers;
          const auto bytes = data->shape().numel();
          if (n == 0 || bytes % n != 0) return refuse("rows that do not split into whole layers");
          const auto per = bytes / n;
          if (st.layer_bytes == 0) st.layer_bytes = per;
          st.info.layer_bytes = st.layer_bytes;
          if (per != st.layer_bytes)
            return refuse("layers of " + std::to_string(per) + " bytes where the vault keeps " +
                          std::to_string(st.layer_bytes));
          const auto* p = static_cast<const std::byte*>(data->data());
          vault_blocks whole_now;
          for (std::size_t i = 0; i < b.slots.size(); ++i) {
            const auto slot = static_cast<std::size_t>(b.slots[i]);
            for (std::int32_t l = 0; l < b.layers; ++l) {
              const auto layer = static_cast<std::size_t>(b.first_layer + l);
              auto& row = st.rows[slot][layer];
              if (row.empty()) st.info.bytes += per;
              row.assign(p, p + per);
              p += per;
              st.names[slot][layer] = b.names[i];
            }
            if (whole(st, slot, b.names[i])) {
              whole_now.slots.push_back(b.slots[i]);
              whole_now.names.push_back(b.names[i]);
            }
          }
          st.info.complete = 0;
          if (!whole_now.slots.empty()) {
            for (std::size_t s = 0; s < st.names.size(); ++s)
              st.info.complete += st.names[s][0] != name_t{} && whole(st, s, st.names[s][0]);
            if (st.opts.notify) self->send(st.opts.notify, vault_ok_atom::value, whole_now);
          }
        },
        [=](vault_get_atom, const vault_blocks& b) -> caf::result<tensor_ref> {
          auto& st = self->state;
          ++st.info.gets;
          auto refuse = [&](const std::string& why) {
            ++st.info.refused;
            return make_error(error_code::not_found, "KV vault: " + why);
          };
          if (auto why = check(st, b); !why.empty()) return refuse(why);
          if (std::ssize(b.slots) > st.opts.slots)  // (the answer is sized by them)
            return refuse(std::to_string(b.slots.size()) + " slots asked of a vault of " +
                          std::to_string(st.opts.slots));
          for (std::size_t i = 0; i < b.slots.size(); ++i)
            for (std::int32_t l = 0; l < b.layers; ++l) {
              const auto slot = static_cast<std::size_t>(b.slots[i]);
              const auto layer = static_cast<std::size_t>(b.first_layer + l);
              if (st.names[slot][layer] != b.names[i] || st.rows[slot][layer].empty())
                return refuse("slot " + std::to_string(b.slots[i]) + " layer " +
                              std::to_string(layer) + " does not hold the block asked for");
            }
          const auto total = static_cast<std::int64_t>(b.slots.size()) * b.layers * st.layer_bytes;
          auto t = kernels::tensor::empty(*st.pool, kernels::dtype::u8,
                                          {std::max<std::int64_t>(1, total)});
          if (!t) return make_error(error_code::internal, t.error().message);
          auto* out = static_cast<std::byte*>(t->data());
          for (std::size_t i = 0; i < b.slots.size(); ++i)
            for (std::int32_t l = 0; l < b.layers; ++l) {
              const auto& row = st.rows[static_cast<std::size_t>(b.slots[i])]
                                       [static_cast<std::size_t>(b.first_layer + l)];
              std::memcpy(out, row.data(), row.size());
              out += row.size();
            }
          auto& dp = data_plane::local();
          const auto key = b.dest == to_string(self->node()) ? std::string{} : b.dest;
          if (!key.empty() && !dp.reachable(key))
            if (auto c = dp.connect(key, b.dest_address); !c)
              return make_error(error_code::peer_lost,
                                "KV vault: the data plane to " + key + ": " + c.error().message);
          auto ref = dp.send(key, "host", std::move(*t));
          if (!ref) return make_error(error_code::peer_lost, "KV vault: " + ref.error().message);
          return std::move(*ref);
        },
        [=](usage_atom) { return self->state.info; },
    };
  };
  return sys.spawn<caf::detached>(impl, std::move(opts));
}

}  // namespace troupe::actors
