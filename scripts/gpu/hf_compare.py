"""Hugging Face transformers as the independent reference on the GPU machine.

For one checkpoint (a `tandem model synth --arch llama` directory): teacher-forced logits of
transformers (bf16, CUDA) and of `tandem eval logits --device cuda:0 --dtype bf16` over the same
ids (a prompt plus transformers' own greedy continuation), compared where transformers' top-2
margin exceeds 0.1; then transformers' eager decode speed at batch 1 and 32 on the same shape.

usage: hf_compare.py MODEL_DIR TANDEM_BIN OUT_JSON
"""

import json
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> int:
    model_dir, tandem, out_path = sys.argv[1:4]
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
    run = subprocess.run(
        [tandem, "eval", "logits", "--model", model_dir, "--device", "cuda:0", "--dtype", "bf16",
         "--json", "--token-ids", ",".join(map(str, seq))],
        capture_output=True, text=True,
    )
    if run.returncode != 0:
        print(run.stderr)
        return 1
    ours = torch.tensor(json.loads(run.stdout)["logits"])
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
