#!/usr/bin/env bash
# The GPU checks, as one prepared script for a machine with a CUDA GPU. It installs nothing: it
# runs accumcheck from this checkout (PYTHONPATH) with the Python that has torch (PYTHON, default
# python3), which needs numpy, numba, rich, matplotlib, pytest and hypothesis beside torch.
#
#   bash ci/gpu_check.sh [OUT_DIR]     (default: $OUT, else ./gpu-check)
#
# Steps, each logged to OUT_DIR/<step>.log:
#   pytest_gpu         the tests marked gpu: torch CUDA backend, the diagnostics' sync-free normal
#                      path under torch.cuda.set_sync_debug_mode("error"), nccl data parallel
#   checks             ci/gpu_check.py: verdicts and fault controls on every built-in case (TF32
#                      off, deterministic algorithms), run-to-run determinism and the noise floor
#                      of nondeterministic kernels, judging on the GPU against the host kernel
#                      (every case and fault) and its throughput, data parallel with a fault on
#                      one rank
#   bench_core         benchmarks/bench_core.py --device cuda: overhead ratio and absolute times
#   bench_diagnostics  benchmarks/bench_diagnostics.py --device cuda
# and writes the one summary, OUT_DIR/gpu_summary.md. Exit status: 0 when every step passed,
# 1 when one failed, 2 when there is no CUDA GPU.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-${OUT:-$root/gpu-check}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
cd "$root"

"$py" -c 'import sys
try:
    import torch
except ImportError:
    sys.exit("gpu_check: " + sys.executable + " has no torch; set PYTHON to the python that has it")
if not torch.cuda.is_available():
    sys.exit("gpu_check: " + sys.executable + "'"'"'s torch " + torch.__version__ + " sees no CUDA GPU; run this on a machine with one")' || exit 2
: > "$out/steps.txt"
status=0
step() {
    local name=$1; shift
    local started=$SECONDS
    echo "== $name: $*"
    if "$@" > "$out/$name.log" 2>&1; then result=PASS; else result=FAIL; status=1; fi
    echo "$name: $result ($((SECONDS - started)) s)" | tee -a "$out/steps.txt"
}
# The pytest plugin: registered by an installed accumcheck, else loaded from this checkout.
plugin=(-p accumcheck.plugin)
if "$py" -c 'import sys, importlib.metadata as m
sys.exit(0 if any(e.value == "accumcheck.plugin" for e in m.entry_points(group="pytest11")) else 1)'; then plugin=(); fi
# In one process (-p no:xdist: not a pytest-xdist worker per core, each with a CUDA context of its own).
step pytest_gpu "$py" -m pytest "${plugin[@]}" -p no:xdist -m gpu -q -rs tests/frameworks --accum-device gpu
step checks "$py" ci/gpu_check.py --out "$out/gpu_checks.json"
step bench_core "$py" benchmarks/bench_core.py --device cuda --json "$out/bench_core.json"
step bench_diagnostics "$py" benchmarks/bench_diagnostics.py --device cuda --steps 20 --reps 5 --json "$out/bench_diagnostics.json"
"$py" ci/gpu_check.py --summarize "$out" > "$out/gpu_summary.md" || status=1
cat "$out/gpu_summary.md"
exit $status
