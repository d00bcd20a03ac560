#pragma once

// Starting and stopping a cluster's node processes (`troupe up` / `down`):
// nodes on loopback addresses run as local processes of this machine; the
// others through the manifest's launch command template. Each runs in a
// session of its own (it outlives `troupe up --detach`), its output goes to
// a log file, and its pid is recorded in the cluster's run directory, so
// that `troupe down` can make sure it ended.

#include <sys/types.h>

#include <expected>
#include <string>
#include <vector>

#include "cluster/manifest.hpp"

namespace troupe::cluster {

struct launched_node {
  std::string node;
  pid_t pid = 0;    ///< the local process (for a remote node: its launch command)
  std::string log;  ///< its stdout and stderr
  bool local = true;
};

/// CERTS_DIR/run: logs and the pid file.
std::string run_dir(const manifest& m);

/// The launch command of node `n`: the template with {host}, {name},
/// {manifest} (absolute) and {troupe} (this program) replaced.
std::string launch_command(const manifest& m, const node_entry& n, const std::string& troupe_exe);

/// Starts node `n`: `troupe_exe node --manifest M --name N` here when its
/// host is a loopback address, else `sh -c <launch command>`.
std::expected<launched_node, std::string> launch_node(const manifest& m, const node_entry& n,
                                                      const std::string& troupe_exe);

/// Starts `argv` here in a session of its own, output to RUN/`name`.log
/// (what launch_node does for a local node; `troupe up --http` starts its
/// gateway with it).
std::expected<launched_node, std::string> launch_local(const manifest& m, const std::string& name,
                                                       std::vector<std::string> argv);

/// The pid file, one "NODE PID LOG" line per node.
std::expected<void, std::string> write_launched(const manifest& m,
                                                const std::vector<launched_node>& nodes);
std::vector<launched_node> read_launched(const manifest& m);

/// Whether process `pid` still runs (and is not a zombie of ours: reaped).
bool process_alive(pid_t pid);

/// The last `lines` lines of a log file (for error messages).
std::string log_tail(const std::string& path, int lines = 8);

}  // namespace troupe::cluster
