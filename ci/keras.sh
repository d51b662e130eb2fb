#!/usr/bin/env bash
# A real bug, caught: Keras 3.0-3.4 applied weight decay and clipping at every micro-step of
# gradient_accumulation_steps and counted micro-steps in Adam's bias correction, so an update was
# not one step of the window's gradient (keras#19990, fixed in 3.5.0). examples/keras_accumulation.py
# fits a small model with AdamW(weight_decay=0.1, gradient_accumulation_steps=4) on Keras's PyTorch
# backend under Keras 3.4.1 (flagged, weight decay and bias correction named) and the current
# release (faithful), which also runs tests/frameworks/keras. Keras is pip-installed into a folder
# of its own per release on top of the test environment (.venv, or $KERAS_BASE_VENV: torch 2.13.0,
# numpy 1.23.5, this project) inside it, put first on PYTHONPATH: no second copy of torch.
# Exits non-zero when a check fails or a test did not run.
set -uo pipefail
cd "$(dirname "$0")/.."
base=${KERAS_BASE_VENV:-.venv}
old=${KERAS_OLD_DIR:-$base/keras-3.4.1}
new=${KERAS_NEW_DIR:-$base/keras-current}
reports=$(mktemp -d)
export KERAS_BACKEND=torch

if [ ! -x "$base/bin/python" ]; then
    python3 -m venv "$base" && "$base/bin/pip" install -q 'torch==2.13.0' 'numpy<1.24' pytest hypothesis -e . \
        || { echo "keras: could not build $base" >&2; exit 2; }
fi
for pair in "$old:keras==3.4.1" "$new:keras==3.15.1"; do
    dir=${pair%%:*}
    rm -rf "$dir"
    "$base/bin/pip" install -q --no-deps --target "$dir" "${pair#*:}" 'namex==0.1.0' 'optree==0.20.0' 'h5py==3.16.0' \
        || { echo "keras: could not install ${pair#*:}" >&2; exit 2; }
    PYTHONPATH=$dir "$base/bin/python" -c "import keras" || { echo "keras: ${pair#*:} does not import" >&2; exit 2; }
done

PYTHONPATH=$old "$base/bin/python" examples/keras_accumulation.py "$reports/old.json" > "$reports/old.txt" 2>&1
old_rc=$?
PYTHONPATH=$new "$base/bin/python" examples/keras_accumulation.py "$reports/new.json" > "$reports/new.txt" 2>&1
new_rc=$?

failed=0
steps() {  # each step's verdict, what its update matches and the tensors that moved inside its window
    "$base/bin/python" -c "
import sys
from accumcheck.report import load_report
for s in load_report(sys.argv[1]).steps:
    print(s.verdict, '|', s.update.matches, '|', ' '.join(s.update.moved))
" "$1"
}
old_steps=$(steps "$reports/old.json")
if [ "$old_rc" -ne 1 ] || [ "$(echo "$old_steps" | grep -c "weight decay applied at every micro-step and Adam's bias correction counting micro-steps | .*kernel")" -ne 2 ]; then
    echo "FAIL: Keras 3.4.1 exited $old_rc, expected 1 with both steps' updates matching weight decay and bias correction per micro-step, kernels moved"
    echo "$old_steps"; tail -n 5 "$reports/old.txt"; failed=1
fi
if [ "$new_rc" -ne 0 ] || [ "$(steps "$reports/new.json" | grep -c "^faithful |  | $")" -ne 2 ]; then
    echo "FAIL: Keras 3.15.1 exited $new_rc, expected 0 with both steps faithful"
    steps "$reports/new.json"; tail -n 5 "$reports/new.txt"; failed=1
fi
grep -E "^(FAITHFUL|FLAGGED|DROPPED)" "$reports/old.txt" | cut -c1-160
grep -E "^(FAITHFUL|FLAGGED|DROPPED)" "$reports/new.txt" | cut -c1-160
# The tests of the check (the faults of keras#19990 emulated on the current release): every one runs.
PYTHONPATH=$new "$base/bin/python" -m pytest -q -p no:cacheprovider tests/frameworks/keras > "$reports/tests.txt" 2>&1
rc=$?
tail -n 1 "$reports/tests.txt"
if [ "$rc" -ne 0 ] || ! tail -n 1 "$reports/tests.txt" | grep -q " passed" || tail -n 1 "$reports/tests.txt" | grep -q "skipped"; then
    echo "FAIL: the Keras tests under 3.15.1 (pytest exit $rc, every test must run and pass)"; tail -n 30 "$reports/tests.txt"; failed=1
fi
# The figures docs/stacks.md quotes from the two runs.
for dir in "$old" "$new"; do
    if ! PYTHONPATH=$dir "$base/bin/python" ci/figures.py --group keras-releases; then
        echo "FAIL: the documentation's figures of $dir differ from its run"; failed=1
    fi
done
[ "$failed" -eq 0 ] && echo "keras: 3 passed, 0 failed" || echo "keras: FAILED"
exit "$failed"
