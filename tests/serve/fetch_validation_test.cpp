// Fetching remote image URLs: which addresses count as public, which URLs
// parse, and fetches against a real local HTTP server (refused as loopback
// unless private hosts are allowed; sizes, statuses and redirects).
#include "serve/fetch.hpp"

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <thread>

namespace {

using namespace troupe::serve;

TEST(ImageFetch, AddressClasses) {
  // Not public, with the range named.
  const std::vector<std::pair<std::string, std::string>> blocked{
      {"127.0.0.1", "loopback"},
      {"127.255.0.9", "loopback"},
      {"10.1.2.3", "private"},
      {"172.16.0.1", "private"},
      {"172.31.255.254", "private"},
      {"192.168.1.1", "private"},
      {"169.254.169.254", "link-local"},
      {"100.64.0.1", "shared"},
      {"0.0.0.0", "this network"},
      {"224.0.0.1", "multicast"},
      {"255.255.255.255", "reserved"},
      {"::1", "loopback"},
      {"::", "unspecified"},
      {"fe80::1", "link-local"},
      {"fc00::1", "unique local"},
      {"fd12:3456::1", "unique local"},
      {"::ffff:127.0.0.1", "loopback"},
      {"::ffff:10.0.0.1", "private"},
      {"ff02::1", "multicast"},
      {"2001:db8::1", "documentation"},
      {"64:ff9b::a00:1", "private"},
  };
  for (const auto& [ip, what] : blocked) {
    const auto r = non_public_reason(ip);
    EXPECT_NE(r.find(what), std::string::npos) << ip << " -> '" << r << "'";
  }
  for (const std::string ip : {"8.8.8.8", "1.1.1.1", "172.32.0.1", "172.15.255.255", "100.128.0.1",
                               "2606:4700::1111", "::ffff:8.8.8.8"})
    EXPECT_EQ(non_public_reason(ip), "") << ip;
  EXPECT_NE(non_public_reason("example.com").find("not a numeric"), std::string::npos);
}

TEST(ImageFetch, UrlParsing) {
  auto p = parse_http_url("HTTPS://Example.com:8443/a/b.png?x=1#frag");
  ASSERT_TRUE(p) << p.error().message;
  EXPECT_EQ(p->scheme, "https");
  EXPECT_EQ(p->host, "Example.com");
  EXPECT_EQ(p->port, 8443);
  EXPECT_EQ(p->path, "/a/b.png?x=1");
  auto v6 = parse_http_url("http://[::1]:81");
  ASSERT_TRUE(v6) << v6.error().message;
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->port, 81);
  EXPECT_EQ(v6->path, "/");
  EXPECT_EQ(parse_http_url("http://a.b")->port, 80);
  for (const std::string bad :
       {"ftp://a/b", "file:///etc/passwd", "http://", "http://user:pw@host/x", "http://host:0/",
        "http://host:65536/", "http://host:12a/", "http://[::1/x", "http://ho st/x", "no scheme",
        "http://host/a b", "gopher://x"}) {
    auto r = parse_http_url(bad);
    ASSERT_FALSE(r) << bad;
    EXPECT_EQ(r.error().code, fetch_errc::bad_url) << bad;
  }
}

class LocalImageServer : public ::testing::Test {
 protected:
  void SetUp() override {
    srv_.Get("/img.png", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(image_, "image/png");
    });
    srv_.Get("/big.png", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(std::string(3u << 20, 'x'), "image/png");
    });
    srv_.Get("/moved",
             [](const httplib::Request&, httplib::Response& res) { res.set_redirect("/img.png"); });
    port_ = srv_.bind_to_any_port("127.0.0.1");
    ASSERT_GT(port_, 0);
    thread_ = std::thread([this] { srv_.listen_after_bind(); });
    for (int i = 0; i < 500 && !srv_.is_running(); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  void TearDown() override {
    srv_.stop();
    if (thread_.joinable()) thread_.join();
  }
  std::string url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }

  httplib::Server srv_;
  std::thread thread_;
  int port_ = 0;
  std::string image_ = std::string("\x89PNG\r\n\x1a\n", 8) + "pixels";
};

TEST_F(LocalImageServer, LoopbackIsRefusedUnlessPrivateHostsAreAllowed) {
  fetch_options o;
  auto refused = fetch_image(url("/img.png"), o);
  ASSERT_FALSE(refused);
  EXPECT_EQ(refused.error().code, fetch_errc::forbidden_address);
  EXPECT_NE(refused.error().message.find("loopback"), std::string::npos) << refused.error().message;
  auto by_name = fetch_image("http://localhost:" + std::to_string(port_) + "/img.png", o);
  ASSERT_FALSE(by_name);
  EXPECT_EQ(by_name.error().code, fetch_errc::forbidden_address);
  EXPECT_NE(by_name.error().message.find("refused"), std::string::npos) << by_name.error().message;

  o.allow_private = true;
  auto got = fetch_image(url("/img.png"), o);
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(std::string(got->begin(), got->end()), image_);
  auto missing = fetch_image(url("/nothing.png"), o);
  ASSERT_FALSE(missing);
  EXPECT_EQ(missing.error().code, fetch_errc::bad_status);
  EXPECT_NE(missing.error().message.find("HTTP 404"), std::string::npos) << missing.error().message;
  auto moved = fetch_image(url("/moved"), o);
  ASSERT_FALSE(moved);
  EXPECT_EQ(moved.error().code, fetch_errc::redirect);
  EXPECT_NE(moved.error().message.find("redirect"), std::string::npos) << moved.error().message;
  o.max_bytes = 1u << 20;
  auto big = fetch_image(url("/big.png"), o);
  ASSERT_FALSE(big);
  EXPECT_EQ(big.error().code, fetch_errc::too_large);
  EXPECT_NE(big.error().message.find("larger than 1 MiB"), std::string::npos)
      << big.error().message;
  auto bad_url = fetch_image("http://127.0.0.1:0/img.png", o);
  ASSERT_FALSE(bad_url);
  EXPECT_EQ(bad_url.error().code, fetch_errc::bad_url);
}

}  // namespace
