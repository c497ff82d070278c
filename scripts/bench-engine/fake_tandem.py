#!/usr/bin/env python3
"""Stand-in for `tandem bench engine --workload ...`, for testing compare.py without the engine.

Accepts `bench engine --model DIR --workload W.json --dtype f32|bf16 --json OUT.json` and writes
the JSON shape the real command writes, with made-up (plausible, slightly jittered) figures and
`"fake": true`. Not a benchmark of anything.
"""

import argparse
import json
import random
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", nargs=2, help="bench engine")
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--dtype", required=True, choices=["f32", "bf16"])
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.cmd != ["bench", "engine"]:
        ap.error("expected: bench engine")
    wl = json.load(open(args.workload))
    jitter = lambda: random.uniform(0.97, 1.03)  # noqa: E731
    width = 1.0 if args.dtype == "f32" else 2.0  # bytes read per weight: 4 vs 2
    floor = 37e9 / (538e6 / width)
    out = {
        "engine": "tandem",
        "dtype": args.dtype,
        "threads": 2,
        "prefill": [
            {"tokens": len(p), "tok_s": 650.0 * 1024 / (1024 + 0.15 * len(p)) * jitter()}
            for p in wl.get("prefill", [])
        ],
        "read_bandwidth_gb_s": 37.0 * jitter(),
        "decode_floor_tok_s": floor,
        "fake": True,
    }
    if wl.get("decode_b1"):
        out["decode_b1_tok_s"] = 0.8 * floor * jitter()
    if wl.get("decode_batch"):
        out["decode_batch"] = len(wl["decode_batch"])
        out["decode_batch_tok_s"] = 6.0 * 0.8 * floor * jitter()
    print(f"fake tandem bench engine ({args.dtype}): {len(out['prefill'])} prefill figures", file=sys.stderr)
    time.sleep(0.3)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
