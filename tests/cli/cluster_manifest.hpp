// A 3-node test manifest for the cluster tests (tests/cli/*cluster*,
// serve): free ports on loopback, fixed ones on other hosts.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../temp_path.hpp"
#include "tests/multiproc.hpp"

namespace troupe::test {

struct cluster_setup {
  std::string dir, manifest;
  std::vector<std::string> hosts;
  std::vector<int> ports;
};

// A 3-node manifest: n0 (the head) on core 0, n1 on core 1, n2 on every
// core; three pipeline stages.
inline cluster_setup make_manifest(const std::string& name, std::vector<std::string> hosts,
                                   const std::string& extra = "") {
  cluster_setup c;
  c.dir = std::filesystem::path(temp_path("cluster-" + name)).lexically_normal().string();
  std::filesystem::remove_all(c.dir);
  std::filesystem::create_directories(c.dir);
  c.hosts = std::move(hosts);
  // The fault, migration and placement tests decode thousands of tokens
  // per request, past the bundled model's 256 positions (out of
  // distribution there, which they do not judge): the context is lifted
  // unless `extra` sets the scheduler itself.
  const std::string context =
      extra.find("[scheduler]") == std::string::npos
          ? "[scheduler]\nmax_model_len = 65536\nallow_long_context = true\n"
          : "";
  std::string text = "[cluster]\nname = \"" + name + "\"\nhead = \"n0\"\ncerts = \"certs\"\n" +
                     extra + context + "[parallelism]\npipeline_stages = 3\n";
  const char* cores[] = {"cores = \"0-0\", ", "cores = \"1-1\", ", ""};
  for (int i = 0; i < 3; ++i) {
    const int port = c.hosts[static_cast<std::size_t>(i)] == "127.0.0.1" ? free_port() : 7400 + i;
    c.ports.push_back(port);
    text += "[[nodes]]\nname = \"n" + std::to_string(i) + "\"\nhost = \"" +
            c.hosts[static_cast<std::size_t>(i)] + "\"\nport = " + std::to_string(port) +
            "\ndevices = [{ type = \"cpu\", " + cores[i] + "memory = \"4GiB\" }]\n";
  }
  c.manifest = c.dir + "/cluster.toml";
  std::ofstream(c.manifest) << text;
  return c;
}

}  // namespace troupe::test
