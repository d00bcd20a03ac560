#!/usr/bin/env bash
# Issue 29's streaming figure: the time to the first token after the end of
# a 20 s clip against a 2 s one, streamed (at most 1.5x) and sent whole
# (above 3x, or the benchmark does not show what streaming buys), on the
# committed tiny tower and on a random tower of Whisper-tiny's encoder
# width (d_model 384, 4 layers) with 2 s windows, which
# tools/make_hearing_fixture.py writes outside the repository (NumPy:
# PYTHONPATH may name a folder holding it). Run from the repository root
# after a build: bench/audio_stream.sh [build]
set -euo pipefail
build=${1:-build}
wide=${TMPDIR:-/tmp}/troupe-hears-whisper-tiny-2s
[ -f "$wide/audio.safetensors" ] ||
  python3 tools/make_hearing_fixture.py --out "$wide" --d-model 384 --layers 4 --heads 6 \
    --ffn 1536 --positions 100 --stack 8
for model in tests/fixtures/llava_hears "$wide"; do
  "$build/bench/bench_audio_stream" --model "$model" --short 2 --long 20 --piece-ms 500 \
    --speed 2 --rounds 5
done
