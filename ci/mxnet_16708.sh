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
# The second pass's cause: the running total multiplied by 16 at every micro-step (five
# contributions), each micro-gradient computed without one of them (8/9 of it).
if ! python3 -c "import json,sys; r=json.load(open(sys.argv[1])); c={x['name']: x['cause'] for x in r['tensors']}['shared.weight']; print('cause:', c['detail']); sys.exit(not (c['kind'] == 'growth' and c['factor'] == 16 and abs(c['grad_scale'] - 8 / 9) < 1e-5 and c['residual_ratio'] <= 1))" "$reports/mxnet-1.6.0.json"; then
    echo "FAIL: mxnet 1.6.0 shared.weight is not explained as the running total growing 16-fold per micro-step"; failed=1
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
# The training trajectory, judged against its control (manual's micro-batches summed last to first,
# fed the same micro-gradients): on 1.6.0 grad_req='add' counts the running total again, so native
# leaves the control's band at the first optimizer step by orders of magnitude past the margin, under
# Adam and SGD alike; on 1.9.1 the kAddTo kernels' reordering stays within it (exit 0), however far
# Adam amplifies it past one ulp.
for optimizer in adam sgd; do
    for release in 1.6.0 1.9.1; do
        runner=$([ "$release" = 1.6.0 ] && echo "$venv/bin/accumcheck" || echo "$new")
        "$runner" train --framework mxnet --case shared-weight --steps 15 --optimizer "$optimizer" \
            --format json >"$reports/train-$optimizer-$release.json"
        echo "$?" >"$reports/train-$optimizer-$release.rc"
    done
    if [ "$(cat "$reports/train-$optimizer-1.6.0.rc")" -ne 1 ] || ! python3 -c "import json,sys
r = json.load(open(sys.argv[1])); first = min(r['first_out_of_control'].values())
worst = max(v[first] for v in r['control_ratio'].values())
print('train $optimizer on 1.6.0: flagged at step %d (%s), %.3g x the control, margin %g' % (first, ', '.join(sorted(r['first_out_of_control'])), worst, r['margin']))
sys.exit(not (first == 0 and 'shared.weight' in r['first_out_of_control'] and worst > 100 * r['margin']))" "$reports/train-$optimizer-1.6.0.json"; then
        echo "FAIL: mxnet 1.6.0 shared-weight train --optimizer $optimizer did not exit 1 flagged at step 0 far past the control"; failed=1
    fi
    if [ "$(cat "$reports/train-$optimizer-1.9.1.rc")" -ne 0 ] || ! python3 -c "import json,sys
r = json.load(open(sys.argv[1])); worst = max(max(v) for v in r['control_ratio'].values())
print('train $optimizer on 1.9.1: within %.3g x the control, margin %g' % (worst, r['margin']))
sys.exit(bool(r['first_out_of_control']) or worst > r['margin'])" "$reports/train-$optimizer-1.9.1.json"; then
        echo "FAIL: mxnet 1.9.1 shared-weight train --optimizer $optimizer is not within the control's band (exit 0)"; failed=1
    fi
done
"$venv/bin/accumcheck" show "$reports/train-adam-1.6.0.json" | tail -n 1
"$new" show "$reports/train-adam-1.9.1.json" | tail -n 1
# The figures the README and docs/ quote from these two runs.
if ! ACCUMCHECK_MX19="$new" "$venv/bin/python" ci/figures.py --group mxnet-1.6.0; then
    echo "FAIL: the documentation's MXNet 1.6.0 figures differ from this run"; failed=1
fi

# The bug report's reproduction: accumcheck under 1.6.0 writes a script that needs only mxnet and
# numpy. In a virtual environment holding nothing else it must show the divergence on 1.6.0 (exit 1)
# and agreement on 1.9.1 (exit 0).
repro=$(mktemp -d)
"$venv/bin/accumcheck" compare --framework mxnet --case shared-weight --repro "$repro/repro.py" \
    --format json --output "$reports/repro-run.json" 2>"$repro/write.txt"
tail -n 1 "$repro/write.txt"
bare() {  # a virtual environment with mxnet $1 and numpy alone
    python3 -m venv "$repro/venv-$1" && "$repro/venv-$1/bin/pip" install -q "mxnet==$1" 'numpy<1.24' \
        >"$repro/pip-$1.txt" 2>&1 || {
        cat "$repro/pip-$1.txt"; echo "mxnet_16708: could not install mxnet $1 on its own" >&2; exit 2; }
    if (cd "$repro" && "$repro/venv-$1/bin/python" -c "import accumcheck" 2>/dev/null); then
        echo "FAIL: the bare mxnet $1 environment has accumcheck"; failed=1
    fi
}
bare 1.6.0
bare 1.9.1
(cd "$repro" && "$repro/venv-1.6.0/bin/python" repro.py) >"$repro/run-1.6.0.txt" 2>&1
old_repro_rc=$?
(cd "$repro" && "$repro/venv-1.9.1/bin/python" repro.py) >"$repro/run-1.9.1.txt" 2>&1
new_repro_rc=$?
tail -n 1 "$repro/run-1.6.0.txt"
tail -n 1 "$repro/run-1.9.1.txt"
if [ "$old_repro_rc" -ne 1 ] || ! grep -q "^DIVERGED: .*shared.weight" "$repro/run-1.6.0.txt" \
     || ! grep -q "^shared.weight .* beyond the bound" "$repro/run-1.6.0.txt"; then
    echo "FAIL: the repro script under mxnet 1.6.0 alone exited $old_repro_rc, expected 1 with shared.weight diverged"
    cat "$repro/run-1.6.0.txt"; failed=1
fi
if [ "$new_repro_rc" -ne 0 ] || ! grep -q "^AGREE: " "$repro/run-1.9.1.txt" \
     || ! grep -q "^shared.weight .* within the bound" "$repro/run-1.9.1.txt"; then
    echo "FAIL: the repro script under mxnet 1.9.1 alone exited $new_repro_rc, expected 0 with agreement"
    cat "$repro/run-1.9.1.txt"; failed=1
fi

# --shrink under 1.6.0: the smallest case that still shows the bug, no larger than shared-weight at
# its own N in any measure, smaller in one, and flagged when run again.
mkdir -p "$repro/shrunk"
"$venv/bin/accumcheck" compare --framework mxnet --case shared-weight --repro "$repro/shrunk/repro.py" --shrink \
    --format json --output "$reports/shrink-run.json" 2>"$repro/shrink.txt"
shrink_rc=$?
grep "^shrunk " "$repro/shrink.txt"
"$venv/bin/accumcheck" compare --framework mxnet --case "$repro/shrunk/repro.toml" --format json \
    --output "$reports/shrunk.json"
shrunk_rc=$?
(cd "$repro/shrunk" && "$repro/venv-1.6.0/bin/python" repro.py) >"$repro/run-shrunk.txt" 2>&1
shrunk_script_rc=$?
if [ "$shrink_rc" -ne 1 ] || [ "$shrunk_rc" -ne 1 ] || [ "$shrunk_script_rc" -ne 1 ] \
     || ! "$venv/bin/python" - "$repro/shrunk/repro.toml" <<'PY'
import sys
from accumcheck.case.reading import builtin_case, load_case
from accumcheck.repro.shrink import size
original, shrunk = builtin_case("shared-weight"), load_case(sys.argv[1])
before, after = size(original, original.accum_steps), size(shrunk, shrunk.accum_steps)
print("shrunk case:", ", ".join(f"{m} {before[m]} -> {after[m]}" for m in before))
sys.exit(not (all(after[m] <= before[m] for m in before) and after != before))
PY
then
    echo "FAIL: --shrink under mxnet 1.6.0 (exit $shrink_rc), its case rerun (exit $shrunk_rc) and its script" \
         "(exit $shrunk_script_rc) must all be flagged (1), the case smaller than shared-weight"
    cat "$repro/shrink.txt"; failed=1
fi
[ "$failed" -eq 0 ] && echo "mxnet_16708: 10 passed, 0 failed" || echo "mxnet_16708: FAILED"
exit "$failed"
