// Cluster nodes over mutual TLS through the real binary: a node publishes
// only its gatekeeper; another node of the cluster (its certificate signed
// by the cluster CA, its key proving its name) is let in; a node of another
// cluster (another CA), a node without its key and a plain CAF connection
// are refused, and the node keeps serving.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "../temp_path.hpp"
#include "run_cli.hpp"
#include "tests/multiproc.hpp"

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using troupe::test::child_process;
using troupe::test::troupe_cli;

// A 3-node loopback manifest in `dir` with free ports; its certificates made.
std::string make_cluster(const std::string& dir, const std::vector<int>& ports) {
  fs::create_directories(dir);
  std::string text = "[cluster]\nname = \"t\"\nhead = \"n0\"\ncerts = \"certs\"\n";
  for (int i = 0; i < 3; ++i)
    text += "[[nodes]]\nname = \"n" + std::to_string(i) +
            "\"\nhost = \"127.0.0.1\"\nport = " + std::to_string(ports[i]) +
            "\ndevices = [{ type = \"cpu\" }]\n";
  const std::string path = dir + "/cluster.toml";
  std::ofstream(path) << text;
  const auto r = troupe_cli("certs " + path);
  EXPECT_EQ(r.exit_code, 0) << r.out;
  return path;
}

}  // namespace

TEST(ClusterNode, LetsInItsClusterAndRefusesStrangers) {
  const std::string root =
      fs::path(troupe::test::temp_path("node-tls")).lexically_normal().string();
  fs::remove_all(root);
  const std::vector<int> ports{troupe::test::free_port(), troupe::test::free_port(),
                               troupe::test::free_port()};
  const auto ours = make_cluster(root + "/ours", ports);
  const auto theirs =
      make_cluster(root + "/theirs", ports);  // same names and addresses, another CA

  child_process n0("n0", {TROUPE_CLI, "node", "--manifest", ours, "--name", "n0"});
  auto ready = n0.expect("troupe node n0:", 30000ms);
  ASSERT_TRUE(ready) << "node n0 did not start";
  EXPECT_NE(ready->find("listening on 127.0.0.1:" + std::to_string(ports[0]) + " (mutual TLS)"),
            std::string::npos)
      << *ready;

  auto r = troupe_cli("node --manifest " + ours + " --name n1 --ping n0");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("node n1: joined node n0 of cluster t"), std::string::npos) << r.out;

  // Another cluster's node: refused during the TLS handshake.
  r = troupe_cli("node --manifest " + theirs + " --name n1 --ping n0");
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("node n0 at 127.0.0.1:" + std::to_string(ports[0])), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("joined"), std::string::npos) << r.out;

  // A plain (not TLS) CAF connection gets nothing.
  r = troupe_cli("run -p hi --remote-stage 127.0.0.1:" + std::to_string(ports[0]));
  EXPECT_NE(r.exit_code, 0) << r.out;

  // A node without its key does not start (no silent anonymous TLS).
  fs::remove(root + "/ours/certs/n2.key");
  r = troupe_cli("node --manifest " + ours + " --name n2");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("refusing to start: missing " + root + "/ours/certs/n2.key"),
            std::string::npos)
      << r.out;
  // Nor one without the data-plane key, or with one others can read.
  ASSERT_EQ(troupe_cli("certs " + ours).exit_code, 0);  // n2's key again
  fs::permissions(root + "/ours/certs/dataplane.key", fs::perms::others_read,
                  fs::perm_options::add);
  r = troupe_cli("node --manifest " + ours + " --name n2");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("dataplane.key is readable by others"), std::string::npos) << r.out;
  fs::remove(root + "/ours/certs/dataplane.key");
  r = troupe_cli("node --manifest " + ours + " --name n2");
  EXPECT_EQ(r.exit_code, 1) << r.out;
  EXPECT_NE(r.out.find("refusing to start: missing " + root + "/ours/certs/dataplane.key"),
            std::string::npos)
      << r.out;
  // Nor does a name the manifest does not know.
  r = troupe_cli("node --manifest " + ours + " --name n9");
  EXPECT_EQ(r.exit_code, 2) << r.out;

  // n0 kept serving through all of it.
  r = troupe_cli("node --manifest " + ours + " --name n1 --ping n0");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  n0.kill();
  fs::remove_all(root);
}
