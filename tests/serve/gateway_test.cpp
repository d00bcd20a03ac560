// The gateway's listening socket: a burst of clients connecting at once is
// queued by the kernel, not dropped. Debian's cpp-httplib listens with a
// backlog of 5; while nothing accepts (here: before serve() runs, as on a
// busy machine where the accept thread is not scheduled) only ~6
// handshakes complete and the other clients' SYNs are dropped and retried
// a second later, or time out. And image URLs that cannot be fetched are
// answered with the status their error code maps to.
#include "serve/gateway.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <caf/all.hpp>
#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
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

// With an API key, /metrics needs it as well (it tells who uses the
// cluster how much); the health checks stay open.
TEST(Gateway, MetricsNeedTheApiKeyWhenOneIsSet) {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  troupe::serve::gateway_options opt;
  opt.host = "127.0.0.1";
  opt.port = 0;
  opt.api_key = "sk-test";
  troupe::serve::gateway gw(sys, troupe::actors::frontdoor_actor{}, opt);
  std::string why;
  ASSERT_TRUE(gw.bind(why)) << why;
  std::thread t([&] { gw.serve(); });
  httplib::Client c("127.0.0.1", gw.port());
  auto anon = c.Get("/metrics");
  ASSERT_TRUE(anon);
  EXPECT_EQ(anon->status, 401) << anon->body;
  EXPECT_NE(anon->body.find("invalid_api_key"), std::string::npos) << anon->body;
  auto wrong = c.Get("/metrics", {{"Authorization", "Bearer sk-other"}});
  ASSERT_TRUE(wrong);
  EXPECT_EQ(wrong->status, 401);
  auto keyed = c.Get("/metrics", {{"Authorization", "Bearer sk-test"}});
  ASSERT_TRUE(keyed);
  EXPECT_EQ(keyed->status, 200) << keyed->body;
  EXPECT_NE(keyed->body.find("troupe"), std::string::npos) << keyed->body;
  auto live = c.Get("/live");
  ASSERT_TRUE(live);
  EXPECT_EQ(live->status, 200);
  gw.stop();
  t.join();
}

// A gateway with remote images on (private hosts allowed: the image server
// is on loopback) and no cluster behind it: a fetch fails before any job is
// submitted.
class RemoteImages : public ::testing::Test {
 protected:
  void SetUp() override {
    images_.Get("/big.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(std::string(2u << 20, 'x'), "image/png");
    });
    image_port_ = images_.bind_to_any_port("127.0.0.1");
    ASSERT_GT(image_port_, 0);
    image_thread_ = std::thread([this] { images_.listen_after_bind(); });
    troupe::serve::gateway_options opt;
    opt.port = 0;
    opt.limits.remote_images = true;
    opt.limits.max_image_bytes = 1u << 20;
    opt.fetch.allow_private = true;
    gw_ = std::make_unique<troupe::serve::gateway>(sys_, troupe::actors::frontdoor_actor{}, opt);
    std::string why;
    ASSERT_TRUE(gw_->bind(why)) << why;
    serve_thread_ = std::thread([this] { gw_->serve(); });
    for (int i = 0; i < 500 && !images_.is_running(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  void TearDown() override {
    // Both servers have answered by now (or never started: nothing to stop).
    if (gw_) gw_->stop();
    if (serve_thread_.joinable()) serve_thread_.join();
    images_.stop();
    if (image_thread_.joinable()) image_thread_.join();
  }
  // POSTs a chat completion with one image part.
  httplib::Result post(const std::string& image_url) {
    const nlohmann::json body{
        {"messages",
         nlohmann::json::array(
             {{{"role", "user"},
               {"content", nlohmann::json::array({{{"type", "text"}, {"text", "What?"}},
                                                  {{"type", "image_url"},
                                                   {"image_url", {{"url", image_url}}}}})}}})}};
    httplib::Client c("127.0.0.1", gw_->port());
    return c.Post("/v1/chat/completions", body.dump(), "application/json");
  }
  std::string image_url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(image_port_) + path;
  }

  caf::actor_system_config cfg_;
  caf::actor_system sys_{cfg_};
  httplib::Server images_;
  int image_port_ = 0;
  std::thread image_thread_;
  std::unique_ptr<troupe::serve::gateway> gw_;
  std::thread serve_thread_;
};

TEST_F(RemoteImages, FetchErrorsAnswerTheStatusOfTheirCode) {
  auto big = post(image_url("/big.png"));
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413) << big->body;
  EXPECT_NE(big->body.find("larger than 1 MiB"), std::string::npos) << big->body;
  auto missing = post(image_url("/nothing.png"));
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 400) << missing->body;
  EXPECT_NE(missing->body.find("HTTP 404"), std::string::npos) << missing->body;
  auto bad_port = post("http://127.0.0.1:0/x.png");
  ASSERT_TRUE(bad_port);
  EXPECT_EQ(bad_port->status, 400) << bad_port->body;
  EXPECT_NE(bad_port->body.find("a bad port"), std::string::npos) << bad_port->body;
}

}  // namespace

// The port is bound exclusively: a second gateway on a port another one
// listens on does not start (cpp-httplib's SO_REUSEPORT let it share the
// port and take half the connections).
TEST(Gateway, ASecondGatewayOnTheSamePortFailsToStart) {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  troupe::serve::gateway_options opt;
  opt.host = "127.0.0.1";
  opt.port = 0;
  troupe::serve::gateway first(sys, troupe::actors::frontdoor_actor{}, opt);
  std::string why;
  ASSERT_TRUE(first.bind(why)) << why;
  opt.port = first.port();
  troupe::serve::gateway second(sys, troupe::actors::frontdoor_actor{}, opt);
  EXPECT_FALSE(second.bind(why));
  EXPECT_NE(why.find("in use"), std::string::npos) << why;
  EXPECT_NE(why.find(std::to_string(opt.port)), std::string::npos) << why;
}
