#pragma once
// Per-process scratch paths: ctest runs each test case as its own process,
// in parallel, so shared names in the temp folder would race. Every path
// handed out is removed (file or folder) when the process that asked for it
// exits normally, so test runs do not pile models up in the temp folder.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <mutex>
#include <string>
#include <vector>

namespace troupe::test {

namespace temp_detail {

struct registry {
  std::mutex m;
  std::vector<std::string> paths;
  pid_t owner = ::getpid();
  ~registry() {
    if (::getpid() != owner) return;  // a forked child leaves its parent's files
    for (const auto& p : paths) {
      std::error_code ec;
      std::filesystem::remove_all(p, ec);
    }
  }
};

inline registry& paths() {
  static registry r;
  return r;
}

}  // namespace temp_detail

inline std::string temp_path(const std::string& name) {
  std::string p = ::testing::TempDir() + "/troupe-" + std::to_string(::getpid()) + "-" + name;
  auto& r = temp_detail::paths();
  std::lock_guard lock(r.m);
  r.paths.push_back(p);
  return p;
}

}  // namespace troupe::test
