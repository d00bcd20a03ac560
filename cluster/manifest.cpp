#include "cluster/manifest.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace troupe::cluster {

namespace {

// Collects errors with the file name; keys are shown as dotted paths
// ("nodes[1].devices[0].type").
// Floats print with up to 6 significant digits in messages.
std::string num_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

struct checker {
  std::string file;
  std::vector<std::string> errors;

  void error(int line, const std::string& key, const std::string& what) {
    std::string m = file;
    if (line > 0) m += ":" + std::to_string(line);
    m += ": ";
    if (!key.empty()) m += key + ": ";
    errors.push_back(m + what);
  }
  static int line_of(const toml::node& n) { return static_cast<int>(n.source().begin.line); }

  // Unknown keys of a table are errors.
  void only_keys(const toml::table& t, const std::string& where,
                 std::initializer_list<std::string_view> allowed) {
    for (const auto& [k, v] : t) {
      if (std::find(allowed.begin(), allowed.end(), k.str()) != allowed.end()) continue;
      std::string list;
      for (auto a : allowed) list += (list.empty() ? "" : ", ") + std::string(a);
      error(line_of(v), where.empty() ? std::string(k.str()) : where + "." + std::string(k.str()),
            "unknown key (expected one of: " + list + ")");
    }
  }

  const toml::table* table(const toml::table& parent, std::string_view key,
                           const std::string& where, bool required) {
    const auto* n = parent.get(key);
    const std::string path = where.empty() ? std::string(key) : where + "." + std::string(key);
    if (!n) {
      if (required) error(line_of(parent), path, "missing (a table)");
      return nullptr;
    }
    if (!n->is_table()) {
      error(line_of(*n), path, "expected a table");
      return nullptr;
    }
    return n->as_table();
  }

  // A string value; `out` keeps its default when absent.
  void str(const toml::table& t, std::string_view key, const std::string& where, std::string& out,
           bool required = false) {
    const std::string path = where.empty() ? std::string(key) : where + "." + std::string(key);
    const auto* n = t.get(key);
    if (!n) {
      if (required) error(line_of(t), path, "missing (a string)");
      return;
    }
    if (!n->is_string()) {
      error(line_of(*n), path, "expected a string");
      return;
    }
    out = n->as_string()->get();
  }

  template <class Int>
  void integer(const toml::table& t, std::string_view key, const std::string& where, Int& out,
               std::int64_t lo, std::int64_t hi, bool required = false) {
    const std::string path = where.empty() ? std::string(key) : where + "." + std::string(key);
    const auto* n = t.get(key);
    if (!n) {
      if (required) error(line_of(t), path, "missing (an integer)");
      return;
    }
    if (!n->is_integer()) {
      error(line_of(*n), path, "expected an integer");
      return;
    }
    const auto v = n->as_integer()->get();
    if (v < lo || v > hi) {
      error(line_of(*n), path,
            "must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                std::to_string(v));
      return;
    }
    out = static_cast<Int>(v);
  }

  void number(const toml::table& t, std::string_view key, const std::string& where, double& out,
              double lo, double hi) {
    const std::string path = where + "." + std::string(key);
    const auto* n = t.get(key);
    if (!n) return;
    if (!n->is_number()) {
      error(line_of(*n), path, "expected a number");
      return;
    }
    const double v = n->value<double>().value_or(0.0);
    if (!(v >= lo && v <= hi)) {
      error(line_of(*n), path,
            "must be in [" + num_text(lo) + ", " + num_text(hi) + "], got " + num_text(v));
      return;
    }
    out = v;
  }

  void boolean(const toml::table& t, std::string_view key, const std::string& where, bool& out) {
    const auto* n = t.get(key);
    if (!n) return;
    if (!n->is_boolean()) {
      error(line_of(*n), where + "." + std::string(key), "expected true or false");
      return;
    }
    out = n->as_boolean()->get();
  }
};

bool valid_name(std::string_view s) {
  if (s.empty() || s.size() > 64) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
  });
}

bool valid_cores(std::string_view s) {
  auto num = [](std::string_view x) {
    return !x.empty() && x.size() <= 4 && std::all_of(x.begin(), x.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c));
    });
  };
  const auto dash = s.find('-');
  if (dash == std::string_view::npos) return num(s);
  const auto a = s.substr(0, dash), b = s.substr(dash + 1);
  return num(a) && num(b) && std::stoi(std::string(a)) <= std::stoi(std::string(b));
}

const std::set<std::string>& weight_formats() {
  static const std::set<std::string> f{"f32", "f16", "bf16", "q8_0", "int8", "q4_0", "int4"};
  return f;
}

void parse_device(checker& c, const toml::table& t, const std::string& where, device_entry& d) {
  c.only_keys(t, where, {"type", "cores", "index", "memory"});
  d.line = checker::line_of(t);
  std::string type;
  c.str(t, "type", where, type, true);
  if (type == "cpu") {
    d.type = device_type::cpu;
  } else if (type == "cuda") {
    d.type = device_type::cuda;
  } else if (type == "npu") {
    d.type = device_type::npu;
  } else if (!type.empty()) {
    c.error(checker::line_of(*t.get("type")), where + ".type",
            "expected cpu, cuda or npu, got '" + type + "'");
  }
  if (const auto* n = t.get("cores")) {
    if (d.type != device_type::cpu) {
      c.error(checker::line_of(*n), where + ".cores",
              "only a cpu device has cores (a " + type + " device has an index)");
    } else if (n->is_string()) {
      d.cores = n->as_string()->get();
      if (!valid_cores(d.cores))
        c.error(checker::line_of(*n), where + ".cores",
                "expected a core (\"3\") or a range (\"0-7\"), got '" + d.cores + "'");
    } else if (n->is_integer()) {
      const auto v = n->as_integer()->get();
      if (v < 0 || v > 9999)
        c.error(checker::line_of(*n), where + ".cores", "a core number must be in [0, 9999]");
      else
        d.cores = std::to_string(v);
    } else {
      c.error(checker::line_of(*n), where + ".cores", "expected a string (\"0-7\") or an integer");
    }
  }
  if (const auto* n = t.get("index")) {
    if (d.type == device_type::cpu)
      c.error(checker::line_of(*n), where + ".index", "a cpu device has cores, not an index");
    else
      c.integer(t, "index", where, d.index, 0, 255);
  }
  if (const auto* n = t.get("memory")) {
    std::optional<std::uint64_t> b;
    if (n->is_string()) b = parse_bytes(n->as_string()->get());
    if (n->is_integer() && n->as_integer()->get() > 0)
      b = static_cast<std::uint64_t>(n->as_integer()->get());
    if (!b)
      c.error(checker::line_of(*n), where + ".memory",
              "expected a size such as \"16GiB\", \"512MiB\" or a byte count");
    else
      d.memory_bytes = *b;
  }
}

void parse_node(checker& c, const toml::table& t, const std::string& where, node_entry& n) {
  c.only_keys(t, where, {"name", "host", "port", "devices", "model_path", "role"});
  n.line = checker::line_of(t);
  c.str(t, "name", where, n.name, true);
  if (t.get("name") && !n.name.empty() && !valid_name(n.name))
    c.error(checker::line_of(*t.get("name")), where + ".name",
            "'" + n.name + "': use letters, digits, '-' and '_' (at most 64)");
  c.str(t, "host", where, n.host, true);
  if (t.get("host") && n.host.empty())
    c.error(checker::line_of(*t.get("host")), where + ".host", "must not be empty");
  if (n.host == "0.0.0.0" || n.host == "::")
    c.error(checker::line_of(*t.get("host")), where + ".host",
            "binding every interface needs an explicit address of this machine (the control plane "
            "must not listen everywhere)");
  c.integer(t, "port", where, n.port, 1, 65535, true);
  c.str(t, "model_path", where, n.model_path);
  c.str(t, "role", where, n.role);
  if (n.role != "stages" && n.role != "kv" && n.role != "head")
    c.error(checker::line_of(*t.get("role")), where + ".role",
            "'" + n.role +
                "': \"stages\" (the default), \"kv\" (only the KV store) or \"head\" (the head "
                "without stages)");
  const auto* devs = t.get("devices");
  if (!devs) {
    c.error(n.line, where + ".devices",
            "missing (an array of device tables, e.g. devices = [{ type = \"cpu\" }])");
    return;
  }
  if (devs->is_array() && devs->as_array()->empty()) {
    c.error(checker::line_of(*devs), where + ".devices", "a node needs at least one device");
    return;
  }
  if (!devs->is_array() || !devs->as_array()->is_array_of_tables()) {
    c.error(checker::line_of(*devs), where + ".devices", "expected an array of tables");
    return;
  }
  const auto& arr = *devs->as_array();
  for (std::size_t i = 0; i < arr.size(); ++i) {
    device_entry d;
    parse_device(c, *arr[i].as_table(), where + ".devices[" + std::to_string(i) + "]", d);
    n.devices.push_back(std::move(d));
  }
}

}  // namespace

const char* to_string(device_type t) {
  switch (t) {
    case device_type::cpu:
      return "cpu";
    case device_type::cuda:
      return "cuda";
    case device_type::npu:
      return "npu";
  }
  return "?";
}

std::string device_entry::spec() const {
  if (type == device_type::cpu) return cores.empty() ? "cpu" : "cpu:" + cores;
  return std::string(to_string(type)) + ":" + std::to_string(index);
}

const node_entry* manifest::node(std::string_view n) const {
  for (const auto& x : nodes)
    if (x.name == n) return &x;
  return nullptr;
}

std::string manifest::model_path_of(const node_entry& n) const {
  const std::string p = n.model_path.empty() ? model.path : n.model_path;
  if (p == "bundled" || p.empty() || std::filesystem::path(p).is_absolute()) return p;
  return (std::filesystem::path(dir) / p).lexically_normal().string();
}

bool is_loopback(std::string_view host) {
  return host == "localhost" || host.starts_with("127.") || host == "::1";
}

std::string manifest_error::text() const {
  std::string s;
  for (const auto& m : messages) s += m + "\n";
  return s;
}

std::optional<std::uint64_t> parse_bytes(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  std::uint64_t v = 0;
  std::size_t digits = 0;
  for (; i < s.size() && std::isdigit(static_cast<unsigned char>(s[i])); ++i, ++digits) {
    if (v > (UINT64_MAX - 9) / 10) return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(s[i] - '0');
  }
  if (digits == 0) return std::nullopt;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  std::string unit(s.substr(i));
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  static const std::map<std::string, std::uint64_t> units{
      {"", 1},
      {"b", 1},
      {"k", 1ull << 10},
      {"kb", 1000},
      {"kib", 1ull << 10},
      {"m", 1ull << 20},
      {"mb", 1000000},
      {"mib", 1ull << 20},
      {"g", 1ull << 30},
      {"gb", 1000000000},
      {"gib", 1ull << 30},
      {"t", 1ull << 40},
      {"tb", 1000000000000},
      {"tib", 1ull << 40},
  };
  auto it = units.find(unit);
  if (it == units.end() || v == 0) return std::nullopt;
  if (v > UINT64_MAX / it->second) return std::nullopt;
  return v * it->second;
}

std::expected<manifest, manifest_error> load_manifest(const std::string& path) {
  constexpr std::size_t cap = 1u << 20;
  // A device or a pipe (a symlink to /dev/zero, say) never ends: only
  // regular files are read, and never more than the cap.
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (!ec && std::filesystem::exists(st) && !std::filesystem::is_regular_file(st))
    return std::unexpected(manifest_error{{path + ": not a regular file; not a manifest"}});
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::unexpected(manifest_error{{path + ": cannot read the manifest"}});
  std::string text(cap + 1, '\0');
  f.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(f.gcount()));
  if (text.size() > cap)
    return std::unexpected(manifest_error{{path + ": larger than 1 MiB; not a manifest"}});
  return parse_manifest(text, path);
}

std::expected<manifest, manifest_error> parse_manifest(std::string_view text,
                                                       const std::string& path) {
  checker c;
  c.file = path;
  toml::table root;
  try {
    root = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    c.error(static_cast<int>(e.source().begin.line), "",
            "not valid TOML: " + std::string(e.description()));
    return std::unexpected(manifest_error{std::move(c.errors)});
  }
  manifest m;
  m.path = path;
  m.dir = std::filesystem::path(path).parent_path().string();
  if (m.dir.empty()) m.dir = ".";
  c.only_keys(root, "",
              {"cluster", "model", "kv", "parallelism", "router", "encoders", "media", "placement",
               "scheduler", "transport", "nodes"});

  if (const auto* t = c.table(root, "cluster", "", true)) {
    c.only_keys(*t, "cluster", {"name", "head", "standby", "certs", "launch"});
    c.str(*t, "name", "cluster", m.name, true);
    if (t->get("name") && !m.name.empty() && !valid_name(m.name))
      c.error(checker::line_of(*t->get("name")), "cluster.name",
              "'" + m.name + "': use letters, digits, '-' and '_' (at most 64)");
    c.str(*t, "head", "cluster", m.head, true);
    // Else the cross-check below is skipped and head_node() derefs null.
    if (t->get("head") && t->get("head")->is_string() && m.head.empty())
      c.error(checker::line_of(*t->get("head")), "cluster.head", "must not be empty");
    c.str(*t, "standby", "cluster", m.standby);
    if (t->get("standby") && t->get("standby")->is_string() && m.standby.empty())
      c.error(checker::line_of(*t->get("standby")), "cluster.standby", "must not be empty");
    std::string certs;
    c.str(*t, "certs", "cluster", certs, true);
    if (!certs.empty())
      m.certs_dir = std::filesystem::path(certs).is_absolute()
                        ? certs
                        : (std::filesystem::path(m.dir) / certs).lexically_normal().string();
    c.str(*t, "launch", "cluster", m.launch);
    if (t->get("launch") && m.launch.find("{host}") == std::string::npos)
      c.error(checker::line_of(*t->get("launch")), "cluster.launch",
              "must contain {host} (where the node runs)");
  }

  if (const auto* t = c.table(root, "model", "", false)) {
    c.only_keys(*t, "model", {"path", "quant", "overrides", "kv_type", "ctx"});
    c.str(*t, "path", "model", m.model.path);
    if (m.model.path.empty() && t->get("path"))
      c.error(checker::line_of(*t->get("path")), "model.path", "must not be empty");
    c.str(*t, "quant", "model", m.model.quant);
    if (!m.model.quant.empty() && !weight_formats().count(m.model.quant))
      c.error(checker::line_of(*t->get("quant")), "model.quant",
              "unknown weight format '" + m.model.quant + "'");
    c.str(*t, "kv_type", "model", m.model.kv_type);
    if (m.model.kv_type != "f32" && m.model.kv_type != "f16" && m.model.kv_type != "int8")
      c.error(checker::line_of(*t->get("kv_type")), "model.kv_type",
              "expected f32, f16 or int8, got '" + m.model.kv_type + "'");
    c.integer(*t, "ctx", "model", m.model.ctx_tokens, 16, std::int64_t{1} << 24);
    if (const auto* o = c.table(*t, "overrides", "model", false)) {
      for (const auto& [k, v] : *o) {
        const std::string key = "model.overrides.\"" + std::string(k.str()) + "\"";
        if (!v.is_string()) {
          c.error(checker::line_of(v), key, "expected a weight format string");
          continue;
        }
        const std::string f = v.as_string()->get();
        if (!weight_formats().count(f))
          c.error(checker::line_of(v), key, "unknown weight format '" + f + "'");
        m.model.overrides.emplace_back(std::string(k.str()), f);
      }
    }
  }

  if (const auto* t = c.table(root, "parallelism", "", false)) {
    c.only_keys(*t, "parallelism", {"pipeline_stages", "tensor_parallel", "replicas"});
    // "auto" (stored as `when_auto`) or a number in [1, hi].
    auto auto_or = [&](std::string_view key, int& out, int when_auto, int hi, const char* what) {
      const auto* n = t->get(key);
      if (!n) return;
      if (n->is_string() && n->as_string()->get() == "auto")
        out = when_auto;
      else if (n->is_integer())
        c.integer(*t, key, "parallelism", out, 1, hi);
      else
        c.error(checker::line_of(*n), "parallelism." + std::string(key),
                std::string("expected \"auto\" or a number of ") + what);
    };
    auto_or("pipeline_stages", m.parallelism.pipeline_stages, 0, 1024, "stages");
    if (const auto* n = t->get("tensor_parallel");
        n && n->is_string() && n->as_string()->get() == "auto")
      c.error(checker::line_of(*n), "parallelism.tensor_parallel",
              "\"auto\" is not built (the cluster does not choose tensor-parallel groups): give "
              "a number of ranks per stage");
    else
      auto_or("tensor_parallel", m.parallelism.tensor_parallel, 1, 256, "ranks");
    auto_or("replicas", m.parallelism.replicas, 0, 256, "replicas");
  }

  if (const auto* t = c.table(root, "router", "", false)) {
    c.only_keys(*t, "router", {"prefix", "max_imbalance", "min_prefix_share"});
    c.boolean(*t, "prefix", "router", m.router.prefix);
    c.integer(*t, "max_imbalance", "router", m.router.max_imbalance, 0, 1000000);
    c.number(*t, "min_prefix_share", "router", m.router.min_prefix_share, 0.0, 1.0);
  }

  int vision_max_line = 0;
  if (const auto* t = c.table(root, "media", "", false)) {
    auto& e = m.media;
    c.only_keys(*t, "media",
                {"max_images", "max_audios", "max_videos", "video_frames", "max_video_frames",
                 "max_video_seconds", "max_video_side"});
    c.integer(*t, "max_images", "media", e.max_images, 0, 1024);
    c.integer(*t, "max_audios", "media", e.max_audios, 0, 1024);
    c.integer(*t, "max_videos", "media", e.max_videos, 0, 64);
    c.integer(*t, "max_video_frames", "media", e.max_video_frames, 1, 1024);
    c.integer(*t, "video_frames", "media", e.video_frames, 1, 1024);
    if (e.video_frames > e.max_video_frames)
      c.error(checker::line_of(t->get("video_frames") ? *t->get("video_frames") : *t),
              "media.video_frames",
              std::to_string(e.video_frames) + " is above max_video_frames (" +
                  std::to_string(e.max_video_frames) + ")");
    c.number(*t, "max_video_seconds", "media", e.max_video_seconds, 0.1, 86400);
    c.integer(*t, "max_video_side", "media", e.max_video_side, 16, 16384);
  }

  if (const auto* t = c.table(root, "encoders", "", false)) {
    c.only_keys(*t, "encoders", {"vision"});
    if (const auto* v = c.table(*t, "vision", "encoders", false)) {
      auto& e = m.encoders.vision;
      c.only_keys(*v, "encoders.vision",
                  {"min", "max", "up_queue", "up_latency_ms", "up_after_s", "down_after_s"});
      c.integer(*v, "min", "encoders.vision", e.min, 1, 1024);
      c.integer(*v, "max", "encoders.vision", e.max, 1, 1024);
      if (!v->get("max")) e.max = std::max(e.max, e.min);
      if (v->get("max")) vision_max_line = checker::line_of(*v->get("max"));
      if (e.max < e.min)
        c.error(checker::line_of(v->get("max") ? *v->get("max") : *v), "encoders.vision.max",
                std::to_string(e.max) + " is below min (" + std::to_string(e.min) + ")");
      c.number(*v, "up_queue", "encoders.vision", e.up_queue, 0.5, 1e6);
      c.number(*v, "up_latency_ms", "encoders.vision", e.up_latency_ms, 1, 3.6e6);
      c.number(*v, "up_after_s", "encoders.vision", e.up_after_s, 0, 86400);
      c.number(*v, "down_after_s", "encoders.vision", e.down_after_s, 0, 86400);
    }
  }

  if (const auto* t = c.table(root, "placement", "", false)) {
    c.only_keys(*t, "placement",
                {"wait_for_nodes_s", "rebalance", "interval_s", "gain_threshold", "cooldown_s",
                 "memory_pressure", "measure_s", "load_half_life_s"});
    c.number(*t, "wait_for_nodes_s", "placement", m.placement.wait_for_nodes_s, 0, 86400);
    c.boolean(*t, "rebalance", "placement", m.placement.rebalance);
    c.number(*t, "interval_s", "placement", m.placement.interval_s, 0.5, 86400);
    c.number(*t, "gain_threshold", "placement", m.placement.gain_threshold, 0, 10);
    c.number(*t, "cooldown_s", "placement", m.placement.cooldown_s, 0, 86400);
    c.number(*t, "memory_pressure", "placement", m.placement.memory_pressure, 0.05, 1);
    c.number(*t, "measure_s", "placement", m.placement.measure_s, 2, 3600);
    c.number(*t, "load_half_life_s", "placement", m.placement.load_half_life_s, 0, 86400);
  }

  if (const auto* t = c.table(root, "scheduler", "", false)) {
    c.only_keys(*t, "scheduler",
                {"queue_limit", "max_running", "token_budget", "micro_batches", "max_model_len",
                 "allow_long_context", "prefix_caching", "stream_idle_s"});
    c.integer(*t, "queue_limit", "scheduler", m.scheduler.queue_limit, 1, 1 << 20);
    c.integer(*t, "max_running", "scheduler", m.scheduler.max_running, 1, 1 << 16);
    c.integer(*t, "token_budget", "scheduler", m.scheduler.token_budget, 16, 1 << 20);
    c.integer(*t, "micro_batches", "scheduler", m.scheduler.micro_batches, 0, 64);
    c.integer(*t, "max_model_len", "scheduler", m.scheduler.max_model_len, 1, 1 << 24);
    c.boolean(*t, "allow_long_context", "scheduler", m.scheduler.allow_long_context);
    c.boolean(*t, "prefix_caching", "scheduler", m.scheduler.prefix_caching);
    c.number(*t, "stream_idle_s", "scheduler", m.scheduler.stream_idle_s, 0.1, 3600);
    if (m.scheduler.allow_long_context && m.scheduler.max_model_len == 0)
      c.error(checker::line_of(*t->get("allow_long_context")), "scheduler.allow_long_context",
              "allows a max_model_len past the model's positions, and none is set");
  }

  if (const auto* t = c.table(root, "kv", "", false)) {
    c.only_keys(*t, "kv", {"host_tokens", "disk_tokens", "disk_dir", "store_tokens", "store_node"});
    c.str(*t, "store_node", "kv", m.kv.store_node);
    if (!m.kv.store_node.empty() && m.kv.store_tokens == 0)
      c.error(checker::line_of(*t->get("store_node")), "kv.store_node",
              "set without kv.store_tokens: there is no store to put there");
    c.integer(*t, "host_tokens", "kv", m.kv.host_tokens, 0, std::int64_t{1} << 30);
    c.integer(*t, "disk_tokens", "kv", m.kv.disk_tokens, 0, std::int64_t{1} << 32);
    c.integer(*t, "store_tokens", "kv", m.kv.store_tokens, 0, std::int64_t{1} << 30);
    c.str(*t, "disk_dir", "kv", m.kv.disk_dir);
    if (!m.kv.disk_dir.empty() && std::filesystem::path(m.kv.disk_dir).is_relative())
      m.kv.disk_dir = (std::filesystem::path(m.dir) / m.kv.disk_dir).string();
    // A tier smaller than one block (16 tokens) would hold nothing, and a
    // folder without a disk tier would be ignored: both are refused.
    for (const auto* key : {"host_tokens", "disk_tokens", "store_tokens"}) {
      const auto v = std::string_view(key) == "host_tokens"   ? m.kv.host_tokens
                     : std::string_view(key) == "disk_tokens" ? m.kv.disk_tokens
                                                              : m.kv.store_tokens;
      if (v > 0 && v < 16)
        c.error(checker::line_of(*t->get(key)), std::string("kv.") + key,
                "holds no KV block of 16 tokens; 0 turns the tier off");
    }
    if (!m.kv.disk_dir.empty() && m.kv.disk_tokens == 0)
      c.error(checker::line_of(*t->get("disk_dir")), "kv.disk_dir",
              "set without kv.disk_tokens: there is no disk tier to put there");
    if ((m.kv.host_tokens > 0 || m.kv.disk_tokens > 0 || m.kv.store_tokens > 0) &&
        !m.scheduler.prefix_caching)
      c.error(checker::line_of(*t), "kv",
              "host, disk and store tiers hold named (prefix-cached) blocks: they need "
              "scheduler.prefix_caching = true");
  }

  if (const auto* t = c.table(root, "transport", "", false)) {
    c.only_keys(*t, "transport", {"tls", "net_devices", "timeout_ms"});
    c.str(*t, "tls", "transport", m.transport.tls);
    c.str(*t, "net_devices", "transport", m.transport.net_devices);
    c.integer(*t, "timeout_ms", "transport", m.transport.timeout_ms, 100, 3600000);
  }

  if (const auto* n = root.get("nodes")) {
    if (!n->is_array() || !n->as_array()->is_array_of_tables()) {
      c.error(checker::line_of(*n), "nodes", "expected [[nodes]] tables");
    } else {
      const auto& arr = *n->as_array();
      for (std::size_t i = 0; i < arr.size(); ++i) {
        node_entry e;
        parse_node(c, *arr[i].as_table(), "nodes[" + std::to_string(i) + "]", e);
        m.nodes.push_back(std::move(e));
      }
    }
  }
  if (m.nodes.empty()) c.error(0, "nodes", "the cluster has no nodes (add [[nodes]] tables)");

  // Cross-checks: unique names and addresses, the head exists, every
  // non-loopback node can be launched.
  std::map<std::string, int> names;
  std::map<std::pair<std::string, int>, std::string> endpoints;
  for (std::size_t i = 0; i < m.nodes.size(); ++i) {
    const auto& e = m.nodes[i];
    const std::string where = "nodes[" + std::to_string(i) + "]";
    if (e.name == "client")
      c.error(e.line, where + ".name", "'client' is reserved (the identity of troupe's clients)");
    if (!e.name.empty()) {
      if (auto [it, fresh] = names.emplace(e.name, e.line); !fresh)
        c.error(e.line, where + ".name",
                "'" + e.name + "' is already the name of the node at line " +
                    std::to_string(it->second));
    }
    if (!e.host.empty() && e.port > 0) {
      if (auto [it, fresh] = endpoints.emplace(std::make_pair(e.host, e.port), e.name); !fresh)
        c.error(e.line, where + ".port",
                e.host + ":" + std::to_string(e.port) + " is already node '" + it->second +
                    "''s address");
    }
    std::set<std::string> cpu_cores;
    std::set<std::pair<int, int>> indices;
    for (std::size_t k = 0; k < e.devices.size(); ++k) {
      const auto& d = e.devices[k];
      const std::string dw = where + ".devices[" + std::to_string(k) + "]";
      if (d.type == device_type::cpu) {
        if (!cpu_cores.insert(d.cores).second)
          c.error(d.line, dw, "the same cpu device (" + d.spec() + ") twice on one node");
      } else if (!indices.insert({static_cast<int>(d.type), d.index}).second) {
        c.error(d.line, dw, "the same device (" + d.spec() + ") twice on one node");
      }
    }
  }
  if (!m.head.empty() && !m.nodes.empty() && !m.node(m.head))
    c.error(0, "cluster.head", "'" + m.head + "' is not the name of any node");
  if (!m.standby.empty() && !m.nodes.empty()) {
    if (const auto* sb = m.node(m.standby); !sb)
      c.error(0, "cluster.standby", "'" + m.standby + "' is not the name of any node");
    else if (m.standby == m.head)
      c.error(0, "cluster.standby", "'" + m.standby + "' is the head itself: name another node");
    else if (sb->role == "kv")
      c.error(sb->line, "cluster.standby",
              "'" + m.standby + "' is of role \"kv\": a standby head runs the scheduler");
  }
  // The KV store's node: named, else the node of role "kv", else the head.
  {
    std::vector<const node_entry*> kv_nodes;
    for (const auto& e : m.nodes)
      if (e.role == "kv")
        kv_nodes.push_back(&e);
      else if (e.role == "head" && e.name != m.head && e.name != m.standby)
        c.error(e.line, "nodes." + e.name + ".role",
                "\"head\", but the cluster's head is '" + m.head + "'" +
                    (m.standby.empty() ? "" : " and its standby '" + m.standby + "'"));
    if (kv_nodes.size() > 1)
      c.error(kv_nodes[1]->line, "nodes." + kv_nodes[1]->name + ".role",
              "a second node of role \"kv\" (one KV store per cluster)");
    for (const auto* e : kv_nodes) {
      if (e->name == m.head)
        c.error(e->line, "nodes." + e->name + ".role",
                "the head runs the scheduler and takes stages: it cannot be of role \"kv\"");
      if (m.kv.store_tokens == 0)
        c.error(e->line, "nodes." + e->name + ".role",
                "\"kv\" without kv.store_tokens: the node would hold nothing");
    }
    if (m.kv.store_node.empty() && m.kv.store_tokens > 0)
      m.kv.store_node = kv_nodes.empty() ? m.head : kv_nodes.front()->name;
    if (!m.kv.store_node.empty() && !m.nodes.empty() && !m.node(m.kv.store_node))
      c.error(0, "kv.store_node", "'" + m.kv.store_node + "' is not the name of any node");
    for (const auto* e : kv_nodes)
      if (m.kv.store_tokens > 0 && e->name != m.kv.store_node)
        c.error(e->line, "nodes." + e->name + ".role",
                "\"kv\", but kv.store_node puts the store on '" + m.kv.store_node + "'");
  }
  const int devices_total = [&] {
    int n = 0;
    for (const auto& e : m.nodes)
      if (e.holds_stages()) n += static_cast<int>(e.devices.size());
    return n;
  }();
  if (m.parallelism.pipeline_stages > 0 && devices_total > 0 &&
      m.parallelism.pipeline_stages * m.parallelism.tensor_parallel > devices_total)
    c.error(0, "parallelism",
            std::to_string(m.parallelism.pipeline_stages) + " stages x " +
                std::to_string(m.parallelism.tensor_parallel) + " tensor-parallel ranks need " +
                std::to_string(m.parallelism.pipeline_stages * m.parallelism.tensor_parallel) +
                " devices; the nodes have " + std::to_string(devices_total));
  const int stage_nodes = static_cast<int>(std::count_if(
      m.nodes.begin(), m.nodes.end(), [](const auto& e) { return e.holds_stages(); }));
  if (m.parallelism.replicas > 1 && !m.nodes.empty()) {
    const int per = std::max(1, m.parallelism.pipeline_stages) * m.parallelism.tensor_parallel;
    if (m.parallelism.replicas * per > stage_nodes)
      c.error(0, "parallelism.replicas",
              std::to_string(m.parallelism.replicas) + " replicas" +
                  (per > 1 ? " of " + std::to_string(per) +
                                 (m.parallelism.tensor_parallel > 1 ? " tensor-parallel ranks"
                                                                    : " stages")
                           : std::string{}) +
                  " need at least " + std::to_string(m.parallelism.replicas * per) +
                  " nodes holding stages (each replica has nodes of its own); the manifest has " +
                  std::to_string(stage_nodes));
  }
  // One encoder replica per node at most (an agent runs one of a kind).
  if (stage_nodes == 0 && !m.nodes.empty())
    c.error(0, "nodes", "no node may hold stages (every node is of role \"kv\" or \"head\")");
  // The first replica runs on the head, the others on nodes holding stages.
  const auto* head_node = m.head.empty() ? nullptr : m.node(m.head);
  const int encoder_hosts = stage_nodes + (head_node && head_node->role == "head" ? 1 : 0);
  if (m.encoders.vision.max > encoder_hosts && stage_nodes > 0)
    c.error(vision_max_line, "encoders.vision.max",
            std::to_string(m.encoders.vision.max) +
                " replicas of the vision encoder need as many nodes holding stages (one per "
                "node); the manifest has " +
                std::to_string(encoder_hosts));
  if (m.parallelism.replicas != 1 && m.kv.store_tokens > 0)
    c.error(0, "kv.store_tokens",
            "a KV store serves one replica so far: leave it out, or set parallelism.replicas = 1");
  if (const int k = m.parallelism.tensor_parallel; k > 1) {
    // Each rank of a tensor-parallel stage is a node (its device).
    const std::string tp = " with tensor_parallel = " + std::to_string(k);
    if (m.parallelism.pipeline_stages == 0)
      c.error(0, "parallelism.pipeline_stages",
              "\"auto\"" + tp +
                  ": give a number (the planner places one device per stage; the stages' ranks "
                  "are runs of " +
                  std::to_string(k) + " nodes in the manifest's order)");
    if (m.parallelism.replicas == 0)
      c.error(0, "parallelism.replicas", "\"auto\"" + tp + ": give a number");
    const int need = std::max(1, m.parallelism.replicas) * m.parallelism.pipeline_stages * k;
    if (m.parallelism.replicas <= 1 && m.parallelism.pipeline_stages > 0 && !m.nodes.empty() &&
        need > stage_nodes)
      c.error(0, "parallelism",
              std::to_string(m.parallelism.pipeline_stages) + " stages of " + std::to_string(k) +
                  " tensor-parallel ranks need " + std::to_string(need) +
                  " nodes holding stages (one device each); the manifest has " +
                  std::to_string(stage_nodes));
    if (m.kv.store_tokens > 0 || m.kv.host_tokens > 0 || m.kv.disk_tokens > 0)
      c.error(0, "kv", "the KV host, disk and remote tiers" + tp + " are not supported yet");
  }
  if (!c.errors.empty()) return std::unexpected(manifest_error{std::move(c.errors)});
  return m;
}

}  // namespace troupe::cluster
