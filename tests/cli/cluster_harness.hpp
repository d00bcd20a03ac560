// What the cluster tests share (tests/cli/*cluster*, *fault*): a client
// of the cluster's door, jobs run concurrently with their token arrivals,
// and a fixture that brings a 3-node loopback cluster up and down.
#pragma once

#include <gtest/gtest.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <thread>

#include "actors/cluster.hpp"
#include "actors/gatekeeper.hpp"
#include "cluster/certs.hpp"
#include "cluster/launcher.hpp"
#include "tests/cli/cluster_manifest.hpp"
#include "tests/cli/run_cli.hpp"

namespace troupe::test::cluster_harness {

using namespace std::chrono_literals;

// Waits until the head accepts TCP connections on its manifest port (a
// node measures its device, ~0.5 s, before it listens; under a loaded CI a
// fixed sleep was not always enough). True once it does.
inline bool wait_for_head(const cluster::manifest& m, std::chrono::milliseconds timeout) {
  const auto* head = m.node(m.head);
  if (!head) return false;
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (::getaddrinfo(head->host.c_str(), std::to_string(head->port).c_str(), &hints, &res) == 0) {
      bool up = false;
      for (auto* a = res; a && !up; a = a->ai_next) {
        const int fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        up = ::connect(fd, a->ai_addr, a->ai_addrlen) == 0;
        ::close(fd);
      }
      ::freeaddrinfo(res);
      if (up) return true;
    }
    std::this_thread::sleep_for(50ms);
  }
  return false;
}
using steady = std::chrono::steady_clock;

inline double ms_since(steady::time_point t) {
  return std::chrono::duration<double, std::milli>(steady::now() - t).count();
}

inline actors::media_data image(int i) {
  char name[32];
  std::snprintf(name, sizeof name, "/shapes/shapes_%03d.png", i);
  const std::string path = std::string(TROUPE_FIXTURES_DIR) + name;
  std::ifstream f(path, std::ios::binary);
  actors::media_data d;
  d.name = path;
  d.bytes.assign(std::istreambuf_iterator<char>(f), {});
  return d;
}

/// Job i's image is shapes_(i + image_offset()) (images the encoders have
/// not cached yet, for a test that needs them to wait).
inline int& image_offset() {
  static int offset = 0;
  return offset;
}

/// Jobs without their image (a model without a vision tower).
inline bool& text_only_jobs() {
  static bool text_only = false;
  return text_only;
}

/// Jobs with an audio clip after their image (a model that hears).
inline bool& audio_jobs() {
  static bool audio = false;
  return audio;
}

inline actors::media_data clip(int i) {
  static const char* files[] = {"speech16k.wav", "speech16k.mp3", "stereo44k_24.wav",
                                "float16k.wav"};
  const std::string path = std::string(TROUPE_FIXTURES_DIR) + "/audio/" + files[i % 4];
  std::ifstream f(path, std::ios::binary);
  actors::media_data d;
  d.name = path;
  d.bytes.assign(std::istreambuf_iterator<char>(f), {});
  d.kind = actors::media_kind::audio;
  return d;
}

inline actors::job_request job(int i, std::int64_t max_tokens, bool ignore_eos) {
  actors::job_request j;
  j.id = actors::random_job_id();
  j.prompt = "Describe the image.";
  if (!text_only_jobs()) {
    j.images.push_back(image(i + image_offset()));
  } else {
    j.prompt = "Tell story number " + std::to_string(i) + ".";  // (distinct, as the images are)
  }
  if (audio_jobs()) j.audios.push_back(clip(i));
  j.max_tokens = max_tokens;
  j.ignore_eos = ignore_eos;
  return j;
}

// The test's own client (what `troupe submit` is): the cluster's client
// certificate, mutual TLS, the head's door.
class client {
 public:
  explicit client(const cluster::manifest& m) {
    actors::configure_runtime(cfg_);
    auto t = actors::configure_cluster_tls(cfg_, m, cluster::client_identity);
    EXPECT_TRUE(t.has_value()) << (t ? "" : t.error());
    sys_ = std::make_unique<caf::actor_system>(cfg_);
    auto d = actors::connect_client(*sys_, m, 10s);
    EXPECT_TRUE(d.has_value()) << (d ? "" : d.error());
    if (d) door_ = *d;
  }
  bool ok() const { return static_cast<bool>(door_); }
  caf::actor_system& sys() { return *sys_; }
  const actors::frontdoor_actor& door() const { return door_; }
  std::optional<actors::cluster_status> status() {
    auto s = actors::query_status(*sys_, door_, 10s);
    return s ? std::optional<actors::cluster_status>(std::move(*s)) : std::nullopt;
  }
  const actors::member_view* member(const actors::cluster_status& s, const std::string& n) {
    for (const auto& m : s.nodes)
      if (m.name == n) return &m;
    return nullptr;
  }
  /// Polls the status until `pred` holds; the time it took, or nothing.
  template <class Pred>
  std::optional<double> wait_for(Pred pred, std::chrono::milliseconds limit) {
    const auto t0 = steady::now();
    while (steady::now() - t0 < limit) {
      if (auto s = status(); s && pred(*s)) return ms_since(t0);
      std::this_thread::sleep_for(50ms);
    }
    return std::nullopt;
  }

 private:
  caf::actor_system_config cfg_;
  std::unique_ptr<caf::actor_system> sys_;
  actors::frontdoor_actor door_;
};

struct job_run {
  std::vector<std::thread> threads;
  std::vector<std::atomic<int>> streamed;
  /// Per job, when each token event arrived and how many tokens it had
  /// (written by that job's callbacks only; read after join).
  std::vector<std::vector<std::pair<steady::time_point, int>>> arrivals;
  std::vector<std::optional<actors::finish_event>> done;
  std::vector<std::string> errors;
  std::mutex mtx;
  explicit job_run(std::size_t n) : streamed(n), arrivals(n), done(n), errors(n) {}
};

// Runs jobs 1..n concurrently; returns once they are all submitted.
inline std::unique_ptr<job_run> start_jobs(client& c, int n, std::int64_t max_tokens,
                                           bool ignore_eos) {
  auto r = std::make_unique<job_run>(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i)
    r->threads.emplace_back([&c, run = r.get(), i, max_tokens, ignore_eos] {
      auto f = actors::client(c.sys(), c.door())
                   .run(job(i + 1, max_tokens, ignore_eos), [run, i](const actors::token_event& e) {
                     run->arrivals[static_cast<std::size_t>(i)].emplace_back(
                         steady::now(), static_cast<int>(e.tokens.size()));
                     run->streamed[static_cast<std::size_t>(i)] +=
                         static_cast<int>(e.tokens.size());
                   });
      std::lock_guard lock(run->mtx);
      if (f)
        run->done[static_cast<std::size_t>(i)] = *f;
      else
        run->errors[static_cast<std::size_t>(i)] = f.error().message;
    });
  return r;
}

inline void join(job_run& r) {
  for (auto& t : r.threads)
    if (t.joinable()) t.join();
}

/// Joins a run's threads when it goes (a failed assertion returns early).
struct joiner {
  job_run& r;
  ~joiner() { join(r); }
};

/// Runs jobs 1..n to their end: the answers of a run without failures or
/// moves (a job that did not end fails the test).
inline std::unique_ptr<job_run> reference_run(client& c, int n, std::int64_t max_tokens) {
  auto ref = start_jobs(c, n, max_tokens, true);
  join(*ref);
  for (std::size_t i = 0; i < static_cast<std::size_t>(n); ++i)
    EXPECT_TRUE(ref->done[i].has_value()) << ref->errors[i];
  return ref;
}

/// Checks that every job of `run` ended by length with the tokens of the
/// same job in `ref`; returns how many were recomputed (preempted).
inline int expect_same_answers(const job_run& run, const job_run& ref) {
  int recomputed = 0;
  for (std::size_t i = 0; i < run.done.size(); ++i) {
    const auto& d = run.done[i];
    EXPECT_TRUE(d.has_value()) << "job " << i << ": " << run.errors[i];
    if (!d) continue;
    EXPECT_EQ(d->reason, actors::finish_reason::length) << to_string(d->reason) << ": " << d->error;
    EXPECT_TRUE(ref.done[i].has_value() && d->tokens == ref.done[i]->tokens)
        << "job " << i << " answered differently";
    recomputed += d->preemptions > 0;
  }
  return recomputed;
}

/// Waits until every job of `run` has streamed between `lo` and `hi`
/// tokens; whether they all had within a minute.
inline bool wait_mid_decode(job_run& run, int lo, int hi, double limit_ms = 60000) {
  auto within = [&] {
    for (auto& s : run.streamed)
      if (s < lo || s > hi) return false;
    return true;
  };
  const auto t0 = steady::now();
  while (ms_since(t0) < limit_ms && !within()) std::this_thread::sleep_for(2ms);
  return within();
}

class ClusterLoopback : public ::testing::Test {
 protected:
  /// `edit`, if given, rewrites the manifest's text before `up`.
  void up(const std::string& name, const std::string& extra = "",
          const std::function<void(std::string&)>& edit = {}) {
    cs_ = make_manifest(name, {"127.0.0.1", "127.0.0.1", "127.0.0.1"}, extra);
    if (edit) {
      std::ifstream in(cs_.manifest);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      in.close();
      edit(text);
      std::ofstream(cs_.manifest) << text;
    }
    auto r = test::troupe_cli("up " + cs_.manifest + " --detach --timeout 180");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    ASSERT_NE(r.out.find("troupe: cluster " + name + " ready"), std::string::npos) << r.out;
    auto m = cluster::load_manifest(cs_.manifest);
    ASSERT_TRUE(m.has_value());
    m_ = *m;
    started_ = true;
  }
  void TearDown() override {
    if (!started_) return;
    const auto nodes = cluster::read_launched(m_);
    auto r = test::troupe_cli("down " + cs_.manifest + " --timeout 60");
    EXPECT_EQ(r.exit_code, 0) << r.out;
    for (const auto& n : nodes)
      EXPECT_FALSE(cluster::process_alive(n.pid)) << n.node << " still runs after troupe down";
    if (::testing::Test::HasFailure())
      for (const auto& n : nodes)
        std::fprintf(stderr, "---- %s ----\n%s\n", n.log.c_str(),
                     cluster::log_tail(n.log, 40).c_str());
  }
  pid_t pid_of(const std::string& node) {
    for (const auto& n : cluster::read_launched(m_))
      if (n.node == node) return n.pid;
    return 0;
  }
  cluster_setup cs_;
  cluster::manifest m_;
  bool started_ = false;
};

}  // namespace troupe::test::cluster_harness
