// The gateway's connection handling against an in-process head: a door
// actor that speaks the head's protocol (submit, cancel, status) and
// streams tokens on a timer. The model and the cluster are not the subject
// here (tests/cli/serve_multiproc_test.cpp drives a real cluster); what is:
// a thousand open streams on a bounded number of threads, a head that does
// not answer or goes away (503 in seconds, then a reconnection), and a
// drain that ends every stream properly.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <caf/all.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "actors/protocol.hpp"
#include "serve/gateway.hpp"

namespace {

using namespace std::chrono_literals;
using namespace troupe;
using tick_atom = caf::atom_constant<caf::atom("tick")>;
using halt_atom = caf::atom_constant<caf::atom("halt")>;

// What the fake head saw, and how it behaves.
struct head_log {
  std::atomic<int> submitted{0}, cancelled{0}, finished{0};
  bool answer = true;                      ///< false: submissions are never answered
  int tokens = 10;                         ///< per request (max_tokens 0 and larger)
  std::chrono::milliseconds every{100ms};  ///< between tokens
  std::vector<std::uint64_t> seeds;        ///< of the jobs submitted (the door's thread)
};

// One job: a token every `every`, then its end; `halt` cancels it.
// With logprobs asked for, token k has logprob -k/4 and piece "t".
caf::behavior job_actor(caf::event_based_actor* self, actors::client_sink_actor sink,
                        std::uint64_t id, int n, std::chrono::milliseconds every,
                        std::shared_ptr<head_log> log, std::int32_t logprobs = -1) {
  auto sent = std::make_shared<std::vector<std::int32_t>>();
  self->delayed_send(self, every, tick_atom::value);
  auto end = [=](actors::finish_reason why) {
    actors::finish_event f;
    f.id = id;
    f.reason = why;
    f.tokens = *sent;
    f.prompt_tokens = 3;
    for (std::size_t i = 0; i < sent->size(); ++i) f.text += "t";
    self->send(sink, std::move(f));
    ++log->finished;
    self->quit();
  };
  return {
      [=](tick_atom) {
        sent->push_back(static_cast<std::int32_t>(sent->size()));
        std::vector<models::token_logprob> lps;
        if (logprobs >= 0) {
          models::token_logprob lp;
          lp.token = sent->back();
          lp.logprob = -0.25f * static_cast<float>(sent->back());
          lp.piece = "t";
          for (std::int32_t k = 0; k < logprobs; ++k) {
            lp.top_ids.push_back(k);
            lp.top_logprobs.push_back(-static_cast<float>(k));
            lp.top_pieces.push_back("u");
          }
          lps.push_back(std::move(lp));
        }
        self->send(sink, actors::token_event{id, {sent->back()}, "t", std::move(lps)});
        if (static_cast<int>(sent->size()) >= n)
          end(actors::finish_reason::length);
        else
          self->delayed_send(self, every, tick_atom::value);
      },
      [=](halt_atom) { end(actors::finish_reason::cancelled); },
  };
}

struct door_state {
  std::map<std::uint64_t, caf::actor> jobs;
  std::vector<caf::typed_response_promise<actors::submit_ack>> unanswered;
};

actors::frontdoor_actor::behavior_type fake_door(
    actors::frontdoor_actor::stateful_pointer<door_state> self, std::shared_ptr<head_log> log) {
  return {
      [=](actors::submit_atom, actors::job_request& job,
          actors::client_sink_actor sink) -> caf::result<actors::submit_ack> {
        ++log->submitted;
        if (!log->answer) {
          auto rp = self->make_response_promise<actors::submit_ack>();
          self->state.unanswered.push_back(rp);
          return rp;
        }
        const int n = job.max_tokens > 0
                          ? static_cast<int>(std::min<std::int64_t>(job.max_tokens, log->tokens))
                          : log->tokens;
        self->state.jobs[job.id] =
            self->spawn(job_actor, sink, job.id, n, log->every, log, job.logprobs);
        log->seeds.push_back(job.seed);
        return actors::submit_ack{job.id, 0, 0};
      },
      // A tokenizer of one token per byte (what the gateway passes along).
      [=](actors::tokenize_atom, actors::job_request& job) {
        actors::tokenize_reply r;
        for (unsigned char ch : job.prompt) r.tokens.push_back(ch);
        r.context_length = 4096;
        return r;
      },
      [=](actors::detokenize_atom, std::vector<std::int32_t>& ids) {
        std::string text;
        for (auto id : ids) text += static_cast<char>(id);
        return text;
      },
      [=](actors::reset_cache_atom) { return std::int64_t{0}; },
      [=](actors::chunk_atom, actors::audio_chunk&) -> caf::result<actors::stream_progress> {
        return actors::make_error(actors::error_code::not_found, "no stream here");
      },
      [=](actors::cancel_atom, std::uint64_t id) {
        auto it = self->state.jobs.find(id);
        if (it == self->state.jobs.end()) return false;
        ++log->cancelled;
        caf::anon_send(it->second, halt_atom::value);
        self->state.jobs.erase(it);
        return true;
      },
      [=](actors::status_atom) {
        actors::cluster_status s;
        s.cluster = "fake";
        s.ready = true;
        return s;
      },
      [=](actors::down_atom) { return true; },
      [=](actors::migrate_atom, actors::migrate_request&) -> caf::result<actors::migrate_report> {
        return caf::make_error(caf::sec::unexpected_message);
      },
      [=](actors::scale_atom, std::int32_t) -> caf::result<std::string> {
        return caf::make_error(caf::sec::unexpected_message);
      },
      [=](actors::follow_atom, bool) -> caf::result<actors::journal_state> {
        return caf::make_error(caf::sec::unexpected_message);
      },
      [=](actors::journal_atom, std::vector<actors::journal_entry>&) {},
      [=](actors::attach_atom, std::uint64_t, std::vector<std::int32_t>&,
          actors::client_sink_actor&) -> caf::result<actors::submit_ack> {
        return caf::make_error(caf::sec::unexpected_message);
      },
  };
}

std::int64_t threads_now() {
  std::int64_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

std::int64_t rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  return 0;
}

// Many HTTP/1.1 clients on non-blocking sockets, driven by poll() from one
// thread: each sends its request and reads until the server closes or the
// body holds `until`.
struct raw_client {
  int fd = -1;
  std::string request, response;
  std::size_t written = 0;
  bool done = false;
};

std::string post_request(const std::string& path, const nlohmann::json& body,
                         bool keep_alive = false) {
  const auto b = body.dump();
  return "POST " + path + " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
         (keep_alive ? "" : "Connection: close\r\n") +
         "Content-Length: " + std::to_string(b.size()) + "\r\n\r\n" + b;
}

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  (void)::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  return fd;
}

// Drives every client until each is done (closed by the server, or its
// response holds `until`) or `limit` passes; calls `during` between polls.
void drive(std::vector<raw_client>& cs, const std::string& until, std::chrono::seconds limit,
           const std::function<void()>& during = {}) {
  const auto end = std::chrono::steady_clock::now() + limit;
  std::vector<pollfd> p(cs.size());
  while (std::chrono::steady_clock::now() < end) {
    std::size_t open = 0;
    for (std::size_t i = 0; i < cs.size(); ++i) {
      p[i].fd = cs[i].done ? -1 : cs[i].fd;
      p[i].events =
          static_cast<short>(POLLIN | (cs[i].written < cs[i].request.size() ? POLLOUT : 0));
      p[i].revents = 0;
      open += !cs[i].done;
    }
    if (!open) break;
    ::poll(p.data(), p.size(), 20);
    for (std::size_t i = 0; i < cs.size(); ++i) {
      auto& c = cs[i];
      if (c.done || !p[i].revents) continue;
      if ((p[i].revents & POLLOUT) && c.written < c.request.size()) {
        const auto n =
            ::send(c.fd, c.request.data() + c.written, c.request.size() - c.written, MSG_NOSIGNAL);
        if (n > 0) c.written += static_cast<std::size_t>(n);
      }
      if (p[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        char buf[4096];
        const auto n = ::recv(c.fd, buf, sizeof buf, 0);
        if (n > 0) c.response.append(buf, static_cast<std::size_t>(n));
        if (n == 0 || (n < 0 && errno != EAGAIN) ||
            (!until.empty() && c.response.find(until) != std::string::npos))
          c.done = true;
      }
    }
    if (during) during();
  }
  for (auto& c : cs) ::close(c.fd);
}

class GatewayAsync : public ::testing::Test {
 protected:
  void SetUp() override {
    actors::configure_runtime(cfg_);
    sys_ = std::make_unique<caf::actor_system>(cfg_);
    log_ = std::make_shared<head_log>();
  }
  void TearDown() override {
    if (gw_) gw_->stop();
    if (serving_.joinable()) serving_.join();
    gw_.reset();
    for (auto& d : doors_) caf::anon_send_exit(d, caf::exit_reason::user_shutdown);
  }
  actors::frontdoor_actor door() {
    auto d = sys_->spawn(fake_door, log_);
    doors_.push_back(d);
    return d;
  }
  void start(serve::gateway_options opt) {
    opt.host = "127.0.0.1";
    opt.port = 0;
    opt.model_name = "fake";
    opt.access_log = false;
    gw_ = std::make_unique<serve::gateway>(*sys_, door(), std::move(opt));
    std::string why;
    ASSERT_TRUE(gw_->bind(why)) << why;
    serving_ = std::thread([this] { gw_->serve(); });
  }
  raw_client stream_client(int max_tokens = 0) {
    raw_client c;
    c.fd = connect_to(gw_->port());
    nlohmann::json body{{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"stream", true}};
    if (max_tokens > 0) body["max_tokens"] = max_tokens;
    c.request = post_request("/v1/chat/completions", body);
    return c;
  }

  caf::actor_system_config cfg_;
  std::unique_ptr<caf::actor_system> sys_;
  std::shared_ptr<head_log> log_;
  std::vector<actors::frontdoor_actor> doors_;
  std::unique_ptr<serve::gateway> gw_;
  std::thread serving_;
};

std::size_t count_of(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// A thousand streamed requests open at once: every one is served to its
// end, while the process's threads stay where they were (a connection or a
// stream costs no thread; the gateway this replaced held one HTTP thread
// per stream, 16 at most). Reports threads and bytes per open stream.
TEST_F(GatewayAsync, AThousandStreamsOnBoundedThreads) {
  log_->tokens = 10;
  log_->every = 300ms;  // about 3 s per stream: all of them are open together
  serve::gateway_options opt;
  start(opt);
  std::this_thread::sleep_for(100ms);
  const auto threads_idle = threads_now();
  const auto rss_idle = rss_bytes();
  const int n = 1000;
  std::vector<raw_client> cs;
  for (int i = 0; i < n; ++i) cs.push_back(stream_client());
  std::int64_t peak_streams = 0, peak_threads = 0, rss_at_peak = 0;
  drive(cs, "data: [DONE]", 120s, [&] {
    const auto now = gw_->current().streams;
    if (now > peak_streams) {
      peak_streams = now;
      rss_at_peak = rss_bytes();
    }
    peak_threads = std::max(peak_threads, threads_now());
  });
  int complete = 0;
  for (const auto& c : cs)
    complete += c.response.find("HTTP/1.1 200") == 0 &&
                c.response.find("\"role\":\"assistant\"") != std::string::npos &&
                count_of(c.response, "\"content\":\"t\"") == 10 &&
                c.response.find("\"finish_reason\":\"length\"") != std::string::npos &&
                c.response.find("data: [DONE]") != std::string::npos;
  EXPECT_EQ(complete, n);
  EXPECT_EQ(log_->submitted.load(), n);
  EXPECT_EQ(peak_streams, n) << "the streams were not all open at once";
  EXPECT_LE(peak_threads - threads_idle, 2) << "threads grew with the streams";
  const double per_stream =
      static_cast<double>(std::max<std::int64_t>(0, rss_at_peak - rss_idle)) / n;
  std::printf(
      "[ gateway ] %d streams open at once: %lld threads before, %lld at most during "
      "(io %d, blocking pool %d); %.1f KiB resident per open stream (server and test "
      "client together)\n",
      n, static_cast<long long>(threads_idle), static_cast<long long>(peak_threads), opt.io_threads,
      opt.blocking_threads, per_stream / 1024);
}

// A head that takes no job: 503 once the submit timeout passes, not a hang
// (the gateway this replaced waited on it forever).
TEST_F(GatewayAsync, AHeadThatDoesNotAnswerIs503WithinTheSubmitTimeout) {
  log_->answer = false;
  serve::gateway_options opt;
  opt.submit_timeout = 500ms;
  start(opt);
  std::vector<raw_client> cs{stream_client()};
  const auto t0 = std::chrono::steady_clock::now();
  drive(cs, "", 30s);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(cs[0].response.find("HTTP/1.1 503"), 0u) << cs[0].response;
  EXPECT_NE(cs[0].response.find("did not answer within 500 ms"), std::string::npos)
      << cs[0].response;
  EXPECT_NE(cs[0].response.find("Retry-After: 1"), std::string::npos) << cs[0].response;
  EXPECT_LT(took, 3s);
}

// The head goes away: requests get 503 at once, and the gateway finds the
// head again (here: a new door from `reconnect`) and serves.
TEST_F(GatewayAsync, AHeadThatWentAwayIs503ThenTheGatewayReconnects) {
  serve::gateway_options opt;
  std::atomic<int> tries{0};
  std::atomic<bool> head_back{false};
  opt.reconnect_every = 100ms;
  opt.reconnect = [&]() -> std::expected<actors::frontdoor_actor, std::string> {
    ++tries;
    if (!head_back) return std::unexpected("connection refused");
    return door();
  };
  start(opt);
  std::vector<raw_client> ok{stream_client(2)};
  drive(ok, "data: [DONE]", 30s);
  ASSERT_EQ(ok[0].response.find("HTTP/1.1 200"), 0u) << ok[0].response;

  caf::anon_send_exit(doors_.front(), caf::exit_reason::kill);
  std::this_thread::sleep_for(200ms);
  std::vector<raw_client> gone{stream_client(2)};
  const auto t0 = std::chrono::steady_clock::now();
  drive(gone, "", 30s);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_EQ(gone[0].response.find("HTTP/1.1 503"), 0u) << gone[0].response;
  EXPECT_NE(gone[0].response.find("went away"), std::string::npos) << gone[0].response;

  head_back = true;
  std::string last;
  for (int i = 0; i < 100; ++i) {
    std::vector<raw_client> again{stream_client(2)};
    drive(again, "data: [DONE]", 10s);
    last = again[0].response;
    if (last.find("HTTP/1.1 200") == 0) break;
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(last.find("HTTP/1.1 200"), 0u) << last;
  EXPECT_NE(last.find("data: [DONE]"), std::string::npos) << last;
  EXPECT_GE(tries.load(), 1);
}

// stop() (SIGTERM, SIGINT in troupe serve) ends every stream in flight with
// an error chunk and [DONE], cancels its request on the head, and returns
// within the drain time.
TEST_F(GatewayAsync, StopEndsEveryStreamWithAnErrorAndDoneAndCancelsItsRequest) {
  log_->tokens = 1000;
  log_->every = 200ms;
  serve::gateway_options opt;
  opt.drain = 5s;
  start(opt);
  const int n = 20;
  std::vector<raw_client> cs;
  for (int i = 0; i < n; ++i) cs.push_back(stream_client());
  std::thread stopper;
  std::chrono::steady_clock::duration stop_took{};
  bool asked = false;
  drive(cs, "", 60s, [&] {
    if (asked) return;
    int started = 0;
    for (const auto& c : cs) started += c.response.find("\"content\":\"t\"") != std::string::npos;
    if (started < n) return;
    asked = true;
    stopper = std::thread([&] {
      const auto t0 = std::chrono::steady_clock::now();
      gw_->stop();
      stop_took = std::chrono::steady_clock::now() - t0;
    });
  });
  ASSERT_TRUE(asked) << "the streams did not all start";
  stopper.join();
  serving_.join();
  int ended = 0;
  for (const auto& c : cs) {
    const auto err = c.response.find("shutting down");
    const auto done = c.response.rfind("data: [DONE]");
    ended += err != std::string::npos && done != std::string::npos && done > err &&
             c.response.find("\"finish_reason\":\"length\"") == std::string::npos;
  }
  EXPECT_EQ(ended, n);
  for (int i = 0; i < 100 && log_->cancelled.load() < n; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_EQ(log_->cancelled.load(), n) << "requests kept running on the head";
  EXPECT_LT(stop_took, opt.drain + 1s);
  // Nothing is accepted any more.
  const int fd = connect_to(gw_->port());
  pollfd p{fd, POLLOUT, 0};
  ::poll(&p, 1, 500);
  int err = 0;
  socklen_t len = sizeof err;
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  EXPECT_EQ(err, ECONNREFUSED);
  ::close(fd);
}

// Keep-alive: one connection carries request after request; an idle one is
// closed after keep_alive; a client that hangs up mid-request has its
// request cancelled (a non-streamed one too).
// One client address may hold max_connections_per_client connections; one
// more gets a 503 at once, and a connection closing makes room again.
TEST_F(GatewayAsync, OneClientCannotHoldEveryConnection) {
  serve::gateway_options opt;
  opt.max_connections_per_client = 4;
  opt.keep_alive = 30s;
  opt.io_timeout = 30s;
  start(opt);
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) held.push_back(connect_to(gw_->port()));
  // The gateway has taken all four (they wait for a request).
  for (int i = 0; i < 200 && gw_->current().connections < 4; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(gw_->current().connections, 4);
  auto ask = [&] {
    raw_client c;
    c.fd = connect_to(gw_->port());
    c.request = "GET /live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    std::vector<raw_client> cs{c};
    drive(cs, "", 10s);
    return cs[0].response;
  };
  const auto fifth = ask();
  EXPECT_EQ(fifth.find("HTTP/1.1 503"), 0u) << fifth;
  EXPECT_NE(fifth.find("too many open connections from 127.0.0.1"), std::string::npos) << fifth;
  ::close(held.back());
  held.pop_back();
  for (int i = 0; i < 200 && gw_->current().connections > 3; ++i) std::this_thread::sleep_for(10ms);
  const auto again = ask();
  EXPECT_EQ(again.find("HTTP/1.1 200"), 0u) << again;
  for (int fd : held) ::close(fd);
}

TEST_F(GatewayAsync, KeepAliveReusesAConnectionAndAHangUpCancels) {
  log_->tokens = 3;
  log_->every = 10ms;
  serve::gateway_options opt;
  opt.keep_alive = 1s;
  start(opt);
  raw_client c;
  c.fd = connect_to(gw_->port());
  nlohmann::json body{{"messages", {{{"role", "user"}, {"content", "hi"}}}}};
  for (int i = 0; i < 3; ++i) c.request += post_request("/v1/chat/completions", body, true);
  std::vector<raw_client> cs{c};
  const auto t0 = std::chrono::steady_clock::now();
  drive(cs, "", 30s);  // until the server closes the idle connection
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(count_of(cs[0].response, "HTTP/1.1 200"), 3u) << cs[0].response;
  EXPECT_EQ(count_of(cs[0].response, "\"chat.completion\""), 3u);
  EXPECT_GE(took, 1s) << "closed before the keep-alive time";
  EXPECT_LT(took, 5s) << "an idle connection was kept open";

  // A non-streamed request whose client hangs up is cancelled on the head.
  log_->tokens = 1000;
  log_->every = 100ms;
  const int before = log_->cancelled.load();
  const int fd = connect_to(gw_->port());
  const auto req = post_request("/v1/chat/completions", body);
  pollfd p{fd, POLLOUT, 0};
  ::poll(&p, 1, 2000);
  ASSERT_EQ(::send(fd, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  for (int i = 0; i < 100 && gw_->current().streams == 0; ++i) std::this_thread::sleep_for(10ms);
  ::close(fd);
  for (int i = 0; i < 200 && log_->cancelled.load() == before; ++i)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(log_->cancelled.load(), before + 1) << "the request kept running";
}

}  // namespace

namespace {

// The small things a client of vLLM or llama-server expects: a method an
// endpoint does not take is 405 with Allow, the Responses API is refused by
// name, a request id comes back, CORS answers only the configured origin.
TEST_F(GatewayAsync, RoutesRequestIdsAndCors) {
  serve::gateway_options opt;
  opt.cors_origins = {"https://app.example"};
  opt.version = "9.9.9";
  start(opt);
  auto ask = [&](const std::string& request) {
    raw_client c;
    c.fd = connect_to(gw_->port());
    c.request = request;
    std::vector<raw_client> cs{c};
    drive(cs, "", 10s);
    return cs[0].response;
  };
  auto get = ask("GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(get.find("HTTP/1.1 405"), 0u) << get;
  EXPECT_NE(get.find("Allow: POST"), std::string::npos) << get;
  auto responses = ask(post_request("/v1/responses", {{"input", "hi"}}));
  EXPECT_EQ(responses.find("HTTP/1.1 404"), 0u) << responses;
  EXPECT_NE(responses.find("Responses API is not supported"), std::string::npos) << responses;
  auto version =
      ask("GET /version HTTP/1.1\r\nHost: x\r\nX-Request-Id: abc-123\r\nConnection: close\r\n\r\n");
  EXPECT_NE(version.find("\"version\":\"9.9.9\""), std::string::npos) << version;
  EXPECT_NE(version.find("X-Request-Id: abc-123"), std::string::npos) << version;
  auto preflight =
      ask("OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\n"
          "Access-Control-Request-Method: POST\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(preflight.find("HTTP/1.1 204"), 0u) << preflight;
  EXPECT_NE(preflight.find("Access-Control-Allow-Origin: https://app.example"), std::string::npos)
      << preflight;
  auto stranger = ask(
      "GET /live HTTP/1.1\r\nHost: x\r\nOrigin: https://evil.example\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(stranger.find("HTTP/1.1 200"), 0u) << stranger;
  EXPECT_EQ(stranger.find("Access-Control-Allow-Origin"), std::string::npos) << stranger;
  auto missing = ask("GET /nothing HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(missing.find("HTTP/1.1 404"), 0u) << missing;
  // Every response is counted by its status, errors included.
  auto metrics = ask("GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_NE(metrics.find("troupe:http_requests_total{status=\"405\"} 1\n"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("troupe:http_requests_total{status=\"404\"} 2\n"), std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("troupe:http_requests_total{status=\"204\"} 1\n"), std::string::npos)
      << metrics;
}

// n choices are n jobs (seeds seed, seed + 1, ...) merged into one
// response; logprobs and usage come through whole and streamed; /tokenize
// and /detokenize ask the head.
TEST_F(GatewayAsync, ChoicesLogprobsAndTokenizePassThrough) {
  log_->every = 5ms;
  start({});
  auto ask = [&](const std::string& request) {
    raw_client c;
    c.fd = connect_to(gw_->port());
    c.request = request;
    std::vector<raw_client> cs{c};
    drive(cs, "", 20s);
    return cs[0].response;
  };
  auto body_of = [](const std::string& response) {
    const auto at = response.find("\r\n\r\n");
    return at == std::string::npos ? std::string() : response.substr(at + 4);
  };
  const auto whole = ask(
      post_request("/v1/completions",
                   {{"prompt", "hi"}, {"max_tokens", 4}, {"n", 3}, {"logprobs", 2}, {"seed", 40}}));
  ASSERT_EQ(whole.find("HTTP/1.1 200"), 0u) << whole;
  auto j = nlohmann::json::parse(body_of(whole));
  ASSERT_EQ(j["choices"].size(), 3u) << j;
  for (int i = 0; i < 3; ++i) {
    const auto& c = j["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["text"], "tttt");
    ASSERT_EQ(c["logprobs"]["tokens"].size(), 4u) << c;
    EXPECT_FLOAT_EQ(c["logprobs"]["token_logprobs"][3].get<float>(), -0.75f);
    EXPECT_EQ(c["logprobs"]["top_logprobs"][0].size(), 1u);  // both alternatives are "u"
    EXPECT_EQ(c["logprobs"]["text_offset"][2], 2);
  }
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 3);
  ASSERT_EQ(log_->seeds.size(), 3u);
  std::sort(log_->seeds.begin(), log_->seeds.end());
  EXPECT_EQ(log_->seeds, (std::vector<std::uint64_t>{40, 41, 42}));

  const auto streamed = ask(post_request(
      "/v1/chat/completions",
      {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
       {"max_tokens", 3},
       {"n", 2},
       {"logprobs", true},
       {"top_logprobs", 1},
       {"stream", true},
       {"stream_options", {{"include_usage", true}, {"continuous_usage_stats", true}}}}));
  ASSERT_EQ(streamed.find("HTTP/1.1 200"), 0u) << streamed;
  std::map<int, std::string> text;
  std::map<int, int> logprobs, finished, roles;
  int usage_chunks = 0, done = 0;
  nlohmann::json last_usage;
  for (std::size_t at = streamed.find("data: "); at != std::string::npos;
       at = streamed.find("data: ", at + 1)) {
    const auto line = streamed.substr(at + 6, streamed.find("\n", at) - at - 6);
    if (line == "[DONE]") {
      ++done;
      continue;
    }
    auto e = nlohmann::json::parse(line);
    if (e["choices"].empty()) {
      last_usage = e["usage"];
      continue;
    }
    const int i = e["choices"][0]["index"];
    const auto& d = e["choices"][0]["delta"];
    if (d.contains("role")) ++roles[i];
    if (d.contains("content")) text[i] += d["content"].get<std::string>();
    if (!e["choices"][0]["logprobs"].is_null())
      logprobs[i] += static_cast<int>(e["choices"][0]["logprobs"]["content"].size());
    if (!e["choices"][0]["finish_reason"].is_null()) ++finished[i];
    if (e.contains("usage") && !d.contains("role")) ++usage_chunks;
  }
  EXPECT_EQ(done, 1);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(text[i], "ttt") << streamed;
    EXPECT_EQ(logprobs[i], 3) << streamed;
    EXPECT_EQ(finished[i], 1);
    EXPECT_EQ(roles[i], 1);
  }
  EXPECT_GE(usage_chunks, 6) << streamed;  // every content and end chunk
  EXPECT_EQ(last_usage["completion_tokens"], 6) << streamed;

  const auto tok = ask(post_request("/tokenize", {{"prompt", "abc"}, {"model", "fake"}}));
  ASSERT_EQ(tok.find("HTTP/1.1 200"), 0u) << tok;
  auto t = nlohmann::json::parse(body_of(tok));
  EXPECT_EQ(t["tokens"], nlohmann::json::array({97, 98, 99}));
  EXPECT_EQ(t["count"], 3);
  EXPECT_EQ(t["max_model_len"], 4096);
  const auto detok = ask(post_request("/detokenize", {{"tokens", {104, 105}}}));
  EXPECT_EQ(nlohmann::json::parse(body_of(detok))["prompt"], "hi") << detok;
  const auto other = ask(post_request("/tokenize", {{"prompt", "abc"}, {"model", "gpt-4o"}}));
  EXPECT_EQ(other.find("HTTP/1.1 404"), 0u) << other;
  const auto both = ask(post_request(
      "/tokenize", {{"prompt", "abc"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}}));
  EXPECT_EQ(both.find("HTTP/1.1 400"), 0u) << both;
  const auto get = ask("GET /tokenize HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(get.find("HTTP/1.1 405"), 0u) << get;
}

}  // namespace
