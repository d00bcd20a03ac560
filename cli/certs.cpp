// troupe certs MANIFEST: makes the cluster's CA (once) and a certificate
// for every node that has none, in the manifest's certificate directory;
// `--check NODE` checks one node's files as a node does before it starts.
#include <spdlog/spdlog.h>

#include <cstdio>

#include "cli/cluster_setup.hpp"
#include "cli/commands.hpp"
#include "cluster/certs.hpp"
#include "cluster/manifest.hpp"

namespace troupe::cli {

namespace {

struct certs_args {
  std::string manifest;
  std::string check;
  int days = 825;
};

int run_certs(const certs_args& a) {
  auto m = load_manifest_or_report(a.manifest);
  if (!m) return 2;
  if (!a.check.empty()) {
    auto ok = cluster::check_node_certificate(*m, a.check);
    if (!ok) {
      spdlog::error("certs: {}", ok.error());
      return 1;
    }
    std::printf("node %s: %s signed by %s, key %s: ok\n", a.check.c_str(), ok->certificate.c_str(),
                ok->ca.c_str(), ok->key.c_str());
    return 0;
  }
  auto wrote = cluster::ensure_certificates(*m, a.days);
  if (!wrote) {
    spdlog::error("certs: {}", wrote.error());
    return 1;
  }
  if (wrote->empty())
    std::printf("certificates of cluster %s: all present in %s\n", m->name.c_str(),
                m->certs_dir.c_str());
  for (const auto& f : *wrote) std::printf("wrote %s\n", f.c_str());
  return 0;
}

}  // namespace

command_runner add_certs(CLI::App& app) {
  auto a = std::make_shared<certs_args>();
  auto* cmd = app.add_subcommand(
      "certs", "Make the cluster CA and the node certificates a manifest needs (mutual TLS)");
  cmd->add_option("manifest", a->manifest, "The cluster's manifest (TOML, see docs/manifest.md)")
      ->required();
  cmd->add_option("--check", a->check, "Only check node NODE's certificate, key and CA");
  cmd->add_option("--days", a->days, "Validity of new node certificates, days")
      ->check(CLI::Range(1, 3650));
  return [a] { return run_certs(*a); };
}

}  // namespace troupe::cli
