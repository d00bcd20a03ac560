#include "cluster/certs.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>

namespace troupe::cluster {

namespace {

namespace fs = std::filesystem;

struct pkey_free {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
struct x509_free {
  void operator()(X509* p) const { X509_free(p); }
};
struct bio_free {
  void operator()(BIO* p) const { BIO_free_all(p); }
};
using pkey_ptr = std::unique_ptr<EVP_PKEY, pkey_free>;
using x509_ptr = std::unique_ptr<X509, x509_free>;
using bio_ptr = std::unique_ptr<BIO, bio_free>;

std::string ssl_error(const std::string& what) {
  std::string s = what;
  char buf[256];
  bool first = true;
  while (const unsigned long e = ERR_get_error()) {
    ERR_error_string_n(e, buf, sizeof buf);
    s += first ? ": " : "; ";
    s += buf;
    first = false;
  }
  return s;
}

std::expected<pkey_ptr, std::string> new_key() {
  pkey_ptr k(EVP_EC_gen("P-256"));
  if (!k) return std::unexpected(ssl_error("generating a P-256 key"));
  return k;
}

bool add_ext(X509* cert, X509* issuer, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  if (!ext) return false;
  const bool ok = X509_add_ext(cert, ext, -1) == 1;
  X509_EXTENSION_free(ext);
  return ok;
}

// A certificate for `key` named `cn`, signed by `issuer_key` (itself when
// `issuer` is null: the CA).
std::expected<x509_ptr, std::string> make_certificate(EVP_PKEY* key, const std::string& cn,
                                                      X509* issuer, EVP_PKEY* issuer_key, int days,
                                                      const std::string& host) {
  x509_ptr cert(X509_new());
  if (!cert) return std::unexpected(ssl_error("X509_new"));
  X509_set_version(cert.get(), 2);
  {
    BIGNUM* bn = BN_new();
    ASN1_INTEGER* serial = nullptr;
    if (bn && BN_rand(bn, 63, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) == 1)
      serial = BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(cert.get()));
    BN_free(bn);
    if (!serial) return std::unexpected(ssl_error("a serial number"));
  }
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(days) * 86400);
  X509_set_pubkey(cert.get(), key);
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "O", MBSTRING_UTF8,
                             reinterpret_cast<const unsigned char*>("troupe"), -1, -1, 0);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_UTF8,
                             reinterpret_cast<const unsigned char*>(cn.c_str()), -1, -1, 0);
  X509* signer = issuer ? issuer : cert.get();
  X509_set_issuer_name(cert.get(), X509_get_subject_name(signer));
  bool ok = true;
  if (!issuer) {
    ok = add_ext(cert.get(), signer, NID_basic_constraints, "critical,CA:TRUE,pathlen:0") &&
         add_ext(cert.get(), signer, NID_key_usage, "critical,keyCertSign,cRLSign") &&
         add_ext(cert.get(), signer, NID_subject_key_identifier, "hash");
  } else {
    unsigned char addr[16];
    const bool ip =
        inet_pton(AF_INET, host.c_str(), addr) == 1 || inet_pton(AF_INET6, host.c_str(), addr) == 1;
    const std::string san = (ip ? "IP:" : "DNS:") + host;
    ok = add_ext(cert.get(), signer, NID_basic_constraints, "critical,CA:FALSE") &&
         add_ext(cert.get(), signer, NID_key_usage, "critical,digitalSignature,keyAgreement") &&
         add_ext(cert.get(), signer, NID_ext_key_usage, "serverAuth,clientAuth") &&
         (host.empty() || add_ext(cert.get(), signer, NID_subject_alt_name, san.c_str()));
  }
  if (!ok) return std::unexpected(ssl_error("certificate extensions for " + cn));
  if (X509_sign(cert.get(), issuer_key, EVP_sha256()) <= 0)
    return std::unexpected(ssl_error("signing the certificate of " + cn));
  return cert;
}

// Writes through a temporary file and a rename (mode 0600 for keys).
std::expected<void, std::string> write_pem(const fs::path& path, bool secret,
                                           const std::function<bool(BIO*)>& write) {
  const fs::path tmp = path.string() + ".tmp" + std::to_string(::getpid());
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, secret ? 0600 : 0644);
  if (fd < 0) return std::unexpected("cannot write " + tmp.string());
  bio_ptr bio(BIO_new_fd(fd, BIO_CLOSE));
  if (!bio || !write(bio.get()) || BIO_flush(bio.get()) != 1) {
    bio.reset();
    std::error_code ec;
    fs::remove(tmp, ec);
    return std::unexpected(ssl_error("writing " + path.string()));
  }
  bio.reset();
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec)
    return std::unexpected("cannot rename " + tmp.string() + " to " + path.string() + ": " +
                           ec.message());
  return {};
}

std::expected<x509_ptr, std::string> read_cert(const std::string& path) {
  bio_ptr bio(BIO_new_file(path.c_str(), "r"));
  if (!bio) return std::unexpected("cannot read " + path);
  x509_ptr c(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (!c) return std::unexpected(ssl_error(path + " is not a PEM certificate"));
  return c;
}

std::expected<pkey_ptr, std::string> read_key(const std::string& path) {
  bio_ptr bio(BIO_new_file(path.c_str(), "r"));
  if (!bio) return std::unexpected("cannot read " + path);
  pkey_ptr k(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, const_cast<char*>("")));
  if (!k) return std::unexpected(ssl_error(path + " is not an unencrypted PEM private key"));
  return k;
}

std::string cn_of(X509* c) {
  char buf[256] = {};
  const int n =
      X509_NAME_get_text_by_NID(X509_get_subject_name(c), NID_commonName, buf, sizeof buf);
  return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
}

}  // namespace

node_tls_files tls_files(const manifest& m, const std::string& node) {
  const fs::path d = m.certs_dir;
  return {(d / (node + ".pem")).string(), (d / (node + ".key")).string(), (d / "ca.pem").string()};
}

std::expected<std::vector<std::string>, std::string> ensure_certificates(const manifest& m,
                                                                         int days) {
  ERR_clear_error();
  std::vector<std::string> wrote;
  const fs::path dir = m.certs_dir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return std::unexpected("cannot create " + dir.string() + ": " + ec.message());
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace, ec);
  const std::string ca_pem = (dir / "ca.pem").string(), ca_key_path = (dir / "ca.key").string();
  x509_ptr ca;
  pkey_ptr ca_key;
  const bool have_pem = fs::exists(ca_pem), have_key = fs::exists(ca_key_path);
  if (have_pem != have_key)
    return std::unexpected(
        "the cluster CA in " + dir.string() +
        " is incomplete (one of ca.pem and ca.key is missing); " +
        "remove the other to make a new CA (every node certificate must then be made again)");
  if (have_pem) {
    auto c = read_cert(ca_pem);
    if (!c) return std::unexpected(c.error());
    auto k = read_key(ca_key_path);
    if (!k) return std::unexpected(k.error());
    if (X509_check_private_key(c->get(), k->get()) != 1)
      return std::unexpected(ssl_error(ca_key_path + " does not match " + ca_pem));
    ca = std::move(*c);
    ca_key = std::move(*k);
  } else {
    auto k = new_key();
    if (!k) return std::unexpected(k.error());
    auto c = make_certificate(k->get(), "troupe cluster CA " + m.name, nullptr, k->get(), 3650, "");
    if (!c) return std::unexpected(c.error());
    if (auto w = write_pem(ca_key_path, true,
                           [&](BIO* b) {
                             return PEM_write_bio_PrivateKey(b, k->get(), nullptr, nullptr, 0,
                                                             nullptr, nullptr) == 1;
                           });
        !w)
      return std::unexpected(w.error());
    if (auto w =
            write_pem(ca_pem, false, [&](BIO* b) { return PEM_write_bio_X509(b, c->get()) == 1; });
        !w)
      return std::unexpected(w.error());
    wrote.push_back(ca_pem);
    ca = std::move(*c);
    ca_key = std::move(*k);
  }
  std::vector<std::pair<std::string, std::string>> identities;  // name, host
  for (const auto& n : m.nodes) identities.emplace_back(n.name, n.host);
  identities.emplace_back(client_identity, "");
  for (const auto& [name, host] : identities) {
    const auto f = tls_files(m, name);
    if (fs::exists(f.certificate) && fs::exists(f.key)) continue;
    auto k = new_key();
    if (!k) return std::unexpected(k.error());
    auto c = make_certificate(k->get(), name, ca.get(), ca_key.get(), days, host);
    if (!c) return std::unexpected(c.error());
    if (auto w = write_pem(f.key, true,
                           [&](BIO* b) {
                             return PEM_write_bio_PrivateKey(b, k->get(), nullptr, nullptr, 0,
                                                             nullptr, nullptr) == 1;
                           });
        !w)
      return std::unexpected(w.error());
    if (auto w = write_pem(f.certificate, false,
                           [&](BIO* b) { return PEM_write_bio_X509(b, c->get()) == 1; });
        !w)
      return std::unexpected(w.error());
    wrote.push_back(f.certificate);
  }
  if (const auto key_path = data_plane_key_file(m); !fs::exists(key_path)) {
    std::array<std::uint8_t, 32> key{};
    if (RAND_bytes(key.data(), static_cast<int>(key.size())) != 1)
      return std::unexpected(ssl_error("no randomness for the data-plane key"));
    static const char* digits = "0123456789abcdef";
    std::string text;
    for (auto b : key) {
      text += digits[b >> 4];
      text += digits[b & 15];
    }
    text += '\n';
    if (auto w = write_pem(key_path, true,
                           [&](BIO* b) {
                             return BIO_write(b, text.data(), static_cast<int>(text.size())) ==
                                    static_cast<int>(text.size());
                           });
        !w)
      return std::unexpected(w.error());
    wrote.push_back(key_path);
  }
  return wrote;
}

std::string data_plane_key_file(const manifest& m) {
  return (fs::path(m.certs_dir) / "dataplane.key").string();
}

std::expected<std::array<std::uint8_t, 32>, std::string> read_data_plane_key(const manifest& m) {
  const std::string path = data_plane_key_file(m);
  const std::string remedy = " (make it with `troupe certs " + m.path + "`)";
  std::error_code ec;
  const auto st = fs::status(path, ec);
  if (ec || !fs::exists(st)) return std::unexpected("missing " + path + remedy);
  if (!fs::is_regular_file(st)) return std::unexpected(path + " is not a regular file");
  if ((st.permissions() & (fs::perms::group_all | fs::perms::others_all)) != fs::perms::none)
    return std::unexpected(path + " is readable by others than its owner (chmod 600 it)");
  if (fs::file_size(path, ec) > 1024 || ec)
    return std::unexpected(path + " is not a data-plane key (too large)");
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::unexpected("cannot read " + path);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const auto b = text.find_first_not_of(" \t\r\n");
  const auto e = text.find_last_not_of(" \t\r\n");
  std::array<std::uint8_t, 32> key{};
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (b == std::string::npos || e - b + 1 != 2 * key.size())
    return std::unexpected(path + " is not a data-plane key (64 hex digits)");
  for (std::size_t i = 0; i < key.size(); ++i) {
    const int hi = nib(text[b + 2 * i]), lo = nib(text[b + 2 * i + 1]);
    if (hi < 0 || lo < 0) return std::unexpected(path + " is not a data-plane key (64 hex digits)");
    key[i] = static_cast<std::uint8_t>(hi * 16 + lo);
  }
  return key;
}

std::expected<node_tls_files, std::string> check_node_certificate(const manifest& m,
                                                                  const std::string& node) {
  ERR_clear_error();
  if (!m.node(node) && node != client_identity)
    return std::unexpected("'" + node + "' is not a node of " + m.path);
  const auto f = tls_files(m, node);
  for (const auto& p : {f.ca, f.certificate, f.key})
    if (!fs::exists(p))
      return std::unexpected("missing " + p +
                             " (mutual TLS needs the CA, the node's certificate and its key; " +
                             "make them with `troupe certs " + m.path + "`)");
  auto ca = read_cert(f.ca);
  if (!ca) return std::unexpected(ca.error());
  auto cert = read_cert(f.certificate);
  if (!cert) return std::unexpected(cert.error());
  auto key = read_key(f.key);
  if (!key) return std::unexpected(key.error());
  if (X509_check_private_key(cert->get(), key->get()) != 1)
    return std::unexpected(ssl_error(f.key + " does not match " + f.certificate));
  EVP_PKEY* ca_pub = X509_get0_pubkey(ca->get());
  if (!ca_pub || X509_verify(cert->get(), ca_pub) != 1)
    return std::unexpected(f.certificate + " was not signed by the cluster CA " + f.ca);
  if (X509_cmp_current_time(X509_get0_notBefore(cert->get())) >= 0)
    return std::unexpected(f.certificate + " is not valid yet");
  if (X509_cmp_current_time(X509_get0_notAfter(cert->get())) <= 0)
    return std::unexpected(f.certificate + " has expired");
  const auto cn = cn_of(cert->get());
  if (cn != node)
    return std::unexpected(f.certificate + " names '" + cn + "', not node '" + node + "'");
  return f;
}

std::expected<std::string, std::string> certificate_common_name(const std::string& pem_path) {
  ERR_clear_error();
  auto c = read_cert(pem_path);
  if (!c) return std::unexpected(c.error());
  return cn_of(c->get());
}

std::vector<std::uint8_t> make_challenge() {
  std::vector<std::uint8_t> c(32);
  if (RAND_bytes(c.data(), static_cast<int>(c.size())) != 1) {
    // No entropy is not a reason to accept anyone: an all-zero challenge
    // still needs a valid signature, but say so loudly.
    std::fprintf(stderr, "troupe: RAND_bytes failed; the identity challenge is weak\n");
  }
  return c;
}

std::expected<identity_proof, std::string> prove_identity(const node_tls_files& files,
                                                          std::span<const std::uint8_t> challenge) {
  ERR_clear_error();
  auto key = read_key(files.key);
  if (!key) return std::unexpected(key.error());
  identity_proof p;
  {
    std::ifstream f(files.certificate, std::ios::binary);
    if (!f) return std::unexpected("cannot read " + files.certificate);
    std::stringstream ss;
    ss << f.rdbuf();
    p.certificate_pem = ss.str();
  }
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  std::size_t len = 0;
  if (!ctx || EVP_DigestSignInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key->get()) != 1 ||
      EVP_DigestSign(ctx.get(), nullptr, &len, challenge.data(), challenge.size()) != 1)
    return std::unexpected(ssl_error("signing the challenge"));
  p.signature.resize(len);
  if (EVP_DigestSign(ctx.get(), p.signature.data(), &len, challenge.data(), challenge.size()) != 1)
    return std::unexpected(ssl_error("signing the challenge"));
  p.signature.resize(len);
  return p;
}

std::expected<void, std::string> verify_identity(const std::string& ca_path,
                                                 const std::string& node,
                                                 std::span<const std::uint8_t> challenge,
                                                 const identity_proof& proof) {
  ERR_clear_error();
  if (proof.certificate_pem.empty() || proof.certificate_pem.size() > 16384)
    return std::unexpected("identity of '" + node + "': a certificate of " +
                           std::to_string(proof.certificate_pem.size()) +
                           " bytes (expected 1 to 16384)");
  if (proof.signature.empty() || proof.signature.size() > 1024)
    return std::unexpected("identity of '" + node + "': a signature of " +
                           std::to_string(proof.signature.size()) + " bytes (expected 1 to 1024)");
  auto ca = read_cert(ca_path);
  if (!ca) return std::unexpected(ca.error());
  bio_ptr bio(BIO_new_mem_buf(proof.certificate_pem.data(),
                              static_cast<int>(proof.certificate_pem.size())));
  x509_ptr cert(bio ? PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr) : nullptr);
  if (!cert) return std::unexpected(ssl_error("identity of '" + node + "': not a PEM certificate"));
  EVP_PKEY* ca_pub = X509_get0_pubkey(ca->get());
  if (!ca_pub || X509_verify(cert.get(), ca_pub) != 1)
    return std::unexpected("identity of '" + node +
                           "': the certificate was not signed by the cluster CA");
  if (X509_cmp_current_time(X509_get0_notBefore(cert.get())) >= 0 ||
      X509_cmp_current_time(X509_get0_notAfter(cert.get())) <= 0)
    return std::unexpected("identity of '" + node + "': the certificate is not valid now");
  const auto cn = cn_of(cert.get());
  if (cn != node)
    return std::unexpected("identity of '" + node + "': the certificate names '" + cn + "'");
  EVP_PKEY* pub = X509_get0_pubkey(cert.get());
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  if (!pub || !ctx || EVP_DigestVerifyInit(ctx.get(), nullptr, EVP_sha256(), nullptr, pub) != 1 ||
      EVP_DigestVerify(ctx.get(), proof.signature.data(), proof.signature.size(), challenge.data(),
                       challenge.size()) != 1) {
    ERR_clear_error();
    return std::unexpected("identity of '" + node +
                           "': the signature does not match the challenge and certificate");
  }
  return {};
}

}  // namespace troupe::cluster
