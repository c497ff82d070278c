#!/usr/bin/env bash
# Builds what a GPU run needs here (the GPU machine has no Rust toolchain) and packs it into
# .gpu/ (git-ignored; under the 64 MiB a run can carry): the release `tandem` binary, the CUDA
# test executables, and the scripts that run them there. `make test-gpu` calls this; then
# run `bash .gpu/run.sh` on the GPU machine, carrying `.gpu`.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=.gpu
rm -rf "$OUT"
mkdir -p "$OUT/bin"
cargo build --release --bin tandem
cp target/release/tandem "$OUT/bin/tandem"
# Test executables (dev profile: the kernels are NVRTC-compiled at run time either way).
cargo test -p tandem-cuda --no-run --message-format=json 2>/dev/null |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$OUT/bin/test-$name"; done
strip "$OUT"/bin/*
# SmolLM2's tokenizer, for serving the SmolLM2-shaped random checkpoint through the router.
SMOL="${TANDEM_HOME:-$HOME/.cache/tandem}/models/smollm2-135m-instruct"
mkdir -p "$OUT/tokenizer"
cp "$SMOL"/tokenizer.json "$SMOL"/tokenizer_config.json "$OUT/tokenizer/"
cp scripts/gpu/*.sh scripts/gpu/*.py "$OUT/"
# The tiny KDA-hybrid references (checkpoints and transformers outputs) the CUDA tests read.
SHARED="${TANDEM_SHARED_DIR:-../shared}"
for m in kimi_tiny glm5_tiny; do
  mkdir -p "$OUT/shared/reference/$m"
  cp "$SHARED/reference/$m"/{config.json,generation_config.json,model.safetensors,reference.json,reference_tensors.safetensors} "$OUT/shared/reference/$m/"
done
# The kernels' source, for A/B variants made from it there (TANDEM_CUDA_KERNELS_FILE).
cp crates/cuda/src/kernels.cu "$OUT/"
du -sh "$OUT"
ls -la "$OUT/bin"
