#pragma once

// The multi-process test harness: starts helper processes with pipes on
// stdin/stdout, each in its own process group (killed, with everything it
// started, when the test ends or times out), keeps each one's stderr in a
// log file and prints the logs when the test failed. Timeouts scale with
// TROUPE_TEST_TIME_SCALE (the sanitizer build sets it).
//
// Also: a free TCP port, and whether network namespaces can be made here.

#include <fcntl.h>
#ifndef TROUPE_MULTIPROC_NO_GTEST
#include <gtest/gtest.h>
#endif
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace troupe::test {

inline double time_scale() {
  const char* s = std::getenv("TROUPE_TEST_TIME_SCALE");
  return s ? std::max(1.0, std::atof(s)) : 1.0;
}

inline std::chrono::milliseconds scaled(std::chrono::milliseconds ms) {
  return std::chrono::milliseconds(
      static_cast<std::int64_t>(static_cast<double>(ms.count()) * time_scale()));
}

/// A TCP port nobody listens on right now (bound to port 0, then closed).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

class child_process {
 public:
  /// Starts argv[0] (a path) with the extra environment entries.
  child_process(std::string label, std::vector<std::string> argv, std::vector<std::string> env = {})
      : label_(std::move(label)) {
    log_ = (std::filesystem::temp_directory_path() /
            ("troupe-" + label_ + "-" + std::to_string(::getpid()) + "-" +
             std::to_string(counter()++) + ".log"))
               .string();
    int in[2], out[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) return;
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setpgid(0, 0);
      ::dup2(in[0], 0);
      ::dup2(out[1], 1);
      const int err = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (err >= 0) ::dup2(err, 2);
      for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> args;
      for (auto& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also from here: no race with the child's own call
    pid_ = pid;
    ::close(in[0]);
    ::close(out[1]);
    to_ = in[1];
    from_ = out[0];
  }
  ~child_process() {
    kill();
    if (to_ >= 0) ::close(to_);
    if (from_ >= 0) ::close(from_);
#ifndef TROUPE_MULTIPROC_NO_GTEST
    const bool keep = ::testing::Test::HasFailure();
#else
    const bool keep = keep_logs;  // benchmarks: set when something failed
#endif
    if (keep) {
      std::ifstream f(log_);
      std::stringstream ss;
      ss << f.rdbuf();
      std::fprintf(stderr, "---- %s stderr (%s) ----\n%s\n---- end %s ----\n", label_.c_str(),
                   log_.c_str(), ss.str().c_str(), label_.c_str());
    } else {
      std::filesystem::remove(log_);
    }
  }
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  bool started() const {
    return pid_ > 0;
  }
  bool keep_logs = false;
  pid_t pid() const {
    return pid_;
  }

  bool send_line(const std::string& s) {
    const std::string l = s + "\n";
    return ::write(to_, l.data(), l.size()) == static_cast<ssize_t>(l.size());
  }

  /// The next stdout line, or nothing when `limit` passes or the child
  /// closed its stdout.
  std::optional<std::string> read_line(std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + scaled(limit);
    for (;;) {
      if (auto nl = buf_.find('\n'); nl != std::string::npos) {
        std::string l = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return l;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char tmp[4096];
      const ssize_t n = ::read(from_, tmp, sizeof tmp);
      if (n <= 0) return std::nullopt;
      buf_.append(tmp, static_cast<std::size_t>(n));
    }
  }

  /// Reads lines until one starts with `prefix` (others are skipped).
  std::optional<std::string> expect(const std::string& prefix, std::chrono::milliseconds limit) {
    const auto until = std::chrono::steady_clock::now() + scaled(limit);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          until - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      auto l = read_line(
          std::chrono::milliseconds(static_cast<std::int64_t>(left.count() / time_scale()) + 1));
      if (!l) return std::nullopt;
      if (l->starts_with(prefix)) return l;
      if (l->starts_with("error") && !prefix.starts_with("error")) return l;
    }
  }

  /// SIGKILL to the whole process group, then reaps the child.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(-pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
    pid_ = -1;
  }

  /// Waits up to `limit` for the child to exit by itself; how it ended
  /// ("exit N", "signal N"), or "still running".
  std::string wait_exit(std::chrono::milliseconds limit) {
    if (pid_ <= 0) return "not running";
    const auto until = std::chrono::steady_clock::now() + scaled(limit);
    for (;;) {
      int st = 0;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        if (WIFEXITED(st)) return "exit " + std::to_string(WEXITSTATUS(st));
        if (WIFSIGNALED(st)) return "signal " + std::to_string(WTERMSIG(st));
        return "ended";
      }
      if (std::chrono::steady_clock::now() >= until) return "still running";
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  std::string label_, log_;
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buf_;
};

/// Runs a shell command; its exit status.
inline int shell(const std::string& cmd) {
  const int st = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/// Runs network setup commands in order; empty, or why one failed.
inline std::string run_setup(const std::vector<std::string>& steps) {
  for (const auto& s : steps)
    if (shell(s) != 0) return "'" + s + "' failed (no privilege for network namespaces here?)";
  return "";
}

/// What a test that needs network namespaces says when it cannot make them
/// (scripts/test finds this line in the ctest log and reports the skip).
inline std::string netns_skipped(const std::string& why) {
  return "network-namespace test skipped: " + why;
}

/// Two network namespaces joined by a veth pair (10.77.N.1 and 10.77.N.2),
/// removed on destruction: separate hosts on one machine. `ok()` is false
/// where the user may not create them (`why()` says so).
class netns_pair {
 public:
  explicit netns_pair(int n = 0) {
    const std::string tag = std::to_string(::getpid() % 100000) + "x" + std::to_string(n);
    a_ = "troupe-a" + tag;
    b_ = "troupe-b" + tag;
    va_ = "tva" + tag;
    vb_ = "tvb" + tag;
    const std::string net = "10.77." + std::to_string(n % 250) + ".";
    ip_a_ = net + "1";
    ip_b_ = net + "2";
    if (::geteuid() != 0) {
      why_ = "network namespaces need root (this user is uid " + std::to_string(::geteuid()) + ")";
      return;
    }
    if (shell("command -v ip") != 0) {
      why_ = "the ip command (iproute2) is missing";
      return;
    }
    const std::vector<std::string> steps{
        "ip netns add " + a_,
        "ip netns add " + b_,
        "ip link add " + va_ + " type veth peer name " + vb_,
        "ip link set " + va_ + " netns " + a_,
        "ip link set " + vb_ + " netns " + b_,
        "ip -n " + a_ + " addr add " + ip_a_ + "/24 dev " + va_,
        "ip -n " + b_ + " addr add " + ip_b_ + "/24 dev " + vb_,
        "ip -n " + a_ + " link set " + va_ + " up",
        "ip -n " + b_ + " link set " + vb_ + " up",
        "ip -n " + a_ + " link set lo up",
        "ip -n " + b_ + " link set lo up",
    };
    why_ = run_setup(steps);
    if (!why_.empty()) {
      cleanup();
      return;
    }
    ok_ = true;
  }
  ~netns_pair() { cleanup(); }
  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  /// argv prefix that runs a command inside namespace a or b.
  std::vector<std::string> exec_in(bool a) const {
    return {"/usr/sbin/ip", "netns", "exec", a ? a_ : b_};
  }
  const std::string& device(bool a) const { return a ? va_ : vb_; }

 private:
  void cleanup() {
    shell("ip netns del " + a_);
    shell("ip netns del " + b_);
  }
  std::string a_, b_, va_, vb_, ip_a_, ip_b_, why_;
  bool ok_ = false;
};

/// `n` network namespaces joined through a bridge in this namespace: hosts
/// 10.78.N.1 .. 10.78.N.n on one subnet (each namespace's end is named
/// "eth0"), this namespace at 10.78.N.254 (so a client here reaches them),
/// all removed on destruction. Namespace i is named prefix() + its host.
class netns_bridge {
 public:
  netns_bridge(int n, int subnet) {
    tag_ = std::to_string(::getpid() % 100000) + "b" + std::to_string(subnet);
    net_ = "10.78." + std::to_string(subnet % 250) + ".";
    br_ = "tbr" + tag_;
    if (::geteuid() != 0) {
      why_ = "network namespaces need root (this user is uid " + std::to_string(::geteuid()) + ")";
      return;
    }
    if (shell("command -v ip") != 0) {
      why_ = "the ip command (iproute2) is missing";
      return;
    }
    std::vector<std::string> steps{"ip link add " + br_ + " type bridge",
                                   "ip addr add " + net_ + "254/24 dev " + br_,
                                   "ip link set " + br_ + " up"};
    for (int i = 0; i < n; ++i) {
      const std::string h = host(i), ns = prefix() + h, v = "tv" + tag_ + "x" + std::to_string(i);
      namespaces_.push_back(ns);
      links_.push_back(v);
      steps.push_back("ip netns add " + ns);
      steps.push_back("ip link add " + v + " type veth peer name eth0 netns " + ns);
      steps.push_back("ip link set " + v + " master " + br_);
      steps.push_back("ip link set " + v + " up");
      steps.push_back("ip -n " + ns + " addr add " + h + "/24 dev eth0");
      steps.push_back("ip -n " + ns + " link set eth0 up");
      steps.push_back("ip -n " + ns + " link set lo up");
    }
    why_ = run_setup(steps);
    if (!why_.empty()) {
      cleanup();
      return;
    }
    ok_ = true;
  }
  ~netns_bridge() { cleanup(); }
  netns_bridge(const netns_bridge&) = delete;
  netns_bridge& operator=(const netns_bridge&) = delete;
  bool ok() const { return ok_; }
  const std::string& why() const { return why_; }
  std::string host(int i) const { return net_ + std::to_string(i + 1); }
  std::string prefix() const { return "tns" + tag_ + "-"; }
  /// Sends `sig` to every process in the namespace of host i.
  void signal_all(int i, int sig) const {
    shell("for p in $(ip netns pids " + prefix() + host(i) + "); do kill -" + std::to_string(sig) +
          " $p; done");
  }

 private:
  void cleanup() {
    for (std::size_t i = 0; i < namespaces_.size(); ++i) {
      shell("for p in $(ip netns pids " + namespaces_[i] + "); do kill -9 $p; done");
      shell("ip netns del " + namespaces_[i]);
      shell("ip link del " + links_[i]);
    }
    shell("ip link del " + br_);
  }
  std::string tag_, net_, br_, why_;
  std::vector<std::string> namespaces_, links_;
  bool ok_ = false;
};

}  // namespace troupe::test
