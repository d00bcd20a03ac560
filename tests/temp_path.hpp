#pragma once
// Per-process scratch paths: ctest runs each test case as its own process,
// in parallel, so shared names in the temp folder would race.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>

namespace troupe::test {

inline std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/troupe-" + std::to_string(::getpid()) + "-" + name;
}

}  // namespace troupe::test
