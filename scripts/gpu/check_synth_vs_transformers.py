"""Loads tandem's synthesised KDA-hybrid checkpoints with Hugging Face transformers and compares
logits with `tandem eval logits` on the same token ids (f32 compute on both sides).

Run where torch + transformers (with kimi_linear) are installed, e.g. the lent GPU machine:
copy a release `tandem` binary to .gpu/tandem and its UCX/numa shared libraries to .gpu/lib
(or set TANDEM_BIN / TANDEM_LIBS), then `OUT=/some/dir python3 scripts/gpu/check_synth_vs_transformers.py`.
Cases: presets tiny and medium, BF16 and block-FP8 (the FP8 ones are compared with transformers'
own FP8 dequantisation and with an f32 dequantisation done here). Writes
$OUT/synth_vs_transformers.json. Results: docs/benchmarks.md, "Synthesised checkpoints vs
transformers".
"""
import json, os, subprocess, traceback
import torch, transformers
from transformers import AutoModelForCausalLM

OUT = os.environ["OUT"]
T = os.path.abspath(os.environ.get("TANDEM_BIN", ".gpu/tandem"))
env = dict(os.environ, LD_LIBRARY_PATH=os.path.abspath(os.environ.get("TANDEM_LIBS", ".gpu/lib")))
ids = [5, 17, 300, 42, 7, 99, 250, 3, 480, 64, 11, 200, 123, 77, 5, 31, 400, 9, 18, 256]
report = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": []}

def tandem_logits(d, tp=1, dp=1):
    r = subprocess.run([T, "eval", "logits", "--model", d, "--token-ids", ",".join(map(str, ids)), "--json",
                        "--tp", str(tp), "--dp", str(dp)], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return torch.tensor(json.loads(r.stdout)["logits"])

def hf_logits(d, device, **kw):
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).to(device).float().eval()
    kinds = sorted({str(p.dtype) for p in m.parameters()})
    print("param dtypes after load:", kinds, flush=True)
    with torch.no_grad():
        out = m(torch.tensor([ids], device=device), use_cache=False).logits[0].float().cpu()
    return out, type(m).__name__

CASES = [("tiny", False), ("tiny", True), ("medium", False), ("medium", True)]
if os.environ.get("ONLY_FP8"):
    CASES = [c for c in CASES if c[1]]
for preset, fp8 in CASES:
    d = f"/tmp/synth-{preset}-{'fp8' if fp8 else 'bf16'}"
    case = {"preset": preset, "fp8": fp8}
    try:
        cmd = [T, "model", "synth", "--arch", "kda-hybrid", "--preset", preset, "--out", d] + (["--fp8"] if fp8 else [])
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        ours = tandem_logits(d)
        case["tandem_shape"] = list(ours.shape)
        if fp8:
            # transformers' own FP8 block dequantisation (weights × weight_scale_inv per 128×128 block)
            from transformers import FineGrainedFP8Config
            q = FineGrainedFP8Config(dequantize=True)
            theirs, cls = hf_logits(d, "cuda", quantization_config=q)
        else:
            theirs, cls = hf_logits(d, "cpu")
        case["hf_class"] = cls
        if fp8:
            # A second reference: the FP8 checkpoint dequantised here in f32 (w · scale_inv per
            # 128×128 block) and saved unquantized, loaded by transformers as a plain checkpoint.
            from safetensors.torch import load_file, save_file
            import shutil
            plain = d + "-dequant"
            os.makedirs(plain, exist_ok=True)
            sd = load_file(os.path.join(d, "model.safetensors"))
            out = {}
            for k, v in sd.items():
                if k.endswith("_scale_inv"):
                    continue
                s_ = sd.get(k + "_scale_inv")
                if s_ is not None:
                    r, c = v.shape
                    s_full = s_.float().repeat_interleave(128, 0)[:r].repeat_interleave(128, 1)[:, :c]
                    v = v.float() * s_full
                out[k] = v.float().contiguous()
            save_file(out, os.path.join(plain, "model.safetensors"), metadata={"format": "pt"})
            cfg = json.load(open(os.path.join(d, "config.json")))
            case["quantization_config"] = cfg.pop("quantization_config", None)
            json.dump(cfg, open(os.path.join(plain, "config.json"), "w"))
            manual, _ = hf_logits(plain, "cpu")
            case["vs_manual_dequant_max_abs_diff"] = (ours - manual).abs().max().item()
            case["hf_dequant_vs_manual_max_abs_diff"] = (theirs - manual).abs().max().item()
        diff = (ours - theirs).abs()
        case["max_abs_diff"] = diff.max().item()
        case["mean_abs_diff"] = diff.mean().item()
        case["logit_std"] = theirs.std().item()
        case["argmax_equal"] = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
        if preset == "tiny" and not fp8:
            for tp, dp in [(2, 2), (4, 1)]:
                sh = tandem_logits(d, tp, dp)
                case[f"tp{tp}dp{dp}_vs_hf_max"] = (sh - theirs).abs().max().item()
    except Exception as e:
        case["error"] = "".join(traceback.format_exception(e))[-3000:]
    report["cases"].append(case)
    print(json.dumps(case)[:3000], flush=True)
json.dump(report, open(f"{OUT}/synth_vs_transformers.json", "w"), indent=1)
