#!/usr/bin/env bash
# Captures the answers of the paths that matter, as token ids, into OUT:
#   llava_images.txt      two images in one prompt, the actor pipeline (one process)
#   llava_direct.txt      the same through the plain loop (no actors)
#   pipeline_stages.txt   the decoder split into 2 stages in one process
#   pp_worker.txt         2 stages across processes (troupe worker --first-layer)
#   tp_worker.txt         tensor parallelism across processes (troupe worker --tp-rank)
#   cluster_migrate.txt   a 3-node cluster; stage 1 moved live while 4 jobs of 1,800 tokens decode
#   cluster_failover.txt  a 3-node cluster; node2 killed (SIGKILL) while 4 jobs decode
#                         (both check that the jobs were still decoding after the action)
# One line per request: its token ids. Greedy decoding, the bundled tiny LLaVA.
#
#   tests/golden/capture.sh build/cli/troupe DIR
#
# tests/golden/*.txt were captured by the troupe of the commit before the
# actors/ refactor (03c1944); tests/golden/check.sh compares a build with them.
set -euo pipefail
troupe=$(realpath "$1")
out=$(realpath -m "$2")
cd "$(dirname "$0")/../.."
mkdir -p "$out"
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -f "$work/cluster.toml" ] && "$troupe" down "$work/cluster.toml" --timeout 20 >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

img1=tests/fixtures/shapes/shapes_002.png
img2=tests/fixtures/shapes/shapes_005.png
# The "tokens" array of one JSON object, as a line of ids.
tokens() { tr -d ' \n' | grep -oE '"tokens":\[[0-9,]*\]' | head -1 | sed -E 's/.*\[(.*)\]/\1/; s/,/ /g'; }
gen() { "$troupe" generate --json --threads 1 --max-tokens 24 "$@" 2>>"$work/log" | tokens; }

gen --chat --image "$img1" --image "$img2" -p "Describe the images." >"$out/llava_images.txt"
gen --direct --chat --image "$img1" --image "$img2" -p "Describe the images." \
  >"$out/llava_direct.txt"
gen --stages 2 --chat --image "$img1" -p "Describe the image." >"$out/pipeline_stages.txt"

# A worker process; waits for its "listening on PORT" line.
worker() {
  local log=$work/worker$1.log
  shift
  "$troupe" worker --port 0 "$@" >"$log" 2>&1 &
  pids+=($!)
  for _ in $(seq 200); do
    port=$(grep -oE 'port [0-9]+' "$log" | head -1 | grep -oE '[0-9]+' || true)
    [ -n "$port" ] && return 0
    sleep 0.1
  done
  echo "worker did not start: $(cat "$log")" >&2
  exit 1
}
worker 1 --first-layer 2
gen --remote-stage "127.0.0.1:$port" --chat --image "$img1" -p "Describe the image." \
  >"$out/pp_worker.txt"
worker 2 --tp-rank 1 --tp-size 2
gen --tp-peer "127.0.0.1:$port" --chat --image "$img1" -p "Describe the image." \
  >"$out/tp_worker.txt"

# A cluster of three local nodes on ports of its own.
sed -e 's/^port = 7400/port = 7460/' -e 's/^port = 7401/port = 7461/' \
  -e 's/^port = 7402/port = 7462/' -e "s|^certs = .*|certs = \"$work/certs\"|" \
  -e 's/^\[scheduler\]$/[scheduler]\nmax_model_len = 8192\nallow_long_context = true/' \
  examples/local.toml >"$work/cluster.toml"
# (1,800 tokens per job: past the bundled model's 256 positions, lifted above.)
prompts=("Describe the image." "What color is the shape?" "Is there a circle?" "Count the shapes.")
cluster_run() {  # NAME ACTION...: 4 jobs decode while ACTION runs
  local name=$1
  shift
  "$troupe" up "$work/cluster.toml" --detach --timeout 120 >"$work/up.log" 2>&1
  local jobs=()
  for i in 0 1 2 3; do
    "$troupe" submit "$work/cluster.toml" --json --temperature 0 --ignore-eos -n 1800 \
      --image "$img1" -p "${prompts[$i]}" >"$work/$name.$i.json" 2>>"$work/log" &
    jobs+=($!)
  done
  sleep 0.5
  "$@"
  # The action must have come while the jobs decoded, or it proved nothing.
  local running=0
  for j in "${jobs[@]}"; do kill -0 "$j" 2>/dev/null && running=$((running + 1)); done
  if [ "$running" -eq 0 ]; then
    echo "$name: every job had ended before the action finished" >&2
    exit 1
  fi
  echo "$name: $running of 4 jobs still decoding after the action" >&2
  for j in "${jobs[@]}"; do wait "$j"; done
  for i in 0 1 2 3; do tokens <"$work/$name.$i.json"; done >"$out/$name.txt"
  "$troupe" down "$work/cluster.toml" --timeout 60 >/dev/null 2>&1 || true
}
migrate() { "$troupe" migrate "$work/cluster.toml" --shard 1 --to node2 --timeout 60 >>"$work/log" 2>&1; }
failover() { pkill -KILL -f -- "--manifest $work/cluster.toml --name node2"; }
cluster_run cluster_migrate migrate
cluster_run cluster_failover failover
echo "captured into $out:"
wc -l "$out"/*.txt
