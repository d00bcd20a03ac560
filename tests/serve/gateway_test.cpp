// The gateway's listening socket: a burst of clients connecting at once is
// queued by the kernel, not dropped. Debian's cpp-httplib listens with a
// backlog of 5; while nothing accepts (here: before serve() runs, as on a
// busy machine where the accept thread is not scheduled) only ~6
// handshakes complete and the other clients' SYNs are dropped and retried
// a second later, or time out.
#include "serve/gateway.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <caf/all.hpp>
#include <chrono>
#include <vector>

namespace {

// Starts `n` non-blocking connects to 127.0.0.1:port and counts those that
// complete within `limit`.
int connections_completed(int port, int n, std::chrono::milliseconds limit) {
  std::vector<int> fds;
  for (int i = 0; i < n; ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (fd < 0) break;
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    (void)::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    fds.push_back(fd);
  }
  int done = 0;
  const auto until = std::chrono::steady_clock::now() + limit;
  std::vector<bool> counted(fds.size(), false);
  while (done < static_cast<int>(fds.size()) && std::chrono::steady_clock::now() < until) {
    std::vector<pollfd> p;
    std::vector<std::size_t> which;
    for (std::size_t i = 0; i < fds.size(); ++i)
      if (!counted[i]) {
        p.push_back({fds[i], POLLOUT, 0});
        which.push_back(i);
      }
    if (::poll(p.data(), p.size(), 50) <= 0) continue;
    for (std::size_t k = 0; k < p.size(); ++k) {
      if (!(p[k].revents & (POLLOUT | POLLERR | POLLHUP))) continue;
      counted[which[k]] = true;
      int err = 0;
      socklen_t len = sizeof err;
      if (::getsockopt(p[k].fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0) ++done;
    }
  }
  for (int fd : fds) ::close(fd);
  return done;
}

TEST(Gateway, ABurstOfClientsIsQueuedWhileNothingAccepts) {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  troupe::serve::gateway_options opt;
  opt.host = "127.0.0.1";
  opt.port = 0;
  // No cluster behind it: no request is sent, only connections.
  troupe::serve::gateway gw(sys, troupe::actors::frontdoor_actor{}, opt);
  std::string why;
  ASSERT_TRUE(gw.bind(why)) << why;
  ASSERT_GT(gw.port(), 0);
  // serve() has not run: nothing accepts, so every completed handshake
  // sits in the listen queue.
  const int n = 64;
  EXPECT_EQ(connections_completed(gw.port(), n, std::chrono::milliseconds(500)), n);
}

}  // namespace
