#!/usr/bin/env bash
# Fetches NVRTC and the CUDA runtime headers (PyPI wheels, ~60 MB, once) into $1 so the CUDA
# kernels can be compiled — and their compile test run — on a machine without a GPU or a CUDA
# toolkit. Prints nothing when already there.
set -euo pipefail
DEST="${1:?usage: fetch-nvrtc.sh DIR}"
LIB="$DEST/nvidia/cu13/lib/libnvrtc.so.13"
[ -f "$LIB" ] && [ -f "$DEST/nvidia/cu13/include/cuda_bf16.h" ] && exit 0
echo "fetching NVRTC and CUDA headers into $DEST (once)…"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download --no-deps -q -d "$TMP" "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-runtime==13.*"
mkdir -p "$DEST"
for w in "$TMP"/*.whl; do python3 -m zipfile -e "$w" "$DEST"; done
[ -f "$LIB" ] || { echo "no $LIB in the wheels"; exit 1; }
