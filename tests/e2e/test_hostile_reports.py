"""Saved reports, tampered with, read back by ``show`` and ``diff``: a report is read strictly.

Every row is one command on a report file made from a real one (written here by ``compare``,
``sweep``, ``train`` and ``stack``, or by accumcheck 0.1.0: tests/fixtures/reports-0.1.0) with one
field changed. A changed report ends in exit 2 with one line naming the field and what is wrong
with it, never in exit 0 (a flagged run read as faithful) and never in exit 3; each untouched
report is shown with the exit code its run had. The rows run in-process through
``accumcheck.cli.main``, in the style of test_hostile_inputs.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shlex
from pathlib import Path
from typing import Any, Callable

import pytest
from conftest import HAS_TORCH
from hostile import Refused, Verdict, assert_outcome

from accumcheck.cli import main
from accumcheck.report import SCHEMA_VERSION

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "reports-0.1.0"
HAS_MXNET = importlib.util.find_spec("mxnet") is not None
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None

# name -> the command that writes it (--output is added), and what it needs
SOURCES = {
    "flagged": (["compare", "--case", "tiny-grads", "--accum-steps", "2", "--inject", "scale", "--format", "json"],
                HAS_TORCH),
    "faithful": (["compare", "--case", "tiny-grads", "--accum-steps", "2", "--format", "json"], HAS_TORCH),
    "cross": (["compare", "--framework", "torch,mxnet", "--case", "tiny-grads", "--accum-steps", "2", "--inject",
               "scale", "--format", "json"], HAS_TORCH and HAS_MXNET),
    "sweep": (["sweep", "--case", "tiny-grads", "--accum-steps", "1,2", "--inject", "scale", "--format", "json"],
              HAS_TORCH),
    "trajectory": (["train", "--case", "tiny-grads", "--accum-steps", "2", "--steps", "3", "--inject", "double-step"],
                   HAS_TORCH),
    "stack": (["stack", "--stack", "accelerate", "--case", "padded-tokens", "--accum-steps", "2", "--batches", "5",
               "--fault", "loss-over-n", "--format", "json"], HAS_TORCH and HAS_ACCELERATE),
}
OLD = ("data-parallel", "full-batch")  # written by accumcheck 0.1.0


def at(*path: Any) -> Callable[[Any], Callable[[dict], None]]:
    """An edit that sets the value at ``path`` (keys and indices)."""
    def setting(value: Any) -> Callable[[dict], None]:
        def edit(data: dict) -> None:
            holder = data
            for key in path[:-1]:
                holder = holder[key]
            holder[path[-1]] = value
        return edit
    return setting


def drop(*path: Any) -> Callable[[dict], None]:
    """An edit that removes the item at ``path``."""
    def edit(data: dict) -> None:
        holder = data
        for key in path[:-1]:
            holder = holder[key]
        del holder[path[-1]]
    return edit


T0 = ("tensors", 0)  # the flagged report's dense0.weight: diverged, 1.7e4 times its bound
HUGE = "<5000 nines>"  # written as a 5000-digit integer: past the 4300 digits Python's int() reads from text
# name -> (source, edit): the files the rows read
TAMPERED: dict[str, tuple[str, Callable[[dict], None]]] = {
    # words a report may hold
    "verdict-bogus": ("flagged", at(*T0, "verdict")("bogus")),
    "verdict-empty": ("flagged", at(*T0, "verdict")("")),
    "verdict-later": ("flagged", at(*T0, "verdict")("drifted")),  # a word a later accumcheck might write
    "verdict-round-off": ("flagged", at(*T0, "verdict")("round-off")),
    "verdict-identical": ("flagged", at(*T0, "verdict")("identical")),
    "verdict-no-gradient": ("flagged", at(*T0, "verdict")("no-gradient")),
    "verdict-overflow": ("flagged", at(*T0, "verdict")("overflow")),
    "kind": ("flagged", at(*T0, "kind")("conv")),
    "dtype": ("flagged", at(*T0, "dtype")("float8")),
    "severity-bogus": ("flagged", at(*T0, "severity")("mild")),
    "severity-marginal": ("flagged", at(*T0, "severity")("marginal")),
    "severity-unflagged": ("flagged", at("tensors", 1, "severity")("diverged")),
    "cause-kind": ("flagged", at(*T0, "cause", "kind")("gremlins")),
    "cause-mode": ("flagged", at(*T0, "cause", "mode")("both")),
    "worst-mode": ("flagged", at(*T0, "worst_mode")("elsewhere")),
    "nearer": ("flagged", at(*T0, "nearer")("neither")),
    "fail-on": ("flagged", at("config", "fail_on")("never")),
    "param-dtype": ("flagged", at("param_dtype")("float12")),
    # numbers out of range
    "count-negative": ("flagged", at(*T0, "mismatched")(-1)),
    "ratio-negative": ("flagged", at(*T0, "ratio")(-5.0)),
    "ratio-minus-inf": ("flagged", at(*T0, "ratio")("-inf")),
    "rtol-nan": ("flagged", at(*T0, "classic_rtol")("nan")),
    "seconds-inf": ("flagged", at("seconds")("inf")),
    "shape-negative": ("flagged", at(*T0, "shape")([-1, 3])),
    "accum-steps-zero": ("flagged", at("accum_steps")(0)),
    "groups-zero": ("flagged", at("groups")(0)),
    "seed-negative": ("flagged", at("seed")(-2)),
    "int-huge": ("flagged", at("accum_steps")(HUGE)),
    "int-huge-in-config": ("flagged", at("config", "seed")(HUGE)),
    "int-past-64-bits": ("flagged", at(*T0, "numel")(2**64)),
    "surrogate-name": ("flagged", at("tensors", 1, "name")("\ud800")),
    "surrogate-key": ("flagged", at("versions", "\udfff")("1")),
    # lists that must agree
    "numel": ("flagged", at(*T0, "numel")(7)),
    "mismatched-past-numel": ("flagged", at(*T0, "mismatched")(10**6)),
    "index-out-of-shape": ("flagged", at(*T0, "worst_index")([1000, 0])),
    "index-rank": ("flagged", at(*T0, "max_abs_diff_index")([0])),
    "name-twice": ("flagged", at("tensors", 1, "name")("dense0.weight")),
    "cause-step": ("flagged", at(*T0, "cause", "step")(2)),
    "steps-with-grad": ("flagged", at(*T0, "steps_with_grad")(3)),
    "bound": ("flagged", at("bound", "native")({})),
    # versions
    "version-newer": ("flagged", at("schema_version")(SCHEMA_VERSION + 1)),
    "version-zero": ("flagged", at("schema_version")(0)),
    # a faithful report changed where it is consistent with itself is still read; one that is not, not
    "faithful-verdict-bogus": ("faithful", at("tensors", 2, "verdict")("fine")),
    # cross-framework
    "cross-three-frameworks": ("cross", at("frameworks")(["torch", "mxnet", "jax"])),
    "cross-one-report": ("cross", drop("reports", 1)),
    "cross-twice": ("cross", at("frameworks")(["torch", "torch"])),
    "cross-report-framework": ("cross", at("reports", 1, "framework")("jax")),
    "cross-agreement-verdict": ("cross", at("agreement", 0, "verdict")("fine")),
    "cross-agreement-ratio": ("cross", at("agreement", 0, "ratio")(5.0)),
    "cross-agreement-dropped": ("cross", drop("agreement", 0)),
    "cross-agreement-pair": ("cross", at("agreement", 0, "frameworks")(["torch", "jax"])),
    "cross-nested-kind": ("cross", at("reports", 0, "kind")("sweep")),
    "cross-nested-verdict": ("cross", at("reports", 0, "tensors", 0, "verdict")("bogus")),
    # sweep
    "sweep-verdict": ("sweep", at("reports", 1, "tensors", 0, "verdict")("bogus")),
    "sweep-steps": ("sweep", at("reports", 1, "accum_steps")(-2)),
    # trajectory
    "trajectory-band-emptied": ("trajectory", at("first_out_of_band")({})),
    "trajectory-short": ("trajectory", at("losses", "manual")([0.5])),
    "trajectory-control-emptied": ("trajectory", at("first_out_of_control")({})),
    "trajectory-margin-gone": ("trajectory", at("margin")(None)),
    "trajectory-steps": ("trajectory", at("steps")(5)),
    "trajectory-oob-negative": ("trajectory", at("first_out_of_band", "dense0.weight")(-1)),
    "trajectory-step-past": ("trajectory", at("first_out_of_band", "dense0.weight")(9)),
    "trajectory-nan": ("trajectory", at("losses", "manual", 2)("nan")),
    "trajectory-lr": ("trajectory", at("lr")("nan")),
    # training stack
    "stack-window-empty": ("stack", at("steps", 0, "micro_batches")([])),
    "stack-equivalent": ("stack", at("steps", 0, "result", "equivalent")(True)),
    "stack-unstepped": ("stack", at("unstepped")([99])),
    "stack-precision": ("stack", at("precision")("float8")),
    "stack-seen": ("stack", at("micro_batches_seen")(-1)),
    # data parallel (0.1.0)
    "dp-rank": ("data-parallel", at("settings", "data_parallel", "ranks", 1, "rank")(5)),
    "dp-fault-rank": ("data-parallel", at("settings", "data_parallel", "fault_rank")(7)),
    "dp-flagged-ranks": ("data-parallel", at(*T0, "flagged_ranks")([3])),
    "dp-worst-mode": ("data-parallel", at(*T0, "worst_mode")("rank x")),
    # full batch (0.1.0)
    "full-batch-equivalent": ("full-batch", at("settings", "full_batch", "equivalent")(True)),
}

VERDICTS_LISTED = "is not one of identical, round-off, suspicious, precision-loss, diverged, non-finite"
ROWS: list[tuple[str, Refused | Verdict]] = [
    # ---- reports as accumcheck wrote them: shown with their run's verdict
    ("show {d}/flagged.json", Verdict(1, "FLAGGED 1 of 4 tensors: dense0.weight")),
    ("show {d}/faithful.json", Verdict(0, "OK: all 4 tensors faithful")),
    ("show {d}/cross.json", Verdict(1, "torch: FLAGGED 1; mxnet: FLAGGED 1")),
    ("show {d}/sweep.json", Verdict(1, "FLAGGED at N = 1, 2: dense0.weight")),
    ("show {d}/trajectory.json", Verdict(1, "FLAGGED at step 0 (dense0.weight): native is ")),
    ("show {d}/stack.json", Verdict(1, "FLAGGED: 3 of 3 optimizer steps")),
    ("show {d}/data-parallel.json", Verdict(1, "FLAGGED")),
    ("show {d}/full-batch.json", Verdict(1, "")),
    ("diff {d}/flagged.json {d}/faithful.json", Verdict(1, "dense0.weight (diverged -> identical")),
    # ---- words
    ("show {d}/verdict-bogus.json", Refused(f"verdict-bogus.json: tensors[0].verdict: 'bogus' {VERDICTS_LISTED}")),
    ("show {d}/verdict-empty.json", Refused(f"tensors[0].verdict: '' {VERDICTS_LISTED}")),
    ("show {d}/verdict-later.json", Refused("tensors[0].verdict: 'drifted' is not one of identical, round-off, "
                                            "suspicious, precision-loss, diverged, non-finite, no-gradient, overflow; "
                                            "upgrade accumcheck if a newer one wrote the report")),
    ("show {d}/verdict-round-off.json", Refused("tensors[0].verdict: 'round-off' with ratio 1.")),
    ("show {d}/verdict-identical.json", Refused("tensors[0].verdict: 'identical' with")),
    ("show {d}/verdict-no-gradient.json", Refused("tensors[0].verdict: 'no-gradient' on a tensor with a gradient "
                                                  "in every")),
    ("show {d}/verdict-overflow.json", Refused("tensors[0].verdict: 'overflow' with no inf or nan in either mode")),
    ("show {d}/kind.json", Refused("tensors[0].kind: 'conv' is not one of embedding, weight, bias, norm")),
    ("show {d}/dtype.json", Refused("tensors[0].dtype: 'float8' is not one of float64, float32, bfloat16, float16")),
    ("show {d}/severity-bogus.json", Refused("tensors[0].severity: 'mild' is not one of marginal, diverged")),
    ("show {d}/severity-marginal.json", Refused("tensors[0].severity: 'marginal' with ratio 1.")),
    ("show {d}/severity-unflagged.json", Refused("tensors[1].severity: 'diverged' on a tensor not flagged")),
    ("show {d}/cause-kind.json", Refused("tensors[0].cause.kind: 'gremlins' is not one of repeat-step, drop-step")),
    ("show {d}/cause-mode.json", Refused("tensors[0].cause.mode: 'both' is not one of native, manual")),
    ("show {d}/worst-mode.json", Refused("tensors[0].worst_mode: 'elsewhere' is not one of native, manual")),
    ("show {d}/nearer.json", Refused("tensors[0].nearer: 'neither' is not one of native, manual, tie")),
    ("show {d}/fail-on.json", Refused("config['fail_on']: 'never' is not one of suspicious, marginal, diverged")),
    ("show {d}/param-dtype.json", Refused("param_dtype: 'float12' is not one of")),
    # ---- numbers
    ("show {d}/count-negative.json", Refused("tensors[0].mismatched: -1 is negative")),
    ("show {d}/ratio-negative.json", Refused("tensors[0].ratio: -5.0 is negative")),
    ("show {d}/ratio-minus-inf.json", Refused("tensors[0].ratio: -inf is negative")),
    ("show {d}/rtol-nan.json", Refused("tensors[0].classic_rtol: nan is not a finite number")),
    ("show {d}/seconds-inf.json", Refused("seconds: inf is not a finite number")),
    ("show {d}/shape-negative.json", Refused("tensors[0].shape[0]: -1 is negative")),
    ("show {d}/accum-steps-zero.json", Refused("accum_steps: 0 is less than 1")),
    ("show {d}/groups-zero.json", Refused("groups: 0 is less than 1")),
    ("show {d}/seed-negative.json", Refused("seed: -2 is less than -1")),
    ("show {d}/int-huge.json", Refused("int-huge.json: accum_steps: an integer of 5000 digits")),
    ("show {d}/int-huge-in-config.json", Refused("config.seed: an integer of 5000 digits")),
    ("show {d}/int-past-64-bits.json", Refused("tensors[0].numel: an integer of about 20 digits, past the 64 bits")),
    ("show {d}/surrogate-name.json", Refused("tensors[1].name: the text holds '\\ud800' at character 0, a lone "
                                             "surrogate, which is not Unicode text")),
    ("show {d}/surrogate-key.json", Refused("versions['\\udfff']: its name holds '\\udfff'")),
    # ---- fields that must agree
    ("show {d}/numel.json", Refused("tensors[0].numel: 7 is not the size of shape")),
    ("show {d}/mismatched-past-numel.json", Refused("tensors[0].mismatched: 1000000 is more than the tensor's")),
    ("show {d}/index-out-of-shape.json", Refused("tensors[0].worst_index: [1000, 0] is not an index into shape "
                                                 "[1000, 10]")),
    ("show {d}/index-rank.json", Refused("tensors[0].max_abs_diff_index: [0] is not an index into shape")),
    ("show {d}/name-twice.json", Refused("tensors[1].name: 'dense0.weight' is listed twice")),
    ("show {d}/cause-step.json", Refused("tensors[0].cause.step: 2 is not one of the 2 micro-steps")),
    ("show {d}/steps-with-grad.json", Refused("tensors[0].steps_with_grad: 3 is more than the 2 micro-steps")),
    ("show {d}/bound.json", Refused("bound['native']: expected an object with the bound's relative factor")),
    # ---- versions
    ("show {d}/version-newer.json", Refused(f"report schema_version {SCHEMA_VERSION + 1} is not supported by this "
                                            f"accumcheck, which reads up to {SCHEMA_VERSION}: the report was written "
                                            "by a newer accumcheck; upgrade accumcheck")),
    ("show {d}/version-zero.json", Refused("report schema_version 0 is not supported")),
    ("show {d}/faithful-verdict-bogus.json", Refused("tensors[2].verdict: 'fine' is not one of")),
    # ---- cross-framework
    ("show {d}/cross-three-frameworks.json", Refused("cross-three-frameworks.json: reports: 2 reports for the 3 "
                                                     "frameworks listed")),
    ("show {d}/cross-one-report.json", Refused("reports: 1 report for the 2 frameworks listed")),
    ("show {d}/cross-twice.json", Refused("frameworks: ['torch', 'torch'] is not two or more frameworks, each once")),
    ("show {d}/cross-report-framework.json", Refused("reports[1].framework: 'jax', where frameworks lists 'mxnet'")),
    ("show {d}/cross-agreement-verdict.json", Refused("agreement[0].verdict: 'fine' is not one of identical, agree, "
                                                      "disagree, non-finite")),
    ("show {d}/cross-agreement-ratio.json", Refused("agreement[0].verdict: 'agree' with ratio 5")),
    ("show {d}/cross-agreement-dropped.json", Refused("agreement: not one record per tensor and pair of frameworks "
                                                      "(no record of 'dense0.weight' in torch vs mxnet)")),
    ("show {d}/cross-agreement-pair.json", Refused("agreement[0].frameworks: ['torch', 'jax'] is not a pair of the "
                                                   "frameworks listed")),
    ("show {d}/cross-nested-kind.json", Refused("reports[0].kind: 'sweep' is not one of report")),
    ("show {d}/cross-nested-verdict.json", Refused(f"reports[0].tensors[0].verdict: 'bogus' {VERDICTS_LISTED}")),
    # ---- sweep
    ("show {d}/sweep-verdict.json", Refused(f"reports[1].tensors[0].verdict: 'bogus' {VERDICTS_LISTED}")),
    ("show {d}/sweep-steps.json", Refused("reports[1].accum_steps: -2 is less than 1")),
    # ---- trajectory
    ("show {d}/trajectory-band-emptied.json", Refused("band_ratio['weight']: past the band at step 0, but "
                                                      "first_out_of_band names no tensor by then")),
    ("show {d}/trajectory-short.json", Refused("losses['manual']: 1 values for 3 steps")),
    ("show {d}/trajectory-control-emptied.json", Refused("control_ratio['weight']: past the margin at step 0, but "
                                                         "first_out_of_control names no tensor by then")),
    ("show {d}/trajectory-margin-gone.json", Refused("margin: none, but the report has a control")),
    ("show {d}/trajectory-steps.json", Refused("losses['manual']: 3 values for 5 steps")),
    ("show {d}/trajectory-oob-negative.json", Refused("first_out_of_band['dense0.weight']: -1 is negative")),
    ("show {d}/trajectory-step-past.json", Refused("first_out_of_band['dense0.weight']: step 9 of a run of 3")),
    ("show {d}/trajectory-nan.json", Refused("losses['manual']: nan, but non_finite names nothing")),
    ("show {d}/trajectory-lr.json", Refused("lr: nan is not a finite number")),
    # ---- training stack
    ("show {d}/stack-window-empty.json", Refused("steps[0].micro_batches: empty")),
    ("show {d}/stack-equivalent.json", Refused("steps[0].result.equivalent: true with a difference of")),
    ("show {d}/stack-unstepped.json", Refused("unstepped: not distinct micro-batches of the 5 seen")),
    ("show {d}/stack-precision.json", Refused("precision: 'float8' is not one of")),
    ("show {d}/stack-seen.json", Refused("micro_batches_seen: -1 is negative")),
    # ---- data parallel and full batch, as accumcheck 0.1.0 wrote them
    ("show {d}/dp-rank.json", Refused("data_parallel.ranks[1].rank: 5 is not a rank of 2")),
    ("show {d}/dp-fault-rank.json", Refused("data_parallel.setup.fault_rank: 7 is not a rank of 2")),
    ("show {d}/dp-flagged-ranks.json", Refused("data_parallel.ranks: tensor 'shared.weight' names rank(s) [3]")),
    ("show {d}/dp-worst-mode.json", Refused("tensors[0].worst_mode: 'rank x' is not one of native, manual, "
                                            "single-process, native vs single-process, rank <n>")),
    ("show {d}/full-batch-equivalent.json", Refused("full_batch.equivalent: true with a difference of")),
    # ---- diff reads as strictly
    ("diff {d}/flagged.json {d}/verdict-bogus.json", Refused(f"tensors[0].verdict: 'bogus' {VERDICTS_LISTED}")),
    ("diff {d}/verdict-empty.json {d}/faithful.json", Refused("verdict-empty.json: tensors[0].verdict: ''")),
    ("diff {d}/flagged.json {d}/version-newer.json", Refused("the report was written by a newer accumcheck")),
    ("diff {d}/int-huge.json {d}/flagged.json", Refused("accum_steps: an integer of 5000 digits")),
    ("diff {d}/flagged.json {d}/surrogate-name.json", Refused("a lone surrogate")),
]


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A folder with the real reports and every tampered one."""
    folder = tmp_path_factory.mktemp("reports")
    for name, (argv, available) in SOURCES.items():
        if available:
            assert main([*argv, "--output", str(folder / f"{name}.json")]) in (0, 1), name
    for name in OLD:
        (folder / f"{name}.json").write_text((FIXTURES / f"{name}.json").read_text())
    for name, (source, edit) in TAMPERED.items():
        if (folder / f"{source}.json").exists():
            data = copy.deepcopy(json.loads((folder / f"{source}.json").read_text()))
            edit(data)
            text = json.dumps(data)  # "\ud800" is written as its escape
            (folder / f"{name}.json").write_text(text.replace(json.dumps(HUGE), "9" * 5000))
    return folder


def test_every_tampered_file_has_a_row_and_no_row_is_listed_twice():
    named = {Path(word).stem for row, _ in ROWS for word in shlex.split(row)[1:]}
    assert set(TAMPERED) <= named
    assert len({row for row, _ in ROWS}) == len(ROWS)


def test_no_row_accepts_exit_0_for_a_changed_report():
    for row, expected in ROWS:
        if isinstance(expected, Verdict) and expected.code == 0:
            assert not any(Path(word).stem in TAMPERED for word in shlex.split(row)[1:]), row


@pytest.mark.parametrize("row, expected", ROWS, ids=[row for row, _ in ROWS])
def test_a_changed_report_is_refused_naming_the_field(row, expected, place, capsys, monkeypatch):
    files = [Path(word).stem for word in shlex.split(row)[1:]]
    missing = sorted({TAMPERED.get(name, (name,))[0] for name in files if not (place / f"{name}.json").exists()})
    if missing:
        pytest.skip(f"the frameworks that write {', '.join(missing)} are not installed")
    monkeypatch.chdir(place)
    try:
        code = main(shlex.split(row.replace("{d}", str(place))))
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    assert_outcome(expected, code, out, err)
    assert "\ud800" not in err and "\x1b" not in err  # a name is shown escaped, never raw
