#include "actors/runtime.hpp"

#include <map>

#include <spdlog/spdlog.h>

#include <atomic>
#include <condition_variable>
#include <filesystem>

#include <caf/io/all.hpp>

#include "actors/data_plane.hpp"
#include "models/llava_config.hpp"
#include "transport/ucx_engine.hpp"
#include "models/weights.hpp"

namespace troupe::actors {

namespace {

using kernels::errc;

std::string dir_of(const std::string& path) {
  return std::filesystem::is_directory(path) ? path : std::filesystem::path(path).parent_path().string();
}

// Reaches the worker serving the last layers, checks what it serves and
// connects the data plane to it.
kernels::result<stage_handles> connect_remote_tail(caf::actor_system& sys, const runtime_config& cfg, int layers) {
  const auto colon = cfg.remote_tail.rfind(':');
  int port = 0;
  if (colon == std::string::npos || colon == 0 ||
      std::sscanf(cfg.remote_tail.c_str() + colon + 1, "%d", &port) != 1 || port <= 0 || port > 65535) {
    return kernels::make_error(errc::invalid_argument, "remote stage '" + cfg.remote_tail + "': expected HOST:PORT");
  }
  const std::string host = cfg.remote_tail.substr(0, colon);
  if (!sys.has_middleman()) return kernels::make_error(errc::internal, "remote stages need CAF's middleman loaded");
  auto host_actor = sys.middleman().remote_actor<stage_host_actor>(host, static_cast<std::uint16_t>(port));
  if (!host_actor) {
    return kernels::make_error(errc::io_error, "remote stage " + cfg.remote_tail + ": " + sys.render(host_actor.error()));
  }
  enable_tcp_nodelay_everywhere();  // step messages must not wait for Nagle
  std::optional<stage_handles> got;
  std::string why;
  caf::scoped_actor self{sys};
  self->request(*host_actor, caf::duration{cfg.remote_timeout}, version_atom::value)
      .receive([&](std::uint32_t v) {
                 if (v != protocol_version)
                   why = "protocol version " + std::to_string(v) + ", this process speaks " + std::to_string(protocol_version);
               },
               [&](caf::error& e) { why = sys.render(e); });
  if (why.empty()) {
    self->request(*host_actor, caf::duration{cfg.remote_timeout}, stage_atom::value)
        .receive([&](stage_handles& h) { got = std::move(h); }, [&](caf::error& e) { why = sys.render(e); });
  }
  if (!got) return kernels::make_error(errc::io_error, "remote stage " + cfg.remote_tail + ": " + why);
  if (got->first_layer <= 0 || got->first_layer >= layers || got->last_layer != layers) {
    return kernels::make_error(errc::invalid_argument, "remote stage " + cfg.remote_tail + " serves layers [" +
                                                           std::to_string(got->first_layer) + "," +
                                                           std::to_string(got->last_layer) + ") of a " +
                                                           std::to_string(layers) + "-layer model: it must serve the last layers");
  }
  auto& dp = data_plane::local();
  if (!dp.engine()) {
    auto e = transport::ucx_engine::create();
    if (!e) return std::unexpected(e.error());
    dp.attach(std::shared_ptr<transport::transfer_engine>(std::move(*e)));
  }
  if (auto c = dp.connect(to_string(got->shard->node()), got->engine_address); !c) {
    return kernels::make_error(c.error().code, "remote stage " + cfg.remote_tail + ": " + c.error().message);
  }
  return *got;
}

}  // namespace

kernels::result<std::unique_ptr<local_runtime>> local_runtime::start(caf::actor_system& sys, const runtime_config& cfg) {
  std::unique_ptr<local_runtime> rt(new local_runtime());
  rt->sys_ = &sys;
  auto devices = cfg.devices.empty() ? std::vector<device_spec>{{"cpu", {}}} : cfg.devices;
  if (cfg.stages < 1) return kernels::make_error(errc::invalid_argument, "--stages must be at least 1");
  // The decoder's shape decides the layer split.
  auto src = models::weight_source::open(cfg.model);
  if (!src) return std::unexpected(src.error());
  const std::string dir = dir_of(cfg.model);
  std::optional<models::llava_config> llava;
  models::llama_config text;
  if ((*src)->is_gguf()) {
    auto c = models::llama_config_from_gguf(*(*src)->gguf());
    if (!c) return std::unexpected(c.error());
    text = *c;
  } else {
    auto json = models::read_text_file(dir + "/config.json");
    if (!json) return std::unexpected(json.error());
    if (models::is_llava_config(*json)) {
      auto c = models::parse_llava_config(*json, dir + "/config.json");
      if (!c) return std::unexpected(c.error());
      llava = *c;
      text = c->text;
    } else {
      auto c = models::load_llama_config(dir + "/config.json");
      if (!c) return std::unexpected(c.error());
      text = *c;
    }
  }
  int L = static_cast<int>(text.num_layers);
  if (!cfg.remote_tail.empty()) {
    auto tail = connect_remote_tail(sys, cfg, L);
    if (!tail) return std::unexpected(tail.error());
    rt->remote_tail_ = *tail;
    L = tail->first_layer;  // the local stages split the layers before it
  }
  if (cfg.stages > L)
    return kernels::make_error(errc::invalid_argument, std::to_string(cfg.stages) + " stages for a model of " +
                                                           std::to_string(L) + " layers");
  auto tok = (*src)->is_gguf() ? models::tokenizer::from_gguf(*(*src)->gguf()) : models::tokenizer::load(dir);
  if (!tok) return std::unexpected(tok.error());
  src->reset();
  rt->frontend_.tok = std::make_shared<const models::tokenizer>(std::move(*tok));
  rt->frontend_.vocab = text.vocab_size;
  rt->frontend_.hidden = text.hidden_size;
  if (llava) {
    rt->frontend_.image_token = static_cast<std::int32_t>(llava->image_token_index);
    rt->frontend_.tokens_per_image = llava->tokens_per_image();
  }
  // One compute context per device, shared by the actors placed on it.
  std::map<std::string, std::shared_ptr<device_context>> contexts;
  auto context_of = [&](const device_spec& d) {
    auto& c = contexts[d.name];
    if (!c) c = device_context::create(d);
    return c;
  };
  // Stages, each on its device.
  std::int64_t blocks = std::numeric_limits<std::int64_t>::max();
  for (int s = 0; s < cfg.stages; ++s) {
    models::layer_range range;
    range.first = s * L / cfg.stages;
    range.last = (s + 1) * L / cfg.stages;
    range.embed = s == 0;
    range.head = s == cfg.stages - 1 && !rt->remote_tail_;
    const auto& dev = devices[static_cast<std::size_t>(s) % devices.size()];
    auto res = make_stage(context_of(dev), cfg.model, range, cfg.plan, cfg.kv);
    if (!res)
      return kernels::make_error(res.error().code, "stage " + std::to_string(s) + " on " + dev.name + " (layers " +
                                                       std::to_string(range.first) + "-" + std::to_string(range.last - 1) +
                                                       "): " + res.error().message);
    (*res)->attention = cfg.attention;
    blocks = std::min(blocks, (*res)->kv->cache.usage().total_blocks);
    rt->stage_res_.push_back(std::move(*res));
  }
  if (llava) {
    const auto& dev = devices[static_cast<std::size_t>(std::max(0, cfg.encoder_device)) % devices.size()];
    auto enc = make_vision_encoder(context_of(dev), cfg.model, cfg.plan);
    if (!enc) return kernels::make_error(enc.error().code, "vision encoder on " + dev.name + ": " + enc.error().message);
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
  rt->node_ = spawn_node(sys, std::move(ns));
  {
    // Once the node answers, its initial actors are published.
    caf::scoped_actor self{sys};
    self->request(rt->node_, caf::infinite, stats_atom::value).receive([](const node_status&) {}, [](caf::error&) {});
  }
  auto sopts = cfg.scheduler;
  sopts.kv = cfg.kv;
  sopts.kv_blocks = blocks;
  if (sopts.micro_batches < 1) sopts.micro_batches = cfg.stages;
  rt->scheduler_ = spawn_scheduler(sys, rt->frontend_, sopts, rt->shards(), rt->kv_stores(), rt->encoder());
  caf::anon_send(rt->node_, reset_atom::value, rt->scheduler_);
  return rt;
}

local_runtime::~local_runtime() { stop(); }

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

std::string local_runtime::describe() const {
  std::string s;
  for (const auto& r : stage_res_) {
    const auto range = r->model->range();
    if (!s.empty()) s += ", ";
    s += r->device.name + " layers [" + std::to_string(range.first) + "," + std::to_string(range.last) + ")";
  }
  if (remote_tail_) {
    s += ", remote worker layers [" + std::to_string(remote_tail_->first_layer) + "," +
         std::to_string(remote_tail_->last_layer) + ")";
  }
  if (encoder_res_) s += ", vision encoder on " + encoder_res_->device.name;
  return s;
}

// -- client ------------------------------------------------------------------

struct client::shared {
  std::mutex mtx;
  std::unordered_map<std::uint64_t, callbacks> cbs;
};

namespace {
client_sink_actor::behavior_type sink_impl(client_sink_actor::pointer, std::shared_ptr<client::shared> sh) {
  return {
      [=](const token_event& e) {
        std::function<void(const token_event&)> f;
        {
          std::lock_guard lock(sh->mtx);
          auto it = sh->cbs.find(e.id);
          if (it != sh->cbs.end()) f = it->second.on_token;
        }
        if (f) f(e);
      },
      [=](const finish_event& e) {
        std::function<void(const finish_event&)> f;
        {
          std::lock_guard lock(sh->mtx);
          auto it = sh->cbs.find(e.id);
          if (it != sh->cbs.end()) {
            f = std::move(it->second.on_finish);
            sh->cbs.erase(it);
          }
        }
        if (f) f(e);
      },
  };
}
}  // namespace

client::client(caf::actor_system& sys, scheduler_actor scheduler)
    : sys_(sys), scheduler_(std::move(scheduler)), shared_(std::make_shared<shared>()) {
  sink_ = sys_.spawn(sink_impl, shared_);
}

client::~client() { caf::anon_send_exit(sink_, caf::exit_reason::user_shutdown); }

std::uint64_t client::next_id() {
  static std::atomic<std::uint64_t> next{1};
  return next++;
}

std::expected<submit_ack, client::rejection> client::submit(generate_request req, callbacks cb) {
  const auto id = req.id;
  {
    std::lock_guard lock(shared_->mtx);
    shared_->cbs[id] = std::move(cb);
  }
  caf::scoped_actor self{sys_};
  std::expected<submit_ack, rejection> out = std::unexpected(rejection{error_code::internal, "no answer"});
  self->request(scheduler_, caf::infinite, submit_atom::value, std::move(req), sink_)
      .receive([&](submit_ack& a) { out = a; },
               [&](caf::error& e) {
                 const auto code = troupe_code(e);
                 out = std::unexpected(rejection{code ? static_cast<error_code>(code) : error_code::internal, describe(sys_, e)});
               });
  if (!out) {
    std::lock_guard lock(shared_->mtx);
    shared_->cbs.erase(id);
  }
  return out;
}

bool client::cancel(std::uint64_t id) {
  caf::scoped_actor self{sys_};
  bool found = false;
  self->request(scheduler_, caf::infinite, cancel_atom::value, id).receive([&](bool b) { found = b; }, [&](caf::error&) {});
  return found;
}

scheduler_stats client::stats() {
  caf::scoped_actor self{sys_};
  scheduler_stats s;
  self->request(scheduler_, caf::infinite, stats_atom::value).receive([&](scheduler_stats& x) { s = x; }, [&](caf::error&) {});
  return s;
}

std::expected<finish_event, client::rejection> client::run(generate_request req,
                                                           std::function<void(const token_event&)> on_token) {
  struct waiter {
    std::mutex m;
    std::condition_variable cv;
    std::optional<finish_event> done;
  };
  auto w = std::make_shared<waiter>();
  callbacks cb;
  cb.on_token = std::move(on_token);
  cb.on_finish = [w](const finish_event& f) {
    std::lock_guard lock(w->m);
    w->done = f;
    w->cv.notify_all();
  };
  auto ack = submit(std::move(req), std::move(cb));
  if (!ack) return std::unexpected(ack.error());
  std::unique_lock lock(w->m);
  w->cv.wait(lock, [&] { return w->done.has_value(); });
  return *w->done;
}

}  // namespace troupe::actors
