"""--memory-budget's rules: one parser of byte counts for the command line, pytest and Python; the
tensors split into groups in canonical order that fit, or one line naming the tensor that does
not and the least budget; the report's groups figure, kept in JSON and read as 1 from older
reports; the ratio map made block by block as it was made whole; and the judge's per-element
temporaries within what the budget counts for them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from accumcheck.bounds import ModeBound
from accumcheck.cli import build_parser
from accumcheck.errors import AccumcheckError
from accumcheck.files import size_text
from accumcheck.judge import ratio
from accumcheck.options.spec import OPTIONS_BY_NAME, command_line
from accumcheck.options.values import byte_count
from accumcheck.render.wording import header_lines
from accumcheck.report import load_report
from accumcheck.run.budget import FIXED_BYTES, JUDGE_BYTES, PRECISION_JUDGE_BYTES, TensorNeed, minimum, plan
from accumcheck.run.validation import configure

KIB, MIB, GIB = 2**10, 2**20, 2**30


@pytest.mark.parametrize("text, value", [
    ("1000000", 1_000_000), (4096, 4096), (2.0 * GIB, 2 * GIB), ("512M", 512 * MIB), ("512m", 512 * MIB),
    ("2G", 2 * GIB), ("1.5GiB", 3 * GIB // 2), ("1.5 GiB", 3 * GIB // 2), ("64k", 64 * KIB), ("64KiB", 64 * KIB),
    ("2GB", 2 * 10**9), ("300MB", 300 * 10**6), ("1T", 2**40), ("10B", 10), (".5G", GIB // 2),
])
def test_a_byte_count_is_read_one_way(text, value):
    assert byte_count(text) == value
    assert OPTIONS_BY_NAME["memory_budget"].validate(text) == value


@pytest.mark.parametrize("text", ["", "12X", "-5", "0", "1.5", "G", "1e9", "2 G B", "nan", True, None, [1], 0.5])
def test_what_is_not_a_byte_count_is_said_with_the_fix(text):
    with pytest.raises(ValueError, match=r"is not a number of bytes \(e\.g\. 512M, 2G, 1\.5GiB or 1000000000\)"):
        byte_count(text)


def test_the_command_line_reads_it_and_refuses_a_bad_one_in_one_line(capsys):
    assert build_parser().parse_args(["compare", "--memory-budget", "2G"]).memory_budget == 2 * GIB
    assert build_parser().parse_args(["check", "setup.py", "--memory-budget", "1.5GiB"]).memory_budget == 3 * GIB // 2
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["compare", "--memory-budget", "lots"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("accumcheck compare: error: argument --memory-budget: 'lots' is not a number of bytes (e.g. 512M, "
                   "2G, 1.5GiB or 1000000000) (see accumcheck compare --help)")


def test_the_api_takes_it_records_it_and_reruns_it():
    config = configure({"case": "tiny-grads", "framework": "torch", "memory_budget": "512M"})
    assert config.memory_budget == 512 * MIB and config.record()["memory_budget"] == 512 * MIB
    line = command_line(config.record())
    assert line.endswith(f"--memory-budget {512 * MIB}")
    args = build_parser().parse_args(line.split()[1:])
    assert args.memory_budget == 512 * MIB
    assert "memory_budget" not in configure({"case": "tiny-grads", "framework": "torch"}).record()
    with pytest.raises(AccumcheckError, match=r"^--memory-budget: 'big' is not a number of bytes"):
        configure({"case": "tiny-grads", "memory_budget": "big"})


def test_the_pytest_plugin_declares_it():
    from accumcheck.plugin import _PLUGIN_OPTIONS

    assert "memory_budget" in [option.name for option in _PLUGIN_OPTIONS]


def _needs(*sizes):
    return [TensorNeed(f"t{i}", held, judging) for i, (held, judging) in enumerate(sizes)]


def test_the_tensors_are_grouped_in_order_within_the_budget():
    needs = _needs((40, 10), (30, 5), (20, 30), (50, 0), (10, 10))
    assert plan(needs, None) == [["t0", "t1", "t2", "t3", "t4"]]
    assert plan(needs, FIXED_BYTES + 10**6) == [["t0", "t1", "t2", "t3", "t4"]]
    groups = plan(needs, FIXED_BYTES + 100)
    assert groups == [["t0", "t1"], ["t2", "t3"], ["t4"]]  # 40+30+10, 20+50+30, 10+10
    assert [name for group in groups for name in group] == [n.name for n in needs]
    assert plan(needs, minimum(needs)) == [["t0"], ["t1"], ["t2"], ["t3"], ["t4"]]
    for group in groups:
        chosen = [n for n in needs if n.name in group]
        assert sum(n.held for n in chosen) + max(n.judging for n in chosen) <= 100


def test_a_budget_below_one_tensor_names_it_and_the_least_budget():
    needs = _needs((40, 10), (80 * MIB, 8 * MIB), (20, 30))
    with pytest.raises(AccumcheckError) as info:
        plan(needs, 100 * MIB)
    least = FIXED_BYTES + 88 * MIB
    assert str(info.value) == (f"--memory-budget 100.0 MiB: tensor t1 alone needs 88.0 MiB beside the model, and 128.0 "
                               f"MiB is kept for accumcheck's own code; give at least {least} (216.0 MiB)")
    assert minimum(needs) == least and len(plan(needs, least)) == 3


def test_a_report_keeps_its_groups_and_an_older_one_reads_as_one_group(tmp_path):
    pytest.importorskip("torch")
    from budget_checks import tightest

    import accumcheck

    least = tightest(case="tiny-grads", framework="torch")
    report = accumcheck.compare("tiny-grads", framework="torch", accum_steps=2, memory_budget=least)
    assert report.groups > 1 and report.config["memory_budget"] == least
    (tmp_path / "r.json").write_text(report.to_json())
    again = load_report(tmp_path / "r.json")
    assert again.groups == report.groups and again == report
    assert f"judged in {report.groups} groups to stay within the memory budget of {size_text(least)}" in \
        header_lines(again)
    data = json.loads(report.to_json())
    del data["groups"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = load_report(tmp_path / "old.json")
    assert old.groups == 1 and not any("groups" in line for line in header_lines(old))


@pytest.mark.parametrize("shape", [(), (7,), (100_000,), (33, 65), (300, 300), (2049, 3), (1, 5000), (5, 3, 70)])
def test_a_ratio_map_made_in_one_compiled_pass_is_the_map_made_whole(shape):
    rng = np.random.default_rng(len(shape))
    a = rng.standard_normal(shape).astype(np.float32)
    b = (a + rng.standard_normal(shape) * 1e-6).astype(np.float32)
    e = a.astype(np.float64) + 1e-7 * rng.standard_normal(shape)
    s = np.abs(e) * 3
    if a.size > 3:
        a.reshape(-1)[2] = np.inf
        b.reshape(-1)[-1] = np.nan  # a NaN distance is infinitely far, as an infinite one
    nb, mb = ModeBound.for_sum("float32", 8, 4.0), ModeBound.for_sum("float32", 8)
    # the map as it was made before blocks: every ratio at once
    rms = ratio.absum_rms(s)
    worst = np.maximum(ratio.bound_ratios(a, e, s, nb, rms), ratio.bound_ratios(b, e, s, mb, rms)).reshape(np.shape(e))
    grid = worst.reshape(1, -1) if worst.ndim < 2 else worst.reshape(worst.shape[0], -1)
    rows, cols = grid.shape
    step_r, step_c = -(-rows // ratio.MAP_CELLS), -(-cols // ratio.MAP_CELLS)
    pad = np.zeros((-(-rows // step_r) * step_r, -(-cols // step_c) * step_c))
    pad[:rows, :cols] = grid
    whole = pad.reshape(pad.shape[0] // step_r, step_r, pad.shape[1] // step_c, step_c).max(axis=(1, 3))
    assert ratio.ratio_map(a, b, e, s, nb, mb) == (whole.tolist(), [step_r, step_c])


JUDGING = textwrap.dedent("""
    import json, sys
    import numpy as np
    from accumcheck.bounds import ModeBound
    from accumcheck.judge.ratio import ratio_map
    from accumcheck.judge.verdicts import compare_tensor

    def status(key):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key))

    n, dtype = 1 << 23, sys.argv[1]
    rng = np.random.default_rng(0)
    a = rng.standard_normal(n).astype(np.float32)
    b = a.copy()
    b[::7] += 1e-6
    e = a.astype(np.float64) + 1e-9
    s = np.abs(e) * 4
    nb, mb = ModeBound.for_sum(dtype, 4), ModeBound.for_sum("float32", 4)
    ref = ModeBound.for_sum("float32", 4) if dtype != "float32" else None
    shape = (2048, -1)
    args = [x.reshape(shape) for x in (a, b, e, s)]
    compare_tensor("w", "weight", *[x[:4] for x in args], nb, mb, reference_bound=ref)  # compiled before
    ratio_map(*[x[:4] for x in args], nb, mb)
    # the parallel build too (a tensor of several chunks), its thread pool started: views, no copies
    from accumcheck.judge.kernel import _CHUNK, reduce_on_host
    m = 2 * _CHUNK + 1
    reduce_on_host(a[:m], b[:m], e[:m], s[:m], 1e-7, 0.0, 1e-7, 0.0, 1e-5, 1e-8)
    open("/proc/self/clear_refs", "w").write("5")  # the peak from here
    before = status("VmRSS")
    compare_tensor("w", "weight", *args, nb, mb, reference_bound=ref)
    ratio_map(*args, nb, mb)
    print(json.dumps((status("VmHWM") - before) / n))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc")
@pytest.mark.parametrize("dtype, allowed", [("float32", JUDGE_BYTES), ("bfloat16", PRECISION_JUDGE_BYTES)])
def test_judging_a_tensor_holds_what_the_budget_counts_for_it(dtype, allowed):
    """The judge's temporaries per element of an 8M-element tensor, in a fresh process's peak RSS."""
    done = subprocess.run([sys.executable, "-c", JUDGING, dtype], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) <= allowed
