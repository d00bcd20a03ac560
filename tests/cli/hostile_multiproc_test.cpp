// Hostile peers on the control plane of a loopback cluster
// (actors/control_guard.hpp): a certificate holder whose CAF header
// announces a gigabyte, and a thousand connections that never finish their
// TLS handshake. The head's memory stays where it was, its heartbeats stay
// on time, and the jobs running meanwhile answer as without them.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "cluster_harness.hpp"

using namespace troupe;
using namespace troupe::test::cluster_harness;

namespace {

using namespace std::chrono_literals;

double rss_mib(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return -1;
}

int tcp_connect(int port, bool blocking) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | (blocking ? 0 : SOCK_NONBLOCK), 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 && errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the peer closed `fd` (end of file or reset; data is read and
// dropped).
bool closed_by_peer(int fd) {
  char buf[4096];
  for (;;) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
  }
}

// A TLS connection holding the cluster's client certificate.
struct tls_conn {
  SSL_CTX* ctx = nullptr;
  SSL* ssl = nullptr;
  int fd = -1;
  ~tls_conn() {
    if (ssl) SSL_free(ssl);
    if (ctx) SSL_CTX_free(ctx);
    if (fd >= 0) ::close(fd);
  }
};

std::unique_ptr<tls_conn> tls_client(const troupe::cluster::manifest& m, int port) {
  auto c = std::make_unique<tls_conn>();
  const auto files = troupe::cluster::tls_files(m, troupe::cluster::client_identity);
  c->ctx = SSL_CTX_new(TLS_client_method());
  if (!c->ctx ||
      SSL_CTX_use_certificate_file(c->ctx, files.certificate.c_str(), SSL_FILETYPE_PEM) != 1 ||
      SSL_CTX_use_PrivateKey_file(c->ctx, files.key.c_str(), SSL_FILETYPE_PEM) != 1)
    return nullptr;
  c->fd = tcp_connect(port, true);
  if (c->fd < 0) return nullptr;
  c->ssl = SSL_new(c->ctx);
  SSL_set_fd(c->ssl, c->fd);
  if (SSL_connect(c->ssl) != 1) return nullptr;
  return c;
}

}  // namespace

TEST_F(ClusterLoopback, AHeaderAnnouncingAGigabyteCostsTheHeadNothing) {
  up("bomb");
  client c(m_);
  ASSERT_TRUE(c.ok());
  const pid_t head = pid_of("n0");
  ASSERT_GT(head, 0);
  const double before = rss_mib(head);
  // Two connections, each a BASP client handshake header announcing 1 GiB
  // (the report's was 4 GiB; CAF zero-fills what a header announces).
  std::vector<std::unique_ptr<tls_conn>> bombs;
  for (int i = 0; i < 2; ++i) {
    auto b = tls_client(m_, cs_.ports[0]);
    ASSERT_TRUE(b) << "no TLS connection with the client certificate";
    std::uint8_t hdr[32] = {};
    hdr[0] = 0x01;  // client_handshake: source and destination actor ids zero
    const std::uint32_t len = 1u << 30;
    hdr[4] = static_cast<std::uint8_t>(len >> 24);
    hdr[5] = static_cast<std::uint8_t>(len >> 16);
    hdr[6] = static_cast<std::uint8_t>(len >> 8);
    hdr[7] = static_cast<std::uint8_t>(len);
    hdr[15] = 1;  // operation data
    ASSERT_EQ(SSL_write(b->ssl, hdr, sizeof hdr), static_cast<int>(sizeof hdr));
    bombs.push_back(std::move(b));
  }
  // The head closes both connections.
  for (auto& b : bombs) {
    timeval tv{10, 0};
    ::setsockopt(b->fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    char buf[256];
    int n = 0;
    const auto t0 = std::chrono::steady_clock::now();
    while ((n = SSL_read(b->ssl, buf, sizeof buf)) > 0 &&
           std::chrono::steady_clock::now() - t0 < 10s) {
    }
    EXPECT_LE(n, 0) << "the head kept the connection";
    ERR_clear_error();
  }
  std::this_thread::sleep_for(500ms);
  const double after = rss_mib(head);
  EXPECT_LT(after - before, 64.0) << "the head grew from " << before << " to " << after << " MiB";
  // Nothing else happened: every node is up and a job runs.
  auto st = c.status();
  ASSERT_TRUE(st.has_value());
  for (const auto& n : st->nodes)
    EXPECT_EQ(n.state, cluster::member_state::up) << n.name << " is " << to_string(n.state);
  EXPECT_EQ(st->replacements, 0);
  auto f = actors::client(c.sys(), c.door()).run(job(1, 8, true));
  ASSERT_TRUE(f.has_value()) << f.error().message;
  EXPECT_EQ(f->reason, actors::finish_reason::length);
  std::printf("[ hostile ] two headers announcing 1 GiB each: head RSS %.1f -> %.1f MiB\n", before,
              after);
}

TEST_F(ClusterLoopback, AThousandHalfOpenConnectionsCostTheHeadLittleAndAreClosed) {
  rlimit rl{};
  ::getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_cur < 2048 && rl.rlim_max > rl.rlim_cur) {
    rl.rlim_cur = std::min<rlim_t>(rl.rlim_max, 4096);
    ::setrlimit(RLIMIT_NOFILE, &rl);
  }
  ASSERT_GE(rl.rlim_cur, 1200u) << "not enough descriptors for the flood";
  up("flood");
  client c(m_);
  ASSERT_TRUE(c.ok());
  constexpr int jobs = 2;
  constexpr std::int64_t tokens = 64;
  auto ref = reference_run(c, jobs, tokens);
  const pid_t head = pid_of("n0");
  const double before = rss_mib(head);

  auto run = start_jobs(c, jobs, tokens, true);
  constexpr int flood = 1000;
  std::vector<int> fds;
  for (int i = 0; i < flood; ++i) {
    const int fd = tcp_connect(cs_.ports[0], false);
    if (fd >= 0) fds.push_back(fd);
  }
  EXPECT_EQ(fds.size(), static_cast<std::size_t>(flood));
  // Meanwhile the head's view of its nodes: heartbeats answered on time.
  double worst_seen_ms = 0, worst_status_ms = 0;
  int not_up = 0;
  std::size_t closed_early = 0;
  const auto t0 = std::chrono::steady_clock::now();
  bool counted_early = false;
  while (std::chrono::steady_clock::now() - t0 < 13s) {
    const auto q0 = std::chrono::steady_clock::now();
    auto st = c.status();
    worst_status_ms = std::max(
        worst_status_ms,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - q0).count());
    if (!st) {
      ++not_up;
      continue;
    }
    for (const auto& n : st->nodes) {
      if (n.name == m_.head) continue;
      worst_seen_ms = std::max(worst_seen_ms, n.last_seen_ms);
      not_up += n.state != cluster::member_state::up;
    }
    if (!counted_early && std::chrono::steady_clock::now() - t0 > 3s) {
      // Over the caps: closed at once.
      for (int fd : fds) closed_early += closed_by_peer(fd);
      counted_early = true;
    }
    std::this_thread::sleep_for(250ms);
  }
  const double during = rss_mib(head);
  std::size_t closed_late = 0;
  for (int fd : fds) closed_late += closed_by_peer(fd);
  for (int fd : fds) ::close(fd);
  join(*run);
  expect_same_answers(*run, *ref);
  EXPECT_EQ(not_up, 0) << "a node was suspected (or the status failed) during the flood";
  EXPECT_LT(worst_seen_ms, 1200.0) << "a heartbeat answer came later than the suspect threshold";
  EXPECT_GE(closed_early, static_cast<std::size_t>(flood - 128))
      << "the head held more unfinished handshakes than its caps";
  EXPECT_EQ(closed_late, fds.size()) << "connections without a handshake outlived the deadline";
  EXPECT_LT(during - before, 48.0) << "the head grew from " << before << " to " << during << " MiB";
  std::printf(
      "[ hostile ] %d half-open connections: %zu closed within 3 s, all %zu within 13 s; head RSS "
      "%.1f -> %.1f MiB; worst heartbeat age %.0f ms, worst status %.0f ms\n",
      flood, closed_early, closed_late, before, during, worst_seen_ms, worst_status_ms);
}

// A second head (cluster/head_lease.hpp): a process holding the head's
// certificate, started at another port, joins no node; it steps down and
// the cluster goes on under its head.
TEST_F(ClusterLoopback, ARogueHeadAtAnotherAddressIsRefusedAndStepsDown) {
  up("rogue-head");
  client c(m_);
  ASSERT_TRUE(c.ok());
  auto before = c.status();
  ASSERT_TRUE(before.has_value());
  // The same manifest (same certificates) with the head at another port.
  std::ifstream in(cs_.manifest);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string from = "port = " + std::to_string(cs_.ports[0]);
  const auto at = text.find(from);
  ASSERT_NE(at, std::string::npos);
  text.replace(at, from.size(), "port = " + std::to_string(test::free_port()));
  const std::string rogue_manifest = cs_.dir + "/rogue.toml";
  std::ofstream(rogue_manifest) << text;
  test::child_process rogue("rogue-head",
                            {TROUPE_CLI, "node", "--manifest", rogue_manifest, "--name", "n0"});
  // It is refused by both nodes and stops by itself.
  const auto ended = rogue.wait_exit(60s);
  EXPECT_NE(ended, "still running") << "the rogue head did not step down";
  int refusing = 0;
  for (const auto& n : cluster::read_launched(m_)) {
    if (n.node == m_.head) continue;
    std::ifstream f(n.log);
    const std::string log((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    refusing += log.find(
                    "refused a head: a process holding the head's certificate, but not the "
                    "one at the head's address") != std::string::npos;
  }
  EXPECT_EQ(refusing, 2) << "not every node refused the rogue";
  // The cluster is as it was and answers.
  auto after = c.status();
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(after->placement, before->placement);
  EXPECT_EQ(after->epoch, before->epoch) << "somebody placed the model again";
  for (const auto& n : after->nodes)
    EXPECT_EQ(n.state, cluster::member_state::up) << n.name << " is " << to_string(n.state);
  auto f = actors::client(c.sys(), c.door()).run(job(3, 8, true));
  ASSERT_TRUE(f.has_value()) << f.error().message;
  EXPECT_EQ(f->reason, actors::finish_reason::length);
}
