#include "actors/gatekeeper.hpp"
#include "actors/log.hpp"

#include <spdlog/spdlog.h>

#include <dlfcn.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

#include <caf/io/all.hpp>
#include <caf/openssl/all.hpp>
#include <map>

#include "cluster/certs.hpp"

// caf_openssl 0.17 calls SSL_read/SSL_write/SSL_connect/SSL_accept on the
// middleman's thread without clearing that thread's OpenSSL error queue
// first, and leaves OpenSSL 3's "unexpected eof while reading" in it when
// a peer (a client that exits) closes its connection without a TLS
// close_notify. The next SSL_read on any other connection that would just
// block then looks like a failure to SSL_get_error, and CAF closed every
// other node's connection. These wrappers (the executable's definitions
// win over libssl's for libcaf_openssl's calls) clear the queue before
// each call, as OpenSSL's documentation requires.
namespace {
template <class F>
F real_ssl(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}
}  // namespace

extern "C" {
int SSL_read(SSL* s, void* buf, int num) {
  static auto real = real_ssl<int (*)(SSL*, void*, int)>("SSL_read");
  ERR_clear_error();
  return real(s, buf, num);
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
  return real(s);
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
};

constexpr std::size_t max_pending = 1024;
constexpr auto challenge_lifetime = 60s;

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
          logging::of("gatekeeper").info("{}: node {} joined", me, h.node);
          return gate_pass{m.name, me, protocol_version, agent, frontdoor_actor{}};
        },
    };
  };
  return sys.spawn(impl, m, self_node, std::move(agent), std::move(door));
}

std::expected<void, std::string> configure_cluster_tls(caf::actor_system_config& cfg,
                                                       const cluster::manifest& m,
                                                       const std::string& node) {
  auto files = cluster::check_node_certificate(m, node);
  if (!files) return std::unexpected(files.error());
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

std::expected<gate_pass, std::string> join_node(caf::actor_system& sys, const cluster::manifest& m,
                                                const std::string& self_node,
                                                const std::string& target,
                                                std::chrono::milliseconds timeout) {
  const auto* t = m.node(target);
  if (!t) return std::unexpected("'" + target + "' is not a node of " + m.path);
  auto gk = caf::openssl::remote_actor<gatekeeper_actor>(sys, t->host,
                                                         static_cast<std::uint16_t>(t->port));
  if (!gk)
    return std::unexpected("node " + target + " at " + t->host + ":" + std::to_string(t->port) +
                           ": " + sys.render(gk.error()));
  caf::scoped_actor self{sys};
  std::string why;
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
  self->request(*gk, caf::duration{timeout}, hello_atom::value,
                gate_hello{self_node, protocol_version, proof->certificate_pem, proof->signature})
      .receive([&](gate_pass& p) { pass = std::move(p); },
               [&](caf::error& e) { why = describe(sys, e); });
  if (!pass) return std::unexpected("node " + target + " refused: " + why);
  if (pass->node != target || pass->cluster != m.name)
    return std::unexpected("node " + target + " answered as node '" + pass->node +
                           "' of cluster '" + pass->cluster + "'");
  return *pass;
}

}  // namespace troupe::actors
