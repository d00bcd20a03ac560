#include "actors/device_spec.hpp"

#include <pthread.h>
#include <sched.h>

#include <charconv>
#include <set>

namespace troupe::actors {

namespace {

using kernels::errc;
using kernels::make_error;

bool parse_int(std::string_view s, int& out) {
  if (s.empty() || s.size() > 6) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && p == s.data() + s.size() && out >= 0;
}

std::set<int> allowed_cores() {
  std::set<int> out;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) out.insert(c);
  return out;
}

}  // namespace

kernels::result<std::vector<device_spec>> parse_devices(std::string_view list) {
  std::vector<device_spec> out;
  const auto allowed = allowed_cores();
  std::set<int> used;
  std::set<std::string> named;
  int cpus = 0;
  bool whole = false;
  std::size_t pos = 0;
  while (pos <= list.size()) {
    const auto comma = list.find(',', pos);
    const auto item =
        list.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    pos = comma == std::string_view::npos ? list.size() + 1 : comma + 1;
    if (item.empty())
      return make_error(errc::invalid_argument, "empty device in list '" + std::string(list) + "'");
    device_spec d;
    d.name = std::string(item);
    const auto colon = item.find(':');
    const auto kind = std::string(item.substr(0, colon));
    if (kind == "npu")
      return make_error(errc::device_unavailable,
                        "device '" + d.name + "': no backend runs on NPUs in this build");
    if (kind == "cuda" || device_kind_registered(kind)) {
      d.kind = kind;
      if (colon != std::string_view::npos && !parse_int(item.substr(colon + 1), d.index))
        return make_error(errc::invalid_argument,
                          "device '" + d.name + "': expected " + kind + " or " + kind + ":N");
      d.name = kind + ":" + std::to_string(d.index);
      if (!named.insert(d.name).second)
        return make_error(errc::invalid_argument,
                          "device '" + d.name + "' is named twice in the list");
      out.push_back(std::move(d));
      continue;
    }
    if (item == "cpu") {
      whole = true;
    } else if (item.starts_with("cpu:")) {
      auto r = item.substr(4);
      const auto dash = r.find('-');
      int a = 0, b = 0;
      const bool ok = dash == std::string_view::npos
                          ? (parse_int(r, a) && (b = a, true))
                          : (parse_int(r.substr(0, dash), a) && parse_int(r.substr(dash + 1), b));
      if (!ok || b < a)
        return make_error(errc::invalid_argument,
                          "device '" + d.name + "': expected cpu, cpu:N or cpu:A-B with A <= B");
      for (int c = a; c <= b; ++c) {
        if (!allowed.count(c))
          return make_error(errc::device_unavailable,
                            "device '" + d.name + "': core " + std::to_string(c) +
                                " does not exist or is not allowed for this process (" +
                                std::to_string(allowed.size()) + " cores allowed)");
        if (!used.insert(c).second)
          return make_error(errc::invalid_argument, "device '" + d.name + "': core " +
                                                        std::to_string(c) +
                                                        " belongs to another device of the list");
        d.cores.push_back(c);
      }
    } else {
      return make_error(errc::invalid_argument,
                        "unknown device '" + d.name + "' (expected cpu, cpu:N, cpu:A-B or cuda:N)");
    }
    ++cpus;
    out.push_back(std::move(d));
  }
  if (whole && cpus > 1)
    return make_error(errc::invalid_argument,
                      "'cpu' (every core) cannot be combined with other devices");
  return out;
}

void pin_current_thread(const std::vector<int>& cores) {
  if (cores.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cores) CPU_SET(c, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

}  // namespace troupe::actors
