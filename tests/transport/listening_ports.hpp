#pragma once

// The TCP addresses and ports a process listens on (Linux: its socket inodes matched
// against /proc/net/tcp and tcp6), for tests that aim at a process's
// listeners. pid 0 is this process.
#include <dirent.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace troupe::test {

/// The addresses ("IP:PORT", IPv4 as printed by ss) a process listens on.
inline std::vector<std::string> listening_addresses(int pid) {
  const std::string proc = pid == 0 ? std::string("/proc/self") : "/proc/" + std::to_string(pid);
  std::set<unsigned long> inodes;
  if (DIR* d = ::opendir((proc + "/fd").c_str())) {
    while (dirent* e = ::readdir(d)) {
      char target[256] = {};
      const std::string link = proc + "/fd/" + e->d_name;
      const ssize_t n = ::readlink(link.c_str(), target, sizeof target - 1);
      unsigned long ino = 0;
      if (n > 0 && std::sscanf(target, "socket:[%lu]", &ino) == 1) inodes.insert(ino);
    }
    ::closedir(d);
  }
  std::vector<std::string> out;
  for (const char* table : {"/net/tcp", "/net/tcp6"}) {
    std::ifstream f(proc + table);
    std::string line;
    std::getline(f, line);
    while (std::getline(f, line)) {
      std::istringstream in(line);
      std::string sl, local, remote, state, queues, timer, retr, uid, timeout;
      unsigned long ino = 0;
      in >> sl >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> ino;
      if (state != "0A" || !inodes.count(ino)) continue;
      const auto colon = local.rfind(':');
      if (colon == std::string::npos) continue;
      const unsigned port = static_cast<unsigned>(std::stoul(local.substr(colon + 1), nullptr, 16));
      const std::string ip = local.substr(0, colon);
      if (ip.size() == 8) {  // IPv4, little-endian hex
        const unsigned long v = std::stoul(ip, nullptr, 16);
        char buf[32];
        std::snprintf(buf, sizeof buf, "%lu.%lu.%lu.%lu:%u", v & 255, (v >> 8) & 255,
                      (v >> 16) & 255, (v >> 24) & 255, port);
        out.push_back(buf);
      } else {
        out.push_back("[" + ip + "]:" + std::to_string(port));
      }
    }
  }
  return out;
}

inline std::vector<unsigned> listening_ports(int pid) {
  std::set<unsigned> ports;
  for (const auto& a : listening_addresses(pid))
    ports.insert(static_cast<unsigned>(std::stoul(a.substr(a.rfind(':') + 1))));
  return {ports.begin(), ports.end()};
}

}  // namespace troupe::test
