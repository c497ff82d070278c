"""fla's KDA kernels (chunk_kda, fused_recurrent_kda) timed on the shapes `tandem bench kda
--device cuda:0` times: one layer of 32 heads x 128, bf16 q/k/v, f32 decays and state.

Usage: fla_kda.py OUT.json [TANDEM.json]. With TANDEM.json (tandem's --json output from the
same call) it prints each figure beside tandem's with the ratio fla / tandem (> 1: tandem is
faster)."""

import json
import sys

import torch
from fla.ops.kda import chunk_kda, fused_recurrent_kda

H, D = 32, 128
dev = "cuda"


def inputs(batch, tokens):
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=dev, generator=g)

    q = torch.nn.functional.normalize(r(batch, tokens, H, D), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(r(batch, tokens, H, D), dim=-1).bfloat16()
    v = r(batch, tokens, H, D).bfloat16()
    gate = -0.1 * torch.rand(batch, tokens, H, D, device=dev, generator=g) - 1e-3
    beta = 0.5 * torch.rand(batch, tokens, H, device=dev, generator=g)
    return q, k, v, gate.float(), beta.bfloat16()


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]  # ms


def graphed(fn, reps):
    """`fn` captured once in a CUDA graph and replayed (what a serving engine's decode does)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, reps)


report = {"device": torch.cuda.get_device_name(), "chunked_prefill": [], "recurrent_decode": []}
for tokens in (2048, 8192, 32768):
    q, k, v, gate, beta = inputs(1, tokens)
    state = torch.zeros(1, H, D, D, device=dev)

    def run():
        chunk_kda(q, k, v, gate, beta, scale=D**-0.5, initial_state=state, output_final_state=True)

    ms = timed(run, 10)
    report["chunked_prefill"].append({"tokens": tokens, "ms": ms})
    print(f"fla chunk_kda {tokens:>6} tokens {ms:9.3f} ms", flush=True)
for n in (1, 32, 128):
    q, k, v, gate, beta = inputs(n, 1)
    state = torch.zeros(n, H, D, D, device=dev)

    def step():
        fused_recurrent_kda(q, k, v, gate, beta, scale=D**-0.5, initial_state=state,
                            output_final_state=True)

    eager = timed(step, 100) * 1e3
    try:
        graph = graphed(step, 100) * 1e3
    except Exception as e:  # a capture failure is reported, not fatal
        print(f"  graph capture failed: {e}")
        graph = None
    report["recurrent_decode"].append({"sequences": n, "us": graph or eager, "eager_us": eager})
    print(f"fla fused_recurrent_kda {n:>4} sequences {eager:8.1f} us eager, "
          f"{graph if graph is not None else float('nan'):8.1f} us in a graph", flush=True)
json.dump(report, open(sys.argv[1], "w"), indent=1)

if len(sys.argv) > 2:
    ours = json.load(open(sys.argv[2]))
    print("fla / tandem (> 1: tandem faster), same call:")
    for a, b in zip(report["chunked_prefill"], ours["chunked_prefill"]):
        print(f"  chunked {a['tokens']:>6} tokens  fla {a['ms']:9.3f} ms  tandem {b['ms']:9.3f} ms"
              f"  {a['ms'] / b['ms']:6.2f}x")
    for a, b in zip(report["recurrent_decode"], ours["recurrent_decode"]):
        print(f"  recurrent {a['sequences']:>4} seqs  fla {a['us']:8.1f} us  tandem {b['us']:8.1f} us"
              f"  {a['us'] / b['us']:6.2f}x")
