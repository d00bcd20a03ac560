#!/usr/bin/env bash
# Scale-out efficiency (issue 28, item 7): output tokens/s of 1, 2 and 4
# replica nodes at the same CPU quota per node, through the whole service,
# and each one's efficiency per node against the same round's single node.
#
# Every node runs in its own network namespace behind a rate-limited link
# (a veth on one bridge, `tc ... tbf` both ways) and in its own cgroup (v1
# `cpu.cfs_quota_us` over a 10 ms period): N nodes of QUOTA cores each,
# N x QUOTA <= 1.5 on this 2-core machine. The head (role "head": it holds
# no stage) runs in a namespace of its own. The head, `troupe serve` and the
# load driver (`troupe bench --http`, 8 streams per replica node) share the
# cores that are left, in one cgroup with the quota that is left (2 - 4 x
# QUOTA). Each setup's row reports the CPU each group used while the load
# ran (from cpuacct.usage), and how often the quota throttled it. After
# each setup, a control: N in-process `troupe bench` runs at once, each in
# a node's cgroup, with no cluster (what the hardware gives N quotas).
#
# Random-weight TinyLlama-shaped Q4_0 model (`troupe write-model`), one
# stage per replica (`pipeline_stages = 1`, `replicas = N`).
#
#   sudo bench/scaling.sh [TROUPE_BINARY] [ROUNDS (1)] [MODEL.gguf]
# Environment: QUOTA (0.375 cores per node), RATE (1gbit), STREAMS (8 per
# node), TOKENS (64 per request), NODES ("1 2 4"; the first is the
# reference), ROUTER (keys for [router], e.g. "prefix = false"), ALONE (1:
# the control runs; 0: not).
set -euo pipefail
troupe=$(realpath "${1:-$(dirname "$0")/../build/cli/troupe}")
rounds=${2:-1}
quota=${QUOTA:-0.375}
rate=${RATE:-1gbit}
streams=${STREAMS:-8}
tokens=${TOKENS:-64}
sizes=${NODES:-1 2 4}
router=${ROUTER:-}
alone_too=${ALONE:-1}
[ "$(id -u)" = 0 ] || {
  echo "scaling.sh: needs root (network namespaces, cgroups, tc)" >&2
  exit 1
}
for h in cpu cpuacct; do
  [ -d /sys/fs/cgroup/$h ] || {
    echo "scaling.sh: no cgroup v1 $h hierarchy at /sys/fs/cgroup/$h" >&2
    exit 1
  }
done
dir=$(mktemp -d /tmp/troupe-scaling.XXXXXX)
chmod 755 "$dir"
model=${3:-$dir/tinyllama-q4_0.gguf}
[ -f "$model" ] || "$troupe" write-model -o "$model" --format q4_0 > /dev/null
model=$(realpath "$model")

tag=$(($$ % 10000))
net=10.79.$((tag % 200 + 20))
br=tsb$tag
ns=tsn$tag-
cg=troupe-scaling-$tag
names=(head n1 n2 n3 n4)
serve_pid=
manifest=
cleanup() {
  set +e
  [ -n "$serve_pid" ] && kill "$serve_pid" 2> /dev/null
  [ -n "$manifest" ] && "$troupe" down "$manifest" --timeout 60 > /dev/null 2>&1
  for n in "${names[@]}"; do
    for p in $(ip netns pids "$ns$n" 2> /dev/null); do kill -9 "$p"; done
    ip netns del "$ns$n" 2> /dev/null
    ip link del "tsv$tag$n" 2> /dev/null
  done
  ip link del "$br" 2> /dev/null
  for h in cpu cpuacct; do
    echo $$ > /sys/fs/cgroup/$h/tasks 2> /dev/null
    for g in front/head front/ctl front n1 n2 n3 n4; do
      # Whatever is left in a group (a straggler of the run) leaves with it.
      for p in $(cat /sys/fs/cgroup/$h/$cg/$g/tasks 2> /dev/null); do
        echo "$p" > /sys/fs/cgroup/$h/tasks 2> /dev/null
      done
      rmdir /sys/fs/cgroup/$h/$cg/$g 2> /dev/null
    done
    rmdir /sys/fs/cgroup/$h/$cg 2> /dev/null
  done
}
trap cleanup EXIT

# The network: one bridge, a namespace per node (the head's .100, node i's
# .i), each link rate-limited both ways.
ip link add "$br" type bridge
ip addr add "$net.254/24" dev "$br"
ip link set "$br" up
i=0
for n in "${names[@]}"; do
  addr=$([ "$n" = head ] && echo 100 || echo "${n#n}")
  v=tsv$tag$n
  ip netns add "$ns$n"
  ip link add "$v" type veth peer name eth0 netns "$ns$n"
  ip link set "$v" master "$br"
  ip link set "$v" up
  ip -n "$ns$n" addr add "$net.$addr/24" dev eth0
  ip -n "$ns$n" link set eth0 up
  ip -n "$ns$n" link set lo up
  tc qdisc add dev "$v" root tbf rate "$rate" burst 256kb latency 50ms
  ip netns exec "$ns$n" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 50ms
  i=$((i + 1))
done

# The CPU: a group per node with QUOTA cores, and `front` with what is
# left, shared by its two children: `head` (the head's process) and `ctl`
# (this script, the gateway, the load driver).
period=10000
node_quota=$(printf '%.0f' "$(echo "$quota * $period" | bc -l)")
front_quota=$(printf '%.0f' "$(echo "(2 - 4 * $quota) * $period" | bc -l)")
[ "$front_quota" -gt 0 ] || {
  echo "scaling.sh: 4 x QUOTA leaves no CPU for the head" >&2
  exit 1
}
groups=(front front/head front/ctl n1 n2 n3 n4)
for h in cpu cpuacct; do
  for g in "${groups[@]}"; do mkdir -p /sys/fs/cgroup/$h/$cg/$g; done
done
for g in front n1 n2 n3 n4; do
  echo $period > /sys/fs/cgroup/cpu/$cg/$g/cpu.cfs_period_us
  echo "$([ $g = front ] && echo "$front_quota" || echo "$node_quota")" \
    > /sys/fs/cgroup/cpu/$cg/$g/cpu.cfs_quota_us
done
echo $$ > /sys/fs/cgroup/cpu/$cg/front/ctl/tasks
echo $$ > /sys/fs/cgroup/cpuacct/$cg/front/ctl/tasks

# `troupe up` starts each node through this: into its cgroup, then its namespace.
cat > "$dir/launch.sh" << SH
#!/bin/sh
# launch.sh NAME MANIFEST TROUPE HOST (the namespace is the name's)
g=\$1
[ "\$1" = head ] && g=front/head
echo \$\$ > /sys/fs/cgroup/cpu/$cg/\$g/tasks
echo \$\$ > /sys/fs/cgroup/cpuacct/$cg/\$g/tasks
exec ip netns exec $ns\$1 "\$3" node --manifest "\$2" --name "\$1"
SH
chmod +x "$dir/launch.sh"

usage() { cat /sys/fs/cgroup/cpuacct/$cg/"$1"/cpuacct.usage; }
throttled() { awk '/^nr_throttled/ {print $2}' /sys/fs/cgroup/cpu/$cg/"$1"/cpu.stat; }

# run N: prints "out_tok_s failed cpu_node_avg cpu_head cpu_ctl throttled_share"
run() {
  local n=$1
  local d=$dir/n$n
  mkdir -p "$d"
  local base=$((7900 + RANDOM % 80))
  manifest=$d/cluster.toml
  {
    cat << TOML
[cluster]
name = "scale-$n"
head = "head"
certs = "certs"
launch = "$dir/launch.sh {name} {manifest} {troupe} {host}"
[model]
path = "$model"
[parallelism]
pipeline_stages = 1
replicas = $n
[router]
$router
[scheduler]
max_running = 64
queue_limit = 256
[transport]
tls = "tcp"
net_devices = "eth0"
[[nodes]]
name = "head"
role = "head"
host = "$net.100"
port = $base
devices = [{ type = "cpu", memory = "4GiB" }]
TOML
    for i in $(seq "$n"); do
      cat << TOML
[[nodes]]
name = "n$i"
host = "$net.$i"
port = $base
devices = [{ type = "cpu", cores = "$(((i - 1) % 2))", memory = "4GiB" }]
TOML
    done
  } > "$manifest"
  "$troupe" up "$manifest" --detach --timeout 600 > "$d/up.log" 2>&1 || {
    cat "$d/up.log" >&2
    return 1
  }
  local port=$((base + 100))
  "$troupe" serve "$manifest" --port "$port" --api-key sk-bench > "$d/serve.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 300); do
    curl -s -o /dev/null "http://127.0.0.1:$port/health" && break
    sleep 0.1
  done
  local c=$((streams * n))
  # A short warm-up (every replica's first batches), then the measured load.
  "$troupe" bench --http "http://127.0.0.1:$port" --api-key sk-bench --completions -c "$c" \
    -n "$c" --max-tokens 8 > "$d/warm.log" 2>&1 || true
  declare -A u0 t0
  for g in front/ctl front/head n1 n2 n3 n4; do
    u0[$g]=$(usage $g)
    t0[$g]=$(throttled $g)
  done
  local s0
  s0=$(date +%s.%N)
  "$troupe" bench --http "http://127.0.0.1:$port" --api-key sk-bench --completions -c "$c" \
    -n $((3 * c)) --max-tokens "$tokens" > "$d/bench.log" 2>&1
  local secs
  secs=$(echo "$(date +%s.%N) - $s0" | bc -l)
  local node_cpu=0 thr=0
  for i in $(seq "$n"); do
    node_cpu=$(echo "$node_cpu + ($(usage n$i) - ${u0[n$i]}) / 1000000000 / $secs" | bc -l)
    thr=$((thr + $(throttled n$i) - ${t0[n$i]}))
  done
  local head_cpu ctl_cpu
  head_cpu=$(echo "($(usage front/head) - ${u0[front/head]}) / 1000000000 / $secs" | bc -l)
  ctl_cpu=$(echo "($(usage front/ctl) - ${u0[front/ctl]}) / 1000000000 / $secs" | bc -l)
  "$troupe" status "$manifest" > "$d/status.log" 2>&1 || true
  kill "$serve_pid" 2> /dev/null || true
  wait "$serve_pid" 2> /dev/null || true
  serve_pid=
  "$troupe" down "$manifest" --timeout 60 > /dev/null 2>&1 || true
  manifest=
  local row
  row=$(grep -E "^\| $c \|" "$d/bench.log" | head -1)
  [ -n "$row" ] || {
    cat "$d/bench.log" >&2
    return 1
  }
  # periods throttled per node per second of load
  echo "$(echo "$row" | awk -F'|' '{gsub(/ /, "", $6); gsub(/ /, "", $4); print $6, $4}')" \
    "$(echo "$node_cpu / $n" | bc -l)" "$head_cpu" "$ctl_cpu" \
    "$(echo "$thr / $n / $secs" | bc -l)"
}

# alone N: N processes of `troupe bench` (the model in-process, no
# cluster), each in node i's cgroup on node i's core, all at once: what the
# hardware gives N quotas by themselves. Prints their summed out tok/s.
alone() {
  local n=$1 pids=() total=0
  mkdir -p "$dir/alone$n"
  for i in $(seq "$n"); do
    sh -c "echo \$\$ > /sys/fs/cgroup/cpu/$cg/n$i/tasks; echo \$\$ > /sys/fs/cgroup/cpuacct/$cg/n$i/tasks; exec \"$troupe\" bench -m \"$model\" --devices cpu:$(((i - 1) % 2)) -c $streams -n $((3 * streams)) --max-tokens $tokens --no-reference" \
      > "$dir/alone$n/n$i.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || true; done
  for i in $(seq "$n"); do
    local t
    t=$(grep -E "^\| $streams \|" "$dir/alone$n/n$i.log" | head -1 | awk -F'|' '{gsub(/ /, "", $6); print $6}')
    total=$(echo "$total + ${t:-0}" | bc -l)
  done
  echo "$total"
}

echo "model $model; quota $quota cores per node (period 10 ms), head + gateway + driver $(echo "2 - 4 * $quota" | bc -l) cores together; links $rate; $streams streams per node, $tokens tokens per request; logs in $dir"
printf "%-6s %-6s %11s %8s %9s %7s %10s %10s %9s %10s %12s %9s\n" round nodes "out tok/s" "x one" \
  "per node" failed "node cpu" "head cpu" "gw+drv cpu" "throttled/s" "alone tok/s" "vs alone"
for r in $(seq "$rounds"); do
  one=
  for n in $sizes; do
    read -r tps failed ncpu hcpu ccpu thr < <(run "$n")
    [ -n "$one" ] || one=$tps
    x=$(echo "$tps / $one" | bc -l)
    al=$([ "$alone_too" = 1 ] && alone "$n" || echo "$tps")
    printf "%-6s %-6s %11.1f %8.2f %9.2f %7s %10.2f %10.2f %9.2f %10.1f %12.1f %9.2f\n" "$r" "$n" \
      "$tps" "$x" "$(echo "$x / $n" | bc -l)" "$failed" "$ncpu" "$hcpu" "$ccpu" "$thr" "$al" \
      "$(echo "$tps / $al" | bc -l)"
  done
done
echo "per node = (N nodes' tok/s / one node's) / N: the target is >= 0.85 at N = 2 and 4"
echo "alone = N in-process \`troupe bench\` runs at once in the same cgroups (no cluster): the hardware's"
echo "own scaling under the quotas; vs alone = the cluster's tok/s / that (troupe's share of the loss)"
