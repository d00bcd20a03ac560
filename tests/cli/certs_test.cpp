// `troupe certs` through the real binary: the example manifest's CA and
// node certificates are made once, checked per node, and a malformed
// manifest is refused with line-numbered errors and exit code 2.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "../temp_path.hpp"
#include "run_cli.hpp"

namespace {

namespace fs = std::filesystem;
using troupe::test::troupe_cli;

TEST(CliCerts, MakesTheExampleClusterCertificatesOnceAndChecksThem) {
  const std::string dir =
      fs::path(troupe::test::temp_path("cli-certs")).lexically_normal().string();
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string manifest = dir + "/local.toml";
  fs::copy_file(std::string(TROUPE_FIXTURES_DIR) + "/../../examples/local.toml", manifest);
  auto r = troupe_cli("certs " + manifest);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  for (const char* f : {"ca.pem", "node0.pem", "node1.pem", "node2.pem"})
    EXPECT_NE(r.out.find("wrote " + dir + "/certs/local/" + f), std::string::npos) << r.out;
  r = troupe_cli("certs " + manifest);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("all present"), std::string::npos) << r.out;
  r = troupe_cli("certs " + manifest + " --check node2");
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("node node2: "), std::string::npos) << r.out;
  // A node whose key is gone refuses (a node checks this before it starts).
  fs::remove(dir + "/certs/local/node2.key");
  r = troupe_cli("certs " + manifest + " --check node2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("missing " + dir + "/certs/local/node2.key"), std::string::npos) << r.out;
  fs::remove_all(dir);
}

TEST(CliCerts, AMalformedManifestGivesLineNumberedErrors) {
  const std::string path = troupe::test::temp_path("bad.toml");
  {
    std::ofstream f(path);
    f << "[cluster]\nname = \"x\"\nhead = \"n\"\ncerts = \"c\"\n"
         "[[nodes]]\nname = \"n\"\nhost = \"127.0.0.1\"\nport = 99999\ndevices = [{ type = \"tpu\" "
         "}]\n";
  }
  const auto r = troupe_cli("certs " + path);
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find(path + ":8: nodes[0].port: must be in [1, 65535], got 99999"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find(path + ":9: nodes[0].devices[0].type: expected cpu, cuda or npu, got 'tpu'"),
            std::string::npos)
      << r.out;
  std::remove(path.c_str());
}

}  // namespace
