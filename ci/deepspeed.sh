#!/usr/bin/env bash
# DeepSpeed's engine under the stack check (accumcheck.integrations.deepspeed): a smoke of minutes on
# the CPU. Installs DeepSpeed 0.19.8 beside torch 2.13.0 (the CPU build) in a virtual environment of
# its own (.venv-deepspeed, or $DEEPSPEED_VENV) and runs tests/frameworks/torch/test_deepspeed_stack.py:
# two ranks under torchrun (gloo), ZeRO-1 and ZeRO-2 with gradient_accumulation_steps judged faithful,
# a rank's micro-batch never backwarded and a rank's loss doubled each flagged, every rank exiting
# alike, the engine and model put back as found, and ZeRO-3 refused in one line; then GradMonitor
# on ZeRO-1/2 engines (tests/frameworks/torch/test_sharded_diagnostics.py) and the figures
# docs/stacks-parallel.md quotes from examples/deepspeed_loop.py. DeepSpeed's CPU
# accelerator (DS_ACCELERATOR=cpu) JIT-builds its shared-memory communication op with g++ on first
# use (about 30 s); a torch.optim optimizer is passed to the engine, so nothing else compiles.
# Exits non-zero when a test fails or none ran.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${DEEPSPEED_VENV:-.venv-deepspeed}
log=$(mktemp)

python3 -m venv "$venv" && "$venv/bin/pip" install -q 'torch==2.13.0' 'deepspeed==0.19.8' pytest hypothesis tomli-w \
    -e '.[diagnostics]' || { echo "deepspeed: could not install deepspeed 0.19.8" >&2; exit 2; }
# the environment ignores itself (a .gitignore of its own), whatever the repository's .gitignore lists
[ -f "$venv/.gitignore" ] || echo '*' > "$venv/.gitignore"
DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    -W ignore::FutureWarning tests/frameworks/torch/test_deepspeed_stack.py \
    tests/frameworks/torch/test_sharded_diagnostics.py > "$log" 2>&1
rc=$?
tail -n 1 "$log"
if [ "$rc" -ne 0 ] || ! tail -n 1 "$log" | grep -q " passed" || tail -n 1 "$log" | grep -q "skipped"; then
    echo "deepspeed: FAILED (pytest exit $rc, every test must run and pass)"; tail -n 30 "$log"; exit 1
fi
if ! DS_ACCELERATOR=cpu "$venv/bin/python" ci/figures.py --group deepspeed; then
    echo "deepspeed: FAILED (the documentation's DeepSpeed figures differ from this run)"; exit 1
fi
echo "deepspeed: passed"
