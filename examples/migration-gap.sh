#!/usr/bin/env bash
# Measures the longest inter-token gap while decoder stages move live
# (docs/cluster.md, "Live migration"): a 4-node loopback cluster (two nodes
# on core 0, two on core 1) holds a random-weight TinyLlama-shaped model
# with 8 layers in q4_0 as 2 pipeline stages; `troupe bench --http` runs 16
# streams of 200 tokens once without moves (the reference) and once while
# each stage moves to the other node of its core and back.
#
#   examples/migration-gap.sh [TROUPE_BINARY]
set -euo pipefail
troupe=${1:-$(dirname "$0")/../build/cli/troupe}
troupe=$(realpath "$troupe")
dir=$(mktemp -d /tmp/troupe-gap.XXXXXX)
cd "$dir"
port=$((7600 + RANDOM % 300))
{
  cat <<TOML
[cluster]
name = "gap"
head = "n0"
certs = "certs"

[model]
path = "tl8.gguf"
kv_type = "f32"

[parallelism]
pipeline_stages = 2
TOML
  i=0
  for core in 0 1 1 0; do
    printf '\n[[nodes]]\nname = "n%d"\nhost = "127.0.0.1"\nport = %d\ndevices = [{ type = "cpu", cores = "%d-%d", memory = "2GiB" }]\n' \
      "$i" $((port + i)) "$core" "$core"
    i=$((i + 1))
  done
} > gap.toml
"$troupe" write-model -o tl8.gguf --format q4_0 --shape tinyllama --layers 8 > /dev/null
"$troupe" certs gap.toml > /dev/null
serve_pid=
cleanup() {
  [ -n "$serve_pid" ] && kill "$serve_pid" 2> /dev/null || true
  "$troupe" down gap.toml --timeout 30 > /dev/null 2>&1 || true
}
trap cleanup EXIT
"$troupe" up gap.toml --detach --timeout 120 > up.log 2>&1
http=$((port + 10))
"$troupe" serve gap.toml --port "$http" > serve.log 2>&1 & serve_pid=$!
sleep 3
echo "reference, no moves:"
"$troupe" bench --http "http://127.0.0.1:$http" -c 16 -n 48 --max-tokens 200 --completions | grep -E "^\| (conc|16)"
echo
"$troupe" bench --http "http://127.0.0.1:$http" -c 16 -n 48 --max-tokens 200 --completions \
  --manifest gap.toml --migrate 1:n2 --migrate 0:n3 --migrate 1:n1 --migrate 0:n0 | sed -n '/^Live migrations/,$p'
echo "logs in $dir"
