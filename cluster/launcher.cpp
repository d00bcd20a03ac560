#include "cluster/launcher.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace troupe::cluster {

namespace fs = std::filesystem;

std::string run_dir(const manifest& m) {
  return (fs::path(m.certs_dir) / "run").string();
}

namespace {
void replace_all(std::string& s, const std::string& what, const std::string& with) {
  for (auto at = s.find(what); at != std::string::npos; at = s.find(what, at + with.size()))
    s.replace(at, what.size(), with);
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}
}  // namespace

std::string launch_command(const manifest& m, const node_entry& n, const std::string& troupe_exe) {
  std::string cmd = m.launch;
  replace_all(cmd, "{host}", n.host);
  replace_all(cmd, "{name}", shell_quote(n.name));
  replace_all(cmd, "{manifest}", shell_quote(fs::absolute(m.path).string()));
  replace_all(cmd, "{troupe}", shell_quote(troupe_exe));
  return cmd;
}

namespace {
std::expected<launched_node, std::string> start(const manifest& m, const std::string& name,
                                                std::vector<std::string> argv, bool local) {
  std::error_code ec;
  fs::create_directories(run_dir(m), ec);
  if (ec) return std::unexpected("cannot create " + run_dir(m) + ": " + ec.message());
  launched_node out;
  out.node = name;
  out.local = local;
  out.log = (fs::path(run_dir(m)) / (name + ".log")).string();
  const int log = ::open(out.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log < 0) return std::unexpected("cannot write " + out.log + ": " + std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log);
    return std::unexpected(std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    ::setsid();  // outlives `troupe up` and its terminal
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    ::dup2(log, 1);
    ::dup2(log, 2);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::fprintf(stderr, "cannot run %s: %s\n", args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(log);
  out.pid = pid;
  return out;
}
}  // namespace

std::expected<launched_node, std::string> launch_local(const manifest& m, const std::string& name,
                                                       std::vector<std::string> argv) {
  return start(m, name, std::move(argv), true);
}

std::expected<launched_node, std::string> launch_node(const manifest& m, const node_entry& n,
                                                      const std::string& troupe_exe) {
  if (is_loopback(n.host))
    return start(
        m, n.name,
        {troupe_exe, "node", "--manifest", fs::absolute(m.path).string(), "--name", n.name}, true);
  return start(m, n.name, {"/bin/sh", "-c", launch_command(m, n, troupe_exe)}, false);
}

std::expected<void, std::string> write_launched(const manifest& m,
                                                const std::vector<launched_node>& nodes) {
  const auto path = fs::path(run_dir(m)) / "nodes.pid";
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream f(tmp);
    for (const auto& n : nodes)
      f << n.node << ' ' << n.pid << ' ' << n.log << ' ' << (n.local ? 1 : 0) << '\n';
    if (!f) return std::unexpected("cannot write " + tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return std::unexpected("cannot write " + path.string() + ": " + ec.message());
  return {};
}

std::vector<launched_node> read_launched(const manifest& m) {
  std::vector<launched_node> out;
  std::ifstream f(fs::path(run_dir(m)) / "nodes.pid");
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream ss(line);
    launched_node n;
    long pid = 0;
    int local = 1;
    if (ss >> n.node >> pid >> n.log >> local && pid > 1) {
      n.pid = static_cast<pid_t>(pid);
      n.local = local != 0;
      out.push_back(std::move(n));
    }
  }
  return out;
}

bool process_alive(pid_t pid) {
  if (pid <= 1) return false;
  int status = 0;
  if (::waitpid(pid, &status, WNOHANG) == pid) return false;  // our child, now reaped
  return ::kill(pid, 0) == 0 || errno == EPERM;
}

std::string log_tail(const std::string& path, int lines) {
  std::ifstream f(path);
  std::deque<std::string> last;
  std::string line;
  while (std::getline(f, line)) {
    last.push_back(line);
    if (static_cast<int>(last.size()) > lines) last.pop_front();
  }
  std::string out;
  for (const auto& l : last) out += "    " + l + "\n";
  return out;
}

}  // namespace troupe::cluster
