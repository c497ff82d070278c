#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, with .gpu/ carried along (see bundle.sh).
# Phases (default: tests): tests | bench | gemv | hf | pd | kda | kda48 | hfkda | mla | all. Logs and JSON go to $OUT (or .gpu/out).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="$HERE/bin"
OUT="${OUT:-$HERE/out}"
mkdir -p "$OUT"
export TANDEM_REQUIRE_GPU=1
# SmolLM2's tokenizer (bundled) for the structured-outputs test on CUDA.
export TANDEM_TEST_TOKENIZER="${TANDEM_TEST_TOKENIZER:-$HERE/tokenizer/tokenizer.json}"
export TANDEM_LOG="${TANDEM_LOG:-warn}"
export TANDEM_CACHE_DIR="${TANDEM_CACHE_DIR:-/tmp/tandem-cache}"
# The reference checkpoints bundle.sh copied (KDA-hybrid tests and phase_kda).
export TANDEM_SHARED_DIR="${TANDEM_SHARED_DIR:-$HERE/shared}"
MODELS=/tmp/tandem-models
status=0

synth() { # preset
  [ -f "$MODELS/$1/config.json" ] || "$BIN/tandem" model synth --arch llama --preset "$1" --out "$MODELS/$1" >/dev/null
}

phase_tests() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  for t in "$BIN"/test-*; do
    echo "== $(basename "$t")"
    log="$OUT/$(basename "$t").log"
    "$t" --test-threads=1 --nocapture >"$log" 2>&1 || status=1
    grep -E "^test |test result|panicked|skipping|max \||^  left|^ right|differ" "$log"
  done
}

phase_bench() {
  for preset in smollm2 1b; do
    synth "$preset"
    echo "== bench engine --device cuda:0 --dtype bf16 ($preset shape)"
    "$BIN/tandem" bench engine --device cuda:0 --dtype bf16 --model "$MODELS/$preset" \
      --json "$OUT/bench-$preset.json" || status=1
  done
}

# Decode steps of 1–8 rows with bf16 products of up to 2 rows on the GEMV kernels (the rest on
# cuBLAS) and of up to 8, for this binary and, when .gpu/bin/tandem-base exists, that one.
phase_gemv() {
  for preset in smollm2 1b; do
    synth "$preset"
    for bin in "$BIN/tandem" "$BIN/tandem-base"; do
      [ -x "$bin" ] || continue
      for rows in 2 8; do
        echo "== $(basename "$bin") $preset TANDEM_CUDA_GEMV_ROWS=$rows"
        TANDEM_CUDA_GEMV_ROWS=$rows "$bin" bench engine --device cuda:0 --dtype bf16 \
          --model "$MODELS/$preset" --step-batches 1,2,3,4,6,8 --step-prefill 0 2>&1 | grep "decode batch" || status=1
      done
    done
  done
}

phase_hf() {
  for preset in smollm2 1b; do
    synth "$preset"
    echo "== transformers vs tandem ($preset shape)"
    python3 "$HERE/hf_compare.py" "$MODELS/$preset" "$BIN/tandem" "$OUT/hf-$preset.json" || status=1
  done
}

# Router + prefill + decode processes on loopback (tandem run) on the SmolLM2-shaped random
# checkpoint with SmolLM2's tokenizer: GPU/GPU, CPU prefill → GPU decode, GPU prefill → CPU
# decode (bf16 K/V across devices), each answer compared with a single-process GPU run.
phase_pd() {
  synth smollm2
  local d="$MODELS/smollm2" prompt="The capital of France is" port=8011
  cp "$HERE"/tokenizer/* "$d/"
  "$BIN/tandem" generate --model "$d" --device cuda:0 --dtype bf16 --prompt "$prompt" \
    --max-tokens 16 --json > "$OUT/pd-single.json" || { status=1; return; }
  echo "single process (cuda:0): $(cat "$OUT/pd-single.json")"
  for pair in "cuda:0 cuda:0" "cpu cuda:0" "cuda:0 cpu"; do
    set -- $pair
    port=$((port + 1))
    "$BIN/tandem" run --model "$d" --dtype bf16 --prefill-device "$1" --decode-device "$2" \
      --port "$port" > "$OUT/pd-run-$port.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 180); do curl -sf "localhost:$port/ready" >/dev/null && break; sleep 1; done
    curl -s "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"smollm2\", \"prompt\": \"$prompt\", \"max_tokens\": 16, \"temperature\": 0}" > "$OUT/pd-$port.json"
    if [ "$1 $2" = "cuda:0 cuda:0" ]; then
      # n = 3 (one prefill, the decode worker's choices sharing the prompt's blocks) against
      # each seed alone, on this pair.
      local body='"model": "smollm2", "prompt": "'"$prompt"'", "max_tokens": 12, "temperature": 1.0, "ignore_eos": true'
      curl -s "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
        -d "{$body, \"n\": 3, \"seed\": 3}" > "$OUT/pd-n3-$port.json"
      for s in 3 4 5; do
        curl -s "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
          -d "{$body, \"seed\": $s}" > "$OUT/pd-seed$s-$port.json"
      done
      python3 - "$OUT" "$port" <<'PY' || status=1
import json, sys
out, port = sys.argv[1], sys.argv[2]
n3 = [c["text"] for c in json.load(open(f"{out}/pd-n3-{port}.json"))["choices"]]
alone = [json.load(open(f"{out}/pd-seed{s}-{port}.json"))["choices"][0]["text"] for s in (3, 4, 5)]
same = n3 == alone
print(f"n = 3 on GPU P/D: {'each choice equals its seed alone' if same else 'DIFFERENT'}: {n3!r} vs {alone!r}")
sys.exit(0 if same else 1)
PY
    fi
    # Which path the handoff took: shared-memory landing slot or the transport.
    curl -s "localhost:$port/admin/workers?wait_idle_ms=5000" > "$OUT/pd-workers-$port.json"
    python3 - "$OUT/pd-workers-$port.json" <<'PY' || true
import json, sys
for w in json.load(open(sys.argv[1]))["workers"]:
    print("  %s: kv_bytes_transferred %s, landed in shared memory %s"
          % (w["role"], w["kv_bytes_transferred"], w.get("kv_bytes_landed", 0)))
PY
    kill "$pid"; wait "$pid" 2>/dev/null
    python3 - "$OUT/pd-single.json" "$OUT/pd-$port.json" "$1" "$2" <<'PY' || status=1
import json, sys
single = json.load(open(sys.argv[1]))["text"]
reply = json.load(open(sys.argv[2]))
text = reply["choices"][0]["text"]
same = text == single
print(f"P {sys.argv[3]} -> D {sys.argv[4]} through the router: {'same text' if same else 'DIFFERENT'}: {text!r}")
sys.exit(0 if same else 1)
PY
  done
}

# KDA hybrids: one layer's delta rule against fla's Triton kernels in the same call (fla-core
# from .whl, carried), then the tiny Kimi-Linear checkpoint (shared/reference/kimi_tiny, with a
# word-level tokenizer: "tN" is id N) served through the router on every device pair, each
# answer compared with a single-process CPU run.
phase_kda() {
  "$BIN/tandem" bench kda --device cuda:0 --json "$OUT/kda-tandem.json" || status=1
  local whl site=/tmp/fla-site
  whl=$(ls "$HERE"/../.whl/fla_core-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    python3 -m pip install -q --no-index --no-deps --target "$site" "$whl" >/dev/null 2>&1
    PYTHONPATH="$site" python3 "$HERE/fla_kda.py" "$OUT/kda-fla.json" "$OUT/kda-tandem.json" || status=1
  else
    echo "fla-core wheel not carried (.whl/): no fla comparison"
  fi
  local d="$MODELS/kimi_tiny" port=8111
  mkdir -p "$d"
  cp "$TANDEM_SHARED_DIR"/reference/kimi_tiny/{config.json,model.safetensors,generation_config.json} "$d/"
  python3 - "$d" <<'PY'
import json, sys
d = sys.argv[1]
vocab = {f"t{i}": i for i in range(512)}
json.dump({"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None,
           "decoder": None, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}},
          open(f"{d}/tokenizer.json", "w"))
json.dump({"chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
           "eos_token": "t2", "bos_token": "t1", "add_bos_token": False, "model_max_length": 4096},
          open(f"{d}/tokenizer_config.json", "w"))
PY
  local ids="9,40,7,300,12,5,77,1,250,64,3" prompt="t9 t40 t7 t300 t12 t5 t77 t1 t250 t64 t3"
  "$BIN/tandem" generate --model "$d" --device cpu --token-ids "$ids" --max-tokens 12 --json > "$OUT/kda-cpu.json" || status=1
  "$BIN/tandem" generate --model "$d" --device cuda:0 --token-ids "$ids" --max-tokens 12 --json > "$OUT/kda-cuda.json" || status=1
  echo "generate cpu:    $(cat "$OUT/kda-cpu.json")"
  echo "generate cuda:0: $(cat "$OUT/kda-cuda.json")"
  for pair in "cuda:0 cuda:0" "cpu cuda:0" "cuda:0 cpu"; do
    set -- $pair
    port=$((port + 1))
    "$BIN/tandem" run --model "$d" --prefill-device "$1" --decode-device "$2" \
      --port "$port" > "$OUT/kda-run-$port.log" 2>&1 &
    local pid=$!
    for _ in $(seq 1 120); do curl -sf "localhost:$port/ready" >/dev/null && break; sleep 1; done
    curl -s "localhost:$port/v1/completions" -H 'Content-Type: application/json' \
      -d "{\"model\": \"kimi_tiny\", \"prompt\": \"$prompt\", \"max_tokens\": 12, \"temperature\": 0, \"ignore_eos\": true}" > "$OUT/kda-pd-$port.json"
    kill "$pid"; wait "$pid" 2>/dev/null
    python3 - "$OUT/kda-cpu.json" "$OUT/kda-pd-$port.json" "$1" "$2" <<'PY' || status=1
import json, sys
want = json.load(open(sys.argv[1]))["text"].split()
try:
    got = json.load(open(sys.argv[2]))["choices"][0]["text"].split()
except Exception as e:
    print(f"KDA P {sys.argv[3]} -> D {sys.argv[4]}: no answer ({e}): {open(sys.argv[2]).read()[:300]}")
    sys.exit(1)
same = got == want
print(f"KDA P {sys.argv[3]} -> D {sys.argv[4]} through the router: {'same tokens' if same else 'DIFFERENT'}: {' '.join(got)}")
sys.exit(0 if same else 1)
PY
  done
}

# Kimi-Linear-48B-A3B's per-layer dimensions, block-FP8 as published (KDA projections BF16),
# LAYERS layers (default 4: one dense, three MoE, MLA among them), and the 1b preset in
# block-FP8: whole decode steps at batch 1 / 32 / 128 (traced) and an 8k prefill, with the
# routed experts kept as FP8 and dequantised to bf16 at load (TANDEM_CUDA_FP8_WEIGHTS=0), per
# layer being the figure to report for the 48b shape.
phase_kda48() {
  local d="$MODELS/kda48-${LAYERS:-4}" s="$MODELS/kda1b-fp8"
  [ -f "$d/config.json" ] || "$BIN/tandem" model synth --arch kda-hybrid --preset 48b --fp8 \
    --layers "${LAYERS:-4}" --out "$d" >/dev/null || { status=1; return; }
  [ -f "$s/config.json" ] || "$BIN/tandem" model synth --arch kda-hybrid --preset 1b --fp8 \
    --out "$s" >/dev/null || { status=1; return; }
  for m in "$s" "$d"; do
    for fp8 in 0 1; do
      echo "== $(basename "$m"), bf16, FP8 experts $fp8"
      TANDEM_CUDA_FP8_WEIGHTS=$fp8 "$BIN/tandem" bench engine --device cuda:0 --dtype bf16 \
        --model "$m" --step-batches 1,32,128 --step-prefill 8192 \
        --json "$OUT/$(basename "$m")-fp8$fp8.json" || status=1
    done
  done
}

# KDA hybrids against transformers' own kimi_linear (fla's kernels when the wheel is carried):
# synthesised medium and 1b checkpoints (bf16), teacher-forced logits of both in bf16 on the GPU,
# greedy agreement where transformers' top-2 margin exceeds 0.1, and transformers' decode speed
# on the shape; then transformers' bf16 run of the tiny references (tiny_bf16_reference.py).
phase_hfkda() {
  local whl site=/tmp/fla-site
  whl=$(ls "$HERE"/../.whl/fla_core-*.whl 2>/dev/null | head -1)
  [ -n "$whl" ] && python3 -m pip install -q --no-index --no-deps --target "$site" "$whl" >/dev/null 2>&1
  for preset in medium 1b; do
    local d="$MODELS/kda-$preset"
    [ -f "$d/config.json" ] || "$BIN/tandem" model synth --arch kda-hybrid --preset "$preset" \
      --out "$d" >/dev/null || { status=1; continue; }
    echo "== transformers kimi_linear vs tandem (kda-hybrid $preset)"
    PYTHONPATH="$site" python3 "$HERE/hf_compare.py" "$d" "$BIN/tandem" "$OUT/hf-kda-$preset.json" || status=1
  done
  PYTHONPATH="$site" python3 "$HERE/tiny_bf16_reference.py" "$TANDEM_SHARED_DIR" "$OUT/tiny-bf16.json" || status=1
}

# MLA decode attention one head a block (the default) vs four (TANDEM_CUDA_MLA_HEADS=4): the
# op test against the CPU with each, then decode steps on Kimi-Linear-48B dimensions (2 layers,
# FP8), the two arms alternated.
phase_mla() {
  for h in 4 1; do
    echo "== test-hybrid_vs_cpu mla, $h heads a block"
    TANDEM_CUDA_MLA_HEADS=$h "$BIN/test-hybrid_vs_cpu" --test-threads=1 mla >"$OUT/mla-test-$h.log" 2>&1 || status=1
    grep -E "^test |test result" "$OUT/mla-test-$h.log"
  done
  local d="$MODELS/kda48-2"
  [ -f "$d/config.json" ] || "$BIN/tandem" model synth --arch kda-hybrid --preset 48b --fp8 \
    --layers 2 --out "$d" >/dev/null || { status=1; return; }
  for h in 1 4 1 4; do
    echo "== kda48-2 decode, $h MLA heads a block"
    TANDEM_CUDA_MLA_HEADS=$h "$BIN/tandem" bench engine --device cuda:0 --dtype bf16 --model "$d" \
      --step-batches 1,32,128 --step-prefill 0 2>&1 | grep "decode batch" || status=1
  done
}

case "${1:-tests}" in
  tests) phase_tests ;;
  bench) phase_bench ;;
  gemv) phase_gemv ;;
  hf) phase_hf ;;
  pd) phase_pd ;;
  kda) phase_kda ;;
  kda48) phase_kda48 ;;
  hfkda) phase_hfkda ;;
  mla) phase_mla ;;
  all) phase_tests; phase_bench; phase_hf; phase_pd; phase_kda ;;
  *) echo "usage: run.sh tests|bench|gemv|hf|pd|kda|kda48|hfkda|mla|all"; exit 2 ;;
esac
exit $status
