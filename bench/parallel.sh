#!/usr/bin/env bash
# Pipeline (PP=2) and tensor (TP=2) parallelism across two processes, one
# core each, next to one process with two threads, on a random-weight
# TinyLlama-shaped Q4_0 model (22 layers, 96-token prompts): `troupe bench`
# at 16 concurrent sequences of 128 tokens. Each round runs the three
# setups one after the other, so that a slow spell of this machine lands
# on all of them; ratios are to the same round's one-process figure.
#
#   bench/parallel.sh [TROUPE_BINARY] [ROUNDS (3)] [MODEL.gguf]
#
# decode tok/s = 16 sequences / the median inter-token gap (steps without a
# prefill in them); out tok/s = every output token / wall time (prefill
# included). The PP rows also give where a micro-batch's round trip went.
set -euo pipefail
troupe=$(realpath "${1:-$(dirname "$0")/../build/cli/troupe}")
rounds=${2:-3}
dir=$(mktemp -d /tmp/troupe-parallel.XXXXXX)
model=${3:-$dir/tinyllama-q4_0.gguf}
[ -f "$model" ] || "$troupe" write-model -o "$model" --format q4_0 > /dev/null
common=(-m "$model" -c 16 -n 16 --max-tokens 128 --no-reference --json)
worker_pid=
cleanup() { [ -n "$worker_pid" ] && kill "$worker_pid" 2> /dev/null || true; }
trap cleanup EXIT

# start_worker LOG ARGS...: a worker on core 1 (its port in $port), waits
# until it listens.
start_worker() {
  local log=$1
  shift
  port=$((7700 + RANDOM % 200))
  "$troupe" worker -m "$model" --device cpu:1-1 --port "$port" "$@" > "$log" 2>&1 &
  worker_pid=$!
  for _ in $(seq 600); do
    grep -q "listening on port" "$log" && return 0
    kill -0 "$worker_pid" 2> /dev/null || break
    sleep 0.1
  done
  echo "worker did not start, see $log" >&2
  return 1
}
stop_worker() {
  kill "$worker_pid" 2> /dev/null || true
  wait "$worker_pid" 2> /dev/null || true
  worker_pid=
}

for r in $(seq "$rounds"); do
  "$troupe" bench "${common[@]}" --devices cpu > "$dir/ref-$r.json" 2> "$dir/ref-$r.log"
  start_worker "$dir/pp-worker-$r.log" --first-layer 11
  "$troupe" bench "${common[@]}" --devices cpu:0-0 --remote-stage "127.0.0.1:$port" --micro-batches 2 \
    > "$dir/pp-$r.json" 2> "$dir/pp-$r.log"
  stop_worker
  start_worker "$dir/tp-worker-$r.log" --tp-rank 1 --tp-size 2
  "$troupe" bench "${common[@]}" --devices cpu:0-0 --tp-peer "127.0.0.1:$port" > "$dir/tp-$r.json" 2> "$dir/tp-$r.log"
  stop_worker
done

echo "troupe bench, $(basename "$model"), 16 sequences x 128 tokens, $rounds rounds; ratios to the same round's 1-process run"
echo
echo "| round | setup | out tok/s | ITL p50 ms | decode tok/s | out / 1 process | decode / 1 process | failed |"
echo "|---|---|---|---|---|---|---|---|"
for r in $(seq "$rounds"); do
  for s in ref pp tp; do
    name=$(case $s in ref) echo "1 process, 2 threads" ;; pp) echo "PP=2, 2 processes" ;; tp) echo "TP=2, 2 processes" ;; esac)
    jq -r --slurpfile ref "$dir/ref-$r.json" '.levels[0] as $l | $ref[0].levels[0] as $b |
      [$l.output_tokens_per_s, $l.itl_ms.p50, 16000 / $l.itl_ms.p50, $l.output_tokens_per_s / $b.output_tokens_per_s,
       $b.itl_ms.p50 / $l.itl_ms.p50, $l.failed] | @tsv' "$dir/$s-$r.json" |
      awk -F'\t' -v r="$r" -v name="$name" '{ printf "| %s | %s | %.1f | %.1f | %.1f | %.2f | %.2f | %d |\n", r, name, $1, $2, $3, $4, $5, $6 }'
  done
done
echo
echo "PP=2: where a micro-batch's round trip went (busy = a stage's compute / wall time)"
echo
echo "| round | round trip ms | compute ms (both stages) | waiting + hand-offs ms | busy per stage |"
echo "|---|---|---|---|---|"
for r in $(seq "$rounds"); do
  jq -r '.levels[0].pipeline as $p | [$p.round_trip_ms, $p.compute_ms, $p.waiting_and_handoffs_ms,
      ([$p.busy_per_stage[] | (. * 100 | round | tostring) + "%"] | join(" / "))] | @tsv' "$dir/pp-$r.json" |
    awk -F'\t' -v r="$r" '{ printf "| %s | %.1f | %.1f | %.1f | %s |\n", r, $1, $2, $3, $4 }'
done
echo
echo "logs and JSON in $dir"
