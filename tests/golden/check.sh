#!/usr/bin/env bash
# Runs tests/golden/capture.sh with TROUPE and compares every answer with
# the committed golden file next to this script (captured before the
# actors/ refactor). A missing golden file is a failure.
#
#   tests/golden/check.sh build/cli/troupe
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
got=$(mktemp -d)
trap 'rm -rf "$got"' EXIT
"$here/capture.sh" "$1" "$got" >/dev/null
status=0
names=(llava_images llava_direct pipeline_stages pp_worker tp_worker cluster_migrate cluster_failover)
for name in "${names[@]}"; do
  want=$here/$name.txt
  if [ ! -s "$want" ]; then
    echo "golden: $want is missing or empty" >&2
    status=1
  elif ! diff -u "$want" "$got/$name.txt" >"$got/$name.diff"; then
    echo "golden: $name differs from $want:" >&2
    cat "$got/$name.diff" >&2
    status=1
  else
    echo "golden: $name: $(wc -l <"$want") answers equal"
  fi
done
exit $status
