"""Hugging Face transformers as the independent reference on the GPU machine.

For one checkpoint (a `tandem model synth --arch llama` directory): teacher-forced logits of
transformers (bf16, CUDA) and of `tandem eval logits --device cuda:0 --dtype bf16` over the same
ids (a prompt plus transformers' own greedy continuation), compared where transformers' top-2
margin exceeds 0.1; then transformers' eager decode speed at batch 1 and 32 on the same shape.
KDA hybrids (model_type kimi_linear) are compared by precision instead: see
compare_by_precision.

usage: hf_compare.py MODEL_DIR TANDEM_BIN OUT_JSON
"""

import json
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def tandem_logits(tandem, model_dir, seq, dtype):
    run = subprocess.run(
        [tandem, "eval", "logits", "--model", model_dir, "--device", "cuda:0", "--dtype", dtype,
         "--json", "--token-ids", ",".join(map(str, seq))],
        capture_output=True, text=True,
    )
    if run.returncode != 0:
        print(run.stderr)
        raise SystemExit(1)
    return torch.tensor(json.loads(run.stdout)["logits"])


def agreement(ref, other, clear):
    """Positions in `clear` where `other` picks `ref`'s greedy token."""
    return int(((ref.argmax(-1) == other.argmax(-1)) & clear).sum())


def compare_by_precision(model_dir, tandem, out_path) -> int:
    """KDA hybrids with random weights: bf16 runs drift from f32 ones through the recurrent
    state and MoE routing, in transformers as much as in tandem. So: f32 against f32 (the
    implementations must agree), and each side's bf16 against transformers' f32 (tandem's
    bf16 must agree about as often as transformers' own bf16 does)."""
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    vocab = hf32.config.vocab_size
    prompt = [(i * 7919 + 13) % vocab for i in range(32)]
    with torch.no_grad():
        seq = hf32.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=32,
                            do_sample=False, pad_token_id=0)[0].tolist()
        ref = hf32(torch.tensor([seq], device="cuda")).logits[0].float().cpu()
    del hf32
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        hf_bf16 = hf16(torch.tensor([seq], device="cuda")).logits[0].float().cpu()
    del hf16
    ours32 = tandem_logits(tandem, model_dir, seq, "f32")
    ours16 = tandem_logits(tandem, model_dir, seq, "bf16")
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    n = int(clear.sum())
    report = {
        "model": model_dir,
        "positions": len(seq),
        "clear_margin_positions": n,
        "f32_greedy_agree_on_clear": agreement(ref, ours32, clear),
        "f32_max_abs_logit_diff": float((ref - ours32).abs().max()),
        "tandem_bf16_agree_with_hf_f32": agreement(ref, ours16, clear),
        "hf_bf16_agree_with_hf_f32": agreement(ref, hf_bf16, clear),
        "tandem_bf16_max_abs_diff_vs_hf_f32": float((ref - ours16).abs().max()),
        "hf_bf16_max_abs_diff_vs_hf_f32": float((ref - hf_bf16).abs().max()),
        "logit_scale": float(ref.abs().max()),
    }
    print(json.dumps(report, indent=1))
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    ok = report["f32_greedy_agree_on_clear"] >= 0.95 * n and (
        report["tandem_bf16_agree_with_hf_f32"] >= report["hf_bf16_agree_with_hf_f32"] - 0.05 * n)
    return 0 if ok else 1


def main() -> int:
    model_dir, tandem, out_path = sys.argv[1:4]
    with open(f"{model_dir}/config.json") as f:
        if json.load(f).get("model_type") == "kimi_linear":
            return compare_by_precision(model_dir, tandem, out_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    prompt = [(i * 7919 + 13) % vocab for i in range(32)]
    with torch.no_grad():
        gen = model.generate(
            torch.tensor([prompt], device="cuda"),
            max_new_tokens=32,
            do_sample=False,
            pad_token_id=0,
        )
        seq = gen[0].tolist()
        hf = model(torch.tensor([seq], device="cuda")).logits[0].float().cpu()
    ours = tandem_logits(tandem, model_dir, seq, "bf16")
    top2 = hf.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.1
    agree = (hf.argmax(-1) == ours.argmax(-1)) & clear
    diff = (hf - ours).abs()
    report = {
        "model": model_dir,
        "positions": len(seq),
        "clear_margin_positions": int(clear.sum()),
        "greedy_agree_on_clear": int(agree.sum()),
        "agree_fraction": float(agree.sum()) / max(1, int(clear.sum())),
        "max_abs_logit_diff": float(diff.max()),
        "mean_abs_logit_diff": float(diff.mean()),
        "logit_scale": float(hf.abs().max()),
    }
    # transformers' own decode speed on this shape (eager, bf16, random weights).
    for batch in (1, 32):
        ids = torch.tensor([prompt] * batch, device="cuda")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
        report[f"hf_eager_decode_b{batch}_tok_s"] = batch * 64 / (time.perf_counter() - t)
    print(json.dumps(report, indent=1))
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    return 0 if report["agree_fraction"] >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
