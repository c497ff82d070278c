#!/usr/bin/env bash
# Runs on the GPU machine (see bundle.sh): per-kernel GPU time of eager decode steps (ncu, durations only), for batch sizes given.
set -u
M=${M:-/tmp/tandem-models/1b}
export TANDEM_CUDA_GRAPHS=0 TANDEM_LOG=warn
for b in "$@"; do
  ncu --metrics gpu__time_duration.sum --csv --launch-skip 1500 --launch-count 400 \
    .gpu/bin/tandem bench engine --device cuda:0 --dtype bf16 --model "$M" --step-batches "$b" --step-prefill 0 \
    > "$OUT/ncu-b$b.csv" 2>/dev/null
  echo "batch $b: $(wc -l < "$OUT/ncu-b$b.csv") lines"
done
