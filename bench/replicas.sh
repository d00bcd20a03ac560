#!/usr/bin/env bash
# Replicas against one pipeline, through the whole service: a cluster of
# two node processes (one core each) on loopback, `troupe serve` in front,
# `troupe bench --http` at 16 concurrent streams of 128 tokens (text
# completions) on a random-weight TinyLlama-shaped Q4_0 model. Three
# setups per round, one after the other (a slow spell of the machine lands
# on all of them):
#   one    one replica, one stage on n0 (n1 idle): one core computes
#   pp2    one replica, two stages (n0, n1): the pipeline's answer to a 2nd node
#   rep2   two replicas, one stage each (n0, n1): the router's
# Output tokens/s of each, and the ratio to the same round's `one`.
#
#   bench/replicas.sh [TROUPE_BINARY] [ROUNDS (1)] [MODEL.gguf]
set -euo pipefail
troupe=$(realpath "${1:-$(dirname "$0")/../build/cli/troupe}")
rounds=${2:-1}
dir=$(mktemp -d /tmp/troupe-replicas.XXXXXX)
model=${3:-$dir/tinyllama-q4_0.gguf}
[ -f "$model" ] || "$troupe" write-model -o "$model" --format q4_0 > /dev/null
model=$(realpath "$model")
serve_pid=
manifest=
cleanup() {
  [ -n "$serve_pid" ] && kill "$serve_pid" 2> /dev/null || true
  [ -n "$manifest" ] && "$troupe" down "$manifest" --timeout 60 > /dev/null 2>&1 || true
}
trap cleanup EXIT

# run NAME STAGES REPLICAS: prints "NAME out_tok_s"
run() {
  local name=$1 stages=$2 replicas=$3
  local d=$dir/$name
  mkdir -p "$d"
  local base=$((7800 + RANDOM % 150))
  manifest=$d/cluster.toml
  cat > "$manifest" << TOML
[cluster]
name = "rep-$name"
head = "n0"
certs = "certs"
[model]
path = "$model"
[parallelism]
pipeline_stages = $stages
replicas = $replicas
[scheduler]
max_running = 32
[[nodes]]
name = "n0"
host = "127.0.0.1"
port = $base
devices = [{ type = "cpu", cores = "0-0", memory = "4GiB" }]
[[nodes]]
name = "n1"
host = "127.0.0.1"
port = $((base + 1))
devices = [{ type = "cpu", cores = "1-1", memory = "4GiB" }]
TOML
  "$troupe" up "$manifest" --detach --timeout 300 > "$d/up.log" 2>&1 || {
    cat "$d/up.log" >&2
    return 1
  }
  local port=$((base + 100))
  "$troupe" serve "$manifest" --port "$port" --api-key sk-bench > "$d/serve.log" 2>&1 &
  serve_pid=$!
  for _ in $(seq 100); do
    curl -s -o /dev/null "http://127.0.0.1:$port/health" && break
    sleep 0.1
  done
  "$troupe" bench --http "http://127.0.0.1:$port" --api-key sk-bench --completions -c 16 -n 48 \
    --max-tokens 128 > "$d/bench.log" 2>&1
  "$troupe" status "$manifest" > "$d/status.log" 2>&1 || true
  kill "$serve_pid" 2> /dev/null || true
  wait "$serve_pid" 2> /dev/null || true
  serve_pid=
  "$troupe" down "$manifest" --timeout 60 > /dev/null 2>&1 || true
  manifest=
  # | conc | done | failed | req/s | out tok/s | ...
  local row
  row=$(grep -E '^\| 16 \|' "$d/bench.log" | head -1)
  [ -n "$row" ] || {
    cat "$d/bench.log" >&2
    return 1
  }
  echo "$name $(echo "$row" | awk -F'|' '{gsub(/ /, "", $6); gsub(/ /, "", $4); print $6, $4}')"
}

echo "model $model; 16 streams x 48 requests x 128 tokens; logs in $dir"
printf "%-6s %-6s %12s %8s %8s\n" round setup "out tok/s" "x one" failed
for r in $(seq "$rounds"); do
  read -r _ one f1 < <(run one 1 1)
  printf "%-6s %-6s %12.1f %8.2f %8s\n" "$r" one "$one" 1 "$f1"
  read -r _ pp f2 < <(run pp2 2 1)
  printf "%-6s %-6s %12.1f %8.2f %8s\n" "$r" pp2 "$pp" "$(echo "$pp / $one" | bc -l)" "$f2"
  read -r _ rep f3 < <(run rep2 1 2)
  printf "%-6s %-6s %12.1f %8.2f %8s\n" "$r" rep2 "$rep" "$(echo "$rep / $one" | bc -l)" "$f3"
done
