#!/usr/bin/env python3
"""tandem's engine against llama.cpp, on the same weights, the same workload, in the same run.

Usage:
  compare.py --tandem target/release/tandem --model-dir DIR --out DIR [--quick]
             [--threads 2] [--workload W.json] [--wait-idle SECONDS] [--retry-noisy N]
             [--fake-tandem]

Steps:
  1. Writes the workload (deterministic token ids in [100, 40100)): prefill prompts of 512, 2048,
     4096 and 8190 tokens (--quick: 512 and 2048), a 32-token prompt for batch-1 decode,
     16 prompts of 32 tokens for batched decode, 64 decode steps, 3 repetitions.
     --workload uses a given file instead.
  2. Makes the F32 and F16 GGUFs from DIR's weights with to_gguf.py (cached in
     ${TANDEM_HOME:-~/.cache/tandem}/bench-gguf) and checks llama.cpp on them against this
     tandem binary: greedy ids and logits (`tandem generate`, `tandem eval logits`).
  3. Runs A/B/B/A per precision, so slow drift on a shared machine hits both engines alike:
       tandem f32, llama.cpp F32, llama.cpp F32, tandem f32,
       tandem bf16, llama.cpp F16, llama.cpp F16, tandem bf16.
     tandem: `TANDEM bench engine --model DIR --workload W --dtype f32|bf16 --json OUT`
     llama.cpp: run_llamacpp.py (in the bench venv, see setup-venv.sh).
  4. Prints, per precision pair, each figure's mean over the two runs of each engine and the
     ratio tandem / llama.cpp; writes the workload, every raw JSON and log, summary.json and
     summary.txt into --out.

Every run records the share of the CPUs other processes used meanwhile (/proc/stat); runs above
5% are flagged, since on a 2-core box a busy neighbour wrecks both engines' figures.
--wait-idle S waits (up to S seconds) before each run for the machine to go idle;
--retry-noisy N runs a flagged step again, up to N times (same rule for both engines).
--fake-tandem replaces the tandem runs with fake_tandem.py (made-up numbers), to test the driver.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

PAIRS = [("f32", "F32"), ("bf16", "F16")]
NOISY = 0.05  # share of the CPUs used by other processes above which a run is flagged


def log(msg: str) -> None:
    print(f"[compare] {msg}", file=sys.stderr, flush=True)


def tandem_home() -> Path:
    home = os.environ.get("TANDEM_HOME")
    return Path(home) if home else Path.home() / ".cache" / "tandem"


# --------------------------------------------------------------------------- workload


def prompt(length: int, salt: int) -> list[int]:
    """Deterministic ids in [100, 40100), distinct per salt."""
    return [100 + (i * 7919 + salt * 104_729) % 40_000 for i in range(length)]


def make_workload(quick: bool) -> dict:
    # 8190, not 8192: the prompt plus its one generated token must fit the 8192-token context.
    lengths = [512, 2048] if quick else [512, 2048, 4096, 8190]
    return {
        "prefill": [prompt(n, 1 + k) for k, n in enumerate(lengths)],
        "decode_b1": prompt(32, 100),
        "decode_batch": [prompt(32, 200 + i) for i in range(16)],
        "decode_tokens": 64,
        "repeat": 3,
    }


# --------------------------------------------------------------------------- running


def bench_python(explicit: str | None) -> str:
    """The interpreter with llama_cpp: --python, this one, or the bench venv's."""
    if explicit:
        return explicit
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    venv = Path(os.environ.get("BENCH_VENV", tandem_home() / "bench-venv")) / "bin" / "python"
    if not venv.exists():
        raise SystemExit(f"no llama_cpp here and no {venv}: run scripts/bench-engine/setup-venv.sh first")
    return str(venv)


def busy_ticks() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)  # all but idle, iowait


def cpu_of_children_and_self() -> float:
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return c.ru_utime + c.ru_stime + time.process_time()


def wait_idle(limit_s: float) -> None:
    """Waits (up to limit_s) until other processes leave the CPUs ≥ 95% idle for 5 s."""
    if limit_s <= 0:
        return
    deadline = time.time() + limit_s
    said = False
    while True:
        b0, t0 = busy_ticks(), time.time()
        time.sleep(5)
        share = (busy_ticks() - b0) / os.sysconf("SC_CLK_TCK") / ((time.time() - t0) * (os.cpu_count() or 1))
        if share < NOISY:
            return
        if time.time() > deadline:
            log(f"machine still busy ({share:.0%} of the CPUs) after {limit_s:.0f} s; running anyway")
            return
        if not said:
            log(f"waiting for the machine to go idle (other processes use {share:.0%} of the CPUs)")
            said = True


def run_logged(cmd: list[str], logfile: Path, env: dict, prefix: str) -> tuple[float, float]:
    """Runs cmd, echoing its output (prefixed) and keeping it in logfile.

    Returns (seconds, share of the CPUs that other processes used meanwhile).
    """
    t0 = time.time()
    busy0, own0 = busy_ticks(), cpu_of_children_and_self()
    with open(logfile, "w") as lf:
        lf.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            print(f"    {prefix} | {line.rstrip()}", file=sys.stderr, flush=True)
        rc = proc.wait()
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {rc}); log: {logfile}")
    wall = time.time() - t0
    busy = (busy_ticks() - busy0) / os.sysconf("SC_CLK_TCK")
    foreign = max(0.0, busy - (cpu_of_children_and_self() - own0))
    return wall, foreign / max(wall * (os.cpu_count() or 1), 1e-9)


def ensure_ggufs(py: str, tandem: str, model_dir: Path, gguf_dir: Path, threads: int, verify: bool,
                 out: Path) -> tuple[dict, list | None]:
    """GGUFs from model_dir (written when missing or stale), checked against this tandem binary."""
    paths = {d: gguf_dir / f"{model_dir.name}.{d}.gguf" for _, d in PAIRS}
    log(f"GGUFs in {gguf_dir} (from {model_dir / 'model.safetensors'}; written when missing or stale)")
    cmd = [py, str(HERE / "to_gguf.py"), "--model-dir", str(model_dir), "--out-dir", str(gguf_dir),
           "--dtypes", ",".join(paths)]
    if not verify:
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            raise SystemExit("to_gguf.py failed")
        return paths, None
    # The parity check runs every time: the tandem binary under test changes more often than the GGUFs.
    log("checking llama.cpp on these GGUFs against `tandem generate` / `tandem eval logits`")
    verify_file = out / "gguf-verify.json"
    rc = subprocess.run(cmd + ["--verify", "--tandem", tandem, "--threads", str(threads),
                               "--verify-json", str(verify_file)], stdout=subprocess.DEVNULL).returncode
    if rc == 2:
        log("WARNING: llama.cpp's F32 greedy ids differ from tandem's (see above)")
    elif rc != 0:
        raise SystemExit(f"to_gguf.py --verify failed (exit {rc})")
    return paths, json.loads(verify_file.read_text())


def load_result(path: Path, engine: str, dtype: str) -> dict:
    r = json.loads(path.read_text())
    if r.get("engine") != engine or str(r.get("dtype", "")).lower() != dtype.lower():
        raise SystemExit(f"{path}: engine/dtype {r.get('engine')}/{r.get('dtype')}, expected {engine}/{dtype}")
    return r


# --------------------------------------------------------------------------- summary


def figures(r: dict) -> dict[str, float]:
    out = {}
    for p in r.get("prefill", []):
        out[f"prefill {p['tokens']} tok/s"] = float(p["tok_s"])
    if "decode_b1_tok_s" in r:
        out["decode batch 1 tok/s"] = float(r["decode_b1_tok_s"])
    if "decode_batch_tok_s" in r:
        out[f"decode batch {r.get('decode_batch', '?')} tok/s"] = float(r["decode_batch_tok_s"])
    return out


def compare(tandem_runs: list[dict], llama_runs: list[dict]) -> list[dict]:
    t = [figures(r) for r in tandem_runs]
    l = [figures(r) for r in llama_runs]
    names = list(dict.fromkeys([k for f in l for k in f] + [k for f in t for k in f]))
    rows = []
    for name in names:
        tv = [f[name] for f in t if name in f]
        lv = [f[name] for f in l if name in f]
        tm = statistics.fmean(tv) if tv else None
        lm = statistics.fmean(lv) if lv else None
        rows.append({
            "figure": name,
            "tandem": tm,
            "llama_cpp": lm,
            "ratio": tm / lm if tm and lm else None,
            "tandem_runs": tv,
            "llama_cpp_runs": lv,
        })
    return rows


def extras(runs: list[dict], engine_keys=("engine", "dtype", "threads", "prefill", "decode_b1_tok_s",
                                          "decode_batch", "decode_batch_tok_s", "decode_tokens", "repeat",
                                          "wall_s", "fake")) -> dict:
    """Mean of the other numeric top-level keys (e.g. read_bandwidth_gb_s, decode_floor_tok_s)."""
    keys = [k for k, v in runs[0].items() if k not in engine_keys and isinstance(v, (int, float))
            and not isinstance(v, bool)]
    return {k: statistics.fmean(float(r[k]) for r in runs if k in r) for k in keys}


def fmt(v, spec=".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def table(title: str, rows: list[dict], tandem_extra: dict) -> str:
    lines = [title, f"  {'figure':<26}{'tandem':>10}{'llama.cpp':>11}{'tandem/llama.cpp':>18}   runs (tandem | llama.cpp)"]
    for r in rows:
        runs = (", ".join(fmt(x) for x in r["tandem_runs"]) + " | " + ", ".join(fmt(x) for x in r["llama_cpp_runs"]))
        lines.append(f"  {r['figure']:<26}{fmt(r['tandem']):>10}{fmt(r['llama_cpp']):>11}"
                     f"{fmt(r['ratio'], '.2f'):>18}   {runs}")
    for k, v in tandem_extra.items():
        lines.append(f"  tandem {k}: {v:.2f}")
    return "\n".join(lines)


def machine() -> dict:
    info = {"nproc": os.cpu_count(), "platform": platform.platform()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description="tandem vs llama.cpp, same weights, same run (A/B/B/A)")
    ap.add_argument("--tandem", required=True, help="the tandem binary")
    ap.add_argument("--model-dir", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--quick", action="store_true", help="prefill 512 and 2048 tokens only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workload", type=Path, help="use this workload file instead of writing one")
    ap.add_argument("--gguf-dir", type=Path, default=tandem_home() / "bench-gguf")
    ap.add_argument("--python", help="interpreter with llama_cpp (default: this one, else the bench venv)")
    ap.add_argument("--no-verify", action="store_true", help="skip the parity check of llama.cpp against this tandem binary")
    ap.add_argument("--wait-idle", type=float, default=0, metavar="SECONDS",
                    help="before each run, wait up to this long for other processes to leave the CPUs idle")
    ap.add_argument("--retry-noisy", type=int, default=0, metavar="N",
                    help="run a step again (up to N times) when other processes used >= 5%% of the CPUs")
    ap.add_argument("--fake-tandem", action="store_true", help="made-up tandem figures (tests the driver)")
    args = ap.parse_args()

    model_dir = args.model_dir.resolve()
    out = args.out.resolve()
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    if not args.fake_tandem and not os.access(args.tandem, os.X_OK):
        raise SystemExit(f"{args.tandem}: not an executable")
    py = bench_python(args.python)
    tandem = str(Path(args.tandem).resolve())
    if not args.fake_tandem:
        help_text = subprocess.run([tandem, "bench", "engine", "--help"], capture_output=True, text=True).stdout
        missing = [f for f in ("--workload", "--dtype", "--json") if f not in help_text]
        if missing:
            raise SystemExit(f"{tandem} bench engine has no {', '.join(missing)}: rebuild it "
                             "(or test the driver with --fake-tandem)")

    workload = out / "workload.json"
    if args.workload:
        wl = json.loads(args.workload.read_text())
    else:
        wl = make_workload(args.quick)
    workload.write_text(json.dumps(wl) + "\n")
    log(f"workload {workload}: prefill {[len(p) for p in wl.get('prefill', [])]} tokens, decode b1 prompt "
        f"{len(wl.get('decode_b1', []))}, decode batch {len(wl.get('decode_batch', []))}, "
        f"{wl.get('decode_tokens')} decode steps, repeat {wl.get('repeat')}")

    gguf, checked = ensure_ggufs(py, tandem, model_dir, args.gguf_dir, args.threads,
                                 verify=not args.no_verify and os.access(tandem, os.X_OK), out=out)

    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    plan = []
    for tdtype, ldtype in PAIRS:
        plan += [("tandem", tdtype), ("llama.cpp", ldtype), ("llama.cpp", ldtype), ("tandem", tdtype)]
    results: dict[tuple[str, str], list[dict]] = {}
    order = []
    t_all = time.time()
    for i, (engine, dtype) in enumerate(plan, 1):
        tag = f"{i:02d}-{'tandem' if engine == 'tandem' else 'llamacpp'}-{dtype}"
        jpath, lpath = raw / f"{tag}.json", raw / f"{tag}.log"
        if engine == "tandem":
            base = [sys.executable, str(HERE / "fake_tandem.py")] if args.fake_tandem else [tandem]
            cmd = base + ["bench", "engine", "--model", str(model_dir), "--workload", str(workload),
                          "--dtype", dtype, "--json", str(jpath)]
        else:
            cmd = [py, str(HERE / "run_llamacpp.py"), "--gguf", str(gguf[dtype]), "--workload", str(workload),
                   "--json", str(jpath), "--threads", str(args.threads)]
        log(f"({i}/{len(plan)}) {engine} {dtype}{' (FAKE)' if engine == 'tandem' and args.fake_tandem else ''}")
        for attempt in range(args.retry_noisy + 1):
            wait_idle(args.wait_idle)
            secs, foreign = run_logged(cmd, lpath, env, f"{engine} {dtype}")
            if foreign < NOISY or attempt == args.retry_noisy:
                break
            log(f"({i}/{len(plan)}) other processes used {foreign:.0%} of the CPUs: running it again"
                f" ({attempt + 1}/{args.retry_noisy})")
        r = load_result(jpath, engine, dtype)
        results.setdefault((engine, dtype), []).append(r)
        order.append({"step": i, "engine": engine, "dtype": dtype, "json": str(jpath), "log": str(lpath),
                      "wall_s": round(secs, 1), "foreign_cpu_share": round(foreign, 3)})
        log(f"({i}/{len(plan)}) {engine} {dtype} done in {secs:.0f} s; "
            + ", ".join(f"{k} {v:.1f}" for k, v in figures(r).items()))
        if foreign >= NOISY:
            log(f"WARNING: other processes used {foreign:.0%} of the CPUs during this run")

    summary = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "threads": args.threads,
        "model_dir": str(model_dir),
        "workload": str(workload),
        "fake_tandem": args.fake_tandem,
        "gguf": {k: str(v) for k, v in gguf.items()},
        "gguf_verify": checked,
        "order": order,
        "wall_s": round(time.time() - t_all, 1),
        "comparisons": {},
    }
    text = []
    for tdtype, ldtype in PAIRS:
        title = f"{tdtype} vs {ldtype}"
        rows = compare(results[("tandem", tdtype)], results[("llama.cpp", ldtype)])
        extra = extras(results[("tandem", tdtype)])
        summary["comparisons"][title] = {"rows": rows, "tandem_extra": extra}
        text.append(table(title + ("  [tandem figures FAKE]" if args.fake_tandem else ""), rows, extra))
    header = (f"tandem vs llama.cpp ({args.threads} threads, {machine().get('cpu', '?')}), "
              f"mean of 2 runs each, A/B/B/A; tok/s")
    noisy = [o for o in order if o["foreign_cpu_share"] >= NOISY]
    if noisy:
        text.append("WARNING: other processes were busy during "
                    + ", ".join(f"run {o['step']} ({o['engine']} {o['dtype']}: {o['foreign_cpu_share']:.0%}"
                                " of the CPUs)" for o in noisy)
                    + "; their figures are unreliable (too low).")
    else:
        text.append("No other process used 5% or more of the CPUs during any run.")
    report = header + "\n\n" + "\n\n".join(text) + "\n"
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.txt").write_text(report)
    print(report)
    log(f"all runs took {summary['wall_s']:.0f} s; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
