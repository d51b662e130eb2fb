#!/usr/bin/env bash
# TRL's trainers under the Trainer's stack check: SFTTrainer with completion-only loss (faithful)
# and a compute_loss of its own that averages each micro-batch (trl#2617's shape: flagged), and
# DPOTrainer, whose micro-batches hold the chosen rows then the rejected ones (faithful with equal
# micro-batches; a last window of 2 + 1 pairs flagged as the mean of their means). TRL 1.16 needs
# numpy >= 1.26, so it has a virtual environment of its own (.venv-trl, or $TRL_VENV) beside
# the current transformers release. Exits non-zero when a test fails or none ran.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${TRL_VENV:-.venv-trl}
log=$(mktemp)

python3 -m venv "$venv" && "$venv/bin/pip" install -q 'torch==2.13.0' 'transformers==5.24.0' 'accelerate==1.15.0' \
    'trl==1.16.0' 'numpy>=1.26' datasets pytest hypothesis -e . || { echo "trl: could not install trl 1.16.0" >&2; exit 2; }
"$venv/bin/python" -m pytest -q -p no:cacheprovider -W ignore::FutureWarning tests/frameworks/torch/test_trl_stack.py \
    > "$log" 2>&1
rc=$?
tail -n 1 "$log"
if [ "$rc" -ne 0 ] || ! tail -n 1 "$log" | grep -q " passed" || tail -n 1 "$log" | grep -q "skipped"; then
    echo "trl: FAILED (pytest exit $rc, every test must run and pass)"; tail -n 30 "$log"; exit 1
fi
echo "trl: passed"
