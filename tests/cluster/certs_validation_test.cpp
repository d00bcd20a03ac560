// The cluster's certificates: made once per cluster, one per node, checked
// before a node starts; OpenSSL's own `openssl verify` agrees with the
// checks, and certificates of another cluster, of another node, corrupt or
// missing files are refused with a message.
#include "cluster/certs.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "../temp_path.hpp"

namespace troupe::cluster {
namespace {

namespace fs = std::filesystem;

manifest make(const std::string& dir, const std::string& name) {
  const std::string text =
      "[cluster]\nname = \"" + name + "\"\nhead = \"a\"\ncerts = \"certs\"\n" +
      "[[nodes]]\nname = \"a\"\nhost = \"127.0.0.1\"\nport = 7400\ndevices = [{ type = \"cpu\" }]\n"
      "[[nodes]]\nname = \"b\"\nhost = \"10.1.2.3\"\nport = 7400\ndevices = [{ type = \"cpu\" }]\n"
      "[[nodes]]\nname = \"c\"\nhost = \"node-c.example\"\nport = 7400\ndevices = [{ type = "
      "\"cpu\" }]\n";
  auto m = parse_manifest(text, dir + "/cluster.toml");
  EXPECT_TRUE(m) << (m ? "" : m.error().text());
  return *m;
}

std::string slurp(const std::string& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int openssl(const std::string& args) {
  return std::system(("openssl " + args + " >/dev/null 2>&1").c_str());
}

class Certs : public ::testing::Test {
 protected:
  void SetUp() override {
    root = troupe::test::temp_path("certs");
    fs::remove_all(root);
    fs::create_directories(root + "/one");
    fs::create_directories(root + "/two");
  }
  void TearDown() override { fs::remove_all(root); }
  std::string root;
};

TEST_F(Certs, OneCaAndOneCertificatePerNodeThatOpensslVerifies) {
  const auto m = make(root + "/one", "one");
  auto wrote = ensure_certificates(m);
  ASSERT_TRUE(wrote) << wrote.error();
  EXPECT_EQ(wrote->size(), 6u);  // ca.pem + 3 nodes + the client + the data-plane key
  for (const char* n : {"a", "b", "c", client_identity}) {
    auto ok = check_node_certificate(m, n);
    ASSERT_TRUE(ok) << ok.error();
    EXPECT_EQ(certificate_common_name(ok->certificate).value_or(""), n);
    // OpenSSL's command line agrees: signed by the CA, fit for TLS both ways.
    EXPECT_EQ(openssl("verify -CAfile " + ok->ca + " -purpose sslserver " + ok->certificate), 0)
        << n;
    EXPECT_EQ(openssl("verify -CAfile " + ok->ca + " -purpose sslclient " + ok->certificate), 0)
        << n;
    struct stat st {};
    ASSERT_EQ(::stat(ok->key.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u) << "a private key readable by others";
  }
  struct stat st {};
  ASSERT_EQ(::stat((m.certs_dir + "/ca.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(data_plane_key_file(m).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "the data-plane key is readable by others";
  // The address is in the certificate (IP for an address, DNS for a name).
  const auto b = slurp(tls_files(m, "b").certificate), c = slurp(tls_files(m, "c").certificate);
  EXPECT_EQ(std::system(("openssl x509 -noout -text -in " + tls_files(m, "b").certificate +
                         " | grep -q 'IP Address:10.1.2.3'")
                            .c_str()),
            0);
  EXPECT_EQ(std::system(("openssl x509 -noout -text -in " + tls_files(m, "c").certificate +
                         " | grep -q 'DNS:node-c.example'")
                            .c_str()),
            0);
  EXPECT_NE(b, c);
}

TEST_F(Certs, RunningAgainKeepsTheCaAndAddsOnlyWhatIsMissing) {
  const auto m = make(root + "/one", "one");
  ASSERT_TRUE(ensure_certificates(m));
  const auto ca = slurp(m.certs_dir + "/ca.pem"), a = slurp(tls_files(m, "a").certificate);
  fs::remove(tls_files(m, "b").certificate);
  auto again = ensure_certificates(m);
  ASSERT_TRUE(again) << again.error();
  ASSERT_EQ(again->size(), 1u);
  EXPECT_EQ((*again)[0], tls_files(m, "b").certificate);
  EXPECT_EQ(slurp(m.certs_dir + "/ca.pem"), ca);
  EXPECT_EQ(slurp(tls_files(m, "a").certificate), a);
  EXPECT_TRUE(check_node_certificate(m, "b"));
}

TEST_F(Certs, EachClusterHasItsOwnDataPlaneKeyAndBadKeyFilesAreRefused) {
  const auto one = make(root + "/one", "one"), two = make(root + "/two", "two");
  ASSERT_TRUE(ensure_certificates(one));
  ASSERT_TRUE(ensure_certificates(two));
  auto k1 = read_data_plane_key(one), k2 = read_data_plane_key(two);
  ASSERT_TRUE(k1) << k1.error();
  ASSERT_TRUE(k2) << k2.error();
  EXPECT_NE(*k1, *k2);
  EXPECT_NE(*k1, (std::array<std::uint8_t, 32>{}));
  // Running again keeps it.
  ASSERT_TRUE(ensure_certificates(one));
  EXPECT_EQ(read_data_plane_key(one).value_or(std::array<std::uint8_t, 32>{}), *k1);
  const auto path = data_plane_key_file(one);
  auto refused = [&](const std::string& why) {
    auto r = read_data_plane_key(one);
    EXPECT_FALSE(r) << why;
    if (!r) {
      EXPECT_NE(r.error().find(path), std::string::npos) << r.error();
    }
  };
  ::chmod(path.c_str(), 0644);
  refused("readable by others");
  { std::ofstream(path, std::ios::trunc) << "abc\n"; }
  ::chmod(path.c_str(), 0600);
  refused("too short");
  { std::ofstream(path, std::ios::trunc) << std::string(64, 'z') << "\n"; }
  refused("not hex");
  fs::remove(path);
  fs::create_directory(path);
  refused("a directory");
  fs::remove(path);
  refused("missing");
  ASSERT_TRUE(ensure_certificates(one));  // made again (a new key)
  EXPECT_TRUE(read_data_plane_key(one));
}

TEST_F(Certs, StrangersAndWrongFilesAreRefused) {
  const auto one = make(root + "/one", "one"), two = make(root + "/two", "two");
  ASSERT_TRUE(ensure_certificates(one));
  ASSERT_TRUE(ensure_certificates(two));
  // Another cluster's certificate (and its own key): not signed by our CA.
  fs::copy_file(tls_files(two, "a").certificate, tls_files(one, "a").certificate,
                fs::copy_options::overwrite_existing);
  fs::copy_file(tls_files(two, "a").key, tls_files(one, "a").key,
                fs::copy_options::overwrite_existing);
  auto r = check_node_certificate(one, "a");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("was not signed by the cluster CA"), std::string::npos) << r.error();
  EXPECT_NE(
      openssl("verify -CAfile " + tls_files(one, "a").ca + " " + tls_files(one, "a").certificate),
      0);
  // Node b's certificate presented as node c's.
  fs::copy_file(tls_files(one, "b").certificate, tls_files(one, "c").certificate,
                fs::copy_options::overwrite_existing);
  fs::copy_file(tls_files(one, "b").key, tls_files(one, "c").key,
                fs::copy_options::overwrite_existing);
  r = check_node_certificate(one, "c");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("names 'b', not node 'c'"), std::string::npos) << r.error();
  // A key that is not the certificate's.
  fs::copy_file(tls_files(two, "b").key, tls_files(one, "b").key,
                fs::copy_options::overwrite_existing);
  r = check_node_certificate(one, "b");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("does not match"), std::string::npos) << r.error();
  // Garbage where a certificate should be.
  {
    std::ofstream f(tls_files(two, "b").certificate);
    f << "-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n";
  }
  r = check_node_certificate(two, "b");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("is not a PEM certificate"), std::string::npos) << r.error();
  // Missing files and unknown nodes.
  fs::remove(tls_files(two, "c").key);
  r = check_node_certificate(two, "c");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("missing " + tls_files(two, "c").key), std::string::npos) << r.error();
  EXPECT_NE(r.error().find("troupe certs"), std::string::npos) << r.error();
  r = check_node_certificate(two, "zz");
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("'zz' is not a node"), std::string::npos) << r.error();
  // Half a CA is not silently replaced.
  fs::remove(two.certs_dir + "/ca.key");
  auto e = ensure_certificates(two);
  ASSERT_FALSE(e);
  EXPECT_NE(e.error().find("incomplete"), std::string::npos) << e.error();
}

TEST_F(Certs, AnIdentityProofHoldsOnlyForTheKeyHolderAndTheChallenge) {
  const auto one = make(root + "/one", "one"), two = make(root + "/two", "two");
  ASSERT_TRUE(ensure_certificates(one));
  ASSERT_TRUE(ensure_certificates(two));
  const auto ca = tls_files(one, "a").ca;
  const auto challenge = make_challenge();
  ASSERT_EQ(challenge.size(), 32u);
  EXPECT_NE(make_challenge(), challenge);
  auto p = prove_identity(tls_files(one, "b"), challenge);
  ASSERT_TRUE(p) << p.error();
  EXPECT_TRUE(verify_identity(ca, "b", challenge, *p));
  // Claiming another node's name with b's certificate.
  auto r = verify_identity(ca, "a", challenge, *p);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("the certificate names 'b'"), std::string::npos) << r.error();
  // Replaying the proof for another challenge.
  r = verify_identity(ca, "b", make_challenge(), *p);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("signature does not match"), std::string::npos) << r.error();
  // a's certificate with a signature made by b's key.
  auto pa = prove_identity(tls_files(one, "a"), challenge);
  ASSERT_TRUE(pa);
  identity_proof forged{pa->certificate_pem, p->signature};
  r = verify_identity(ca, "a", challenge, forged);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("signature does not match"), std::string::npos) << r.error();
  // Another cluster's node.
  auto stranger = prove_identity(tls_files(two, "b"), challenge);
  ASSERT_TRUE(stranger);
  r = verify_identity(ca, "b", challenge, *stranger);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("not signed by the cluster CA"), std::string::npos) << r.error();
  // Garbage and oversized input from the network.
  r = verify_identity(ca, "b", challenge,
                      identity_proof{"-----BEGIN CERTIFICATE-----\nzz\n", p->signature});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("not a PEM certificate"), std::string::npos) << r.error();
  r = verify_identity(ca, "b", challenge, identity_proof{std::string(20000, 'x'), p->signature});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("a certificate of 20000 bytes"), std::string::npos) << r.error();
  r = verify_identity(ca, "b", challenge, identity_proof{p->certificate_pem, {}});
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().find("a signature of 0 bytes"), std::string::npos) << r.error();
  auto flipped = *p;
  flipped.signature[flipped.signature.size() / 2] ^= 0x40;
  EXPECT_FALSE(verify_identity(ca, "b", challenge, flipped));
}

}  // namespace
}  // namespace troupe::cluster
