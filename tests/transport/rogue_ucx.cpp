// troupe_rogue_ucx: a stranger on the data plane, for the tests of
// transport/ucx_gate.hpp. It speaks plain UCP (no troupe code, no key) to
// a process's UCX TCP listener the way an attacker on the host can: it
// takes its own worker address, puts the victim's port where its own TCP
// port is, connects to that and sends tagged messages (eager and
// rendezvous, endpoint error handling off: the UCX 1.13 wire protocol then
// carries raw pointers the receiver dereferences).
//
//   troupe_rogue_ucx PORT [MESSAGES [BYTES [NET_DEVICE]]]   (NET_DEVICE: lo)
//
// Prints "rogue: ..." lines; exits 0 once it has tried (whether or not the
// victim took the messages), 2 on bad arguments, 3 when UCX fails here.
#include <ucp/api/ucp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/transport/listening_ports.hpp"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: troupe_rogue_ucx PORT [MESSAGES [BYTES [NET_DEVICE]]]\n");
    return 2;
  }
  const unsigned target = static_cast<unsigned>(std::atoi(argv[1]));
  const int messages = argc > 2 ? std::atoi(argv[2]) : 10;
  const std::size_t bytes = argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 65536;
  if (target == 0 || target > 65535 || messages <= 0 || bytes == 0 || bytes > (64u << 20)) {
    std::fprintf(stderr, "rogue: bad arguments\n");
    return 2;
  }
  ucp_config_t* cfg = nullptr;
  if (ucp_config_read(nullptr, nullptr, &cfg) != UCS_OK) return 3;
  ucp_config_modify(cfg, "TLS", "tcp");
  ucp_config_modify(cfg, "NET_DEVICES", argc > 4 ? argv[4] : "lo");
  ucp_params_t p{};
  p.field_mask = UCP_PARAM_FIELD_FEATURES;
  p.features = UCP_FEATURE_TAG;
  ucp_context_h ctx = nullptr;
  const ucs_status_t st = ucp_init(&p, cfg, &ctx);
  ucp_config_release(cfg);
  if (st != UCS_OK) return 3;
  ucp_worker_params_t wp{};
  ucp_worker_h w = nullptr;
  if (ucp_worker_create(ctx, &wp, &w) != UCS_OK) return 3;
  ucp_address_t* a = nullptr;
  std::size_t len = 0;
  if (ucp_worker_get_address(w, &a, &len) != UCS_OK) return 3;
  // Our own TCP ports, as the packed address carries them (big endian).
  const auto own = troupe::test::listening_ports(0);
  auto* b = reinterpret_cast<unsigned char*>(a);
  int hits = 0;
  for (unsigned port : own) {
    for (std::size_t i = 0; i + 1 < len; ++i) {
      if (b[i] == (port >> 8) && b[i + 1] == (port & 255)) {
        b[i] = static_cast<unsigned char>(target >> 8);
        b[i + 1] = static_cast<unsigned char>(target & 255);
        ++hits;
      }
    }
  }
  std::printf("rogue: %zu own port(s), %d patched in a %zu-byte address\n", own.size(), hits, len);
  if (hits == 0) return 3;
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  ep.address = a;
  ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  ucp_ep_h e = nullptr;
  if (ucp_ep_create(w, &ep, &e) != UCS_OK) {
    std::printf("rogue: could not connect\n");
    return 0;
  }
  std::vector<char> msg(bytes, 0x41);
  ucp_request_param_t prm{};
  int sent = 0;
  std::vector<void*> reqs;
  for (int i = 0; i < messages; ++i) {
    // The header tags of transfers 0..MESSAGES-1 (transport/chunked.hpp:
    // the first tags a receiver posts).
    const ucp_tag_t tag = (ucp_tag_t(i) << 16) | 0xffff;
    void* r = ucp_tag_send_nbx(e, msg.data(), msg.size(), tag, &prm);
    if (!UCS_PTR_IS_ERR(r)) ++sent;
    if (r && !UCS_PTR_IS_ERR(r)) reqs.push_back(r);
    for (int k = 0; k < 1000; ++k) ucp_worker_progress(w);
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < until) ucp_worker_progress(w);
  std::printf("rogue: posted %d message(s) of %zu bytes to port %u\n", sent, bytes, target);
  std::fflush(stdout);
  // Leave without cleaning up (as an attacker's process would die).
  std::_Exit(0);
}
