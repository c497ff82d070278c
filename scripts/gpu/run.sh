#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with .gpu/ carried along (see bundle.sh).
# Phases (default: tests): tests | bench | hf | all. Logs and JSON go to $OUT (or .gpu/out).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="$HERE/bin"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
export TANDEM_REQUIRE_GPU=1
export TANDEM_LOG="${TANDEM_LOG:-warn}"
export TANDEM_CACHE_DIR="${TANDEM_CACHE_DIR:-/tmp/tandem-cache}"
MODELS=/tmp/tandem-models
status=0

synth() { # preset
  [ -f "$MODELS/$1/config.json" ] || "$BIN/tandem" model synth --arch llama --preset "$1" --out "$MODELS/$1" >/dev/null
}

phase_tests() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  for t in "$BIN"/test-*; do
    echo "== $(basename "$t")"
    log="$OUT/$(basename "$t").log"
    "$t" --test-threads=1 --nocapture >"$log" 2>&1 || status=1
    grep -E "^test |test result|panicked|skipping|max \||^  left|^ right|differ" "$log"
  done
}

phase_bench() {
  for preset in smollm2 1b; do
    synth "$preset"
    echo "== bench engine --device cuda:0 --dtype bf16 ($preset shape)"
    "$BIN/tandem" bench engine --device cuda:0 --dtype bf16 --model "$MODELS/$preset" \
      --json "$OUT/bench-$preset.json" || status=1
  done
}

phase_hf() {
  for preset in smollm2 1b; do
    synth "$preset"
    echo "== transformers vs tandem ($preset shape)"
    python3 "$HERE/hf_compare.py" "$MODELS/$preset" "$BIN/tandem" "$OUT/hf-$preset.json" || status=1
  done
}

case "${1:-tests}" in
  tests) phase_tests ;;
  bench) phase_bench ;;
  hf) phase_hf ;;
  all) phase_tests; phase_bench; phase_hf ;;
  *) echo "usage: run.sh tests|bench|hf|all"; exit 2 ;;
esac
exit $status
