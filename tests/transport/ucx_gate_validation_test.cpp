// The data-plane gate's proof (transport/ucx_gate.hpp): good for one key,
// one pair of connection ends and a window of time; anything else refused.
// (The gate in front of real UCX connections: multiproc_test.cpp.)
#include "transport/ucx_gate.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <openssl/hmac.h>

#include <cstring>
#include <string>

using namespace troupe::transport;

namespace {

sockaddr_storage v4(const char* ip, unsigned port) {
  sockaddr_storage s{};
  auto& in = reinterpret_cast<sockaddr_in&>(s);
  in.sin_family = AF_INET;
  in.sin_port = htons(static_cast<std::uint16_t>(port));
  inet_pton(AF_INET, ip, &in.sin_addr);
  return s;
}

sockaddr_storage v6(const char* ip, unsigned port) {
  sockaddr_storage s{};
  auto& in6 = reinterpret_cast<sockaddr_in6&>(s);
  in6.sin6_family = AF_INET6;
  in6.sin6_port = htons(static_cast<std::uint16_t>(port));
  inet_pton(AF_INET6, ip, &in6.sin6_addr);
  return s;
}

data_plane_key key_of(std::uint8_t seed) {
  data_plane_key k{};
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = static_cast<std::uint8_t>(seed + 7 * i);
  return k;
}

constexpr std::int64_t t0 = 1796400000;

}  // namespace

TEST(UcxGate, AProofHoldsForItsKeyItsEndsAndItsTime) {
  const auto k = key_of(1);
  const auto c = v4("127.0.0.1", 40001), s = v4("127.0.0.1", 50002);
  const auto p = make_gate_proof(k, c, s, t0);
  EXPECT_EQ(check_gate_proof(k, p, c, s, t0), gate_verdict::ok);
  EXPECT_EQ(check_gate_proof(k, p, c, s, t0 + gate_proof_window_s), gate_verdict::ok);
  EXPECT_EQ(check_gate_proof(k, p, c, s, t0 - gate_proof_window_s), gate_verdict::ok);
  // The MAC is HMAC-SHA256 over the label, both ends and the time, as
  // OpenSSL computes it here independently.
  std::string msg = "troupe ucx gate v1";
  const unsigned char c_end[] = {4, 127, 0, 0, 1, 40001 >> 8, 40001 & 255};
  const unsigned char s_end[] = {4, 127, 0, 0, 1, 50002 >> 8, 50002 & 255};
  msg.append(reinterpret_cast<const char*>(c_end), sizeof c_end);
  msg.append(reinterpret_cast<const char*>(s_end), sizeof s_end);
  for (int i = 0; i < 8; ++i) msg.push_back(static_cast<char>(std::uint64_t(t0) >> (8 * i)));
  unsigned char mac[32];
  unsigned len = 0;
  ASSERT_NE(HMAC(EVP_sha256(), k.data(), 32, reinterpret_cast<const unsigned char*>(msg.data()),
                 msg.size(), mac, &len),
            nullptr);
  EXPECT_EQ(std::memcmp(p.data() + 16, mac, 32), 0);
  EXPECT_EQ(std::memcmp(p.data(), "TRPGATE1", 8), 0);
}

TEST(UcxGate, AnotherKeyAnotherConnectionOrAnotherTimeIsRefused) {
  const auto k = key_of(1);
  const auto c = v4("10.0.0.1", 40001), s = v4("10.0.0.2", 50002);
  const auto p = make_gate_proof(k, c, s, t0);
  EXPECT_EQ(check_gate_proof(key_of(2), p, c, s, t0), gate_verdict::bad_mac);
  EXPECT_EQ(check_gate_proof(k, p, v4("10.0.0.1", 40002), s, t0), gate_verdict::bad_mac);
  EXPECT_EQ(check_gate_proof(k, p, c, v4("10.0.0.3", 50002), t0), gate_verdict::bad_mac);
  EXPECT_EQ(check_gate_proof(k, p, s, c, t0), gate_verdict::bad_mac) << "ends swapped";
  EXPECT_EQ(check_gate_proof(k, p, c, s, t0 + gate_proof_window_s + 1), gate_verdict::stale);
  EXPECT_EQ(check_gate_proof(k, p, c, s, t0 - gate_proof_window_s - 1), gate_verdict::stale);
  // Every single flipped bit of the proof is caught.
  for (std::size_t i = 0; i < gate_proof_bytes; ++i) {
    for (int bit = 0; bit < 8; ++bit) {
      auto bad = p;
      bad[i] ^= static_cast<std::uint8_t>(1u << bit);
      EXPECT_NE(check_gate_proof(k, bad, c, s, t0), gate_verdict::ok) << "byte " << i;
    }
  }
}

TEST(UcxGate, WhatAStrangerSendsIsNoProof) {
  const auto k = key_of(3);
  const auto c = v6("::1", 1234), s = v6("::1", 4321);
  EXPECT_EQ(check_gate_proof(k, make_gate_proof(k, c, s, t0), c, s, t0), gate_verdict::ok);
  gate_proof zero{};
  EXPECT_EQ(check_gate_proof(k, zero, c, s, t0), gate_verdict::bad_magic);
  // UCX's own first bytes (its TCP magic number) are not a proof.
  gate_proof ucx{};
  const std::uint64_t magic = 0xCAFEBABE12345678ull;
  std::memcpy(ucx.data(), &magic, 8);
  EXPECT_EQ(check_gate_proof(k, ucx, c, s, t0), gate_verdict::bad_magic);
  // Short or long input is refused whatever it holds.
  const auto good = make_gate_proof(k, c, s, t0);
  EXPECT_EQ(check_gate_proof(k, std::span(good).first(47), c, s, t0), gate_verdict::bad_magic);
  // The v4 and v6 forms of one address are different ends.
  EXPECT_NE(check_gate_proof(k, make_gate_proof(k, v4("127.0.0.1", 1234), s, t0),
                             v6("::ffff:127.0.0.1", 1234), s, t0),
            gate_verdict::ok);
  EXPECT_FALSE(ucx_gate_armed()) << "nothing armed the gate in this process";
}
