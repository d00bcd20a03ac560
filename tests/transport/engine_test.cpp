// Both engines behind transfer_engine, in one process: tagged messages,
// RMA, timeouts, chunked double-buffered tensors, leak counts. The UCX
// cases run two real ucp workers (shared memory, or TCP on loopback);
// the sides run on two threads so that each progresses its own worker.
#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <numeric>
#include <random>
#include <thread>

#include "transport/chunked.hpp"
#include "transport/framing.hpp"
#include "transport/inproc_engine.hpp"
#include "transport/ucx_engine.hpp"

namespace tr = troupe::transport;
using namespace std::chrono_literals;

namespace {

struct pair_of_engines {
  std::unique_ptr<tr::transfer_engine> a, b;
  tr::peer_id a_to_b = 0, b_to_a = 0;
};

pair_of_engines make_pair(const std::string& kind, std::chrono::milliseconds timeout = 20000ms) {
  pair_of_engines p;
  if (kind == "inproc") {
    p.a = std::make_unique<tr::inproc_engine>(timeout);
    p.b = std::make_unique<tr::inproc_engine>(timeout);
  } else {
    tr::ucx_options o;
    o.default_timeout = timeout;
    if (kind == "ucx-tcp") {
      o.tls = "tcp";
      o.net_devices = "lo";
    }
    auto a = tr::ucx_engine::create(o);
    auto b = tr::ucx_engine::create(o);
    EXPECT_TRUE(a) << a.error().message;
    EXPECT_TRUE(b) << b.error().message;
    p.a = std::move(*a);
    p.b = std::move(*b);
  }
  auto ab = p.a->connect(p.b->address());
  auto ba = p.b->connect(p.a->address());
  EXPECT_TRUE(ab) << ab.error().message;
  EXPECT_TRUE(ba) << ba.error().message;
  p.a_to_b = *ab;
  p.b_to_a = *ba;
  return p;
}

std::vector<std::uint8_t> pattern(std::size_t n, std::uint32_t seed) {
  std::vector<std::uint8_t> v(n);
  std::mt19937 rng(seed);
  for (auto& x : v) x = static_cast<std::uint8_t>(rng());
  return v;
}

tr::op_spec send_spec(tr::peer_id peer, std::uint64_t tag, void* data, std::size_t n) {
  tr::op_spec s;
  s.kind = tr::op_kind::send;
  s.peer = peer;
  s.tag = tag;
  s.local = data;
  s.bytes = n;
  return s;
}

tr::op_spec recv_spec(std::uint64_t tag, void* data, std::size_t n) {
  tr::op_spec s;
  s.kind = tr::op_kind::recv;
  s.tag = tag;
  s.local = data;
  s.bytes = n;
  return s;
}

// An owner that keeps waiting (on a receive nobody sends) until `stop`,
// so its engine's worker progresses as a computing stage's would not.
std::jthread keep_waiting(tr::transfer_engine& e, const std::atomic<bool>& stop,
                          std::chrono::milliseconds each) {
  return std::jthread([&e, &stop, each] {
    std::vector<std::uint8_t> dummy(8);
    while (!stop) {
      auto s = recv_spec(999999, dummy.data(), dummy.size());
      s.timeout = each;
      (void)tr::run_op(e, s);
    }
  });
}

class EngineTest : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(EngineTest, TaggedMessagesMatchByTagInAnyOrder) {
  auto p = make_pair(GetParam());
  const std::vector<std::size_t> sizes{0, 1, 4096, 100000, 3 << 20};
  std::vector<std::vector<std::uint8_t>> sent;
  for (std::size_t i = 0; i < sizes.size(); ++i)
    sent.push_back(pattern(sizes[i], static_cast<std::uint32_t>(i)));
  auto sender = std::async(std::launch::async, [&] {
    // Posted in reverse order of the receives below, then waited for.
    std::vector<tr::op_handle> ops;
    for (std::size_t i = sizes.size(); i-- > 0;) {
      auto h = p.a->prepare(send_spec(p.a_to_b, 1000 + i, sent[i].data(), sent[i].size()));
      if (!h) return h.error().message;
      if (auto r = p.a->post(*h); !r) return r.error().message;
      ops.push_back(*h);
    }
    std::string err;
    for (auto h : ops) {
      for (;;) {
        auto st = p.a->wait(h, 1000ms);
        if (!st) return st.error().message;
        if (st->state == tr::op_state::failed && err.empty()) err = st->failure.message;
        if (st->state != tr::op_state::in_flight) break;
      }
      p.a->release(h);
    }
    return err;
  });
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<std::uint8_t> got(sizes[i] + 16, 0xee);
    auto r = tr::run_op(*p.b, recv_spec(1000 + i, got.data(), got.size()));
    ASSERT_TRUE(r) << r.error().message;
    EXPECT_EQ(r->bytes, sizes[i]);
    got.resize(sizes[i]);
    EXPECT_EQ(got, sent[i]) << "message " << i;
  }
  EXPECT_EQ(sender.get(), "");
  EXPECT_EQ(p.a->live_ops(), 0u);
  EXPECT_EQ(p.b->live_ops(), 0u);
}

TEST_P(EngineTest, MessageLargerThanTheReceiveBufferFailsClearly) {
  auto p = make_pair(GetParam(), 3000ms);
  auto data = pattern(8192, 7);
  auto sender = std::async(std::launch::async, [&] {
    auto r = tr::run_op(*p.a, send_spec(p.a_to_b, 5, data.data(), data.size()));
    return r.has_value();
  });
  std::vector<std::uint8_t> small(100);
  auto r = tr::run_op(*p.b, recv_spec(5, small.data(), small.size()));
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("larger than the receive buffer"), std::string::npos)
      << r.error().message;
  sender.get();  // may succeed (eager) or fail; it must not hang past its timeout
  EXPECT_EQ(p.b->live_ops(), 0u);
}

TEST_P(EngineTest, ReceiveWithNoSenderTimesOutAndReleasesEverything) {
  auto p = make_pair(GetParam());
  std::vector<std::uint8_t> buf(1024);
  auto spec = recv_spec(77, buf.data(), buf.size());
  spec.timeout = 200ms;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = tr::run_op(*p.b, spec);
  const auto took = std::chrono::steady_clock::now() - t0;
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message.find("timed out after 200 ms"), std::string::npos)
      << r.error().message;
  EXPECT_GE(took, 200ms);
  EXPECT_LT(took, 5000ms);
  EXPECT_EQ(p.b->live_ops(), 0u);
}

TEST_P(EngineTest, PutAndGetReachOnlyTheExposedRegion) {
  auto p = make_pair(GetParam());
  std::vector<std::uint8_t> target(1 << 20, 0);
  tr::remote_region region;
  auto reg = p.b->expose(target.data(), target.size(), region);
  ASSERT_TRUE(reg) << reg.error().message;
  EXPECT_EQ(region.bytes, target.size());

  auto data = pattern(300000, 11);
  tr::op_spec put;
  put.kind = tr::op_kind::put;
  put.peer = p.a_to_b;
  put.local = data.data();
  put.bytes = data.size();
  put.remote = &region;
  put.remote_offset = 4096;
  // The owner's worker must progress for some transports: a thread keeps it going.
  std::atomic<bool> stop{false};
  auto owner = keep_waiting(*p.b, stop, 50ms);
  auto r = tr::run_op(*p.a, put);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(std::equal(data.begin(), data.end(), target.begin() + 4096));
  EXPECT_EQ(target[4095], 0);

  std::vector<std::uint8_t> back(1000);
  tr::op_spec get = put;
  get.kind = tr::op_kind::get;
  get.local = back.data();
  get.bytes = back.size();
  get.remote_offset = 4096 + 500;
  r = tr::run_op(*p.a, get);
  ASSERT_TRUE(r) << r.error().message;
  EXPECT_TRUE(std::equal(back.begin(), back.end(), data.begin() + 500));

  // Past the end of the region: refused before anything moves.
  put.remote_offset = target.size() - 10;
  put.bytes = 11;
  auto bad = p.a->prepare(put);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("exceeds the exposed"), std::string::npos)
      << bad.error().message;

  // A corrupted key is refused.
  tr::remote_region broken = region;
  broken.key[broken.key.size() / 2] ^= 0x40;
  put.remote = &broken;
  put.remote_offset = 0;
  bad = p.a->prepare(put);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message.find("checksum"), std::string::npos) << bad.error().message;

  stop = true;
  owner.join();
  p.b->unexpose(*reg);
  EXPECT_EQ(p.b->live_regions(), 0u);
  EXPECT_EQ(p.a->live_ops(), 0u);
}

TEST_P(EngineTest, GarbageAddressesAreRefused) {
  auto p = make_pair(GetParam());
  auto good = p.b->address();
  std::vector<std::vector<std::uint8_t>> bad{
      {}, {1, 2, 3}, std::vector<std::uint8_t>(good.begin(), good.end() - 1)};
  auto flipped = good;
  flipped[flipped.size() / 2] ^= 1;
  bad.push_back(flipped);
  bad.push_back(pattern(500, 3));
  for (const auto& b : bad) {
    auto r = p.a->connect(b);
    ASSERT_FALSE(r) << "accepted " << b.size() << " bytes";
    EXPECT_FALSE(r.error().message.empty());
  }
}

TEST_P(EngineTest, ChunkedTensorIsConsumedChunkByChunkWhileTheNextArrives) {
  auto p = make_pair(GetParam());
  tr::tensor_header h;
  h.transfer_id = 42;
  h.type = troupe::kernels::dtype::f32;
  h.shape = {640, 1000};  // 2.56 MB: 10 chunks of 256 KiB
  h.device = "cpu:0";
  std::vector<float> src(640 * 1000);
  std::iota(src.begin(), src.end(), 0.5f);
  tr::chunk_options opt;
  opt.chunk_bytes = 256 * 1024;
  opt.window = 2;

  tr::tensor_receiver recv(*p.b, h, opt);
  ASSERT_TRUE(recv.start());
  auto sender = std::async(std::launch::async, [&] {
    auto r = tr::send_tensor(*p.a, p.a_to_b, h, src.data(), opt);
    return r ? std::string() : r.error().message;
  });
  std::vector<float> dst(src.size(), -1.f);
  std::uint32_t expect_index = 0;
  auto got = recv.receive([&](const tr::chunk_view& c) -> tr::result<void> {
    EXPECT_EQ(c.index, expect_index++);
    EXPECT_EQ(c.offset, std::uint64_t{c.index} * opt.chunk_bytes);
    std::memcpy(reinterpret_cast<std::uint8_t*>(dst.data()) + c.offset, c.data, c.bytes);
    return {};
  });
  ASSERT_TRUE(got) << got.error().message;
  EXPECT_EQ(sender.get(), "");
  EXPECT_EQ(got->chunk_count, 10u);
  EXPECT_EQ(expect_index, 10u);
  EXPECT_EQ(dst, src);

  // Straight into place, another transfer id.
  h.transfer_id = 43;
  std::vector<float> dst2(src.size());
  sender = std::async(std::launch::async, [&] {
    auto r = tr::send_tensor(*p.a, p.a_to_b, h, src.data(), opt);
    return r ? std::string() : r.error().message;
  });
  auto got2 = tr::receive_tensor(*p.b, h, dst2.data(), dst2.size() * sizeof(float), opt);
  ASSERT_TRUE(got2) << got2.error().message;
  EXPECT_EQ(sender.get(), "");
  EXPECT_EQ(dst2, src);
  EXPECT_EQ(p.a->live_ops(), 0u);
  EXPECT_EQ(p.b->live_ops(), 0u);
}

TEST_P(EngineTest, ReceiverRefusesAHeaderItDidNotExpect) {
  auto p = make_pair(GetParam(), 2000ms);
  tr::tensor_header h;
  h.transfer_id = 9;
  h.type = troupe::kernels::dtype::f32;
  h.shape = {4, 8};
  std::vector<float> src(32, 1.f);
  tr::chunk_options opt;
  opt.timeout = 2000ms;
  auto sender = std::async(std::launch::async, [&] {
    return tr::send_tensor(*p.a, p.a_to_b, h, src.data(), opt).has_value();
  });
  tr::tensor_header want = h;
  want.shape = {8, 4};
  std::vector<float> dst(32);
  auto got = tr::receive_tensor(*p.b, want, dst.data(), dst.size() * 4, opt);
  ASSERT_FALSE(got);
  EXPECT_NE(got.error().message.find("shape [4,8], expected [8,4]"), std::string::npos)
      << got.error().message;
  sender.get();
  EXPECT_EQ(p.b->live_ops(), 0u);
}

INSTANTIATE_TEST_SUITE_P(Engines, EngineTest, ::testing::Values("inproc", "ucx", "ucx-tcp"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

TEST(InprocEngine, ZeroCopyReceiveSeesTheSendersBufferUntilReleased) {
  tr::inproc_engine a, b;
  auto peer = a.connect(b.address());
  ASSERT_TRUE(peer);
  std::vector<std::uint8_t> data = pattern(1000, 5);
  auto s = a.prepare(send_spec(*peer, 1, data.data(), data.size()));
  ASSERT_TRUE(s);
  ASSERT_TRUE(a.post(*s));
  auto r = b.prepare(recv_spec(1, nullptr, 0));
  ASSERT_TRUE(r);
  ASSERT_TRUE(b.post(*r));
  auto st = b.wait(*r, 1000ms);
  ASSERT_TRUE(st);
  EXPECT_EQ(st->state, tr::op_state::done);
  EXPECT_EQ(st->data, data.data());  // the buffer itself
  EXPECT_EQ(st->bytes, data.size());
  // The send is not complete while the receiver holds the buffer.
  EXPECT_EQ(a.poll(*s)->state, tr::op_state::in_flight);
  b.release(*r);
  EXPECT_EQ(a.poll(*s)->state, tr::op_state::done);
  a.release(*s);
  EXPECT_EQ(a.live_ops(), 0u);
}

// Over TCP, UCX emulates RMA with messages the target must progress. The
// target's progress thread does that while its owner never calls the
// engine (a stage computing); without the thread the same get stays
// pending, which shows the test can fail.
TEST(UcxEngine, TheProgressThreadServesRmaWhileTheOwnerIsBusy) {
  for (const bool thread : {true, false}) {
    tr::ucx_options o;
    o.tls = "tcp";
    o.net_devices = "lo";
    o.default_timeout = 20000ms;
    auto a = tr::ucx_engine::create(o);
    o.progress_thread = thread;
    auto b = tr::ucx_engine::create(o);
    ASSERT_TRUE(a && b);
    auto ab = (*a)->connect((*b)->address());
    auto ba = (*b)->connect((*a)->address());
    ASSERT_TRUE(ab && ba);
    std::vector<std::uint8_t> target = pattern(4 << 20, 5);
    tr::remote_region region;
    auto reg = (*b)->expose(target.data(), target.size(), region);
    ASSERT_TRUE(reg) << reg.error().message;
    // The endpoints' wire-up completes while both sides progress.
    for (int i = 0; i < 20; ++i) {
      std::vector<std::uint8_t> x(8);
      auto s = recv_spec(424242, x.data(), x.size());
      s.timeout = 5ms;
      (void)tr::run_op(**b, s);
      s.timeout = 5ms;
      (void)tr::run_op(**a, s);
    }
    // From here on b's owner does not call its engine until the get ends.
    std::vector<std::uint8_t> back(target.size() / 2);
    tr::op_spec get;
    get.kind = tr::op_kind::get;
    get.peer = *ab;
    get.local = back.data();
    get.bytes = back.size();
    get.remote = &region;
    get.remote_offset = target.size() / 4;
    auto h = (*a)->prepare(get);
    ASSERT_TRUE(h) << h.error().message;
    ASSERT_TRUE((*a)->post(*h));
    auto st = (*a)->wait(*h, 3000ms);
    ASSERT_TRUE(st) << st.error().message;
    if (thread) {
      EXPECT_EQ(st->state, tr::op_state::done) << st->failure.message;
      EXPECT_TRUE(std::equal(back.begin(), back.end(), target.begin() + target.size() / 4));
    } else {
      EXPECT_EQ(st->state, tr::op_state::in_flight)
          << "the get completed without the target progressing";
      // The owner comes back: its waits progress the worker and the get ends.
      std::atomic<bool> stop{false};
      auto owner = keep_waiting(**b, stop, 20ms);
      st = (*a)->wait(*h, 10000ms);
      stop = true;
      ASSERT_TRUE(st);
      EXPECT_EQ(st->state, tr::op_state::done);
      EXPECT_TRUE(std::equal(back.begin(), back.end(), target.begin() + target.size() / 4));
    }
    (*a)->release(*h);
    (*b)->unexpose(*reg);
    EXPECT_EQ((*a)->live_ops(), 0u);
  }
}

TEST(UcxEngine, IdleWaitSleepsInsteadOfSpinning) {
  auto e = tr::ucx_engine::create();
  ASSERT_TRUE(e);
  std::vector<std::uint8_t> buf(16);
  auto spec = recv_spec(1234, buf.data(), buf.size());
  spec.timeout = 600ms;
  const std::clock_t c0 = std::clock();
  auto r = tr::run_op(**e, spec);
  const double cpu_ms = 1000.0 * static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  ASSERT_FALSE(r);
  // Busy-polling would burn ~600 ms of CPU.
  EXPECT_LT(cpu_ms, 150.0) << "the wait used " << cpu_ms << " ms of CPU in 600 ms";
}
