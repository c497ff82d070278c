#!/usr/bin/env python3
"""Where a long prompt's time goes between the prefill and the decode worker, through the router.

Starts `tandem run` (router + prefill + decode on this host, CPU, SmolLM2) once per handoff
path, alternating A/B/B/A: `landing` (the decode worker's shared-memory slots, the default)
and `transport` (TANDEM_KV_LANDING_MIB=0: every handoff over UCX). For each prompt length it
streams a completion of 2 tokens and prints the time to the first token (the prefill worker's
prompt) and the gap to the second (the handoff, its import into the decode cache and one decode
step), with the handoff's size.

Usage: scripts/bench-handoff.py [--tandem target/release/tandem] [--lengths 2048,8000]
                                [--paths landing,transport]
"""
import argparse, json, os, random, socket, subprocess, sys, time, urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, limit=300):
    end = time.time() + limit
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"tandem run exited with {proc.returncode}")
        try:
            urllib.request.urlopen(url + "/ready", timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    sys.exit("cluster not ready")


def stream_two_tokens(url, prompt):
    body = json.dumps({"model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 2,
                       "min_tokens": 2, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    if len(stamps) < 2:
        sys.exit(f"expected two tokens, got {len(stamps)}")
    return stamps[0] - t0, stamps[1] - stamps[0]


def workers(url):
    with urllib.request.urlopen(url + "/admin/workers?wait_idle_ms=20000", timeout=60) as r:
        return json.load(r)["workers"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tandem", default="target/release/tandem")
    ap.add_argument("--lengths", default="2048,8000")
    ap.add_argument("--paths", default="landing,transport")
    args = ap.parse_args()
    paths = args.paths.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    rng = random.Random(7)
    prompts = {n: [rng.randrange(100, 40000) for _ in range(n)] for n in lengths}
    rows = []
    for mode in paths + paths[::-1]:
        port = free_port()
        env = dict(os.environ, TANDEM_LOG="warn",
                   TANDEM_KV_LANDING_MIB="1024" if mode == "landing" else "0")
        proc = subprocess.Popen([args.tandem, "run", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url, proc)
            stream_two_tokens(url, prompts[lengths[0]][:64])  # warm-up
            for n in lengths:
                before = {w["role"]: w for w in workers(url)}
                ttft, gap = stream_two_tokens(url, prompts[n])
                after = {w["role"]: w for w in workers(url)}
                moved = after["prefill"]["kv_bytes_transferred"] - before["prefill"]["kv_bytes_transferred"]
                landed = after["prefill"].get("kv_bytes_landed", 0) - before["prefill"].get("kv_bytes_landed", 0)
                rows.append((mode, n, ttft, gap, moved, landed))
                print(f"{mode:9} {n:6} tokens: first token {ttft*1e3:8.1f} ms, second after "
                      f"{gap*1e3:7.1f} ms; handoff {moved/1e6:6.1f} MB ({'landed' if landed else 'transport'})",
                      flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print("\nmedian gap to the second token (handoff + import + one decode step):")
    for n in lengths:
        g = {m: sorted(r[3] for r in rows if r[0] == m and r[1] == n) for m in paths}
        print(f"  {n:6} tokens: " + ", ".join(f"{m} {v[len(v) // 2]*1e3:7.1f} ms" for m, v in g.items()))


if __name__ == "__main__":
    main()
