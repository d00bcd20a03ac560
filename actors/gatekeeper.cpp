#include "actors/gatekeeper.hpp"
#include "actors/log.hpp"

#include <spdlog/spdlog.h>

#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <caf/io/all.hpp>
#include <caf/openssl/all.hpp>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "actors/control_guard.hpp"
#include "cluster/certs.hpp"
#include "cluster/head_lease.hpp"
#include "transport/ucx_gate.hpp"

// caf_openssl 0.17 calls SSL_read/SSL_write/SSL_connect/SSL_accept on the
// middleman's thread without clearing that thread's OpenSSL error queue
// first, and leaves OpenSSL 3's "unexpected eof while reading" in it when
// a peer (a client that exits) closes its connection without a TLS
// close_notify. The next SSL_read on any other connection that would just
// block then looks like a failure to SSL_get_error, and CAF closed every
// other node's connection. These wrappers (the executable's definitions
// win over libssl's for libcaf_openssl's calls) clear the queue before
// each call, as OpenSSL's documentation requires.
//
// Once the control guard is armed (configure_cluster_tls), they also bound
// what a connection costs before CAF sees it (actors/control_guard.hpp):
// SSL_read follows the decrypted stream's BASP framing and fails the read
// that completes a header announcing too much, before CAF allocates it;
// SSL_accept's success ends the connection's handshake deadline; accepted
// sockets over the per-address or total caps of unfinished handshakes are
// closed before CAF sees them (transport/ucx_gate.cpp's accept wrapper
// asks), and a reaper shuts down those past their deadline.
namespace {

template <class F>
F real_ssl(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

struct control_guard_state {
  std::mutex mtx;
  std::atomic<bool> armed{false};
  std::atomic<std::uint64_t> budget{0};
  std::unordered_map<const SSL*, std::unique_ptr<troupe::actors::basp_stream_guard>> streams;
  troupe::actors::connection_admission admission;
  std::uint64_t refused_connections = 0, refused_messages = 0, expired = 0, abandoned = 0;
  // The connections CAF made from this process to other nodes ("ip port"
  // they lead to, and when), until they close; `answered` once a connect
  // through them answered.
  struct outgoing_connection {
    std::string to;
    std::chrono::steady_clock::time_point since;
    bool answered = false;
    bool given_up = false;
  };
  std::unordered_map<int, outgoing_connection> outgoing;
  std::chrono::steady_clock::time_point last_log{};
  std::uint64_t unlogged = 0;
};

control_guard_state& guard() {
  static auto* g = new control_guard_state;  // never destroyed: sockets close during exit
  return *g;
}

// Under g.mtx: at most one line a second.
template <typename... A>
void guard_log(control_guard_state& g, fmt::format_string<A...> f, A&&... a) {
  const auto now = std::chrono::steady_clock::now();
  if (now - g.last_log < std::chrono::seconds(1)) {
    ++g.unlogged;
    return;
  }
  g.last_log = now;
  spdlog::warn("control plane: {} ({} more since the last report)",
               fmt::format(f, std::forward<A>(a)...), g.unlogged);
  g.unlogged = 0;
}

bool called_from(const void* caller, const char* library) {
  Dl_info info{};
  return caller && ::dladdr(caller, &info) != 0 && info.dli_fname &&
         std::strstr(info.dli_fname, library) != nullptr;
}

std::string peer_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "?";
  char ip[INET6_ADDRSTRLEN] = "?";
  if (a.ss_family == AF_INET)
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in&>(a).sin_addr, ip, sizeof ip);
  else if (a.ss_family == AF_INET6)
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6&>(a).sin6_addr, ip, sizeof ip);
  return ip;
}

bool on_accept(int fd, const void* caller) {
  if (!called_from(caller, "libcaf_io")) return true;
  auto& g = guard();
  const std::string from = peer_address(fd);
  std::lock_guard lk(g.mtx);
  const auto v = g.admission.accepted(fd, from, std::chrono::steady_clock::now());
  if (v == troupe::actors::connection_admission::verdict::admit) return true;
  ++g.refused_connections;
  guard_log(g, "refused a connection from {}: {}", from, troupe::actors::to_string(v));
  return false;
}

// "ip port" of a socket address (IPv4 or IPv6), or "".
std::string endpoint_text(const sockaddr* a) {
  char ip[INET6_ADDRSTRLEN] = "";
  unsigned port = 0;
  if (a->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(a);
    ::inet_ntop(AF_INET, &in->sin_addr, ip, sizeof ip);
    port = ntohs(in->sin_port);
  } else if (a->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, ip, sizeof ip);
    port = ntohs(in6->sin6_port);
  } else {
    return {};
  }
  return std::string(ip) + " " + std::to_string(port);
}

void on_connect(int fd, const sockaddr* to, const void* caller) {
  if (!called_from(caller, "libcaf_io")) return;
  auto text = endpoint_text(to);
  if (text.empty()) return;
  auto& g = guard();
  std::lock_guard lk(g.mtx);
  g.outgoing.insert_or_assign(fd, control_guard_state::outgoing_connection{
                                      std::move(text), std::chrono::steady_clock::now()});
}

void on_close(int fd) {
  auto& g = guard();
  std::lock_guard lk(g.mtx);
  g.admission.closed(fd);
  g.outgoing.erase(fd);
}

void reap_handshakes() {
  auto& g = guard();
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    std::lock_guard lk(g.mtx);
    for (int fd : g.admission.overdue(std::chrono::steady_clock::now())) {
      ++g.expired;
      guard_log(g, "closed a connection from {} that did not finish its TLS handshake in {} ms",
                peer_address(fd), g.admission.caps().handshake_deadline.count());
      ::shutdown(fd, SHUT_RDWR);  // CAF reads end-of-file and closes it
    }
  }
}

}  // namespace

extern "C" {
int SSL_read(SSL* s, void* buf, int num) {
  static auto real = real_ssl<int (*)(SSL*, void*, int)>("SSL_read");
  ERR_clear_error();
  const int n = real(s, buf, num);
  auto& g = guard();
  if (n <= 0 || !g.armed.load(std::memory_order_acquire)) return n;
  std::lock_guard lk(g.mtx);
  auto& st = g.streams[s];
  if (!st) st = std::make_unique<troupe::actors::basp_stream_guard>(&g.budget);
  if (auto why =
          st->feed(std::span(static_cast<const std::uint8_t*>(buf), static_cast<std::size_t>(n)))) {
    ++g.refused_messages;
    guard_log(g, "closed a connection from {}: {}", peer_address(SSL_get_fd(s)), *why);
    // SSL_get_error then says SSL_ERROR_SSL and CAF closes the connection.
    ERR_raise(ERR_LIB_SSL, SSL_R_EXCESSIVE_MESSAGE_SIZE);
    return -1;
  }
  return n;
}
int SSL_write(SSL* s, const void* buf, int num) {
  static auto real = real_ssl<int (*)(SSL*, const void*, int)>("SSL_write");
  ERR_clear_error();
  return real(s, buf, num);
}
int SSL_connect(SSL* s) {
  static auto real = real_ssl<int (*)(SSL*)>("SSL_connect");
  ERR_clear_error();
  return real(s);
}
int SSL_accept(SSL* s) {
  static auto real = real_ssl<int (*)(SSL*)>("SSL_accept");
  ERR_clear_error();
  const int r = real(s);
  if (r == 1 && guard().armed.load(std::memory_order_acquire)) {
    auto& g = guard();
    std::lock_guard lk(g.mtx);
    g.admission.authenticated(SSL_get_fd(s));
  }
  return r;
}
void SSL_free(SSL* s) {
  static auto real = real_ssl<void (*)(SSL*)>("SSL_free");
  if (s && guard().armed.load(std::memory_order_acquire)) {
    auto& g = guard();
    std::lock_guard lk(g.mtx);
    g.streams.erase(s);
  }
  real(s);
}
}

namespace troupe::actors {

namespace {

using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

struct gatekeeper_state {
  struct pending {
    std::vector<std::uint8_t> challenge;
    clock_type::time_point issued;
  };
  std::map<caf::node_id, pending> challenges;  // one per connecting node
  std::set<std::string> verified_heads;        // node ids seen at the head's address
};

constexpr std::size_t max_pending = 1024;
constexpr auto challenge_lifetime = 60s;
// How long checking a head's address may take (connecting there).
constexpr auto head_check_limit = 3s;

}  // namespace

gatekeeper_actor spawn_gatekeeper(caf::actor_system& sys, const cluster::manifest& m,
                                  const std::string& self_node, node_agent_actor agent,
                                  frontdoor_actor door) {
  auto impl = [](gatekeeper_actor::stateful_pointer<gatekeeper_state> self, cluster::manifest m,
                 std::string me, node_agent_actor agent,
                 frontdoor_actor door) -> gatekeeper_actor::behavior_type {
    const std::string ca = cluster::tls_files(m, me).ca;
    return {
        [=](challenge_atom) -> caf::result<std::vector<std::uint8_t>> {
          const auto& sender = self->current_sender();
          if (!sender) return make_error(error_code::invalid_request, "an anonymous sender");
          auto& cs = self->state.challenges;
          const auto now = clock_type::now();
          for (auto it = cs.begin(); it != cs.end();)
            it = now - it->second.issued > challenge_lifetime ? cs.erase(it) : ++it;
          if (cs.size() >= max_pending)
            return make_error(error_code::overloaded, "too many handshakes in progress");
          auto c = cluster::make_challenge();
          cs[sender->node()] = {c, now};
          return c;
        },
        [=](hello_atom, const gate_hello& h) -> caf::result<gate_pass> {
          const auto& sender = self->current_sender();
          if (!sender) return make_error(error_code::invalid_request, "an anonymous sender");
          auto& cs = self->state.challenges;
          auto it = cs.find(sender->node());
          if (it == cs.end() || clock_type::now() - it->second.issued > challenge_lifetime)
            return make_error(error_code::invalid_request,
                              "no challenge was issued to this connection (ask for one first)");
          const auto challenge = std::move(it->second.challenge);
          cs.erase(it);  // one attempt per challenge
          auto refuse = [&](error_code code, const std::string& why) {
            logging::of("gatekeeper").warn("{}: refused '{}': {}", me, h.node.substr(0, 64), why);
            return make_error(code, why);
          };
          if (h.version != protocol_version)
            return refuse(error_code::version_mismatch,
                          "protocol version " + std::to_string(h.version) + ", this node speaks " +
                              std::to_string(protocol_version));
          const bool client = h.node == cluster::client_identity;
          if (client && !door)
            return refuse(error_code::invalid_request,
                          "clients submit to the head node (" + m.head + "), not to " + me);
          if (!client && (!m.node(h.node) || h.node == me))
            return refuse(
                error_code::invalid_request,
                "'" + h.node.substr(0, 64) + "' is not another node of cluster " + m.name);
          if (auto v = cluster::verify_identity(
                  ca, h.node, challenge, cluster::identity_proof{h.certificate_pem, h.signature});
              !v)
            return refuse(error_code::invalid_request, v.error());
          if (client) {
            logging::of("gatekeeper").debug("{}: a client came in", me);
            return gate_pass{m.name, me, protocol_version, node_agent_actor{}, door};
          }
          // The head and its standby: a term claims the lease (below); term
          // 0 joins as a node, one that may follow this head's journal
          // through its door (the standby; the head too, restarted after its
          // standby took over).
          const bool head_role = h.node == m.head || (!m.standby.empty() && h.node == m.standby);
          const gate_pass pass{m.name, me, protocol_version, agent,
                               head_role && h.term == 0 ? door : frontdoor_actor{}};
          if (!head_role || h.term == 0) {
            logging::of("gatekeeper").info("{}: node {} joined", me, h.node);
            return pass;
          }
          // The head (or the standby, taking over with a term): the process
          // at its manifest address, with a term no lower than the lease's
          // (cluster/head_lease.hpp).
          const std::string caller = to_string(sender->node());
          auto grant = [me, caller, term = h.term]() -> caf::error {
            auto& l = cluster::local_head_lease();
            std::lock_guard lk(l.mtx);
            const auto before = l.lease.term();
            const auto v = l.lease.offer(caller, term);
            if (v != cluster::head_lease::verdict::granted) {
              const std::string why = std::string(cluster::to_string(v)) + " (term " +
                                      std::to_string(before) + "; this head's is " +
                                      std::to_string(term) + "): it must step down";
              logging::of("gatekeeper").warn("{}: refused a head: {}", me, why);
              return make_error(error_code::not_the_head, why);
            }
            logging::of("gatekeeper").info("{}: the head joined (term {})", me, term);
            return {};
          };
          if (self->state.verified_heads.count(caller)) {
            if (auto e = grant()) return e;
            return pass;
          }
          const auto* head = m.node(h.node);
          const std::string at = head->host + ":" + std::to_string(head->port);
          auto checker = self->system().spawn<caf::detached>(
              [host = head->host, port = head->port](caf::event_based_actor* c) -> caf::behavior {
                return {[=](ping_atom) -> caf::result<std::string> {
                  c->quit();
                  auto gk = caf::openssl::remote_actor<gatekeeper_actor>(
                      c->system(), host, static_cast<std::uint16_t>(port));
                  if (!gk)
                    return make_error(error_code::not_the_head, c->system().render(gk.error()));
                  return to_string(gk->node());
                }};
              });
          auto rp = self->make_response_promise<gate_pass>();
          self->request(checker, head_check_limit, ping_atom::value)
              .then(
                  [self, rp, caller, at, me, grant, pass](std::string& there) mutable {
                    if (there != caller) {
                      const std::string why =
                          "a process holding the head's certificate, but "
                          "not the one at the head's address " +
                          at + ": it must step down";
                      logging::of("gatekeeper").warn("{}: refused a head: {}", me, why);
                      rp.deliver(make_error(error_code::not_the_head, why));
                      return;
                    }
                    self->state.verified_heads.insert(caller);
                    if (auto e = grant())
                      rp.deliver(std::move(e));
                    else
                      rp.deliver(pass);
                  },
                  [rp, at, me](caf::error& e) mutable {
                    const std::string why = "the head's address " + at +
                                            " did not answer as the head: " + caf::to_string(e);
                    logging::of("gatekeeper").warn("{}: refused a head: {}", me, why);
                    rp.deliver(make_error(error_code::not_the_head, why));
                  });
          return rp;
        },
    };
  };
  // Detached: checking a head's address makes a connection.
  return sys.spawn<caf::detached>(impl, m, self_node, std::move(agent), std::move(door));
}

void arm_control_guard() {
  static std::once_flag once;
  std::call_once(once, [] {
    guard().armed.store(true, std::memory_order_release);
    transport::set_socket_observers(&on_accept, &on_close);
    transport::set_connect_observer(&on_connect);
    std::thread(reap_handshakes).detach();
  });
}

control_guard_counters control_guard_stats() {
  auto& g = guard();
  std::lock_guard lk(g.mtx);
  return {g.refused_connections, g.refused_messages, g.expired, g.admission.pending(), g.abandoned};
}

std::expected<void, std::string> configure_cluster_tls(caf::actor_system_config& cfg,
                                                       const cluster::manifest& m,
                                                       const std::string& node) {
  auto files = cluster::check_node_certificate(m, node);
  if (!files) return std::unexpected(files.error());
  arm_control_guard();
  cfg.load<caf::io::middleman>();
  cfg.load<caf::openssl::manager>();
  cfg.set("openssl.certificate", files->certificate);
  cfg.set("openssl.key", files->key);
  cfg.set("openssl.cafile", files->ca);
  cfg.set("middleman.enable-automatic-connections", false);
  // CAF notices a hung peer only with its heartbeats and connection
  // timeout (DEPENDENCIES.md), but with them on, CAF 0.17 closed every
  // other node's connection at the next heartbeat after any one connection
  // (a client's) closed. The head runs heartbeats of its own instead
  // (actors/cluster.hpp), and a dead process's connection closes by itself.
  cfg.set("middleman.heartbeat-interval", caf::timespan{std::chrono::milliseconds(0)});
  return {};
}

namespace {

/// Whether the process at host:port answers a TLS ClientHello within
/// `limit`. A stopped (SIGSTOPped) process's kernel still completes the
/// TCP handshake, and CAF's connect then waits for it forever (spinning
/// the middleman meanwhile); only the process itself answers TLS.
bool answers_tls(const std::string& host, int port, std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  auto left = [&] {
    return static_cast<int>(std::max<std::int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(until -
                                                                 std::chrono::steady_clock::now())
               .count()));
  };
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return false;
  bool alive = false;
  for (auto* a = res; a && !alive && left() > 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    pollfd p{fd, POLLOUT, 0};
    int err = 0;
    socklen_t len = sizeof err;
    const bool connected =
        (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 || errno == EINPROGRESS) &&
        ::poll(&p, 1, left()) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 &&
        err == 0;
    if (connected) {
      SSL_CTX* ctx = SSL_CTX_new(TLS_client_method());
      SSL* ssl = ctx ? SSL_new(ctx) : nullptr;
      if (ssl && SSL_set_fd(ssl, fd) == 1) {
        const int r = SSL_connect(ssl);  // sends the ClientHello
        if (r == 1) {
          alive = true;
        } else if (SSL_get_error(ssl, r) == SSL_ERROR_WANT_READ) {
          pollfd q{fd, POLLIN, 0};
          alive = ::poll(&q, 1, left()) == 1;  // its ServerHello (or an alert): it runs
        }
      }
      if (ssl) SSL_free(ssl);
      if (ctx) SSL_CTX_free(ctx);
      ERR_clear_error();
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return alive;
}

/// The endpoints ("ip port") `host`:`port` resolves to.
std::set<std::string> endpoints_of(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::set<std::string> out;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return out;
  for (auto* a = res; a; a = a->ai_next)
    if (auto t = endpoint_text(a->ai_addr); !t.empty()) out.insert(std::move(t));
  ::freeaddrinfo(res);
  return out;
}

/// A handshake this old that has not answered has stalled: one takes
/// milliseconds, and seconds on a loaded machine.
constexpr auto stalled_after = std::chrono::seconds(10);

/// After a connect to `ends`: this process's connections there are marked
/// answered (it answered), or, when it did not answer in time, those never
/// answered and older than `stalled_after` are shut down. CAF 0.17's
/// middleman keeps one pending connect per endpoint with no time limit, and
/// attaches every later connect there to it: a handshake that stalls once
/// would keep this process from that node for good. Shut down, the
/// connection reads end-of-file, CAF fails the handshake and forgets it.
/// A younger one is left alone: cutting a handshake that is only slow (a
/// node starting on a loaded machine) would lose it. Returns how many were
/// shut down.
std::size_t settle_connects(const std::set<std::string>& ends, bool answered) {
  auto& g = guard();
  std::lock_guard lk(g.mtx);
  const auto now = std::chrono::steady_clock::now();
  std::size_t n = 0;
  for (auto& [fd, o] : g.outgoing) {
    if (!ends.count(o.to) || o.answered || o.given_up) continue;
    if (answered) {
      o.answered = true;
      continue;
    }
    if (now - o.since < stalled_after) continue;
    ::shutdown(fd, SHUT_RDWR);
    o.given_up = true;
    ++g.abandoned;
    ++n;
  }
  return n;
}

}  // namespace

std::expected<gate_pass, std::string> join_node(caf::actor_system& sys, const cluster::manifest& m,
                                                const std::string& self_node,
                                                const std::string& target,
                                                std::chrono::milliseconds timeout,
                                                std::uint64_t term) {
  const auto* t = m.node(target);
  if (!t) return std::unexpected("'" + target + "' is not a node of " + m.path);
  const std::string at = t->host + ":" + std::to_string(t->port);
  // One join at a time from this process to a node: its gatekeeper keeps
  // one challenge per connecting process, so concurrent joins (clients
  // failing over together) would replace each other's challenge.
  static std::mutex joins_mtx;
  static std::map<std::string, std::shared_ptr<std::mutex>> joins;
  std::shared_ptr<std::mutex> one;
  {
    std::lock_guard lk(joins_mtx);
    auto& p = joins[at];
    if (!p) p = std::make_shared<std::mutex>();
    one = p;
  }
  std::lock_guard serial(*one);
  if (!answers_tls(t->host, t->port, std::min(timeout, std::chrono::milliseconds(3000))))
    return std::unexpected("node " + target + " at " + at +
                           " does not answer (down, stopped or unreachable)");
  // caf::openssl::remote_actor, with a limit on the wait. The first try
  // gets half the time when that is longer than `stalled_after`: a
  // connection whose handshake has not answered by then is shut down
  // (settle_connects) and the next try makes a new one. A shorter join
  // (a client's 2 s) shuts it down once it is that old, and the next join
  // connects again.
  caf::scoped_actor self{sys};
  std::optional<gatekeeper_actor> gk;
  std::string why;
  const auto ends = endpoints_of(t->host, t->port);
  const auto until = std::chrono::steady_clock::now() + timeout;
  auto limit = timeout / 2 > stalled_after
                   ? std::chrono::duration_cast<std::chrono::milliseconds>(timeout / 2)
                   : timeout;
  bool gave_up = false;
  for (int attempt = 0; attempt < 4 && !gk && limit.count() > 0; ++attempt) {
    bool stalled = false;
    why.clear();
    self->request(sys.openssl_manager().actor_handle(), caf::duration{limit},
                  caf::connect_atom::value, t->host, static_cast<std::uint16_t>(t->port))
        .receive(
            [&](caf::node_id&, caf::strong_actor_ptr& ptr, std::set<std::string>& ifs) {
              if (!ptr)
                why = "no actor published there";
              else if (!sys.assignable<gatekeeper_actor>(ifs))
                why = "the actor there is not a gatekeeper";
              else
                gk = caf::actor_cast<gatekeeper_actor>(std::move(ptr));
            },
            [&](caf::error& e) {
              why = sys.render(e);
              // A timeout, or the end of a connection given up on before.
              stalled = e == caf::sec::request_timeout ||
                        (gave_up && e == caf::sec::disconnect_during_handshake);
            });
    if (gk) break;
    const auto n = stalled ? settle_connects(ends, false) : 0;
    if (n > 0) {
      gave_up = true;
      logging::of("gatekeeper")
          .warn(
              "{}: gave up on {} connection(s) to node {} at {} whose handshake stalled; "
              "trying again",
              self_node, n, target, at);
    } else if (!(stalled && gave_up)) {
      break;
    }
    limit = std::chrono::duration_cast<std::chrono::milliseconds>(until -
                                                                  std::chrono::steady_clock::now());
  }
  if (!gk) return std::unexpected("node " + target + " at " + at + ": " + why);
  settle_connects(ends, true);
  std::vector<std::uint8_t> challenge;
  self->request(*gk, caf::duration{timeout}, challenge_atom::value)
      .receive([&](std::vector<std::uint8_t>& c) { challenge = std::move(c); },
               [&](caf::error& e) { why = describe(sys, e); });
  if (!why.empty()) return std::unexpected("node " + target + ": " + why);
  if (challenge.size() < 16 || challenge.size() > 1024)
    return std::unexpected("node " + target + ": a challenge of " +
                           std::to_string(challenge.size()) + " bytes");
  auto proof = cluster::prove_identity(cluster::tls_files(m, self_node), challenge);
  if (!proof) return std::unexpected(proof.error());
  std::optional<gate_pass> pass;
  self->request(
          *gk, caf::duration{timeout}, hello_atom::value,
          gate_hello{self_node, protocol_version, proof->certificate_pem, proof->signature, term})
      .receive([&](gate_pass& p) { pass = std::move(p); },
               [&](caf::error& e) { why = describe(sys, e); });
  if (!pass) return std::unexpected("node " + target + " refused: " + why);
  if (pass->node != target || pass->cluster != m.name)
    return std::unexpected("node " + target + " answered as node '" + pass->node +
                           "' of cluster '" + pass->cluster + "'");
  return *pass;
}

}  // namespace troupe::actors
