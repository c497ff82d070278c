#!/usr/bin/env bash
# Runs on the GPU machine (see bundle.sh): per-kernel GPU time of one eager decode step at
# batch B (context 512) for the model in $M (the 1B shape by default), grouped by kernel.
# Unlike profile.sh, caches are not flushed and clocks not locked between kernels (ncu
# --cache-control none --clock-control none), so small kernels read close to what they take
# in a real step (the weights of a step do not fit in L2 either way). Kernels still run one
# at a time: the programmatic-launch overlap of a real step is not in these figures.
# For a KDA-hybrid checkpoint in $M (tandem model synth --arch kda-hybrid ...), set SKIP=0 and
# COUNT large enough for a few steps (of the complete steps between two embeddings, the last
# of the commonest kernel count is read).
# T names another tandem binary to profile (an older build, for a before/after in one call);
# TAG suffixes the output files.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
M=${M:-/tmp/tandem-models/1b}
B=${1:-1}
OUT=${OUT:-$HERE/out}
mkdir -p "$OUT"
[ -f "$M/config.json" ] || "$HERE/bin/tandem" model synth --arch llama --preset 1b --out "$M" >/dev/null
export TANDEM_CUDA_GRAPHS=0 TANDEM_LOG=warn
ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv --cache-control none --clock-control none \
  --launch-skip "${SKIP:-1500}" --launch-count "${COUNT:-300}" \
  "${T:-$HERE/bin/tandem}" bench engine --device cuda:0 --dtype bf16 --model "$M" --step-batches "$B" --step-prefill 0 \
  > "$OUT/ncu-decode-$B${TAG:-}.csv" 2>"$OUT/ncu-decode-$B${TAG:-}.err"
python3 - "$OUT/ncu-decode-$B${TAG:-}.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head, rows = rows[0], rows[1:]
name, metric, unit, value, rid = (head.index(k) for k in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value", "ID"))
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
bscale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
launches = collections.OrderedDict()
for r in rows:
    d = launches.setdefault(r[rid], {"name": r[name]})
    v = float(r[value].replace(",", ""))
    if r[metric].startswith("gpu__time"):
        d["us"] = v * scale[r[unit]]
    else:
        d["bytes"] = v * bscale.get(r[unit], 1)
ls = list(launches.values())
starts = [i for i, d in enumerate(ls) if d["name"].startswith("embed")]
# Decode steps repeat with one kernel count; a prefill chunk (the bench's warm-up, or a
# build that runs it later) is a one-off: take the last segment of the commonest length.
segs = [ls[a:b] for a, b in zip(starts, starts[1:])]
if not segs:
    sys.exit(f"no complete step in the capture ({len(ls)} kernels): raise COUNT or the time limit")
common = collections.Counter(len(g) for g in segs).most_common(1)[0][0]
step = [g for g in segs if len(g) == common][-1]
total = collections.defaultdict(lambda: [0.0, 0.0, 0])
for d in step:
    k = d["name"].split("(")[0][:60]
    t = total[k]; t[0] += d.get("us", 0); t[1] += d.get("bytes", 0); t[2] += 1
all_us = sum(v[0] for v in total.values())
print(f"one decode step: {len(step)} kernels, {all_us:.1f} us of GPU time (kernels one at a time)")
for k, (us, b, n) in sorted(total.items(), key=lambda kv: -kv[1][0]):
    print(f"  {us:8.1f} us {100*us/all_us:5.1f}%  x{n:<4} {us/n:7.2f} us each  {b/us/1e6 if us else 0:5.2f} TB/s  {k}")
PY
if command -v nsys >/dev/null; then
  echo "nsys: $(command -v nsys)"
else
  echo "nsys: not installed"
fi
