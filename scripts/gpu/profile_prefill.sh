#!/usr/bin/env bash
# Runs on the GPU machine (see bundle.sh): per-kernel GPU time of one eager prefill step of
# N tokens (ncu, durations only), grouped by kernel, for the model in $M (the 1B shape by default).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
M=${M:-/tmp/tandem-models/1b}
N=${1:-8192}
OUT=${OUT:-$HERE/out}
mkdir -p "$OUT"
[ -f "$M/config.json" ] || "$HERE/bin/tandem" model synth --arch llama --preset 1b --out "$M" >/dev/null
export TANDEM_CUDA_GRAPHS=0 TANDEM_LOG=warn
ncu --metrics gpu__time_duration.sum --csv \
  "$HERE/bin/tandem" bench engine --device cuda:0 --dtype bf16 --model "$M" --step-batches 1 --step-prefill "$N" \
  > "$OUT/ncu-prefill-$N.csv" 2>"$OUT/ncu-prefill-$N.err"
python3 - "$OUT/ncu-prefill-$N.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
name, unit, value = head.index("Kernel Name"), head.index("Metric Unit"), head.index("Metric Value")
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
starts = [i for i, r in enumerate(rows) if r[name].startswith("embed")]
last = rows[starts[-1]:]
total = collections.defaultdict(lambda: [0.0, 0])
for r in last:
    us = float(r[value].replace(",", "")) * scale[r[unit]]
    k = r[name].split("(")[0][:60]
    total[k][0] += us; total[k][1] += 1
all_us = sum(v[0] for v in total.values())
print(f"one prefill step: {len(last)} kernels, {all_us/1e3:.2f} ms of GPU time")
for k, (us, n) in sorted(total.items(), key=lambda kv: -kv[1][0]):
    print(f"  {us/1e3:8.2f} ms  {100*us/all_us:5.1f}%  x{n:<4} {k}")
PY
