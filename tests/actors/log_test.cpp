// The log formats: JSON lines that parse, with their tags and the message
// escaped; text lines with the node/actor tag.
#include "actors/log.hpp"

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>

#include <nlohmann/json.hpp>
#include <sstream>

namespace {

using namespace troupe::actors;

TEST(Logging, JsonLinesParseAndCarryTheirTags) {
  std::ostringstream out;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(out);
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("troupe", sink));
  logging::configure(logging::format::json, "node7");
  const std::string nasty = "quote \" backslash \\ newline \n tab \t bell \x07 utf-8 \xc3\xa9";
  logging::of("head").info("placed {}", nasty);
  logging::of("scheduler").warn("step {}", 3);
  std::istringstream lines(out.str());
  std::string line;
  std::vector<nlohmann::json> got;
  while (std::getline(lines, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << line;
    got.push_back(j);
  }
  ASSERT_EQ(got.size(), 2u) << out.str();
  EXPECT_EQ(got[0]["actor"], "head");
  EXPECT_EQ(got[0]["node"], "node7");
  EXPECT_EQ(got[0]["level"], "info");
  EXPECT_EQ(got[0]["msg"], "placed " + nasty);
  EXPECT_EQ(got[1]["actor"], "scheduler");
  EXPECT_EQ(got[1]["level"], "warning");
  EXPECT_EQ(got[1]["msg"], "step 3");
  EXPECT_EQ(got[0]["time"].get<std::string>().size(),
            std::string("2026-12-03T19:40:01.123").size());

  // Back to text: the node and the actor in the tag, the message as is.
  out.str("");
  logging::configure(logging::format::text, "node7");
  logging::of("head").info("plain");
  EXPECT_NE(out.str().find("[node7/head] plain"), std::string::npos) << out.str();
  logging::set_node("");
  out.str("");
  logging::of("agent").info("no node");
  EXPECT_NE(out.str().find("[agent] no node"), std::string::npos) << out.str();
}

TEST(Logging, FormatNames) {
  EXPECT_EQ(logging::parse_format("json").value(), logging::format::json);
  EXPECT_EQ(logging::parse_format("text").value(), logging::format::text);
  auto bad = logging::parse_format("yaml");
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().find("text or json"), std::string::npos);
}

}  // namespace
