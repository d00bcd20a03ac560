#!/usr/bin/env bash
# Measures a re-plan when a node joins (docs/cluster.md, "Placement"):
# a 2-node loopback cluster with pipeline_stages = "auto" serves a steady
# load from `troupe bench --http`; node n1 starts 45 s in; the head's
# decision log then holds the predicted and the measured effect.
#
#   examples/placement-join.sh [TROUPE_BINARY]
#   MEASURE_S=60 examples/placement-join.sh ...   (longer windows: steadier)
set -euo pipefail
measure=${MEASURE_S:-30}
troupe=${1:-$(dirname "$0")/../build/cli/troupe}
troupe=$(realpath "$troupe")
dir=$(mktemp -d /tmp/troupe-join.XXXXXX)
cd "$dir"
port0=$((7600 + RANDOM % 300)); port1=$((port0 + 1)); http=$((port0 + 2))
cat > join.toml <<TOML
[cluster]
name = "join"
head = "n0"
certs = "certs"

[model]
path = "tl8.gguf"

[placement]
wait_for_nodes_s = 3
measure_s = $measure

[[nodes]]
name = "n0"
host = "127.0.0.1"
port = $port0
devices = [{ type = "cpu", cores = "0-0", memory = "2GiB" }]

[[nodes]]
name = "n1"
host = "127.0.0.1"
port = $port1
devices = [{ type = "cpu", cores = "1-1", memory = "2GiB" }]
TOML
"$troupe" write-model -o tl8.gguf --format q4_0 --shape tinyllama --layers 8 > /dev/null
"$troupe" certs join.toml > /dev/null
pids=()
cleanup() {
  "$troupe" down join.toml --timeout 30 > /dev/null 2>&1 || true
  for p in "${pids[@]}"; do kill "$p" 2> /dev/null || true; done
}
trap cleanup EXIT
"$troupe" node --manifest join.toml --name n0 > n0.log 2>&1 & pids+=($!)
sleep 8
"$troupe" serve join.toml --port "$http" > serve.log 2>&1 & pids+=($!)
sleep 2
"$troupe" bench --http "http://127.0.0.1:$http" -c 16 -n 1000 --max-tokens 64 --completions > bench.log 2>&1 & pids+=($!)
sleep $((measure + 15))
"$troupe" node --manifest join.toml --name n1 > n1.log 2>&1 & pids+=($!)
# The decision, its settling (the requests running then finish: ~10 s
# here), then measure_s.
sleep $((measure + 35))
"$troupe" status join.toml | grep -E "^cluster|^decision|^  stage|^measured|^  (over|a step|each|busy)"
echo "logs in $dir"
