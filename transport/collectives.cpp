#include "transport/collectives.hpp"

#include <algorithm>
#include <vector>

namespace troupe::transport {

namespace {

constexpr std::uint64_t collective_bit = std::uint64_t{1} << 63;  // apart from chunk tags

std::uint64_t tag_of(std::uint64_t id, int phase, int step, int dst) {
  return collective_bit | (id << 24) | (static_cast<std::uint64_t>(phase) << 23) |
         (static_cast<std::uint64_t>(step) << 8) | static_cast<std::uint64_t>(dst);
}

// Segment k of `count` elements split `size` ways: [begin, end).
std::pair<std::size_t, std::size_t> segment(std::size_t count, int size, int k) {
  const std::size_t base = count / static_cast<std::size_t>(size),
                    extra = count % static_cast<std::size_t>(size);
  const auto kk = static_cast<std::size_t>(k);
  const std::size_t begin = kk * base + std::min(kk, extra);
  return {begin, begin + base + (kk < extra ? 1 : 0)};
}

result<void> wait_done(const ring& r, op_handle h) {
  auto& e = *r.engine;
  // Poll first: the partner is usually a moment away.
  const auto spin_until = std::chrono::steady_clock::now() + r.spin;
  while (std::chrono::steady_clock::now() < spin_until) {
    auto st = e.poll(h);
    if (!st) {
      e.release(h);
      return std::unexpected(st.error());
    }
    if (st->state == op_state::done) {
      e.release(h);
      return {};
    }
    if (st->state == op_state::failed) {
      e.release(h);
      return std::unexpected(st->failure);
    }
    if (r.abort && r.abort->load(std::memory_order_acquire)) break;
  }
  for (;;) {
    auto st = e.wait(h, std::chrono::milliseconds(r.abort ? 50 : 1000));
    if (!st) {
      e.release(h);
      return std::unexpected(st.error());
    }
    if (st->state == op_state::in_flight) {
      if (r.abort && r.abort->load(std::memory_order_acquire)) {
        e.release(h);  // cancels it
        return make_error(errc::io_error, "aborted: a rank of the group is gone");
      }
      continue;
    }
    e.release(h);
    if (st->state == op_state::failed) return std::unexpected(st->failure);
    return {};
  }
}

// Sends `send` to the next rank and receives into `recv` from the previous
// one, both in flight at once.
result<void> exchange(const ring& r, std::uint64_t id, int phase, int step, const float* send,
                      std::size_t send_n, float* recv, std::size_t recv_n) {
  auto& e = *r.engine;
  op_spec rs;
  rs.kind = op_kind::recv;
  rs.tag = tag_of(id, phase, step, r.rank);
  rs.local = recv;
  rs.bytes = recv_n * sizeof(float);
  rs.timeout = r.timeout;
  op_spec ss;
  ss.kind = op_kind::send;
  ss.peer = r.next;
  ss.tag = tag_of(id, phase, step, (r.rank + 1) % r.size);
  ss.local = const_cast<float*>(send);
  ss.bytes = send_n * sizeof(float);
  ss.timeout = r.timeout;
  auto rh = e.prepare(rs);
  if (!rh) return std::unexpected(rh.error());
  if (auto p = e.post(*rh); !p) {
    e.release(*rh);
    return p;
  }
  auto sh = e.prepare(ss);
  if (!sh) {
    e.release(*rh);
    return std::unexpected(sh.error());
  }
  if (auto p = e.post(*sh); !p) {
    e.release(*rh);
    e.release(*sh);
    return p;
  }
  auto a = wait_done(r, *sh);
  auto b = wait_done(r, *rh);
  if (!a) return a;
  return b;
}

}  // namespace

result<void> ring_allreduce_sum(const ring& r, float* data, std::size_t count,
                                std::uint64_t collective_id) {
  if (!r.engine || r.size < 1 || r.size > 256 || r.rank < 0 || r.rank >= r.size) {
    return make_error(errc::invalid_argument, "all-reduce: bad ring (rank " +
                                                  std::to_string(r.rank) + " of " +
                                                  std::to_string(r.size) + ", at most 256 ranks)");
  }
  if (collective_id >= (std::uint64_t{1} << 38))
    return make_error(errc::invalid_argument, "all-reduce: collective id too large");
  if (count > 0 && !data) return make_error(errc::invalid_argument, "all-reduce: no data");
  if (r.size == 1 || count == 0) return {};
  using sclock = std::chrono::steady_clock;
  auto ns = [](sclock::time_point a, sclock::time_point b) {
    return static_cast<std::uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(b - a).count());
  };
  const auto t_call = sclock::now();
  std::uint64_t exchanged = 0, fastest = ~std::uint64_t{0}, reduce = 0;
  std::uint64_t exchanges = 0;
  // Times one exchange.
  auto timed = [&](auto&& fn) {
    const auto t0 = sclock::now();
    auto x = fn();
    const auto d = ns(t0, sclock::now());
    ++exchanges;
    exchanged += d;
    fastest = std::min(fastest, d);
    return x;
  };
  const int n = r.size;
  auto mod = [n](int x) { return ((x % n) + n) % n; };
  std::size_t largest = 0;
  for (int k = 0; k < n; ++k) {
    auto [b, e] = segment(count, n, k);
    largest = std::max(largest, e - b);
  }
  std::vector<float> incoming(largest);
  // Reduce-scatter: after n-1 steps rank r holds the full sum of segment r+1.
  for (int s = 0; s < n - 1; ++s) {
    auto [sb, se] = segment(count, n, mod(r.rank - s));
    auto [rb, re] = segment(count, n, mod(r.rank - s - 1));
    auto x = timed([&] {
      return exchange(r, collective_id, 0, s, data + sb, se - sb, incoming.data(), re - rb);
    });
    if (!x) {
      return make_error(x.error().code, "all-reduce " + std::to_string(collective_id) + ", rank " +
                                            std::to_string(r.rank) + ", reduce-scatter step " +
                                            std::to_string(s) + ": " + x.error().message);
    }
    const auto t0 = sclock::now();
    for (std::size_t i = 0; i < re - rb; ++i) data[rb + i] += incoming[i];
    reduce += ns(t0, sclock::now());
  }
  // All-gather: pass the finished segments around.
  for (int s = 0; s < n - 1; ++s) {
    auto [sb, se] = segment(count, n, mod(r.rank + 1 - s));
    auto [rb, re] = segment(count, n, mod(r.rank - s));
    auto x = timed(
        [&] { return exchange(r, collective_id, 1, s, data + sb, se - sb, data + rb, re - rb); });
    if (!x) {
      return make_error(x.error().code, "all-reduce " + std::to_string(collective_id) + ", rank " +
                                            std::to_string(r.rank) + ", all-gather step " +
                                            std::to_string(s) + ": " + x.error().message);
    }
  }
  if (r.stats) {
    auto& st = *r.stats;
    st.calls.fetch_add(1, std::memory_order_relaxed);
    st.bytes.fetch_add(count * sizeof(float), std::memory_order_relaxed);
    st.total_ns.fetch_add(ns(t_call, sclock::now()), std::memory_order_relaxed);
    st.exchanges.fetch_add(exchanges, std::memory_order_relaxed);
    st.exchange_ns.fetch_add(exchanged, std::memory_order_relaxed);
    st.paced_ns.fetch_add(exchanges * fastest, std::memory_order_relaxed);
    st.reduce_ns.fetch_add(reduce, std::memory_order_relaxed);
  }
  return {};
}

allreduce_breakdown breakdown_of(const allreduce_totals& t) {
  allreduce_breakdown b;
  if (t.calls == 0) return b;
  const double calls = static_cast<double>(t.calls);
  b.calls = calls;
  b.total_us = static_cast<double>(t.total_ns) / calls / 1e3;
  b.reduce_us = static_cast<double>(t.reduce_ns) / calls / 1e3;
  b.kib = static_cast<double>(t.bytes) / calls / 1024.0;
  b.transfer_us = static_cast<double>(t.paced_ns) / calls / 1e3;
  b.waiting_us =
      static_cast<double>(t.exchange_ns - std::min(t.exchange_ns, t.paced_ns)) / calls / 1e3;
  return b;
}

}  // namespace troupe::transport
