#include "transport/ucx_gate.hpp"

#include <dlfcn.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace troupe::transport {

namespace {

constexpr char proof_magic[8] = {'T', 'R', 'P', 'G', 'A', 'T', 'E', '1'};
constexpr char mac_label[] = "troupe ucx gate v1";
// Accepted connections that have not shown their proof yet, at most: past
// it the oldest is shut down (UCX then reads end-of-file and drops it), so
// a peer that connects and stays silent cannot pile up descriptors.
constexpr std::size_t max_pending = 64;

// Appends an address as family, IP and port (network order).
void put_address(std::vector<std::uint8_t>& out, const sockaddr_storage& a) {
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    out.push_back(4);
    const auto* ip = reinterpret_cast<const std::uint8_t*>(&in.sin_addr);
    out.insert(out.end(), ip, ip + 4);
    const auto* port = reinterpret_cast<const std::uint8_t*>(&in.sin_port);
    out.insert(out.end(), port, port + 2);
  } else if (a.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
    out.push_back(6);
    const auto* ip = reinterpret_cast<const std::uint8_t*>(&in6.sin6_addr);
    out.insert(out.end(), ip, ip + 16);
    const auto* port = reinterpret_cast<const std::uint8_t*>(&in6.sin6_port);
    out.insert(out.end(), port, port + 2);
  } else {
    out.push_back(0);
  }
}

std::array<std::uint8_t, 32> mac_of(const data_plane_key& key, const sockaddr_storage& client,
                                    const sockaddr_storage& server, std::int64_t seconds) {
  std::vector<std::uint8_t> msg(mac_label, mac_label + sizeof mac_label - 1);
  put_address(msg, client);
  put_address(msg, server);
  for (int i = 0; i < 8; ++i)
    msg.push_back(static_cast<std::uint8_t>(std::uint64_t(seconds) >> (8 * i)));
  std::array<std::uint8_t, 32> mac{};
  unsigned len = 0;
  if (!HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), msg.data(), msg.size(),
            mac.data(), &len) ||
      len != mac.size()) {
    // Never a usable proof: a zero MAC differs from every real one.
    mac.fill(0);
  }
  return mac;
}

std::string address_text(const sockaddr_storage& a) {
  char ip[INET6_ADDRSTRLEN] = "?";
  unsigned port = 0;
  if (a.ss_family == AF_INET) {
    const auto& in = reinterpret_cast<const sockaddr_in&>(a);
    inet_ntop(AF_INET, &in.sin_addr, ip, sizeof ip);
    port = ntohs(in.sin_port);
  } else if (a.ss_family == AF_INET6) {
    const auto& in6 = reinterpret_cast<const sockaddr_in6&>(a);
    inet_ntop(AF_INET6, &in6.sin6_addr, ip, sizeof ip);
    port = ntohs(in6.sin6_port);
  }
  return std::string(ip) + ":" + std::to_string(port);
}

// --- the process's gate ----------------------------------------------------

enum class fd_state : std::uint8_t { client_pending, server_pending, refused };

struct tracked_fd {
  fd_state state{};
  std::size_t have = 0;  // proof bytes received (server) or sent (client)
  bool built = false;    // client: proof computed
  gate_proof buf{};
};

struct gate_state {
  std::mutex mtx;
  std::atomic<bool> armed{false};
  std::atomic<int> tracked{0};  // fds in `fds` (the fast path skips the lock at 0)
  data_plane_key key{};
  std::unordered_map<int, tracked_fd> fds;
  std::deque<int> pending_order;  // server_pending fds, oldest first
  ucx_gate_counters counters;
  std::time_t last_log = 0;
  std::uint64_t unlogged = 0;
  const void* ucs_base = nullptr;  // where libucs is loaded (its calls are gated)
};

std::atomic<accept_observer> other_accepts{nullptr};
std::atomic<close_observer> other_closes{nullptr};
std::atomic<connect_observer> other_connects{nullptr};

gate_state& gate() {
  static gate_state* g = new gate_state;  // never destroyed: sockets close during exit
  return *g;
}

template <typename F>
F next_symbol(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

using connect_fn = int (*)(int, const sockaddr*, socklen_t);
using accept_fn = int (*)(int, sockaddr*, socklen_t*);
using accept4_fn = int (*)(int, sockaddr*, socklen_t*, int);
using send_fn = ssize_t (*)(int, const void*, size_t, int);
using sendmsg_fn = ssize_t (*)(int, const msghdr*, int);
using recv_fn = ssize_t (*)(int, void*, size_t, int);
using close_fn = int (*)(int);

recv_fn real_recv() {
  static auto f = next_symbol<recv_fn>("recv");
  return f;
}
send_fn real_send() {
  static auto f = next_symbol<send_fn>("send");
  return f;
}

bool from_ucs(const void* caller) {
  auto& g = gate();
  if (!g.ucs_base || !caller) return false;
  Dl_info info{};
  return ::dladdr(caller, &info) != 0 && info.dli_fbase == g.ucs_base;
}

bool inet_socket(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof a;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return false;
  return a.ss_family == AF_INET || a.ss_family == AF_INET6;
}

bool ends_of(int fd, sockaddr_storage& local, sockaddr_storage& peer) {
  socklen_t l1 = sizeof local, l2 = sizeof peer;
  return ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &l1) == 0 &&
         ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &l2) == 0;
}

// Under g.mtx.
void log_refusal(gate_state& g, int fd, const char* why) {
  const std::time_t now = std::time(nullptr);
  if (now == g.last_log) {
    ++g.unlogged;
    return;
  }
  sockaddr_storage local{}, peer{};
  ends_of(fd, local, peer);
  std::fprintf(stderr,
               "troupe: data plane: refused a TCP connection from %s to %s: %s (%llu more since "
               "the last report)\n",
               address_text(peer).c_str(), address_text(local).c_str(), why,
               static_cast<unsigned long long>(g.unlogged));
  g.last_log = now;
  g.unlogged = 0;
}

// Under g.mtx.
void track(gate_state& g, int fd, fd_state s) {
  auto [it, fresh] = g.fds.insert_or_assign(fd, tracked_fd{});
  it->second.state = s;
  if (fresh) g.tracked.fetch_add(1, std::memory_order_release);
  if (s == fd_state::server_pending) {
    g.pending_order.push_back(fd);
    // Evict the oldest silent connections past the cap.
    std::size_t live = 0;
    for (int p : g.pending_order) {
      auto f = g.fds.find(p);
      if (f != g.fds.end() && f->second.state == fd_state::server_pending) ++live;
    }
    while (live > max_pending && !g.pending_order.empty()) {
      const int old = g.pending_order.front();
      g.pending_order.pop_front();
      auto f = g.fds.find(old);
      if (f == g.fds.end() || f->second.state != fd_state::server_pending) continue;
      f->second.state = fd_state::refused;
      ++g.counters.refused;
      log_refusal(g, old, "no proof while newer connections waited");
      ::shutdown(old, SHUT_RDWR);
      --live;
    }
  }
}

// Under g.mtx.
void untrack(gate_state& g, int fd) {
  if (g.fds.erase(fd) > 0) g.tracked.fetch_sub(1, std::memory_order_release);
  if (g.pending_order.size() > 4 * max_pending) {
    std::deque<int> keep;
    for (int p : g.pending_order) {
      auto f = g.fds.find(p);
      if (f != g.fds.end() && f->second.state == fd_state::server_pending) keep.push_back(p);
    }
    g.pending_order.swap(keep);
  }
}

// A socket just opened by `caller`: when the gate is armed and the caller
// is libucs, gated if it is IPv4/IPv6. Returns whether it was libucs's.
bool note_new_socket(int fd, fd_state s, const void* caller) {
  auto& g = gate();
  if (fd < 0 || !g.armed.load(std::memory_order_acquire)) return false;
  const int saved = errno;
  const bool ucs = from_ucs(caller);
  if (ucs && inet_socket(fd)) {
    std::lock_guard lk(g.mtx);
    track(g, fd, s);
  }
  errno = saved;
  return ucs;
}

// Under g.mtx: an untracked fd passes (false); a refused one is answered
// with a reset (true, `out` set); otherwise `found` is its record.
std::optional<bool> lookup(gate_state& g, int fd, tracked_fd*& found, ssize_t& out) {
  auto it = g.fds.find(fd);
  if (it == g.fds.end()) return false;
  if (it->second.state == fd_state::refused) {
    out = -1;
    errno = ECONNRESET;
    return true;
  }
  found = &it->second;
  return std::nullopt;
}

// Before recv on a gated fd: true with `out` set when the gate answers
// instead of the socket.
bool gate_recv(int fd, ssize_t& out) {
  auto& g = gate();
  std::lock_guard lk(g.mtx);
  tracked_fd* found = nullptr;
  if (auto answered = lookup(g, fd, found, out)) return *answered;
  tracked_fd& t = *found;
  if (t.state != fd_state::server_pending) return false;
  while (t.have < gate_proof_bytes) {
    const ssize_t n =
        real_recv()(fd, t.buf.data() + t.have, gate_proof_bytes - t.have, MSG_DONTWAIT);
    if (n > 0) {
      t.have += static_cast<std::size_t>(n);
      continue;
    }
    out = n;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;  // wait for more
    // Closed (or failed) before it showed a proof: a stranger that sent
    // less than a proof, or gave up waiting for an answer.
    const int saved = errno;
    t.state = fd_state::refused;
    ++g.counters.refused;
    log_refusal(g, fd, "the connection ended before a full proof arrived");
    errno = saved;
    return true;
  }
  sockaddr_storage local{}, peer{};
  gate_verdict v = gate_verdict::bad_mac;
  if (ends_of(fd, local, peer))
    v = check_gate_proof(g.key, t.buf, peer, local, static_cast<std::int64_t>(std::time(nullptr)));
  if (v != gate_verdict::ok) {
    t.state = fd_state::refused;
    ++g.counters.refused;
    log_refusal(g, fd, to_string(v));
    ::shutdown(fd, SHUT_RDWR);
    out = -1;
    errno = ECONNRESET;
    return true;
  }
  ++g.counters.admitted;
  untrack(g, fd);
  return false;  // proof consumed: UCX's own bytes follow
}

// Before send/sendmsg on a gated fd.
bool gate_send(int fd, ssize_t& out) {
  auto& g = gate();
  std::lock_guard lk(g.mtx);
  tracked_fd* found = nullptr;
  if (auto answered = lookup(g, fd, found, out)) return *answered;
  tracked_fd& t = *found;
  if (t.state != fd_state::client_pending) return false;
  if (!t.built) {
    sockaddr_storage local{}, peer{};
    if (!ends_of(fd, local, peer)) {
      out = -1;  // not connected yet: UCX retries when the socket is writable
      errno = EAGAIN;
      return true;
    }
    t.buf = make_gate_proof(g.key, local, peer, static_cast<std::int64_t>(std::time(nullptr)));
    t.built = true;
  }
  while (t.have < gate_proof_bytes) {
    const ssize_t n = real_send()(fd, t.buf.data() + t.have, gate_proof_bytes - t.have,
                                  MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n > 0) {
      t.have += static_cast<std::size_t>(n);
      continue;
    }
    out = -1;
    if (n == 0) errno = EAGAIN;
    return true;
  }
  ++g.counters.proved;
  untrack(g, fd);
  return false;
}

}  // namespace

const char* to_string(gate_verdict v) {
  switch (v) {
    case gate_verdict::ok:
      return "ok";
    case gate_verdict::bad_magic:
      return "no troupe proof (a stranger, or a peer without the data-plane key)";
    case gate_verdict::stale:
      return "a proof outside its time window (clocks apart, or a replay)";
    case gate_verdict::bad_mac:
      return "a proof made with another key or for another connection";
  }
  return "?";
}

gate_proof make_gate_proof(const data_plane_key& key, const sockaddr_storage& client,
                           const sockaddr_storage& server, std::int64_t unix_seconds) {
  gate_proof p{};
  std::memcpy(p.data(), proof_magic, 8);
  for (int i = 0; i < 8; ++i)
    p[8 + i] = static_cast<std::uint8_t>(std::uint64_t(unix_seconds) >> (8 * i));
  const auto mac = mac_of(key, client, server, unix_seconds);
  std::memcpy(p.data() + 16, mac.data(), mac.size());
  return p;
}

gate_verdict check_gate_proof(const data_plane_key& key, std::span<const std::uint8_t> proof,
                              const sockaddr_storage& client, const sockaddr_storage& server,
                              std::int64_t now_unix_seconds) {
  if (proof.size() != gate_proof_bytes || std::memcmp(proof.data(), proof_magic, 8) != 0)
    return gate_verdict::bad_magic;
  std::uint64_t s = 0;
  for (int i = 0; i < 8; ++i) s |= std::uint64_t(proof[8 + i]) << (8 * i);
  const auto seconds = static_cast<std::int64_t>(s);
  if (seconds < now_unix_seconds - gate_proof_window_s ||
      seconds > now_unix_seconds + gate_proof_window_s)
    return gate_verdict::stale;
  const auto mac = mac_of(key, client, server, seconds);
  if (CRYPTO_memcmp(mac.data(), proof.data() + 16, mac.size()) != 0) return gate_verdict::bad_mac;
  return gate_verdict::ok;
}

bool arm_ucx_gate(const data_plane_key& key) {
  auto& g = gate();
  std::lock_guard lk(g.mtx);
  if (g.armed.load()) return CRYPTO_memcmp(g.key.data(), key.data(), key.size()) == 0;
  // Where libucs lives: its socket calls are the ones gated.
  if (void* sym = ::dlsym(RTLD_DEFAULT, "ucs_socket_connect")) {
    Dl_info info{};
    if (::dladdr(sym, &info) != 0) g.ucs_base = info.dli_fbase;
  }
  if (!g.ucs_base) return false;
  g.key = key;
  g.armed.store(true, std::memory_order_release);
  return true;
}

void set_socket_observers(accept_observer on_accept, close_observer on_close) {
  other_accepts.store(on_accept);
  other_closes.store(on_close);
}

void set_connect_observer(connect_observer on_connect) {
  other_connects.store(on_connect);
}

bool ucx_gate_armed() {
  return gate().armed.load(std::memory_order_acquire);
}

ucx_gate_counters ucx_gate_stats() {
  auto& g = gate();
  std::lock_guard lk(g.mtx);
  return g.counters;
}

}  // namespace troupe::transport

namespace {

using namespace troupe::transport;

// An accepted socket: UCX's go to the gate, the others to the observer.
int after_accept(int r, const void* caller) {
  if (r < 0) return r;
  const int saved = errno;
  if (!note_new_socket(r, fd_state::server_pending, caller)) {
    if (auto on = other_accepts.load(); on && !on(r, caller)) {
      static auto real_close = next_symbol<close_fn>("close");
      real_close(r);
      errno = EAGAIN;  // as if nobody had been waiting
      return -1;
    }
  }
  errno = saved;
  return r;
}

}  // namespace

// --- the socket calls, as libucs sees them -----------------------------------
// Everything else in the process passes straight through (one atomic load
// when no gated handshake is open).

extern "C" {

int connect(int fd, const sockaddr* addr, socklen_t len) {
  const void* caller = __builtin_return_address(0);
  static auto real = next_symbol<connect_fn>("connect");
  const int r = real(fd, addr, len);
  if ((r == 0 || errno == EINPROGRESS) && addr &&
      (addr->sa_family == AF_INET || addr->sa_family == AF_INET6) &&
      !note_new_socket(fd, fd_state::client_pending, caller)) {
    if (auto on = other_connects.load(); on) {
      const int saved = errno;
      on(fd, addr, caller);
      errno = saved;
    }
  }
  return r;
}

int accept(int fd, sockaddr* addr, socklen_t* len) {
  const void* caller = __builtin_return_address(0);
  static auto real = next_symbol<accept_fn>("accept");
  return after_accept(real(fd, addr, len), caller);
}

int accept4(int fd, sockaddr* addr, socklen_t* len, int flags) {
  const void* caller = __builtin_return_address(0);
  static auto real = next_symbol<accept4_fn>("accept4");
  return after_accept(real(fd, addr, len, flags), caller);
}

ssize_t recv(int fd, void* buf, size_t n, int flags) {
  if (gate().tracked.load(std::memory_order_acquire) != 0) {
    ssize_t out = 0;
    if (gate_recv(fd, out)) return out;
  }
  return real_recv()(fd, buf, n, flags);
}

ssize_t send(int fd, const void* buf, size_t n, int flags) {
  if (gate().tracked.load(std::memory_order_acquire) != 0) {
    ssize_t out = 0;
    if (gate_send(fd, out)) return out;
  }
  return real_send()(fd, buf, n, flags);
}

ssize_t sendmsg(int fd, const msghdr* msg, int flags) {
  static auto real = next_symbol<sendmsg_fn>("sendmsg");
  if (gate().tracked.load(std::memory_order_acquire) != 0) {
    ssize_t out = 0;
    if (gate_send(fd, out)) return out;
  }
  return real(fd, msg, flags);
}

int close(int fd) {
  static auto real = next_symbol<close_fn>("close");
  if (auto on = other_closes.load(); on) on(fd);
  auto& g = gate();
  if (g.tracked.load(std::memory_order_acquire) != 0) {
    std::lock_guard lk(g.mtx);
    untrack(g, fd);
  }
  return real(fd);
}

}  // extern "C"
