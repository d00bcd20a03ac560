#!/usr/bin/env bash
# The gateway's own cost in time to first token (issue 26): TTFT at 32
# streamed clients over HTTP (troupe serve) against the same requests sent
# through the cluster's client actor, in one run (`troupe bench --http ...
# --compare-client`). On a small machine the gateway and the bench client
# take CPU from the nodes; with ISOLATE=1 (root, cgroup v1) the nodes run in
# one CPU cgroup (NODES_QUOTA, in hundredths of a core: 130) and the
# gateway and the bench client in another (FRONT_QUOTA: 70), so both paths
# leave the nodes the same CPU.
#
#   [ISOLATE=1] bench/gateway_ttft.sh [TROUPE_BINARY] [ROUNDS (3)]
set -euo pipefail
troupe=$(realpath "${1:-$(dirname "$0")/../build/cli/troupe}")
rounds=${2:-3}
dir=$(mktemp -d /tmp/troupe-ttft.XXXXXX)
manifest=$dir/local.toml
cp "$(dirname "$0")/../examples/local.toml" "$manifest"
port=$((20000 + RANDOM % 20000))
cg=/sys/fs/cgroup/cpu
serve_pid=
cleanup() {
  set +e
  [ -n "$serve_pid" ] && kill "$serve_pid" 2> /dev/null && wait "$serve_pid" 2> /dev/null
  "$troupe" down "$manifest" --timeout 60 > /dev/null 2>&1
  if [ "${ISOLATE:-}" = 1 ]; then
    echo $$ > $cg/cgroup.procs
    rmdir $cg/troupe-ttft-nodes $cg/troupe-ttft-front 2> /dev/null
  fi
}
trap cleanup EXIT
if [ "${ISOLATE:-}" = 1 ]; then
  for g in nodes front; do
    mkdir -p $cg/troupe-ttft-$g
    echo 10000 > $cg/troupe-ttft-$g/cpu.cfs_period_us
  done
  echo $((${NODES_QUOTA:-130} * 100)) > $cg/troupe-ttft-nodes/cpu.cfs_quota_us
  echo $((${FRONT_QUOTA:-70} * 100)) > $cg/troupe-ttft-front/cpu.cfs_quota_us
fi
for r in $(seq "$rounds"); do
  "$troupe" up "$manifest" --detach --timeout 300 > "$dir/up.log" 2>&1 || {
    tail "$dir/up.log" >&2
    exit 1
  }
  if [ "${ISOLATE:-}" = 1 ]; then
    for p in $(pgrep -f "troupe node --manifest $manifest"); do echo "$p" > $cg/troupe-ttft-nodes/cgroup.procs; done
    echo $$ > $cg/troupe-ttft-front/cgroup.procs
  fi
  "$troupe" serve "$manifest" --port "$port" --api-key ttft > "$dir/serve.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 100); do
    curl -s -o /dev/null "http://127.0.0.1:$port/health" && break
    sleep 0.1
  done
  line=$("$troupe" bench --http "http://127.0.0.1:$port" --api-key ttft --manifest "$manifest" \
    --compare-client -c 32 -n 320 --max-tokens 64 2>&1 | tail -1)
  echo "round $r (isolated: ${ISOLATE:-0}): TTFT http / actor, p50 and p99: $line"
  kill "$serve_pid"
  wait "$serve_pid" 2> /dev/null || true
  serve_pid=
  "$troupe" down "$manifest" --timeout 60 > /dev/null 2>&1
  [ "${ISOLATE:-}" = 1 ] && echo $$ > $cg/cgroup.procs
done
