#include "transport/ucx_engine.hpp"

#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>

#include <cstdarg>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <list>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "transport/framing.hpp"

namespace troupe::transport {

namespace {

using clock = std::chrono::steady_clock;

constexpr std::uint32_t address_magic = 0x58435554;  // "TUCX"
constexpr std::uint32_t region_magic = 0x47524354;   // "TCRG"
// Bounds on what a peer may hand us (a ucp worker address is a few hundred
// bytes; a packed rkey for host memory well under 1 KiB).
constexpr std::size_t max_address_bytes = 64 * 1024;
constexpr std::size_t max_rkey_bytes = 16 * 1024;

std::string ucs_text(ucs_status_t st) {
  return ucs_status_string(st);
}

bool tls_has_shm(const std::string& tls) {
  if (tls.empty()) return true;
  for (const char* t : {"all", "sm", "shm", "posix", "sysv", "cma", "xpmem", "knem"}) {
    // Tokens separated by commas; a leading ^ negates the whole list.
    if (tls.starts_with("^")) return true;
    std::size_t pos = 0;
    while (pos <= tls.size()) {
      const std::size_t end = std::min(tls.find(',', pos), tls.size());
      if (tls.compare(pos, end - pos, t) == 0) return true;
      pos = end + 1;
    }
  }
  return false;
}

struct op_rec {
  op_spec spec;
  op_state state = op_state::prepared;
  void* req = nullptr;        // the ucp request while in flight
  void* flush_req = nullptr;  // put: the endpoint flush that makes it remotely complete
  bool req_done = false;
  bool flush_done = false;
  ucs_status_t status = UCS_OK;
  std::size_t received = 0;
  clock::time_point deadline{};
  ucp_rkey_h rkey = nullptr;  // put/get
  std::uint64_t remote_base = 0;
  error failure;
};

}  // namespace

struct ucx_engine::impl {
  ucx_options opt;
  bool peer_mode = false;
  ucp_context_h ctx = nullptr;
  ucp_worker_h worker = nullptr;
  int efd = -1;
  std::vector<std::uint8_t> addr;
  mutable std::mutex mtx;
  // The progress thread's own sleep: it watches `waiters` and
  // `last_wait_end_ns` without taking `mtx`, so its timed wake-ups never
  // take the lock from a thread spinning in wait().
  std::mutex idle_mtx;
  std::condition_variable idle_cv;                // wakes the progress thread (to stop)
  std::atomic<int> waiters{0};                    // threads inside wait() (changed under mtx)
  std::atomic<std::int64_t> last_wait_end_ns{0};  // steady_clock ns when the last waiter left
  std::thread progressor;
  std::atomic<bool> stopping{false};

  struct peer_rec {
    ucp_ep_h ep = nullptr;
    bool failed = false;
    std::string why;
  };
  std::vector<peer_rec> peers;  // index = peer_id - 1
  std::unordered_map<region_handle, ucp_mem_h> regions;
  region_handle next_region = 1;
  std::unordered_map<op_handle, std::unique_ptr<op_rec>> ops;
  op_handle next_op = 1;
  // Released while UCX still owned their requests (a send to a dead peer
  // without peer error handling): freed once UCX completes them.
  std::list<std::unique_ptr<op_rec>> orphans;
  std::vector<void*> closing;  // endpoint close requests to finish

  ~impl() {
    stop_progress_thread();
    shutdown();
  }

  void stop_progress_thread() {
    if (!progressor.joinable()) return;
    {
      std::lock_guard il(idle_mtx);
      stopping = true;
    }
    if (worker) ucp_worker_signal(worker);
    idle_cv.notify_all();
    progressor.join();
  }

  // The progress thread: progresses whenever the worker has events and
  // nobody has waited for `progress_quiet` (a waiter progresses the worker
  // itself; two threads taking turns on the lock would halve the bandwidth
  // on 2 cores). A caller that waits op after op (a stream of messages)
  // leaves wait() between them for microseconds only: the thread does not
  // wake for those gaps (waking it on each cost 25% of 1 MiB bandwidth
  // over shared memory here), only once the caller has gone to compute.
  void progress_loop() {
    const auto quiet = std::chrono::duration_cast<clock::duration>(opt.progress_quiet);
    // While a thread keeps waiting (a stream of messages) the naps grow to
    // 8 ms: each timed wake-up takes a core from a spinning waiter (on 2
    // cores at 1 ms naps that cost ~10% of 16 MiB bandwidth here).
    const auto longest_nap = std::max<clock::duration>(quiet, std::chrono::milliseconds(8));
    auto nap = quiet;
    while (!stopping) {
      const auto since = clock::now().time_since_epoch() - clock::duration(last_wait_end_ns.load());
      const bool waited_on = waiters.load() > 0;
      if (waited_on || since < quiet) {
        const auto sleep = waited_on ? nap : quiet - since;
        if (waited_on) nap = std::min(longest_nap, 2 * nap);
        std::unique_lock il(idle_mtx);
        idle_cv.wait_for(il, sleep, [&] { return stopping.load(); });
        continue;
      }
      nap = quiet;
      std::unique_lock lk(mtx);
      if (waiters.load() > 0) continue;
      progress();
      if (efd < 0) {
        lk.unlock();
        std::this_thread::yield();
        continue;
      }
      if (ucp_worker_arm(worker) == UCS_ERR_BUSY) continue;
      lk.unlock();
      pollfd pfd{efd, POLLIN, 0};
      ::poll(&pfd, 1, 100);
    }
  }

  static void send_cb(void* /*request*/, ucs_status_t st, void* user) {
    auto* o = static_cast<op_rec*>(user);
    o->req_done = true;
    o->status = st;
  }
  static void flush_cb(void* /*request*/, ucs_status_t st, void* user) {
    auto* o = static_cast<op_rec*>(user);
    o->flush_done = true;
    if (o->status == UCS_OK) o->status = st;
  }
  static void recv_cb(void* /*request*/, ucs_status_t st, const ucp_tag_recv_info_t* info,
                      void* user) {
    auto* o = static_cast<op_rec*>(user);
    o->req_done = true;
    o->status = st;
    if (st == UCS_OK && info) o->received = info->length;
  }
  static void ep_error_cb(void* arg, ucp_ep_h ep, ucs_status_t st) {
    auto* self = static_cast<impl*>(arg);
    for (auto& p : self->peers) {
      if (p.ep == ep && !p.failed) {
        p.failed = true;
        p.why = "peer connection failed: " + ucs_text(st);
      }
    }
  }

  // Returns whether UCX had anything to do.
  bool progress() {
    bool any = false;
    while (ucp_worker_progress(worker) != 0) any = true;
    reap_orphans();
    for (auto it = closing.begin(); it != closing.end();) {
      if (ucp_request_check_status(*it) != UCS_INPROGRESS) {
        ucp_request_free(*it);
        it = closing.erase(it);
      } else {
        ++it;
      }
    }
    return any;
  }

  void reap_orphans() {
    for (auto it = orphans.begin(); it != orphans.end();) {
      op_rec& o = **it;
      const bool req_over = o.req == nullptr || o.req_done;
      const bool flush_over = o.flush_req == nullptr || o.flush_done;
      if (req_over && flush_over) {
        free_requests(o);
        it = orphans.erase(it);
      } else {
        ++it;
      }
    }
  }

  void free_requests(op_rec& o) {
    if (o.req) ucp_request_free(o.req);
    if (o.flush_req) ucp_request_free(o.flush_req);
    o.req = o.flush_req = nullptr;
    if (o.rkey) ucp_rkey_destroy(o.rkey);
    o.rkey = nullptr;
  }

  void close_ep(peer_rec& p) {
    if (!p.ep) return;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // A forced close completes the endpoint's outstanding requests with
    // UCS_ERR_CANCELED at once, which is what frees them when the peer is
    // gone. UCX asks for peer error handling on both sides because the
    // remote side may see transport errors: a peer we force-close has
    // failed (missed a deadline or died) and is treated as dead from here
    // on; a healthy peer is closed gracefully (flushed).
    prm.flags = (peer_mode || p.failed) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void* r = ucp_ep_close_nbx(p.ep, &prm);
    p.ep = nullptr;
    if (r != nullptr && !UCS_PTR_IS_ERR(r)) closing.push_back(r);
  }

  void finish_closing(std::chrono::milliseconds limit) {
    const auto until = clock::now() + limit;
    while (!closing.empty() && clock::now() < until) {
      progress();  // frees the close requests that are done
    }
  }

  void shutdown() {
    if (!worker) return;
    for (auto& [h, o] : ops) orphan(std::move(o));
    ops.clear();
    for (auto& p : peers) close_ep(p);
    finish_closing(std::chrono::milliseconds(2000));
    progress();
    // Whatever UCX still holds (a non-forced close to a dead peer) goes
    // with the worker.
    for (auto& o : orphans) {
      if (o->rkey) ucp_rkey_destroy(o->rkey);
      o->rkey = nullptr;
    }
    orphans.clear();
    for (auto& [h, m] : regions) ucp_mem_unmap(ctx, m);
    regions.clear();
    ucp_worker_destroy(worker);
    worker = nullptr;
    ucp_cleanup(ctx);
    ctx = nullptr;
  }

  // Gives an in-flight operation's requests to the orphan list (its record
  // must stay alive until UCX calls back).
  void orphan(std::unique_ptr<op_rec> o) {
    if (o->req && !o->req_done && o->spec.kind != op_kind::recv) {
      if (auto* p = find_peer(o->spec.peer); p && p->failed) ucp_request_cancel(worker, o->req);
    }
    if (o->req && !o->req_done && o->spec.kind == op_kind::recv) {
      // The caller may free the buffer after release: the receive must be
      // over before that (a cancelled expected receive completes at once; a
      // rendezvous already pulling data finishes first).
      ucp_request_cancel(worker, o->req);
      const auto until = clock::now() + std::chrono::milliseconds(2000);
      while (!o->req_done && clock::now() < until) ucp_worker_progress(worker);
    }
    orphans.push_back(std::move(o));
    reap_orphans();
  }

  peer_rec* find_peer(peer_id id) {
    if (id == 0 || id > peers.size()) return nullptr;
    return &peers[id - 1];
  }

  void fail(op_rec& o, errc code, std::string why) {
    o.state = op_state::failed;
    o.failure = error{code, std::move(why)};
  }

  std::string describe(const op_rec& o) const {
    std::string s =
        std::string(to_string(o.spec.kind)) + " of " + std::to_string(o.spec.bytes) + " bytes";
    if (o.spec.kind == op_kind::send || o.spec.kind == op_kind::recv)
      s += " (tag " + std::to_string(o.spec.tag) + ")";
    if (o.spec.kind != op_kind::recv) s += " to peer " + std::to_string(o.spec.peer);
    return s;
  }

  // Moves the record's state forward from its requests and deadline.
  void update(op_rec& o) {
    if (o.state != op_state::in_flight) return;
    const bool flush_needed = o.spec.kind == op_kind::put;
    if (o.req_done && (!flush_needed || o.flush_done || o.status != UCS_OK)) {
      if (o.status == UCS_OK) {
        o.state = op_state::done;
      } else {
        auto* p = find_peer(o.spec.peer);
        std::string why = describe(o) + " failed: " + ucs_text(o.status);
        if (o.status == UCS_ERR_MESSAGE_TRUNCATED) {
          why = describe(o) + " failed: the message is larger than the receive buffer";
        } else if (p && p->failed && o.spec.kind != op_kind::recv) {
          why += " (" + p->why + ")";
        }
        fail(o, o.status == UCS_ERR_MESSAGE_TRUNCATED ? errc::invalid_argument : errc::io_error,
             why);
      }
      return;
    }
    if (o.spec.kind != op_kind::recv) {
      if (auto* p = find_peer(o.spec.peer); p && p->failed && !peer_mode) {
        // Without peer error handling nobody completes the requests for us.
        fail(o, errc::io_error, describe(o) + " failed: " + p->why);
        return;
      }
    }
    if (clock::now() >= o.deadline) {
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(o.spec.timeout).count();
      if (o.spec.kind == op_kind::recv) {
        fail(o, errc::io_error,
             describe(o) + " timed out after " + std::to_string(ms) +
                 " ms: no matching message arrived");
      } else {
        fail(o, errc::io_error,
             describe(o) + " timed out after " + std::to_string(ms) +
                 " ms: the peer did not complete it; peer marked failed");
        if (auto* p = find_peer(o.spec.peer); p && !p->failed) {
          p->failed = true;
          p->why = "a " + std::string(to_string(o.spec.kind)) + " to it timed out";
          close_ep(*p);
        }
      }
    }
  }

  op_status status_of(const op_rec& o) const {
    op_status s;
    s.state = o.state;
    s.bytes = o.spec.kind == op_kind::recv ? o.received : o.spec.bytes;
    if (o.state == op_state::failed) s.failure = o.failure;
    return s;
  }
};

const char* to_string(op_kind k) {
  switch (k) {
    case op_kind::send:
      return "send";
    case op_kind::recv:
      return "recv";
    case op_kind::put:
      return "put";
    case op_kind::get:
      return "get";
  }
  return "?";
}

result<op_status> run_op(transfer_engine& engine, const op_spec& spec) {
  auto h = engine.prepare(spec);
  if (!h) return std::unexpected(h.error());
  if (auto p = engine.post(*h); !p) {
    engine.release(*h);
    return std::unexpected(p.error());
  }
  for (;;) {
    auto st = engine.wait(*h, std::chrono::milliseconds(1000));
    if (!st) {
      engine.release(*h);
      return std::unexpected(st.error());
    }
    if (st->state == op_state::done) {
      engine.release(*h);
      return *st;
    }
    if (st->state == op_state::failed) {
      engine.release(*h);
      return std::unexpected(st->failure);
    }
  }
}

namespace {

// UCX writes its log lines (warnings about a dead peer's unmatched
// messages, for instance) to stdout by default, where troupe prints
// answers and JSON. Unless the user chose a log file (UCX_LOG_FILE), they
// go to stderr, prefixed "[ucx]".
ucs_log_func_rc_t log_to_stderr(const char* file, unsigned line, const char*, ucs_log_level_t level,
                                const ucs_log_component_config_t* comp, const char* format,
                                va_list ap) {
  if (comp && level > comp->log_level) return UCS_LOG_FUNC_RC_STOP;
  const char* base = std::strrchr(file, '/');
  char msg[1024];
  std::vsnprintf(msg, sizeof msg, format, ap);
  std::fprintf(stderr, "[ucx] %s %s:%u %s\n", ucs_log_level_names[level], base ? base + 1 : file,
               line, msg);
  return UCS_LOG_FUNC_RC_STOP;
}

void route_ucx_log() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!std::getenv("UCX_LOG_FILE")) ucs_log_push_handler(&log_to_stderr);
  });
}

}  // namespace

result<std::string> net_device_for_host(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0)
    return make_error(errc::invalid_argument,
                      "cannot resolve '" + host + "': " + ::gai_strerror(rc));
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) {
    ::freeaddrinfo(found);
    return make_error(errc::io_error, "cannot list this machine's network interfaces");
  }
  std::string name;
  for (addrinfo* a = found; a && name.empty(); a = a->ai_next) {
    for (ifaddrs* i = ifs; i && name.empty(); i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != a->ai_addr->sa_family) continue;
      if (a->ai_family == AF_INET) {
        const auto* x = reinterpret_cast<const sockaddr_in*>(a->ai_addr);
        const auto* y = reinterpret_cast<const sockaddr_in*>(i->ifa_addr);
        if (x->sin_addr.s_addr == y->sin_addr.s_addr) name = i->ifa_name;
      } else if (a->ai_family == AF_INET6) {
        const auto* x = reinterpret_cast<const sockaddr_in6*>(a->ai_addr);
        const auto* y = reinterpret_cast<const sockaddr_in6*>(i->ifa_addr);
        if (std::memcmp(&x->sin6_addr, &y->sin6_addr, sizeof x->sin6_addr) == 0) name = i->ifa_name;
      }
    }
  }
  ::freeifaddrs(ifs);
  ::freeaddrinfo(found);
  if (name.empty())
    return make_error(errc::invalid_argument,
                      "no network interface of this machine has the address of '" + host +
                          "' (set [transport] net_devices in the manifest to choose one)");
  return name;
}

ucx_engine::ucx_engine(std::unique_ptr<impl> p) : p_(std::move(p)) {}
ucx_engine::~ucx_engine() = default;

result<std::unique_ptr<ucx_engine>> ucx_engine::create(const ucx_options& options) {
  route_ucx_log();
  auto p = std::make_unique<impl>();
  p->opt = options;
  // Operators may lengthen (or shorten) the spin before a wait sleeps.
  if (const char* s = std::getenv("TROUPE_UCX_SPIN_US")) {
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    if (end != s && *end == '\0' && v >= 0 && v <= 1000000)
      p->opt.spin_before_sleep = std::chrono::microseconds(v);
  }
  if (options.default_timeout.count() <= 0)
    return make_error(errc::invalid_argument, "ucx: default_timeout must be positive");
  // The gate goes up before the worker exists: UCX's TCP listener accepts
  // from the moment the worker is made.
  if (options.access_key && !arm_ucx_gate(*options.access_key))
    return make_error(errc::invalid_argument,
                      "ucx: the data-plane gate cannot be armed (another key is armed in this "
                      "process, or libucs was not found)");
  p->peer_mode = options.peer_errors.value_or(!tls_has_shm(options.tls));

  ucp_config_t* config = nullptr;
  if (auto st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) {
    return make_error(errc::device_unavailable,
                      "ucx: reading the configuration failed: " + ucs_text(st));
  }
  if (!options.tls.empty()) {
    if (auto st = ucp_config_modify(config, "TLS", options.tls.c_str()); st != UCS_OK) {
      ucp_config_release(config);
      return make_error(errc::invalid_argument,
                        "ucx: bad tls '" + options.tls + "': " + ucs_text(st));
    }
  }
  if (!options.net_devices.empty()) {
    if (auto st = ucp_config_modify(config, "NET_DEVICES", options.net_devices.c_str());
        st != UCS_OK) {
      ucp_config_release(config);
      return make_error(errc::invalid_argument,
                        "ucx: bad net_devices '" + options.net_devices + "': " + ucs_text(st));
    }
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  params.features =
      UCP_FEATURE_TAG | UCP_FEATURE_RMA | (options.sleep_when_idle ? UCP_FEATURE_WAKEUP : 0);
  params.mt_workers_shared = 0;
  const ucs_status_t st = ucp_init(&params, config, &p->ctx);
  ucp_config_release(config);
  if (st != UCS_OK)
    return make_error(errc::device_unavailable, "ucx: ucp_init failed: " + ucs_text(st));

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // our mutex serializes
  if (auto s = ucp_worker_create(p->ctx, &wp, &p->worker); s != UCS_OK) {
    ucp_cleanup(p->ctx);
    p->ctx = nullptr;
    return make_error(errc::device_unavailable, "ucx: creating the worker failed: " + ucs_text(s));
  }
  if (options.sleep_when_idle) {
    if (auto s = ucp_worker_get_efd(p->worker, &p->efd); s != UCS_OK) {
      return make_error(errc::device_unavailable,
                        "ucx: the worker has no event fd: " + ucs_text(s));
    }
  }
  ucp_address_t* a = nullptr;
  std::size_t len = 0;
  if (auto s = ucp_worker_get_address(p->worker, &a, &len); s != UCS_OK) {
    return make_error(errc::device_unavailable,
                      "ucx: getting the worker address failed: " + ucs_text(s));
  }
  p->addr = frame(address_magic, std::span(reinterpret_cast<const std::uint8_t*>(a), len));
  ucp_worker_release_address(p->worker, a);
  if (options.progress_thread) {
    impl* raw = p.get();
    p->progressor = std::thread([raw] { raw->progress_loop(); });
  }
  return std::unique_ptr<ucx_engine>(new ucx_engine(std::move(p)));
}

std::uint32_t ucx_engine::capabilities() const {
  return capability::remote | capability::rma;
}

bool ucx_engine::peer_errors() const {
  return p_->peer_mode;
}

std::vector<std::uint8_t> ucx_engine::address() const {
  return p_->addr;
}

result<peer_id> ucx_engine::connect(std::span<const std::uint8_t> peer_address) {
  auto body = unframe(address_magic, peer_address, max_address_bytes, "ucx peer address");
  if (!body) return std::unexpected(body.error());
  std::lock_guard lk(p_->mtx);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = reinterpret_cast<const ucp_address_t*>(body->data());
  ep.err_mode = p_->peer_mode ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (p_->peer_mode) {
    ep.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.err_handler.cb = &impl::ep_error_cb;
    ep.err_handler.arg = p_.get();
  }
  ucp_ep_h h = nullptr;
  if (auto st = ucp_ep_create(p_->worker, &ep, &h); st != UCS_OK) {
    return make_error(errc::io_error, "ucx: connecting to the peer failed: " + ucs_text(st));
  }
  p_->peers.push_back(impl::peer_rec{h, false, {}});
  return static_cast<peer_id>(p_->peers.size());
}

void ucx_engine::disconnect(peer_id peer, bool gone) {
  std::lock_guard lk(p_->mtx);
  auto* p = p_->find_peer(peer);
  if (!p || !p->ep) return;
  // A gone peer's endpoint is closed by force (close_ep forces the close of
  // a failed peer, so it is marked failed first): a graceful close flushes
  // to the peer, which a dead one never answers. Measured with UCX 1.13:
  // either way, the peer's shared-memory segments this process attached
  // (its two FIFOs and, once a message went through, its 4 MiB of receive
  // descriptors) stay mapped after the close (docs/security.md).
  if (!p->failed) {
    p->why = gone ? "gone" : "disconnected";
    if (gone) p->failed = true;
  }
  p_->close_ep(*p);
  p->failed = true;
  p_->finish_closing(std::chrono::milliseconds(0));
}

std::string ucx_engine::describe_peer(peer_id peer) const {
  std::lock_guard lk(p_->mtx);
  auto* p = const_cast<impl*>(p_.get())->find_peer(peer);
  if (!p || !p->ep) return "(no such peer)";
  char* buf = nullptr;
  std::size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (!f) return "(unavailable)";
  ucp_ep_print_info(p->ep, f);
  std::fclose(f);
  std::string text(buf, len);
  std::free(buf);
  // Keep the lane lines' transport/device names: "... tcp/lo ..." etc.
  std::string out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    const std::size_t end = std::min(text.find('\n', pos), text.size());
    const std::string line = text.substr(pos, end - pos);
    if (line.find("lane[") != std::string::npos) {
      const auto colon = line.find(':');
      if (!out.empty()) out += "; ";
      out += line.substr(colon == std::string::npos ? 0 : colon + 1);
    }
    pos = end + 1;
  }
  return out;
}

result<region_handle> ucx_engine::expose(void* data, std::size_t bytes, remote_region& out) {
  if (!data || bytes == 0)
    return make_error(errc::invalid_argument, "ucx: expose needs a non-empty buffer");
  std::lock_guard lk(p_->mtx);
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.address = data;
  mp.length = bytes;
  ucp_mem_h memh = nullptr;
  if (auto st = ucp_mem_map(p_->ctx, &mp, &memh); st != UCS_OK) {
    return make_error(errc::out_of_memory, "ucx: registering " + std::to_string(bytes) +
                                               " bytes failed: " + ucs_text(st));
  }
  void* rkey = nullptr;
  std::size_t rkey_len = 0;
  if (auto st = ucp_rkey_pack(p_->ctx, memh, &rkey, &rkey_len); st != UCS_OK) {
    ucp_mem_unmap(p_->ctx, memh);
    return make_error(errc::internal, "ucx: packing the remote key failed: " + ucs_text(st));
  }
  // key = base address, length, packed rkey; framed and checksummed.
  std::vector<std::uint8_t> body(16 + rkey_len);
  const std::uint64_t base = reinterpret_cast<std::uintptr_t>(data);
  const std::uint64_t len64 = bytes;
  std::memcpy(body.data(), &base, 8);
  std::memcpy(body.data() + 8, &len64, 8);
  std::memcpy(body.data() + 16, rkey, rkey_len);
  ucp_rkey_buffer_release(rkey);
  out.key = frame(region_magic, body);
  out.bytes = bytes;
  const region_handle h = p_->next_region++;
  p_->regions.emplace(h, memh);
  return h;
}

void ucx_engine::unexpose(region_handle region) {
  std::lock_guard lk(p_->mtx);
  auto it = p_->regions.find(region);
  if (it == p_->regions.end()) return;
  ucp_mem_unmap(p_->ctx, it->second);
  p_->regions.erase(it);
}

result<op_handle> ucx_engine::prepare(const op_spec& spec) {
  if (spec.bytes > 0 && spec.local == nullptr) {
    return make_error(errc::invalid_argument,
                      std::string("ucx: ") + to_string(spec.kind) + " needs a local buffer");
  }
  if (spec.timeout.count() < 0) return make_error(errc::invalid_argument, "ucx: negative timeout");
  std::lock_guard lk(p_->mtx);
  auto o = std::make_unique<op_rec>();
  o->spec = spec;
  if (o->spec.timeout.count() == 0) o->spec.timeout = p_->opt.default_timeout;
  if (spec.kind != op_kind::recv) {
    auto* p = p_->find_peer(spec.peer);
    if (!p)
      return make_error(errc::invalid_argument, "ucx: unknown peer " + std::to_string(spec.peer));
    if (p->failed)
      return make_error(errc::io_error,
                        "ucx: peer " + std::to_string(spec.peer) + " has failed: " + p->why);
  }
  if (spec.kind == op_kind::put || spec.kind == op_kind::get) {
    if (!spec.remote)
      return make_error(errc::invalid_argument, "ucx: put/get needs a remote region");
    auto body =
        unframe(region_magic, spec.remote->key, max_rkey_bytes + 16, "ucx remote region key");
    if (!body) return std::unexpected(body.error());
    if (body->size() <= 16)
      return make_error(errc::corrupt_data, "ucx remote region key: too short");
    std::uint64_t base = 0, len = 0;
    std::memcpy(&base, body->data(), 8);
    std::memcpy(&len, body->data() + 8, 8);
    if (spec.remote_offset > len || spec.bytes > len - spec.remote_offset) {
      return make_error(errc::invalid_argument,
                        "ucx: " + std::string(to_string(spec.kind)) + " of " +
                            std::to_string(spec.bytes) + " bytes at offset " +
                            std::to_string(spec.remote_offset) + " exceeds the exposed " +
                            std::to_string(len) + " bytes");
    }
    auto* p = p_->find_peer(spec.peer);
    if (auto st = ucp_ep_rkey_unpack(p->ep, body->data() + 16, &o->rkey); st != UCS_OK) {
      return make_error(errc::corrupt_data,
                        "ucx: the remote region key does not unpack: " + ucs_text(st));
    }
    o->remote_base = base;
  }
  const op_handle h = p_->next_op++;
  p_->ops.emplace(h, std::move(o));
  return h;
}

result<void> ucx_engine::post(op_handle h) {
  std::lock_guard lk(p_->mtx);
  auto it = p_->ops.find(h);
  if (it == p_->ops.end()) return make_error(errc::invalid_argument, "ucx: unknown operation");
  op_rec& o = *it->second;
  if (o.state != op_state::prepared)
    return make_error(errc::invalid_argument, "ucx: operation already posted");
  ucp_ep_h ep = nullptr;
  if (o.spec.kind != op_kind::recv) {
    auto* p = p_->find_peer(o.spec.peer);
    if (!p || p->failed || !p->ep) {
      p_->fail(o, errc::io_error,
               p_->describe(o) + " failed: " + (p ? p->why : std::string("unknown peer")));
      return {};
    }
    ep = p->ep;
  }
  ucp_request_param_t prm{};
  prm.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
  prm.datatype = ucp_dt_make_contig(1);
  prm.user_data = &o;
  void* r = nullptr;
  switch (o.spec.kind) {
    case op_kind::send:
      prm.cb.send = &impl::send_cb;
      r = ucp_tag_send_nbx(ep, o.spec.local, o.spec.bytes, o.spec.tag, &prm);
      break;
    case op_kind::recv:
      prm.cb.recv = &impl::recv_cb;
      // UCX 1.13 leaves recv_info unfilled when a receive completes in
      // place (measured: length 0): always take the callback instead.
      prm.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      r = ucp_tag_recv_nbx(p_->worker, o.spec.local, o.spec.bytes, o.spec.tag, ~ucp_tag_t{0}, &prm);
      break;
    case op_kind::put:
      prm.cb.send = &impl::send_cb;
      r = ucp_put_nbx(ep, o.spec.local, o.spec.bytes, o.remote_base + o.spec.remote_offset, o.rkey,
                      &prm);
      break;
    case op_kind::get:
      prm.cb.send = &impl::send_cb;
      r = ucp_get_nbx(ep, o.spec.local, o.spec.bytes, o.remote_base + o.spec.remote_offset, o.rkey,
                      &prm);
      break;
  }
  o.deadline = clock::now() + o.spec.timeout;
  o.state = op_state::in_flight;
  if (UCS_PTR_IS_ERR(r)) {
    o.req_done = true;
    o.status = UCS_PTR_STATUS(r);
  } else if (r == nullptr) {
    o.req_done = true;  // completed in place
    o.status = UCS_OK;
    if (o.spec.kind == op_kind::recv) o.received = o.spec.bytes;  // (not reached: NO_IMM_CMPL)
  } else {
    o.req = r;
  }
  if (o.spec.kind == op_kind::put && o.status == UCS_OK) {
    // A put is complete when the data is in the peer's memory: flush.
    ucp_request_param_t fp{};
    fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    fp.cb.send = &impl::flush_cb;
    fp.user_data = &o;
    void* f = ucp_ep_flush_nbx(ep, &fp);
    if (UCS_PTR_IS_ERR(f)) {
      o.flush_done = true;
      o.status = UCS_PTR_STATUS(f);
    } else if (f == nullptr) {
      o.flush_done = true;
    } else {
      o.flush_req = f;
    }
  }
  p_->update(o);
  return {};
}

result<op_status> ucx_engine::poll(op_handle h) {
  std::lock_guard lk(p_->mtx);
  auto it = p_->ops.find(h);
  if (it == p_->ops.end()) return make_error(errc::invalid_argument, "ucx: unknown operation");
  p_->progress();
  p_->update(*it->second);
  return p_->status_of(*it->second);
}

result<op_status> ucx_engine::wait(op_handle h, std::chrono::milliseconds limit) {
  const auto until = clock::now() + limit;
  // Sleep only after `spin_before_sleep` without an event: a long transfer
  // makes events all along (TCP segments, rendezvous fragments), and
  // sleeping between them would cost a wake-up each.
  auto spin_until = clock::now() + p_->opt.spin_before_sleep;
  std::unique_lock lk(p_->mtx);
  ++p_->waiters;
  struct leave {
    impl* p;
    ~leave() {
      if (--p->waiters == 0) p->last_wait_end_ns = clock::now().time_since_epoch().count();
    }
  } leave_guard{p_.get()};
  for (;;) {
    auto it = p_->ops.find(h);
    if (it == p_->ops.end()) return make_error(errc::invalid_argument, "ucx: unknown operation");
    op_rec& o = *it->second;
    const bool busy = p_->progress();
    p_->update(o);
    if (o.state != op_state::in_flight) return p_->status_of(o);
    const auto now = clock::now();
    if (busy) spin_until = now + p_->opt.spin_before_sleep;
    if (now >= until) return p_->status_of(o);
    if (now < spin_until || p_->efd < 0) continue;  // spin a while, or always (busy-poll)
    if (ucp_worker_arm(p_->worker) == UCS_ERR_BUSY) continue;
    // Sleep until an event, the caller's limit or the operation's deadline.
    const auto wake = std::min(until, o.deadline);
    const auto ms = std::max<std::int64_t>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(wake - now).count() + 1);
    pollfd pfd{p_->efd, POLLIN, 0};
    lk.unlock();
    ::poll(&pfd, 1, static_cast<int>(std::min<std::int64_t>(ms, 1000)));
    lk.lock();
  }
}

void ucx_engine::release(op_handle h) {
  std::lock_guard lk(p_->mtx);
  auto it = p_->ops.find(h);
  if (it == p_->ops.end()) return;
  auto o = std::move(it->second);
  p_->ops.erase(it);
  p_->progress();
  p_->orphan(std::move(o));
}

std::size_t ucx_engine::live_ops() const {
  std::lock_guard lk(p_->mtx);
  return p_->ops.size();
}

std::size_t ucx_engine::stuck_requests() const {
  std::lock_guard lk(p_->mtx);
  return p_->orphans.size();
}

std::size_t ucx_engine::live_regions() const {
  std::lock_guard lk(p_->mtx);
  return p_->regions.size();
}

}  // namespace troupe::transport
