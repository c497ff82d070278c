#!/usr/bin/env python3
"""Serving on this CPU, end to end: tandem (aggregated, and P/D) against vLLM's CPU build,
both measured by the stock `vllm bench serve` client on the same SmolLM2 directory, in the
same run.

For each dtype (f32 = vLLM float32, bf16 = vLLM bfloat16) it starts vLLM, then tandem
aggregated (`tandem run --aggregated`), then tandem P/D (`tandem run`), each alone on the
machine, and runs the client against it at every concurrency: random dataset, 256 input and
64 output tokens, --ignore-eos, temperature 0, 64 prompts, prefix caching off. It prints
output throughput, TTFT and TPOT medians per server and the ratios tandem / vLLM
(throughput: higher is better; TTFT: vLLM's ÷ tandem's, so above 1 means tandem is faster),
and writes every result JSON under --out.

Usage: run.py --tandem target/release/tandem --model-dir DIR [--vllm-venv DIR]
              [--dtypes f32,bf16] [--concurrency 1,8] [--num-prompts 64]
              [--servers vllm,aggregated,pd] [--out DIR]
(`make bench-serve-cpu` sets the venv up first: scripts/bench-serve-cpu/setup-venv.sh.)
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

VLLM_DTYPE = {"f32": "float32", "bf16": "bfloat16"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read()


def wait_ready(url, proc, what, deadline_s):
    """Polls `url/health` until it answers 200 (or the process exits, or time runs out)."""
    start = time.time()
    last = time.time()
    while time.time() - start < deadline_s:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready")
        try:
            status, _ = get(url + "/health")
            if status == 200:
                print(f"[bench-serve] {what} ready after {time.time() - start:.0f}s", flush=True)
                return
        except OSError:
            pass
        if time.time() - last > 30:
            print(f"[bench-serve] waiting for {what} ({time.time() - start:.0f}s)", flush=True)
            last = time.time()
        time.sleep(1)
    raise SystemExit(f"{what} not ready after {deadline_s}s")


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def tcmalloc():
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "libtcmalloc_minimal.so.4" in line and "=>" in line:
            return line.split("=>")[1].strip()
    return None


def start_vllm(args, dtype, port, log):
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="4",
        VLLM_CPU_OMP_THREADS_BIND=args.cpus,
    )
    lib = tcmalloc()
    if lib:
        env["LD_PRELOAD"] = lib
    cmd = [
        os.path.join(args.vllm_venv, "bin", "vllm"), "serve", args.model_dir,
        "--dtype", VLLM_DTYPE[dtype], "--port", str(port), "--host", "127.0.0.1",
        "--served-model-name", "smollm2", "--no-enable-prefix-caching",
        "--max-model-len", "2048",
    ]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def start_tandem(args, dtype, port, aggregated, log):
    cmd = [args.tandem, "run", "--model", args.model_dir, "--port", str(port), "--dtype", dtype]
    if aggregated:
        cmd.append("--aggregated")
    env = dict(os.environ, NO_COLOR="1")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def served_name(url):
    _, body = get(url + "/v1/models")
    return json.loads(body)["data"][0]["id"]


def bench(args, url, name, concurrency, result_dir, result_file):
    cmd = [
        os.path.join(args.vllm_venv, "bin", "vllm"), "bench", "serve",
        "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
        "--model", name, "--tokenizer", args.model_dir,
        "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64",
        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--save-result", "--result-dir", result_dir, "--result-filename", result_file,
    ]
    print(f"[bench-serve] {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"vllm bench serve failed ({done.returncode})")
    with open(os.path.join(result_dir, result_file)) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tandem", required=True)
    p.add_argument("--model-dir", required=True)
    home = os.environ.get("TANDEM_HOME", os.path.expanduser("~/.cache/tandem"))
    p.add_argument("--vllm-venv", default=os.path.join(home, "vllm-venv"))
    p.add_argument("--dtypes", default="f32,bf16")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--servers", default="vllm,aggregated,pd")
    p.add_argument("--cpus", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--out", default=None, help="directory for logs and result JSONs")
    args = p.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="bench-serve-cpu-")
    os.makedirs(out, exist_ok=True)
    print(f"[bench-serve] results and server logs under {out}", flush=True)
    table = {}
    started = time.time()
    for dtype in args.dtypes.split(","):
        for server in args.servers.split(","):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            log = open(os.path.join(out, f"{server}-{dtype}.log"), "w")
            if server == "vllm":
                proc = start_vllm(args, dtype, port, log)
            else:
                proc = start_tandem(args, dtype, port, server == "aggregated", log)
            try:
                wait_ready(url, proc, f"{server} ({dtype})", 600)
                name = served_name(url)
                for c in map(int, args.concurrency.split(",")):
                    r = bench(args, url, name, c, out, f"{server}-{dtype}-c{c}.json")
                    table[(dtype, server, c)] = r
                    print(
                        f"[bench-serve] {server} {dtype} C{c}: {r['completed']}/{args.num_prompts} "
                        f"done, output {r['output_throughput']:.1f} tok/s, TTFT median "
                        f"{r['median_ttft_ms']:.0f} ms, TPOT median {r['median_tpot_ms']:.1f} ms",
                        flush=True,
                    )
            finally:
                stop(proc)
                log.close()
    print(f"\n{'dtype':5} {'server':10} {'C':>2} {'done':>5} {'out tok/s':>9} {'TTFT ms':>8} "
          f"{'TPOT ms':>8} {'tok/s ÷ vLLM':>12} {'vLLM TTFT ÷':>11}")
    for (dtype, server, c), r in table.items():
        base = table.get((dtype, "vllm", c))
        ratio = ttft = ""
        if base and server != "vllm":
            ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}"
            ttft = f"{base['median_ttft_ms'] / r['median_ttft_ms']:.2f}"
        print(f"{dtype:5} {server:10} {c:>2} {r['completed']:>5} {r['output_throughput']:>9.1f} "
              f"{r['median_ttft_ms']:>8.0f} {r['median_tpot_ms']:>8.1f} {ratio:>12} {ttft:>11}")
    print(f"\n[bench-serve] {time.time() - started:.0f}s in all; results in {out}")


if __name__ == "__main__":
    main()
