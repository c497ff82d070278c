#!/usr/bin/env bash
# GPU tests, then the prefill attention built for block size 16 against the same
# kernels with the run-time block size (a variant source), alternated in one run.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$HERE/out}"; mkdir -p "$OUT"
export TANDEM_CACHE_DIR=/tmp/tandem-cache TANDEM_LOG=warn
bash "$HERE/run.sh" tests 2>&1 | tail -60
M=/tmp/tandem-models
for p in 1b smollm2; do
  [ -f "$M/$p/config.json" ] || "$HERE/bin/tandem" model synth --arch llama --preset $p --out "$M/$p" >/dev/null
done
mkdir -p "$HERE/variants"
sed -e 's/^PREFILL_ATTENTION(64, 16, _b16)/PREFILL_ATTENTION(64, 0, _b16)/' \
    -e 's/^PREFILL_ATTENTION(128, 16, _b16)/PREFILL_ATTENTION(128, 0, _b16)/' \
    "$HERE/kernels.cu" > "$HERE/variants/runtime_bs.cu"
grep -c "PREFILL_ATTENTION(.*, 0, _b16)" "$HERE/variants/runtime_bs.cu"
for round in 1 2; do
  for v in b16 runtime; do
    if [ $v = runtime ]; then export TANDEM_CUDA_KERNELS_FILE="$HERE/variants/runtime_bs.cu"; else unset TANDEM_CUDA_KERNELS_FILE; fi
    for p in 1b smollm2; do
      echo "== round $round $v $p"
      "$HERE/bin/tandem" bench engine --device cuda:0 --dtype bf16 --model "$M/$p" --step-batches 1 --step-prefill 8192 2>&1 | grep -E "prefill|decode batch"
    done
  done
done
unset TANDEM_CUDA_KERNELS_FILE
