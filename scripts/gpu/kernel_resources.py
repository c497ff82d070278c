#!/usr/bin/env python3
"""Compiles crates/cuda/src/kernels.cu with NVRTC here (no GPU needed) and prints ptxas's
resource use (registers, spills, shared memory) of the kernels whose names contain a filter:
a kernel's compile errors and register pressure show before a GPU run.

Usage: scripts/gpu/kernel_resources.py [NAME_FILTER] [--arch sm_90]
NVRTC and the CUDA headers come from the PyPI wheels `make test` fetches (scripts/fetch-nvrtc.sh)
into ${TANDEM_HOME:-~/.cache/tandem}/nvrtc.
"""
import argparse, ctypes, glob, os, pathlib, sys

root = pathlib.Path(__file__).resolve().parents[2]
home = pathlib.Path(os.environ.get("TANDEM_HOME", pathlib.Path.home() / ".cache/tandem")) / "nvrtc"
ap = argparse.ArgumentParser()
ap.add_argument("filter", nargs="?", default="")
ap.add_argument("--arch", default="sm_90")
args = ap.parse_args()
libs = sorted(glob.glob(str(home / "nvidia/*/lib/libnvrtc.so*")))
headers = sorted(glob.glob(str(home / "nvidia/*/include/cuda_bf16.h")))
if not libs or not headers:
    sys.exit(f"no NVRTC under {home}: run `bash scripts/fetch-nvrtc.sh {home}` first")
# The builtins library beside it is loaded by name: load it from there first.
for builtins in glob.glob(os.path.join(os.path.dirname(libs[0]), "libnvrtc-builtins.so*")):
    ctypes.CDLL(builtins)
lib = ctypes.CDLL(libs[0])
src = (root / "crates/cuda/src/kernels.cu").read_bytes()
prog = ctypes.c_void_p()
assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"kernels.cu", 0, None, None) == 0
opts = [f"--gpu-architecture={args.arch}", f"--include-path={os.path.dirname(headers[0])}",
        "--std=c++17", "--ptxas-options=-v"]
arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
n = ctypes.c_size_t()
lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
log = ctypes.create_string_buffer(n.value)
lib.nvrtcGetProgramLog(prog, log)
kernel = None
for line in log.value.decode(errors="replace").splitlines():
    if "error" in line:
        print(line)
    if "Compiling entry function" in line:
        kernel = line.split("'")[1]
    elif kernel and args.filter in kernel and ("Used" in line or "spill" in line):
        detail = line.split(":", 1)[1] if "Used" in line else line.replace("ptxas", "", 1)
        print(f"{kernel}: {detail.strip(' .')}")
sys.exit(0 if rc == 0 else 1)
