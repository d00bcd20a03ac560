#!/usr/bin/env bash
# The real head against 1,000 nodes (issue 28, item 7): a head process
# (`troupe node`, CAF and mutual TLS, the bundled model placed on itself)
# whose manifest names 1,000 more nodes, all simulated by
# `bench_head_load` over loopback, several hundred per process. Each
# simulated node is a CAF node of its own with its certificate, the real
# gatekeeper and an agent that answers heartbeats with a fixed report. The
# head joins every one, then pings each every 500 ms. Reported: how long
# until every node is up, the head's CPU over SECONDS once they are (from
# /proc/PID/stat: target <= 10 % of one core), its resident memory, and the
# simulators' CPU.
#
#   bench/head_load.sh [TROUPE_BINARY] [NODES (1000)] [PROCESSES (4)] [SECONDS (30)]
#
# SHARED=1: each simulator process is one CAF node whose simulated nodes
# share its actor system (bench_head_load --shared): one TLS connection per
# process to the head instead of one per node.
set -euo pipefail
troupe=$(realpath "${1:-$(dirname "$0")/../build/cli/troupe}")
sim=$(realpath "${SIM:-$(dirname "$troupe")/../bench/bench_head_load}")
n=${2:-1000}
procs=${3:-4}
secs=${4:-30}
dir=$(mktemp -d /tmp/troupe-headload.XXXXXX)
base=$((20000 + RANDOM % (64000 - 20000 - n)))
manifest=$dir/cluster.toml
pids=()
head_pid=
cleanup() {
  set +e
  [ -n "$head_pid" ] && kill "$head_pid" 2> /dev/null
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null; done
  sleep 1
  [ -n "$head_pid" ] && kill -9 "$head_pid" 2> /dev/null
  for p in "${pids[@]}"; do kill -9 "$p" 2> /dev/null; done
}
trap cleanup EXIT
{
  cat << TOML
[cluster]
name = "headload"
head = "head"
certs = "certs"
[model]
path = "bundled"
[parallelism]
pipeline_stages = 1
[placement]
wait_for_nodes_s = 600
[[nodes]]
name = "head"
host = "127.0.0.1"
port = $base
devices = [{ type = "cpu", memory = "2GiB" }]
TOML
  for i in $(seq "$n"); do
    printf '[[nodes]]\nname = "n%d"\nhost = "127.0.0.1"\nport = %d\ndevices = [{ type = "cpu", cores = "0", memory = "4GiB" }]\n' \
      "$i" $((base + i))
  done
} > "$manifest"
t0=$(date +%s.%N)
"$sim" --certs "$manifest" > "$dir/certs.log"
echo "head + $n simulated nodes, $procs simulator processes; certificates made in $(echo "$(date +%s.%N) - $t0" | bc -l | xargs printf '%.1f') s; logs in $dir"
chunk=$(((n + procs - 1) / procs))
for p in $(seq 0 $((procs - 1))); do
  "$sim" ${SHARED:+--shared} "$manifest" $((1 + p * chunk)) "$chunk" > "$dir/sim$p.log" 2>&1 &
  pids+=($!)
done
for p in $(seq 0 $((procs - 1))); do
  for _ in $(seq 600); do
    grep -q "listening" "$dir/sim$p.log" && break
    sleep 0.1
  done
  grep -q "listening" "$dir/sim$p.log" || {
    cat "$dir/sim$p.log" >&2
    exit 1
  }
done
t0=$(date +%s.%N)
"$troupe" node --manifest "$manifest" --name head > "$dir/head.log" 2>&1 &
head_pid=$!
up=0
for _ in $(seq 600); do
  up=$("$troupe" status "$manifest" --json 2> /dev/null | grep -o '"state":"up"' | wc -l || true)
  [ "$up" -ge $((n + 1)) ] && break
  sleep 1
done
up_s=$(echo "$(date +%s.%N) - $t0" | bc -l)
[ "$up" -ge $((n + 1)) ] || {
  echo "only $up of $((n + 1)) nodes up after $up_s s" >&2
  tail -20 "$dir/head.log" >&2
  exit 1
}
sleep 5
ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
h0=$(ticks "$head_pid")
s0=0
for p in "${pids[@]}"; do s0=$((s0 + $(ticks "$p"))); done
sleep "$secs"
h1=$(ticks "$head_pid")
s1=0
for p in "${pids[@]}"; do s1=$((s1 + $(ticks "$p"))); done
rss=$(awk '/VmRSS/ {print $2}' "/proc/$head_pid/status")
state=$("$troupe" status "$manifest" --json 2> /dev/null | grep -o '"state":"[a-z]*"' | sort | uniq -c | tr '\n' ' ')
share=$(echo "($h1 - $h0) / $hz / $secs" | bc -l)
printf "all %d nodes up %.1f s after the head started; over %d s after: head CPU %.3f of a core (target <= 0.10), RSS %d MiB; simulators %.2f cores; states: %s\n" \
  $((n + 1)) "$up_s" "$secs" "$share" $((rss / 1024)) "$(echo "($s1 - $s0) / $hz / $secs" | bc -l)" "$state"
