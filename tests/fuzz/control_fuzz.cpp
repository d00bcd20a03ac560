// libFuzzer target: what troupe reads from peers before it trusts them.
// - actors/control_guard.hpp: a control connection's decrypted stream, cut
//   into reads of fuzzed sizes, through the BASP framing guard (two
//   connections sharing one budget), and admission bookkeeping driven by
//   the same bytes;
// - transport/ucx_gate.hpp: the first 48 bytes of a data-plane connection
//   as a gate proof;
// - transport/framing.hpp: a peer's UCX address or region key.
// Invariants: the shared budget never exceeds its limit and returns to
// zero when the connections go; nothing fuzzed passes the gate.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>

#include "actors/control_guard.hpp"
#include "transport/framing.hpp"
#include "transport/ucx_gate.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace troupe;
  const std::span<const std::uint8_t> in(data, size);
  {
    std::atomic<std::uint64_t> budget{0};
    const std::uint64_t limit = 1u << 20;
    std::optional<actors::basp_stream_guard> a, b;
    a.emplace(&budget, 1u << 19, limit);
    b.emplace(&budget, 1u << 19, limit);
    std::size_t at = 0;
    bool turn = false;
    while (at < in.size()) {
      const std::size_t n = std::min<std::size_t>(in.size() - at, 1 + in[at] % 64);
      (void)(turn ? b : a)->feed(in.subspan(at, n));
      if (budget.load() > limit) __builtin_trap();
      at += n;
      turn = !turn;
    }
    a.reset();
    b.reset();
    if (budget.load() != 0) __builtin_trap();
  }
  {
    actors::connection_admission adm(
        {.per_address = 3, .total = 5, .handshake_deadline = std::chrono::milliseconds(10)});
    const auto t0 = actors::connection_admission::clock::now();
    for (std::size_t i = 0; i + 1 < in.size(); i += 2) {
      const int fd = in[i] % 16;
      const auto t = t0 + std::chrono::milliseconds(i);
      switch (in[i + 1] % 4) {
        case 0:
          (void)adm.accepted(fd, std::string(1, static_cast<char>('a' + in[i + 1] % 3)), t);
          break;
        case 1:
          adm.authenticated(fd);
          break;
        case 2:
          adm.closed(fd);
          break;
        default:
          (void)adm.overdue(t);
      }
      if (adm.pending() > 5) __builtin_trap();
    }
  }
  {
    transport::data_plane_key key{};
    key[0] = 1;
    sockaddr_storage c{}, s{};
    c.ss_family = AF_INET;
    s.ss_family = AF_INET6;
    if (transport::check_gate_proof(key, in.first(std::min<std::size_t>(in.size(), 48)), c, s,
                                    1796400000) == transport::gate_verdict::ok)
      __builtin_trap();
  }
  (void)transport::unframe(0x58435554, in, 64 * 1024, "fuzz address");
  return 0;
}
