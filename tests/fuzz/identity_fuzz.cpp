// libFuzzer target: the gatekeeper's check of a joining node's proof
// (cluster/certs.hpp verify_identity): a certificate (PEM, from the network)
// and a signature over the challenge, against a cluster CA made once at
// start. The input is "PEM \0 SIGNATURE"; nothing fuzzed may verify.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "cluster/certs.hpp"
#include "cluster/manifest.hpp"

namespace {

std::string ca_path;
const std::vector<std::uint8_t> challenge(32, 0x5a);

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("troupe-fuzz-identity-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string text =
      "[cluster]\nname = \"fuzz\"\nhead = \"n0\"\ncerts = \"certs\"\n"
      "[[nodes]]\nname = \"n0\"\nhost = \"127.0.0.1\"\nport = 7000\n"
      "devices = [{ type = \"cpu\" }]\n";
  std::ofstream((dir / "cluster.toml").string()) << text;
  auto m = troupe::cluster::load_manifest((dir / "cluster.toml").string());
  if (!m || !troupe::cluster::ensure_certificates(*m)) __builtin_trap();
  ca_path = troupe::cluster::tls_files(*m, "n0").ca;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* nul = static_cast<const std::uint8_t*>(std::memchr(data, 0, size));
  const std::size_t pem_len = nul ? static_cast<std::size_t>(nul - data) : size;
  troupe::cluster::identity_proof p;
  p.certificate_pem.assign(reinterpret_cast<const char*>(data), pem_len);
  if (nul) p.signature.assign(nul + 1, data + size);
  if (troupe::cluster::verify_identity(ca_path, "n0", challenge, p)) __builtin_trap();
  return 0;
}
