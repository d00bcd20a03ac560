#pragma once

// The cluster's certificates: a CA of its own and one certificate per node,
// made by troupe (OpenSSL) in the manifest's certificate directory. Every
// control-plane connection is mutual TLS against that CA (caf_openssl), so
// a process without a certificate signed by it cannot connect. The
// certificate's subject CN is the node name; since CAF accepts any
// certificate of the CA, the node's gatekeeper ties the name to it.
//
// Layout of the directory:
//   ca.pem, ca.key          the cluster CA (key 0600)
//   NODE.pem, NODE.key      each node's certificate and key (key 0600)
//   dataplane.key           32 random bytes (hex, 0600): the data plane's
//                           gate key (transport/ucx_gate.hpp); every node
//                           needs it, clients do not
// Files are written to a temporary name and renamed: caf_openssl re-reads
// them per connection, and a half-written file would abort it.

#include <array>
#include <cstdint>
#include <expected>
#include <span>
#include <string>
#include <vector>

#include "cluster/manifest.hpp"

namespace troupe::cluster {

/// The identity of clients (`troupe submit`, `status`, `down`, `up`): one
/// more certificate of the cluster CA, with CN "client". The head's
/// gatekeeper gives its holder the door for jobs, never a node's agent.
inline constexpr const char* client_identity = "client";

struct node_tls_files {
  std::string certificate;  ///< NODE.pem
  std::string key;          ///< NODE.key
  std::string ca;           ///< ca.pem
};

/// The files node `node` uses (they may not exist yet).
node_tls_files tls_files(const manifest& m, const std::string& node);

/// Creates what is missing: the CA (once; an existing CA is kept), a
/// certificate for every node of the manifest that has none, valid for
/// `days`, the client certificate and the data-plane key. Returns the files
/// it wrote.
std::expected<std::vector<std::string>, std::string> ensure_certificates(const manifest& m,
                                                                         int days = 825);

/// Checks that node `node` can run mutual TLS: its certificate, key and the
/// CA exist, the key matches the certificate, the certificate was signed by
/// the CA, is valid now and names the node (CN). A node refuses to start
/// otherwise (caf_openssl would silently fall back to anonymous TLS).
/// `node` may also be client_identity.
std::expected<node_tls_files, std::string> check_node_certificate(const manifest& m,
                                                                  const std::string& node);

/// A node's proof, for a gatekeeper, that it holds the key of its
/// certificate: the certificate (PEM) and its signature over the
/// gatekeeper's challenge. CAF's TLS accepts any certificate of the CA and
/// tells actors nothing about it; this ties a connection to a node name.
struct identity_proof {
  std::string certificate_pem;
  std::vector<std::uint8_t> signature;
};

/// A fresh random challenge (32 bytes).
std::vector<std::uint8_t> make_challenge();

/// Signs `challenge` (SHA-256, the node's key) and attaches the certificate.
std::expected<identity_proof, std::string> prove_identity(const node_tls_files& files,
                                                          std::span<const std::uint8_t> challenge);

/// Checks a proof received from the network: sizes bounded, the
/// certificate signed by the CA in `ca_path`, valid now, naming `node`, and
/// the signature over `challenge` made by its key.
std::expected<void, std::string> verify_identity(const std::string& ca_path,
                                                 const std::string& node,
                                                 std::span<const std::uint8_t> challenge,
                                                 const identity_proof& proof);

/// The data-plane key file of the cluster (it may not exist yet).
std::string data_plane_key_file(const manifest& m);

/// Reads the data-plane key: a regular file of at most 1 KiB holding 64 hex
/// digits, readable by its owner only. A node refuses to start without it.
std::expected<std::array<std::uint8_t, 32>, std::string> read_data_plane_key(const manifest& m);

/// The subject CN of a PEM certificate file.
std::expected<std::string, std::string> certificate_common_name(const std::string& pem_path);

}  // namespace troupe::cluster
