#include "actors/runtime.hpp"

#include <map>

#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>

#include <caf/io/all.hpp>

#include "actors/data_plane.hpp"
#include "actors/prompt.hpp"
#include "models/llava_config.hpp"
#include "models/weights.hpp"
#include "placement/planner.hpp"
#include "transport/ucx_engine.hpp"

namespace troupe::actors {

namespace {

using kernels::errc;

struct remote_worker {
  stage_host_actor host;
  stage_handles handles;
};

// Reaches a `troupe worker` at "host:port", checks its protocol version,
// gets its stage and connects the data plane to it.
kernels::result<remote_worker> connect_worker(caf::actor_system& sys, const std::string& addr,
                                              std::chrono::milliseconds timeout,
                                              const std::string& what) {
  const auto colon = addr.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      std::sscanf(addr.c_str() + colon + 1, "%d", &port) != 1 || port <= 0 || port > 65535) {
    return kernels::make_error(errc::invalid_argument,
                               what + " '" + addr + "': expected HOST:PORT");
  }
  const std::string host = addr.substr(0, colon);
  if (!sys.has_middleman())
    return kernels::make_error(errc::internal, "remote stages need CAF's middleman loaded");
  auto host_actor =
      sys.middleman().remote_actor<stage_host_actor>(host, static_cast<std::uint16_t>(port));
  if (!host_actor) {
    return kernels::make_error(errc::io_error,
                               what + " " + addr + ": " + sys.render(host_actor.error()));
  }
  enable_tcp_nodelay_everywhere();  // step messages must not wait for Nagle
  std::optional<stage_handles> got;
  std::string why;
  caf::scoped_actor self{sys};
  self->request(*host_actor, caf::duration{timeout}, version_atom::value)
      .receive(
          [&](std::uint32_t v) {
            if (v != protocol_version)
              why = "protocol version " + std::to_string(v) + ", this process speaks " +
                    std::to_string(protocol_version);
          },
          [&](caf::error& e) { why = sys.render(e); });
  if (why.empty()) {
    self->request(*host_actor, caf::duration{timeout}, stage_atom::value)
        .receive([&](stage_handles& h) { got = std::move(h); },
                 [&](caf::error& e) { why = sys.render(e); });
  }
  if (!got) return kernels::make_error(errc::io_error, what + " " + addr + ": " + why);
  auto& dp = data_plane::local();
  if (!dp.engine()) {
    auto e = transport::ucx_engine::create();
    if (!e) return std::unexpected(e.error());
    dp.attach(std::shared_ptr<transport::transfer_engine>(std::move(*e)));
  }
  if (auto c = dp.connect(to_string(got->shard->node()), got->engine_address); !c) {
    return kernels::make_error(c.error().code, what + " " + addr + ": " + c.error().message);
  }
  return remote_worker{*host_actor, std::move(*got)};
}

// Reaches the worker serving the last layers and checks what it serves.
kernels::result<stage_handles> connect_remote_tail(caf::actor_system& sys,
                                                   const runtime_config& cfg, int layers) {
  auto w = connect_worker(sys, cfg.remote_tail, cfg.remote_timeout, "remote stage");
  if (!w) return std::unexpected(w.error());
  const auto& got = w->handles;
  if (got.tp_size != 1)
    return kernels::make_error(
        errc::invalid_argument,
        "remote stage " + cfg.remote_tail + " is a tensor-parallel rank (use --tp-peer for it)");
  if (got.first_layer <= 0 || got.first_layer >= layers || got.last_layer != layers) {
    return kernels::make_error(
        errc::invalid_argument,
        "remote stage " + cfg.remote_tail + " serves layers [" + std::to_string(got.first_layer) +
            "," + std::to_string(got.last_layer) + ") of a " + std::to_string(layers) +
            "-layer model: it must serve the last layers");
  }
  return got;
}

// Reaches the tensor-parallel ranks 1..K-1, checks that they form one
// group with this process as rank 0, hands every rank the ring and fills
// `g` (rank 0's group). Returns the workers in rank order.
kernels::result<std::vector<std::pair<std::string, stage_handles>>> connect_tp_group(
    caf::actor_system& sys, const runtime_config& cfg, int layers, tp_group& g) {
  const int k = static_cast<int>(cfg.tp_peers.size()) + 1;
  std::vector<std::optional<remote_worker>> ranks(static_cast<std::size_t>(k));
  std::vector<std::string> addrs(static_cast<std::size_t>(k));
  for (const auto& addr : cfg.tp_peers) {
    auto w = connect_worker(sys, addr, cfg.remote_timeout, "tensor-parallel peer");
    if (!w) return std::unexpected(w.error());
    const auto& h = w->handles;
    if (h.tp_size != k)
      return kernels::make_error(
          errc::invalid_argument,
          "tensor-parallel peer " + addr + " is " +
              (h.tp_size == 1
                   ? std::string("a pipeline stage, not a tensor-parallel rank")
                   : "rank " + std::to_string(h.tp_rank) + " of " + std::to_string(h.tp_size)) +
              ", but this group has " + std::to_string(k) + " ranks (this process and " +
              std::to_string(k - 1) + " peers)");
    if (h.tp_rank < 1 || h.tp_rank >= k || ranks[static_cast<std::size_t>(h.tp_rank)])
      return kernels::make_error(
          errc::invalid_argument,
          "tensor-parallel peer " + addr + " is rank " + std::to_string(h.tp_rank) + ", which " +
              (h.tp_rank < 1 || h.tp_rank >= k ? "is out of range" : "another peer already is"));
    if (h.first_layer != 0 || h.last_layer != layers)
      return kernels::make_error(
          errc::invalid_argument,
          "tensor-parallel peer " + addr + " holds layers [" + std::to_string(h.first_layer) + "," +
              std::to_string(h.last_layer) + ") of a " + std::to_string(layers) +
              "-layer model: it must hold them all");
    addrs[static_cast<std::size_t>(h.tp_rank)] = addr;
    ranks[static_cast<std::size_t>(h.tp_rank)] = std::move(*w);
  }
  auto& dp = data_plane::local();
  tp_ring_addresses ring(static_cast<std::size_t>(k));
  ring[0] = dp.address();
  for (int r = 1; r < k; ++r)
    ring[static_cast<std::size_t>(r)] = ranks[static_cast<std::size_t>(r)]->handles.engine_address;
  caf::scoped_actor self{sys};
  for (int r = 1; r < k; ++r) {
    std::string why;
    self->request(ranks[static_cast<std::size_t>(r)]->host, caf::duration{cfg.remote_timeout},
                  tp_atom::value, ring)
        .receive(
            [&](std::int32_t got) {
              if (got != r) why = "answered as rank " + std::to_string(got);
            },
            [&](caf::error& e) { why = describe(sys, e); });
    if (!why.empty())
      return kernels::make_error(errc::io_error, "tensor-parallel peer " +
                                                     addrs[static_cast<std::size_t>(r)] +
                                                     " (rank " + std::to_string(r) + "): " + why);
  }
  g.rank = 0;
  g.size = k;
  std::vector<std::pair<std::string, stage_handles>> out;
  for (int r = 1; r < k; ++r) {
    const auto& h = ranks[static_cast<std::size_t>(r)]->handles;
    g.peer_shards.push_back(h.shard);
    g.peer_kvs.push_back(h.kv);
    g.peer_keys.push_back(to_string(h.shard->node()));
    out.emplace_back(addrs[static_cast<std::size_t>(r)], h);
  }
  g.ring.engine = dp.engine().get();
  g.ring.rank = 0;
  g.ring.size = k;
  g.ring.next = *dp.peer(g.peer_keys[0]);
  g.ring.abort = &g.broken;
  g.ring.stats = &g.allreduce;
  g.reply_timeout = std::max(g.reply_timeout, cfg.remote_timeout);
  return out;
}

}  // namespace

kernels::result<std::unique_ptr<local_runtime>> local_runtime::start(caf::actor_system& sys,
                                                                     const runtime_config& cfg) {
  std::unique_ptr<local_runtime> rt(new local_runtime());
  rt->sys_ = &sys;
  auto devices = cfg.devices.empty() ? std::vector<device_spec>{{"cpu", {}}} : cfg.devices;
  if (cfg.stages < 1)
    return kernels::make_error(errc::invalid_argument, "--stages must be at least 1");
  for (const auto& [what, tokens] : {std::pair{"--kv-host-tokens", cfg.kv.tiers.host_tokens},
                                     std::pair{"--kv-disk-tokens", cfg.kv.tiers.disk_tokens}})
    if (tokens > 0 && tokens < cfg.kv.block_size)
      return kernels::make_error(errc::invalid_argument,
                                 std::string(what) + " " + std::to_string(tokens) +
                                     " holds no KV block of " + std::to_string(cfg.kv.block_size) +
                                     " tokens; 0 turns the tier off");
  if (!cfg.kv.tiers.disk_dir.empty() && cfg.kv.tiers.disk_tokens == 0)
    return kernels::make_error(errc::invalid_argument,
                               "--kv-disk-dir without --kv-disk-tokens: there is no disk tier");
  if (cfg.kv.tiers.host_tokens > 0 || cfg.kv.tiers.disk_tokens > 0) {
    if (!cfg.scheduler.prefix_caching || cfg.kv.window > 0)
      return kernels::make_error(errc::invalid_argument,
                                 "KV host and disk tiers hold prefix-cached blocks: they need "
                                 "prefix caching (and no sliding window)");
    if (!cfg.remote_tail.empty() || !cfg.tp_peers.empty())
      return kernels::make_error(errc::invalid_argument,
                                 "KV host and disk tiers do not combine with --remote-stage or "
                                 "--tp-peer yet (the worker processes have no tiers)");
  }
  // The decoder's shape decides the layer split.
  auto setup = load_prompt_setup(cfg.model);
  if (!setup) return std::unexpected(setup.error());
  const std::optional<models::llava_config> llava = setup->llava;
  const models::llama_config text = setup->text;
  int L = static_cast<int>(text.num_layers);
  std::shared_ptr<tp_group> tp;
  if (!cfg.tp_peers.empty()) {
    if (cfg.stages != 1 || !cfg.remote_tail.empty())
      return kernels::make_error(
          errc::invalid_argument,
          "tensor parallelism across processes runs the whole model as one stage: it does not "
          "combine with --stages > 1 or --remote-stage yet");
    tp = std::make_shared<tp_group>();
    auto peers = connect_tp_group(sys, cfg, L, *tp);
    if (!peers) return std::unexpected(peers.error());
    rt->tp_peers_ = std::move(*peers);
    rt->tp_ = tp;
  }
  if (!cfg.remote_tail.empty()) {
    auto tail = connect_remote_tail(sys, cfg, L);
    if (!tail) return std::unexpected(tail.error());
    rt->remote_tail_ = *tail;
    L = tail->first_layer;  // the local stages split the layers before it
  }
  if (cfg.stages > L)
    return kernels::make_error(
        errc::invalid_argument,
        std::to_string(cfg.stages) + " stages for a model of " + std::to_string(L) + " layers");
  rt->frontend_.tok = setup->tok;
  rt->frontend_.vocab = text.vocab_size;
  rt->frontend_.hidden = text.hidden_size;
  auto ctx = models::serving_context_length(text.max_position_embeddings, cfg.scheduler.context,
                                            "--max-model-len");
  if (!ctx) return std::unexpected(ctx.error());
  rt->frontend_.context_length = *ctx;
  if (llava) {
    rt->frontend_.image_token = static_cast<std::int32_t>(llava->image_token_index);
    rt->frontend_.tokens_per_image = llava->tokens_per_image();
    if (llava->audio)
      rt->frontend_.audio_token = static_cast<std::int32_t>(llava->audio->token_index);
    if (llava->video)
      rt->frontend_.video_token = static_cast<std::int32_t>(llava->video->token_index);
  }
  // One compute context per device, shared by the actors placed on it.
  std::map<std::string, std::shared_ptr<kernels::device>> opened;
  auto device_of = [&](const device_spec& d) -> kernels::result<std::shared_ptr<kernels::device>> {
    if (auto it = opened.find(d.name); it != opened.end()) return it->second;
    auto c = open_device(d);
    if (c) opened[d.name] = *c;
    return c;
  };
  // Stages, each on its device.
  std::int64_t blocks = std::numeric_limits<std::int64_t>::max();
  const auto ranges = placement::even_split(L, cfg.stages);  // cfg.stages <= L: checked above
  for (int s = 0; s < cfg.stages; ++s) {
    models::layer_range range;
    range.first = ranges[static_cast<std::size_t>(s)].first;
    range.last = ranges[static_cast<std::size_t>(s)].second;
    range.embed = s == 0;
    range.head = s == cfg.stages - 1 && !rt->remote_tail_;
    const auto& dev = devices[static_cast<std::size_t>(s) % devices.size()];
    auto opened_dev = device_of(dev);
    if (!opened_dev) return std::unexpected(opened_dev.error());
    auto res = make_stage(dev, *opened_dev, cfg.model, range, cfg.plan, cfg.kv, tp);
    if (!res)
      return kernels::make_error(
          res.error().code, "stage " + std::to_string(s) + " on " + dev.name + " (layers " +
                                std::to_string(range.first) + "-" + std::to_string(range.last - 1) +
                                "): " + res.error().message);
    (*res)->attention = cfg.attention;
    blocks = std::min(blocks, (*res)->kv->cache.usage().total_blocks);
    rt->stage_res_.push_back(std::move(*res));
  }
  // A tensor-parallel group holds a sequence only where every rank has room.
  for (const auto& [addr, h] : rt->tp_peers_) {
    caf::scoped_actor self{sys};
    std::string why;
    self->request(h.kv, caf::duration{cfg.remote_timeout}, usage_atom::value)
        .receive([&](const kv_usage_info& u) { blocks = std::min(blocks, u.total_blocks); },
                 [&](caf::error& e) { why = actors::describe(sys, e); });
    if (!why.empty())
      return kernels::make_error(errc::io_error, "tensor-parallel peer " + addr + ": " + why);
  }
  if (llava) {
    const auto& dev =
        devices[static_cast<std::size_t>(std::max(0, cfg.encoder_device)) % devices.size()];
    auto opened_dev = device_of(dev);
    if (!opened_dev) return std::unexpected(opened_dev.error());
    auto enc = make_media_encoder(dev, *opened_dev, cfg.model, cfg.plan);
    if (!enc)
      return kernels::make_error(enc.error().code,
                                 "vision encoder on " + dev.name + ": " + enc.error().message);
    rt->encoder_res_ = std::move(*enc);
  }
  // The node spawns and supervises the stages and the encoder; then the
  // scheduler starts over them.
  node_setup ns;
  ns.stages = rt->stage_res_;
  ns.encoder = rt->encoder_res_;
  ns.encoder_opts = cfg.encoder;
  ns.handles = rt->handles_;
  ns.opts = cfg.node;
  ns.remote_tail = rt->remote_tail_;
  for (const auto& [addr, h] : rt->tp_peers_) ns.tp_peers.push_back(h);
  rt->node_ = spawn_node(sys, std::move(ns));
  {
    // Once the node answers, its initial actors are published.
    caf::scoped_actor self{sys};
    self->request(rt->node_, caf::infinite, stats_atom::value)
        .receive([](const node_status&) {}, [](caf::error&) {});
  }
  auto sopts = cfg.scheduler;
  sopts.kv = cfg.kv;
  sopts.kv_blocks = blocks;
  sopts.cache_namespace = cache_namespace(cfg.model, cfg.plan, cfg.kv);
  sopts.host_blocks = cfg.kv.tiers.host_tokens / cfg.kv.block_size;
  sopts.disk_blocks = cfg.kv.tiers.disk_tokens / cfg.kv.block_size;
  for (const auto& r : rt->stage_res_)
    sopts.kv_slot_bytes += static_cast<std::int64_t>(r->kv->cache.slot_bytes());
  if (sopts.micro_batches < 1) sopts.micro_batches = cfg.stages;
  rt->scheduler_ =
      spawn_scheduler(sys, rt->frontend_, sopts, rt->shards(), rt->kv_stores(), rt->encoder());
  caf::anon_send(rt->node_, notify_atom::value, rt->scheduler_);
  return rt;
}

local_runtime::~local_runtime() {
  stop();
}

void local_runtime::stop() {
  if (!sys_) return;
  // The node first (it stops what it spawned and restarts nothing more).
  if (node_) caf::anon_send_exit(node_, caf::exit_reason::user_shutdown);
  if (scheduler_) caf::anon_send_exit(scheduler_, caf::exit_reason::user_shutdown);
  sys_ = nullptr;
}

std::vector<shard_actor> local_runtime::shards() const {
  std::lock_guard lock(handles_->mtx);
  return handles_->shards;
}

std::vector<kv_store_actor> local_runtime::kv_stores() const {
  std::lock_guard lock(handles_->mtx);
  return handles_->kv_stores;
}

encoder_actor local_runtime::encoder() const {
  std::lock_guard lock(handles_->mtx);
  return handles_->encoder;
}

std::optional<transport::allreduce_totals> local_runtime::tp_allreduce() const {
  if (!tp_) return std::nullopt;
  return tp_->allreduce.snapshot();
}

int local_runtime::tp_size() const {
  return tp_ ? tp_->size : 1;
}

std::string local_runtime::describe() const {
  std::string s;
  for (const auto& r : stage_res_) {
    const auto range = r->model->range();
    if (!s.empty()) s += ", ";
    s += r->device.name + " layers [" + std::to_string(range.first) + "," +
         std::to_string(range.last) + ")";
  }
  if (!tp_peers_.empty()) {
    s += " tensor-parallel rank 0 of " + std::to_string(tp_peers_.size() + 1);
    for (const auto& [addr, h] : tp_peers_)
      s += ", remote rank " + std::to_string(h.tp_rank) + " at " + addr;
  }
  if (remote_tail_) {
    s += ", remote worker layers [" + std::to_string(remote_tail_->first_layer) + "," +
         std::to_string(remote_tail_->last_layer) + ")";
  }
  if (encoder_res_) s += ", vision encoder on " + encoder_res_->device.name;
  return s;
}

}  // namespace troupe::actors
