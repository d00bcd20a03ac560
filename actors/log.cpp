#include "actors/log.hpp"

#include <spdlog/pattern_formatter.h>

#include <cstdio>
#include <ctime>
#include <map>
#include <memory>
#include <mutex>

namespace troupe::actors::logging {

namespace {

struct settings {
  std::mutex mtx;
  format fmt = format::text;
  std::string node;
  std::map<std::string, std::shared_ptr<spdlog::logger>> loggers;
};

settings& state() {
  static settings s;
  return s;
}

void escape_into(std::string& out, std::string_view s) {
  static const char* hex = "0123456789abcdef";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += static_cast<char>(c);  // UTF-8 passes through
        }
    }
  }
}

/// One JSON object per line; the node tag is fixed when the formatter is made.
class json_formatter final : public spdlog::formatter {
 public:
  explicit json_formatter(std::string node) : node_(std::move(node)) {}
  void format(const spdlog::details::log_msg& msg, spdlog::memory_buf_t& dest) override {
    const auto t = std::chrono::system_clock::to_time_t(msg.time);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(msg.time.time_since_epoch()).count() %
        1000;
    std::tm tm{};
    ::localtime_r(&t, &tm);
    char when[96];
    std::snprintf(when, sizeof when, "%04d-%02d-%02dT%02d:%02d:%02d.%03lld", tm.tm_year + 1900,
                  tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
                  static_cast<long long>(ms));
    const auto level = spdlog::level::to_string_view(msg.level);
    const auto line = json_line(when, std::string_view(level.data(), level.size()), node_,
                                std::string_view(msg.logger_name.data(), msg.logger_name.size()),
                                std::string_view(msg.payload.data(), msg.payload.size()));
    dest.append(line.data(), line.data() + line.size());
    dest.push_back('\n');
  }
  std::unique_ptr<spdlog::formatter> clone() const override {
    return std::make_unique<json_formatter>(node_);
  }

 private:
  std::string node_;
};

std::unique_ptr<spdlog::formatter> make_formatter(format f, const std::string& node) {
  if (f == format::json) return std::make_unique<json_formatter>(node);
  std::string tag;
  for (char c : node) {
    if (c == '%') tag += '%';
    tag += c;
  }
  return std::make_unique<spdlog::pattern_formatter>("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [" +
                                                     (tag.empty() ? "" : tag + "/") + "%n] %v");
}

}  // namespace

std::expected<format, std::string> parse_format(std::string_view name) {
  if (name == "text") return format::text;
  if (name == "json") return format::json;
  return std::unexpected("unknown log format '" + std::string(name) + "' (text or json)");
}

void configure(format f, std::string node) {
  auto& s = state();
  std::lock_guard lock(s.mtx);
  s.fmt = f;
  s.node = std::move(node);
  spdlog::set_formatter(make_formatter(s.fmt, s.node));  // every registered logger
}

void set_node(std::string node) {
  configure(current_format(), std::move(node));
}

format current_format() {
  auto& s = state();
  std::lock_guard lock(s.mtx);
  return s.fmt;
}

spdlog::logger& of(const std::string& actor) {
  auto& s = state();
  std::lock_guard lock(s.mtx);
  auto it = s.loggers.find(actor);
  if (it != s.loggers.end()) return *it->second;
  std::shared_ptr<spdlog::logger> l = spdlog::get(actor);
  if (!l) {
    const auto& sinks = spdlog::default_logger()->sinks();
    l = std::make_shared<spdlog::logger>(actor, sinks.begin(), sinks.end());
    l->set_formatter(make_formatter(s.fmt, s.node));
    l->set_level(spdlog::default_logger()->level());
    spdlog::register_logger(l);
  }
  s.loggers.emplace(actor, l);
  return *l;
}

std::string json_line(std::string_view time, std::string_view level, std::string_view node,
                      std::string_view actor, std::string_view msg) {
  std::string out = "{\"time\":\"";
  escape_into(out, time);
  out += "\",\"level\":\"";
  escape_into(out, level);
  out += "\",\"node\":\"";
  escape_into(out, node);
  out += "\",\"actor\":\"";
  escape_into(out, actor);
  out += "\",\"msg\":\"";
  escape_into(out, msg);
  out += "\"}";
  return out;
}

}  // namespace troupe::actors::logging
