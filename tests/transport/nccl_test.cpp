// NCCL groups on this machine's GPUs: skipped (saying why) where there is
// no CUDA build or no device. With one GPU a group of one; with two or
// more, two ranks in threads sum their buffers and pass one to the other.
#include "transport/nccl.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <future>
#include <numeric>

namespace tr = troupe::transport;

namespace {

std::span<std::uint8_t> bytes_of(std::vector<float>& v) {
  return {reinterpret_cast<std::uint8_t*>(v.data()), v.size() * sizeof(float)};
}

}  // namespace

TEST(Nccl, WithoutAGpuEveryCallSaysWhy) {
  if (tr::nccl_group::available()) GTEST_SKIP() << "a CUDA device is present";
  EXPECT_FALSE(tr::nccl_group::why_unavailable().empty());
  auto id = tr::nccl_group::new_id();
  if (!id) {
    EXPECT_FALSE(id.error().message.empty());
  }
  auto g = tr::nccl_group::join(0, 0, 1, std::vector<std::uint8_t>(128));
  ASSERT_FALSE(g);
  EXPECT_FALSE(g.error().message.empty());
}

TEST(Nccl, AGroupOfOneKeepsItsValues) {
  if (!tr::nccl_group::available()) GTEST_SKIP() << tr::nccl_group::why_unavailable();
  auto id = tr::nccl_group::new_id();
  ASSERT_TRUE(id) << id.error().message;
  auto g = tr::nccl_group::join(0, 0, 1, *id);
  ASSERT_TRUE(g) << g.error().message;
  std::vector<float> host(1000);
  std::iota(host.begin(), host.end(), 1.f);
  auto buf = tr::device_buffer::alloc(0, host.size() * 4);
  ASSERT_TRUE(buf) << buf.error().message;
  ASSERT_TRUE(buf->upload(bytes_of(host)));
  ASSERT_TRUE((*g)->all_reduce_sum(static_cast<float*>(buf->data()), host.size()));
  std::vector<float> back(host.size());
  ASSERT_TRUE(buf->download(bytes_of(back)));
  EXPECT_EQ(back, host);
  EXPECT_FALSE(tr::nccl_group::join(0, 0, 1, std::vector<std::uint8_t>(5)));  // a truncated id
}

TEST(Nccl, TwoGpusSumAndPass) {
  if (tr::nccl_group::device_count() < 2)
    GTEST_SKIP() << "needs 2 CUDA devices, this machine has " << tr::nccl_group::device_count();
  auto id = tr::nccl_group::new_id();
  ASSERT_TRUE(id) << id.error().message;
  const std::size_t n = 1 << 20;
  auto rank = [&](int r) -> std::string {
    auto g = tr::nccl_group::join(r, r, 2, *id);
    if (!g) return g.error().message;
    std::vector<float> host(n, static_cast<float>(r + 1));
    auto buf = tr::device_buffer::alloc(r, n * 4);
    if (!buf) return buf.error().message;
    if (auto u = buf->upload(bytes_of(host)); !u) return u.error().message;
    if (auto a = (*g)->all_reduce_sum(static_cast<float*>(buf->data()), n); !a)
      return a.error().message;
    if (auto d = buf->download(bytes_of(host)); !d) return d.error().message;
    for (float x : host)
      if (x != 3.f)
        return "rank " + std::to_string(r) + ": sum " + std::to_string(x) + ", expected 3";
    // Rank 0 sends its buffer (all 3s) to rank 1, which had zeroed its own.
    if (r == 1) {
      std::vector<float> zero(n, 0.f);
      if (auto u = buf->upload(bytes_of(zero)); !u) return u.error().message;
      if (auto x = (*g)->recv(buf->data(), n * 4, 0); !x) return x.error().message;
      if (auto d = buf->download(bytes_of(host)); !d) return d.error().message;
      if (host[n - 1] != 3.f) return "rank 1 received the wrong values";
    } else if (auto x = (*g)->send(buf->data(), n * 4, 1); !x) {
      return x.error().message;
    }
    return "";
  };
  auto a = std::async(std::launch::async, rank, 0), b = std::async(std::launch::async, rank, 1);
  EXPECT_EQ(a.get(), "");
  EXPECT_EQ(b.get(), "");
}
