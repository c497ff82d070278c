#!/usr/bin/env python3
"""llama.cpp's side of the engine comparison: prefill and decode throughput on one GGUF.

Usage: run_llamacpp.py --gguf FILE --workload W.json --json OUT.json [--threads 2]

The workload (compare.py writes it; tandem reads the same file):
  {"prefill": [[ids...], ...], "decode_b1": [ids...], "decode_batch": [[ids...], ...],
   "decode_tokens": 64, "repeat": 3}

Measured through llama-cpp-python's low-level API (llama_decode on a llama_batch, logits read
straight from the context, greedy argmax in numpy), CPU only, library defaults for everything
not listed here (flash attention auto, f16 KV cache, default load mode, non-unified KV cache):

  prefill       per prompt: llama_decode of the prompt in n_batch (512) chunks, logits for the
                last token only, from the first llama_decode to llama_synchronize and the
                argmax of the last logits. n_ctx covers the longest prompt (8192 or more).
  decode b1     prefill `decode_b1` (untimed), argmax, then `decode_tokens` steps of one
                llama_decode of one token plus argmax: decode_tokens / time.
  decode batch  N = len(decode_batch) sequences (seq ids 0..N-1, one context, n_seq_max = N),
                each prompt prefilled (untimed), then `decode_tokens` steps that each decode one
                token of every sequence in one llama_batch and argmax each sequence's logits:
                N * decode_tokens / time.

Each figure is the median of `repeat` runs; the KV cache is cleared before every run. Every run
also records the share of the CPUs other processes used meanwhile (from /proc/stat), since a
busy neighbour on a 2-core box halves the figures. Each
context gets one untimed warm-up first (a 512-token chunk for prefill, a short run for the
decode figures), so one-off graph and buffer allocation is not timed.

Output JSON: {"engine": "llama.cpp", "dtype": "F32"|"F16", "threads": 2,
  "prefill": [{"tokens": 512, "tok_s": ...}, ...], "decode_b1_tok_s": ...,
  "decode_batch": N, "decode_batch_tok_s": ..., plus the raw runs and the settings used}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_lowlevel as ll  # noqa: E402

FILE_TYPES = {"0": "F32", "1": "F16"}


def log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def busy(share: float) -> str:
    """A warning suffix when other processes used a noticeable share of the CPUs."""
    return f"   (other processes used {share:.0%} of the CPUs)" if share >= 0.05 else ""


def check_ids(name: str, ids, n_vocab: int) -> list[int]:
    ids = [int(x) for x in ids]
    if not ids:
        raise SystemExit(f"workload: {name} is empty")
    bad = [x for x in ids if not 0 <= x < n_vocab]
    if bad:
        raise SystemExit(f"workload: {name} has ids outside the vocabulary ({n_vocab}): {bad[:3]}")
    return ids


def bench_prefill(model, prompts, repeat, threads):
    longest = max(len(p) for p in prompts)
    ctx = ll.Context(model, n_ctx=round_up(max(8192, longest + 1), 256), threads=threads)
    try:
        ctx.prefill(prompts[0][: ctx.n_batch])  # warm-up
        ctx.clear()
        results = []
        for p in prompts:
            runs, foreign = [], []
            for r in range(repeat):
                ctx.clear()
                fc = ll.ForeignCpu()
                t0 = time.perf_counter()
                logits = ctx.prefill(p)
                int(np.argmax(logits))
                dt = time.perf_counter() - t0
                foreign.append(round(fc.share(), 3))
                runs.append(len(p) / dt)
                log(f"  prefill {len(p):>5} tokens, run {r + 1}/{repeat}: {runs[-1]:8.1f} tok/s{busy(foreign[-1])}")
            results.append({
                "tokens": len(p),
                "tok_s": statistics.median(runs),
                "runs_tok_s": runs,
                "runs_foreign_cpu_share": foreign,
            })
        return results, ctx.params
    finally:
        ctx.close()


def decode_b1_once(ctx, prompt, steps):
    ctx.clear()
    tok = int(np.argmax(ctx.prefill(prompt)))
    pos = len(prompt)
    t0 = time.perf_counter()
    for _ in range(steps):
        ctx.decode([tok], [pos], [0], [1])
        ctx.sync()
        tok = int(np.argmax(ctx.logits(-1)))
        pos += 1
    return time.perf_counter() - t0


def bench_decode_b1(model, prompt, steps, repeat, threads):
    ctx = ll.Context(model, n_ctx=round_up(max(512, len(prompt) + steps + 8), 256), threads=threads)
    try:
        decode_b1_once(ctx, prompt, min(8, steps))  # warm-up
        runs, foreign = [], []
        for r in range(repeat):
            fc = ll.ForeignCpu()
            runs.append(steps / decode_b1_once(ctx, prompt, steps))
            foreign.append(round(fc.share(), 3))
            log(f"  decode batch 1, run {r + 1}/{repeat}: {runs[-1]:8.1f} tok/s{busy(foreign[-1])}")
        return statistics.median(runs), runs, foreign, ctx.params
    finally:
        ctx.close()


def decode_batch_once(ctx, prompts, steps):
    ctx.clear()
    n = len(prompts)
    toks = np.empty(n, dtype=np.int32)
    for i, p in enumerate(prompts):
        toks[i] = int(np.argmax(ctx.prefill(p, seq=i)))
    pos = np.array([len(p) for p in prompts], dtype=np.int32)
    seqs = np.arange(n)
    outs = np.ones(n, dtype=np.int8)
    t0 = time.perf_counter()
    for _ in range(steps):
        ctx.decode(toks, pos, seqs, outs)
        ctx.sync()
        toks = ctx.all_logits(n).argmax(axis=1).astype(np.int32)
        pos += 1
    return time.perf_counter() - t0


def bench_decode_batch(model, prompts, steps, repeat, threads):
    n = len(prompts)
    need = max(len(p) for p in prompts) + steps + 8
    ctx = ll.Context(model, n_ctx=n * round_up(need, 256), n_seq_max=n, threads=threads)
    try:
        if ctx.params["n_ctx_seq"] < need:
            raise SystemExit(f"context gives {ctx.params['n_ctx_seq']} positions per sequence, need {need}")
        if n > ctx.n_batch:
            raise SystemExit(f"decode batch of {n} exceeds n_batch {ctx.n_batch}")
        decode_batch_once(ctx, prompts, min(4, steps))  # warm-up
        runs, foreign = [], []
        for r in range(repeat):
            fc = ll.ForeignCpu()
            runs.append(n * steps / decode_batch_once(ctx, prompts, steps))
            foreign.append(round(fc.share(), 3))
            log(f"  decode batch {n}, run {r + 1}/{repeat}: {runs[-1]:8.1f} tok/s{busy(foreign[-1])}")
        return statistics.median(runs), runs, foreign, ctx.params
    finally:
        ctx.close()


def main() -> int:
    ap = argparse.ArgumentParser(description="llama.cpp prefill/decode throughput on a workload")
    ap.add_argument("--gguf", required=True, type=Path)
    ap.add_argument("--workload", required=True, type=Path)
    ap.add_argument("--json", required=True, type=Path, help="write the figures here")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    wl = json.loads(args.workload.read_text())
    steps = int(wl.get("decode_tokens", 64))
    repeat = int(wl.get("repeat", 3))
    if steps < 1 or repeat < 1:
        raise SystemExit("workload: decode_tokens and repeat must be at least 1")

    import llama_cpp

    model = ll.Model(str(args.gguf))
    try:
        ftype = model.meta("general.file_type")
        dtype = FILE_TYPES.get(ftype or "", f"file_type {ftype}")
        nv = model.n_vocab
        prefill = [check_ids(f"prefill[{i}]", p, nv) for i, p in enumerate(wl.get("prefill", []))]
        b1 = check_ids("decode_b1", wl["decode_b1"], nv) if wl.get("decode_b1") else None
        batch = [check_ids(f"decode_batch[{i}]", p, nv) for i, p in enumerate(wl.get("decode_batch", []))]
        log(f"{args.gguf.name} ({dtype}), {args.threads} threads, llama-cpp-python {llama_cpp.__version__}")
        t_start = time.time()
        out = {
            "engine": "llama.cpp",
            "dtype": dtype,
            "threads": args.threads,
            "prefill": [],
            "decode_tokens": steps,
            "repeat": repeat,
        }
        contexts = {}
        if prefill:
            log(f"prefill: {len(prefill)} prompts ({', '.join(str(len(p)) for p in prefill)} tokens)")
            out["prefill"], contexts["prefill"] = bench_prefill(model, prefill, repeat, args.threads)
        if b1:
            log(f"decode batch 1: {len(b1)}-token prompt, {steps} steps")
            (out["decode_b1_tok_s"], out["decode_b1_runs_tok_s"], out["decode_b1_runs_foreign_cpu_share"],
             contexts["decode_b1"]) = bench_decode_b1(model, b1, steps, repeat, args.threads)
        if batch:
            log(f"decode batch {len(batch)}: {steps} steps")
            out["decode_batch"] = len(batch)
            (out["decode_batch_tok_s"], out["decode_batch_runs_tok_s"], out["decode_batch_runs_foreign_cpu_share"],
             contexts["decode_batch"]) = bench_decode_batch(model, batch, steps, repeat, args.threads)
        out["llama_cpp_python"] = llama_cpp.__version__
        out["gguf"] = str(args.gguf.resolve())
        out["gguf_bytes"] = os.path.getsize(args.gguf)
        out["system_info"] = ll.system_info()
        out["contexts"] = contexts
        out["wall_s"] = round(time.time() - t_start, 1)
    finally:
        model.close()

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    summary = ", ".join(f"prefill {p['tokens']}: {p['tok_s']:.1f}" for p in out["prefill"])
    if "decode_b1_tok_s" in out:
        summary += f", decode b1: {out['decode_b1_tok_s']:.1f}"
    if "decode_batch_tok_s" in out:
        summary += f", decode b{out['decode_batch']}: {out['decode_batch_tok_s']:.1f}"
    log(f"done in {out['wall_s']} s (tok/s) {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
