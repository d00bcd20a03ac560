// The gatekeeper's handshake in one process (the TLS path is in
// tests/cli/node_multiproc_test.cpp): a node of the manifest that signs
// its challenge gets a pass; a wrong version, an unknown or its own name,
// a missing or reused challenge, another node's certificate and a bad
// signature are refused with a reason.
#include "actors/gatekeeper.hpp"

#include <gtest/gtest.h>

#include <filesystem>

#include "../temp_path.hpp"
#include "cluster/certs.hpp"

namespace troupe::actors {
namespace {

namespace fs = std::filesystem;

class Gatekeeper : public ::testing::Test {
 protected:
  void SetUp() override {
    dir = troupe::test::temp_path("gatekeeper");
    fs::remove_all(dir);
    fs::create_directories(dir);
    auto parsed = cluster::parse_manifest(
        "[cluster]\nname = \"g\"\nhead = \"a\"\ncerts = \"certs\"\n"
        "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = \"cpu\" "
        "}]\n"
        "[[nodes]]\nname = \"b\"\nhost = \"127.0.0.1\"\nport = 7401\ndevices = [{ type = \"cpu\" "
        "}]\n"
        "[[nodes]]\nname = \"c\"\nhost = \"127.0.0.1\"\nport = 7402\ndevices = [{ type = \"cpu\" "
        "}]\n",
        dir + "/g.toml");
    ASSERT_TRUE(parsed) << parsed.error().text();
    m = *parsed;
    ASSERT_TRUE(cluster::ensure_certificates(m));
    gk = spawn_gatekeeper(sys, m, "a");
  }
  void TearDown() override {
    caf::anon_send_exit(gk, caf::exit_reason::kill);
    fs::remove_all(dir);
  }

  std::vector<std::uint8_t> challenge() {
    std::vector<std::uint8_t> c;
    self->request(gk, caf::infinite, challenge_atom::value)
        .receive([&](std::vector<std::uint8_t>& x) { c = std::move(x); },
                 [&](caf::error& e) { ADD_FAILURE() << sys.render(e); });
    return c;
  }
  // The pass, or the refusal's text.
  std::string hello(const gate_hello& h) {
    std::string out;
    self->request(gk, caf::infinite, hello_atom::value, h)
        .receive([&](gate_pass& p) { out = "pass " + p.cluster + "/" + p.node; },
                 [&](caf::error& e) { out = describe(sys, e); });
    return out;
  }
  gate_hello signed_as(const std::string& files_of, const std::string& claim,
                       const std::vector<std::uint8_t>& c) {
    auto p = cluster::prove_identity(cluster::tls_files(m, files_of), c);
    EXPECT_TRUE(p) << p.error();
    return gate_hello{claim, protocol_version, p->certificate_pem, p->signature};
  }

  caf::actor_system_config cfg = [] {
    caf::actor_system_config c;
    register_protocol(c);
    return c;
  }();
  caf::actor_system sys{cfg};
  caf::scoped_actor self{sys};
  std::string dir;
  cluster::manifest m;
  gatekeeper_actor gk;
};

TEST_F(Gatekeeper, ANodeThatSignsItsChallengeGetsAPass) {
  const auto c = challenge();
  ASSERT_EQ(c.size(), 32u);
  EXPECT_EQ(hello(signed_as("b", "b", c)), "pass g/a");
}

TEST_F(Gatekeeper, EveryOtherHelloIsRefusedWithAReason) {
  // No challenge asked for.
  EXPECT_NE(hello(gate_hello{"b", protocol_version, "x", {1}}).find("no challenge was issued"),
            std::string::npos);
  // A challenge is good for one attempt only.
  auto c = challenge();
  auto h = signed_as("b", "b", c);
  h.version = protocol_version + 1;
  const auto v = hello(h);
  EXPECT_NE(
      v.find("protocol version mismatch: protocol version " + std::to_string(protocol_version + 1)),
      std::string::npos)
      << v;
  h.version = protocol_version;
  EXPECT_NE(hello(h).find("no challenge was issued"), std::string::npos);
  // Names the manifest does not have, and the gatekeeper's own.
  c = challenge();
  EXPECT_NE(hello(signed_as("b", "zz", c)).find("'zz' is not another node of cluster g"),
            std::string::npos);
  c = challenge();
  EXPECT_NE(hello(signed_as("b", "a", c)).find("'a' is not another node"), std::string::npos);
  // b's certificate claiming to be c.
  c = challenge();
  EXPECT_NE(hello(signed_as("b", "c", c)).find("the certificate names 'b'"), std::string::npos);
  // A signature over an older challenge.
  const auto old = challenge();
  const auto stale = signed_as("b", "b", old);
  (void)challenge();  // a new one replaces it
  const auto s = hello(stale);
  EXPECT_NE(s.find("signature does not match"), std::string::npos) << s;
  // Garbage in every field.
  c = challenge();
  EXPECT_NE(hello(gate_hello{"b", protocol_version, std::string(100000, '\0'),
                             std::vector<std::uint8_t>(5000, 7)})
                .find("a certificate of 100000 bytes"),
            std::string::npos);
  // And afterwards an honest node still gets in.
  c = challenge();
  EXPECT_EQ(hello(signed_as("c", "c", c)), "pass g/a");
}

}  // namespace
}  // namespace troupe::actors
