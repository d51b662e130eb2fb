#!/usr/bin/env bash
# A real bug, caught: Hugging Face transformers before 4.46 accumulated the mean of each
# micro-batch's mean loss, not the window's mean, so with variable-length sequences a step of
# gradient_accumulation_steps=4 was not the gradient of its 4 micro-batches as one batch
# (huggingface/transformers#34191). examples/trainer_variable_length.py runs a tiny Llama through
# the Trainer of 4.45.2 (flagged: no constant factor) and of the current release (faithful), each
# in a virtual environment of its own; the test environment's 4.57.6 (a constant factor,
# transformers#46204) is checked by tests/frameworks/torch/test_transformers_stack.py. The current
# release also runs the tests of the models people train now (tests/frameworks/torch/
# test_transformers_models.py): BERT heads that take **kwargs and ignore num_items_in_batch
# (transformers#47688), a Mixtral whose grouped_mm experts have no float64 kernel.
set -uo pipefail
cd "$(dirname "$0")/.."
old=${TRANSFORMERS_OLD_VENV:-.venv-transformers-4.45}
new=${TRANSFORMERS_NEW_VENV:-.venv-transformers-current}
reports=$(mktemp -d)

python3 -m venv "$old" && "$old/bin/pip" install -q 'torch==2.13.0' 'transformers==4.45.2' 'accelerate==0.34.2' \
    'numpy<2' -e . || { echo "transformers_releases: could not install transformers 4.45.2" >&2; exit 2; }
python3 -m venv "$new" && "$new/bin/pip" install -q 'torch==2.13.0' 'transformers==5.24.0' 'accelerate==1.15.0' \
    pytest hypothesis -e . || { echo "transformers_releases: could not install transformers 5.24.0" >&2; exit 2; }

"$old/bin/python" examples/trainer_variable_length.py "$reports/old.json" > "$reports/old.txt" 2>&1
old_rc=$?
"$new/bin/python" examples/trainer_variable_length.py "$reports/new.json" > "$reports/new.txt" 2>&1
new_rc=$?

failed=0
verdicts() {  # the step verdicts of a saved report, one word each
    python3 -c "import json,sys; print(' '.join(s['result']['equivalent'] and 'faithful' or ('constant' if s['result']['constant'] else 'mismatch') for s in json.load(open(sys.argv[1]))['steps']))" "$1"
}
if [ "$old_rc" -ne 1 ] || [ "$(verdicts "$reports/old.json")" != "mismatch mismatch mismatch mismatch" ]; then
    echo "FAIL: transformers 4.45.2 exited $old_rc, expected 1 with every step a mismatch (no constant factor)"
    tail -n 5 "$reports/old.txt"; failed=1
fi
if [ "$new_rc" -ne 0 ] || [ "$(verdicts "$reports/new.json")" != "faithful faithful faithful faithful faithful" ]; then
    echo "FAIL: transformers 5.24.0 exited $new_rc, expected 0 with every step faithful"
    tail -n 5 "$reports/new.txt"; failed=1
fi
grep -E "^(FAITHFUL|FLAGGED|DROPPED)" "$reports/old.txt" | cut -c1-160
grep -E "^(FAITHFUL|FLAGGED|DROPPED)" "$reports/new.txt" | cut -c1-160
# The models of today under the current release: the heads that ignore num_items_in_batch named
# (N, N, k), Mixtral checked through its eager experts and its router loss named.
if ! "$new/bin/python" -m pytest -q -p no:cacheprovider tests/frameworks/torch/test_transformers_models.py \
        tests/frameworks/torch/test_transformers_stack.py > "$reports/models.txt" 2>&1; then
    echo "FAIL: the transformers tests under 5.24.0"; tail -n 15 "$reports/models.txt"; failed=1
fi
tail -n 1 "$reports/models.txt"
# The figures docs/stacks.md quotes from these two runs.
for venv in "$old" "$new"; do
    if ! "$venv/bin/python" ci/figures.py --group trainer-releases; then
        echo "FAIL: the documentation's figures of $venv differ from its run"; failed=1
    fi
done
if ! "$new/bin/python" ci/figures.py --group trainer-models --group trainer-ddp; then
    echo "FAIL: the documentation's figures of the models under $new differ from its run"; failed=1
fi
[ "$failed" -eq 0 ] && echo "transformers_releases: 3 passed, 0 failed" || echo "transformers_releases: FAILED"
exit "$failed"
