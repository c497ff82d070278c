#!/usr/bin/env bash
# Creates (once) the Python environment the llama.cpp side of the engine comparison runs in:
#   ${TANDEM_HOME:-$HOME/.cache/tandem}/bench-venv
# with llama-cpp-python compiled from source on this machine (default CPU build: ggml picks the
# CPU features of the build machine itself), plus gguf, numpy and safetensors.
#
# The compile takes ~8 minutes on 2 cores. It runs at the lowest priority and one compiler job at
# a time, so that it does not starve a cargo build running next to it. A second run checks a
# marker and the imports and returns in seconds.
#
# Usage: scripts/bench-engine/setup-venv.sh        prints the venv's python path on the last line
# Env:   TANDEM_HOME, BENCH_VENV (override the venv path), BENCH_BUILD_JOBS (default 1)
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION=0.3.36
GGUF_VERSION=0.19.0
SAFETENSORS_VERSION=0.8.0
NUMPY_SPEC='numpy>=1.26,<3'
SPEC="llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION gguf==$GGUF_VERSION safetensors==$SAFETENSORS_VERSION $NUMPY_SPEC"

home=${TANDEM_HOME:-$HOME/.cache/tandem}
venv=${BENCH_VENV:-$home/bench-venv}
marker=$venv/.tandem-bench-ready
py=$venv/bin/python
jobs=${BENCH_BUILD_JOBS:-1}

log() { echo "[setup-venv] $*" >&2; }

imports_ok() {
  "$py" - <<'PY' >/dev/null 2>&1
import llama_cpp, gguf, numpy, safetensors.numpy
PY
}

if [ -f "$marker" ] && [ "$(cat "$marker")" = "$SPEC" ] && [ -x "$py" ] && imports_ok; then
  log "ready: $venv ($("$py" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__)'))"
  echo "$py"
  exit 0
fi

if [ ! -x "$py" ]; then
  log "creating venv $venv"
  mkdir -p "$(dirname "$venv")"
  python3 -m venv "$venv" || { log "python3 -m venv failed (Debian/Ubuntu: apt-get install python3-venv)"; exit 1; }
fi
rm -f "$marker"

log "upgrading pip"
"$py" -m pip install -q --upgrade pip

log "installing $NUMPY_SPEC gguf==$GGUF_VERSION safetensors==$SAFETENSORS_VERSION"
"$py" -m pip install -q "$NUMPY_SPEC" "gguf==$GGUF_VERSION" "safetensors==$SAFETENSORS_VERSION"

if "$py" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_PYTHON_VERSION')" 2>/dev/null; then
  log "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION already installed"
else
  log "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION from source (nice 19, $jobs job(s); ~8 min on 2 cores)"
  start=$(date +%s)
  # Default CPU backend; the multimodal (llava/mtmd) library is not needed for this benchmark.
  # -v so that the compile shows progress; the full log is kept, only progress lines are shown.
  buildlog=$venv/build-llama-cpp-python.log
  CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAVA_BUILD=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=$jobs MAKEFLAGS="-j$jobs" \
    nice -n 19 "$py" -m pip install -v --no-binary llama-cpp-python \
      "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" 2>&1 \
    | tee "$buildlog" \
    | sed -nu -E \
        -e 's#^\s*\[([0-9]+/[0-9]+)\].* -o ([^ ]+).*#[setup-venv]   [\1] \2#p' \
        -e 's#^\s*\[([0-9]+/[0-9]+)\] (Linking.*)#[setup-venv]   [\1] \2#p' \
        -e '/Successfully installed|ERROR|error:/s#^\s*#[setup-venv]   #p' >&2 || true
  if ! "$py" -c "import llama_cpp" 2>/dev/null; then
    log "llama-cpp-python did not install; see $buildlog"
    exit 1
  fi
  log "built in $(( $(date +%s) - start )) s"
fi

imports_ok || { log "imports failed in $venv"; exit 1; }
echo "$SPEC" > "$marker"
log "ready: $venv"
echo "$py"
