#!/usr/bin/env bash
# The audio encoder's batching figure (issue 29: 16 clips at once at least
# 4x one clip at a time), on the committed tiny tower and on a random tower
# of Whisper-tiny's encoder shape (d_model 384, 4 layers, 30 s windows),
# which tools/make_hearing_fixture.py writes outside the repository (NumPy:
# PYTHONPATH may name a folder holding it). Run from the repository root
# after a build: bench/audio_encoder.sh [build]
set -euo pipefail
build=${1:-build}
tiny=${TMPDIR:-/tmp}/troupe-hears-whisper-tiny
[ -f "$tiny/audio.safetensors" ] ||
  python3 tools/make_hearing_fixture.py --out "$tiny" --d-model 384 --layers 4 --heads 6 \
    --ffn 1536 --positions 1500 --stack 8
for model in tests/fixtures/llava_hears "$tiny"; do
  for seconds in 2 30; do
    "$build/bench/bench_audio_encoder" --model "$model" --seconds "$seconds" --clips 16 \
      --max-batch 16 --rounds 3
  done
done
