#!/usr/bin/env bash
# Runs on the GPU machine (see bundle.sh): the GPU tests, then one- and two-row products on the
# bulk-copy GEMVs (opt-in, TANDEM_CUDA_BULK_GEMV=1) against the register-streaming ones (the
# default), alternated in one run, decode steps of 1, 2 and 8 rows.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export TANDEM_CACHE_DIR=/tmp/tandem-cache TANDEM_LOG=warn
M=/tmp/tandem-models
for p in 1b smollm2; do
  [ -f "$M/$p/config.json" ] || "$HERE/bin/tandem" model synth --arch llama --preset $p --out "$M/$p" >/dev/null
done
# A hang in a new kernel must not eat the call: every run is bounded.
timeout 240 "$HERE/bin/test-ops_vs_cpu" --test-threads=1 --nocapture gemvs 2>&1 | grep -E "^test |test result|panicked|bulk-copy|max \|" 
for round in 1 2; do
  for v in 1 0; do
    for p in 1b smollm2; do
      echo "== round $round TANDEM_CUDA_BULK_GEMV=$v $p"
      TANDEM_CUDA_BULK_GEMV=$v timeout 120 "$HERE/bin/tandem" bench engine --device cuda:0 --dtype bf16 --model "$M/$p" \
        --step-batches 1,2,8 --step-prefill 0 2>&1 | grep -E "decode batch|error|panic"
    done
  done
done
timeout 300 bash "$HERE/run.sh" tests 2>&1 | tail -40
