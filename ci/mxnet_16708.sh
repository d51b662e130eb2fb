#!/usr/bin/env bash
# A real bug, caught: MXNet 1.6.0's grad_req='add' counts the running total again when a parameter
# has more than four gradient contributions in one backward pass (apache/mxnet#16708, #17989;
# fixed in 1.7.0 by #17995). accumcheck must flag `shared-weight` on 1.6.0, naming the weight, and
# must pass it on 1.9.1. 1.6.0 gets a virtual environment of its own; 1.9.1 is the one the test
# command installed (.venv), or any accumcheck with mxnet 1.9.1 given as ACCUMCHECK_MX19.
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${MXNET16_VENV:-.venv-mxnet16}
new=${ACCUMCHECK_MX19:-.venv/bin/accumcheck}
reports=$(mktemp -d)

python3 -m venv "$venv" && "$venv/bin/pip" install -q 'mxnet==1.6.0' 'numpy<1.24' -e . || {
    echo "mxnet_16708: could not install mxnet 1.6.0" >&2; exit 2; }

"$venv/bin/accumcheck" compare --framework mxnet --case shared-weight --format json --output "$reports/mxnet-1.6.0.json"
old_rc=$?
"$new" compare --framework mxnet --case shared-weight --format json --output "$reports/mxnet-1.9.1.json"
new_rc=$?

failed=0
if [ "$old_rc" -ne 1 ]; then
    echo "FAIL: mxnet 1.6.0 shared-weight exited $old_rc, expected 1 (flagged)"; failed=1
elif ! grep -q '"name": "shared.weight"' "$reports/mxnet-1.6.0.json" \
     || ! python3 -c "import json,sys; r=json.load(open(sys.argv[1])); t={x['name']: x['verdict'] for x in r['tensors']}; sys.exit(t['shared.weight'] != 'diverged')" "$reports/mxnet-1.6.0.json"; then
    echo "FAIL: mxnet 1.6.0 report does not call shared.weight diverged"; failed=1
fi
if [ "$new_rc" -ne 0 ]; then
    echo "FAIL: mxnet 1.9.1 shared-weight exited $new_rc, expected 0"; failed=1
fi
"$venv/bin/accumcheck" show "$reports/mxnet-1.6.0.json" | tail -n 1
"$new" show "$reports/mxnet-1.9.1.json" | tail -n 1
# accumcheck diff names what changed verdict between the two releases.
changes=$("$new" diff "$reports/mxnet-1.6.0.json" "$reports/mxnet-1.9.1.json")
echo "$changes" | tail -n 1
if ! echo "$changes" | grep -q "shared.weight (diverged -> round-off)"; then
    echo "FAIL: accumcheck diff does not name shared.weight going from diverged to round-off"; failed=1
fi
# The figures the README and docs/ quote from these two runs.
if ! ACCUMCHECK_MX19="$new" "$venv/bin/python" ci/figures.py --group mxnet-1.6.0; then
    echo "FAIL: the documentation's MXNet 1.6.0 figures differ from this run"; failed=1
fi
[ "$failed" -eq 0 ] && echo "mxnet_16708: 4 passed, 0 failed" || echo "mxnet_16708: FAILED"
exit "$failed"
