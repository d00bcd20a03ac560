// The progress display: a bar redrawn in place in a terminal, plain lines
// (only when the text changes) otherwise.
#include "cli/progress.hpp"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace {

using troupe::cli::progress;
using troupe::cli::progress_bar;

std::string read_all(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string s;
  char buf[256];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  return s;
}

TEST(Progress, Bars) {
  EXPECT_EQ(progress_bar(0, 4), "[....]");
  EXPECT_EQ(progress_bar(0.5, 4), "[##..]");
  EXPECT_EQ(progress_bar(1, 4), "[####]");
  EXPECT_EQ(progress_bar(7, 4), "[####]");
  EXPECT_EQ(progress_bar(-1, 4), "[....]");
  EXPECT_EQ(progress_bar(0.999, 10), "[#########.]");
}

TEST(Progress, PlainLinesWhenNotATerminal) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    progress p(f, false);
    p.update("loading", 1.0 / 3, "1/3 stages");
    p.update("loading", 1.0 / 3, "1/3 stages");  // unchanged: no line
    p.update("loading", 1.0, "3/3 stages");
    p.line("ready");
  }
  const auto out = read_all(f);
  std::fclose(f);
  EXPECT_EQ(out,
            "loading [########................]  33%  1/3 stages\n"
            "loading [########################] 100%  3/3 stages\n"
            "ready\n");
  EXPECT_EQ(out.find('\r'), std::string::npos);
}

TEST(Progress, RedrawnInPlaceInATerminal) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  {
    progress p(f, true);
    p.update("migrating", 0.25, "KV round 1");
    p.update("migrating", 0.5, "KV round 2");
    p.line("done");
  }
  const auto out = read_all(f);
  std::fclose(f);
  EXPECT_EQ(out,
            "\rmigrating [######..................]  25%  KV round 1\033[K"
            "\rmigrating [############............]  50%  KV round 2\033[K\n"
            "done\n");
}

}  // namespace
