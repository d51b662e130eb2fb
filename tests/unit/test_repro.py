"""The framework-free parts of ``accumcheck compare --repro``: the .npz, the request's refusals, the
fault lines and the judging code every script carries, the case as TOML, and the shrink loop on
a fake run."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from accumcheck.bounds import ModeBound
from accumcheck.case.reading import builtin_case, builtin_case_names, parse_case
from accumcheck.errors import AccumcheckError
from accumcheck.judge.statistics import tensor_figures
from accumcheck.options.choices import FAULT_KINDS
from accumcheck.repro.request import case_arrays, check_request, repro_files, target_of, write_data
from accumcheck.repro.script import JUDGE, check_fault_kind, fault_kinds_written, fault_source
from accumcheck.repro.shrink import case_toml, reductions, shrink, size, smaller, still_flagged
from accumcheck.run import registry
from accumcheck.run.backend import Backend
from accumcheck.run.config import RunConfig
from accumcheck.run.faults import Fault, FaultInjector, round_to_bfloat16

# ----------------------------------------------------------------------------- the data


def test_the_npz_holds_the_initial_weights_and_every_micro_batch_with_its_gates(tmp_path):
    case = builtin_case("conditional-branch")
    path = tmp_path / "repro.npz"
    write_data(path, case_arrays(case, 6))
    data = np.load(path)
    weights = case.weights()
    assert sorted(k for k in data.files if k.startswith("weights/")) == sorted(f"weights/{n}" for n in weights)
    for name, value in weights.items():
        assert data[f"weights/{name}"].dtype == np.float32 and np.array_equal(data[f"weights/{name}"], value)
    for k in range(6):
        batch = case.batch(k)
        assert np.array_equal(data[f"inputs/{k}"], batch.inputs) and data[f"inputs/{k}"].dtype == batch.inputs.dtype
        assert np.array_equal(data[f"labels/{k}"], batch.labels)
        assert data[f"gates/{k}"].tolist() == case.gates(batch.index)
    assert "inputs/6" not in data.files
    assert [data[f"gates/{k}"].tolist() for k in range(6)] == [[True], [False], [False], [False], [True], [False]]


def test_padding_labels_and_cycled_batches_are_written_as_each_micro_step_feeds_them():
    tokens = case_arrays(builtin_case("padded-tokens"), 2)
    assert (tokens["labels/0"] == -100).any() and tokens["inputs/0"].dtype == np.int64
    assert tokens["gates/0"].size == 0  # no conditional layers
    cycled = case_arrays(builtin_case("tiny-grads"), 4)  # two distinct batches, fed in turn
    assert np.array_equal(cycled["inputs/0"], cycled["inputs/2"]) and not np.array_equal(cycled["inputs/0"],
                                                                                          cycled["inputs/1"])


# ----------------------------------------------------------------------------- refusals


def _config(**changes) -> RunConfig:
    return dataclasses.replace(RunConfig(case=builtin_case("shared-weight"), accum_steps=4, frameworks=("torch",)),
                               **changes)


@pytest.mark.parametrize("changes, path, words", [
    ({}, "repro.txt", "give the script a .py name"),
    ({}, ".py", "give the script a .py name"),
    ({"frameworks": ("torch", "mxnet")}, "r.py", "one framework's run"),
    ({"world_size": 2}, "r.py", "single-process run; drop --world-size"),
    ({"dtype": "bfloat16"}, "r.py", "drop --dtype bfloat16"),
    ({"accum_dtype": "float64"}, "r.py", "drop --accum-dtype float64"),
    ({"mode": "compensated"}, "r.py", "drop --mode compensated"),
    ({"fault": Fault("no-such-kind", "shared.weight", 2)}, "r.py", "cannot carry the fault 'no-such-kind'"),
])
def test_a_request_that_could_not_be_written_is_refused_in_one_line(tmp_path, changes, path, words):
    with pytest.raises(AccumcheckError, match=words) as caught:
        check_request(_config(**changes), tmp_path / path, False)
    assert "\n" not in str(caught.value)


def test_shrink_needs_repro_and_paths_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(AccumcheckError, match="--shrink: .* add --repro repro.py"):
        check_request(_config(), None, True)
    assert check_request(_config(), None, False) is None
    with pytest.raises(AccumcheckError, match="folder .* does not exist"):
        check_request(_config(), tmp_path / "missing" / "r.py", False)
    (tmp_path / "r.npz").mkdir()  # the data's place is taken
    with pytest.raises(AccumcheckError, match="r.npz: is a folder"):
        check_request(_config(), tmp_path / "r.py", False)
    (tmp_path / "s.toml").mkdir()  # only --shrink writes the case
    assert check_request(_config(), tmp_path / "s.py", False) == repro_files(tmp_path / "s.py")
    with pytest.raises(AccumcheckError, match="s.toml: is a folder"):
        check_request(_config(), tmp_path / "s.py", True)


class _Silent(Backend):
    name = "silent"

    def has_device(self, kind):
        return True

    def versions(self):
        return {}

    def run(self, config, progress=None, weights=None):
        raise AssertionError("not run")


def test_a_backend_that_writes_no_scripts_is_refused_naming_the_ones_that_do(tmp_path, monkeypatch):
    monkeypatch.setitem(registry._registered, "silent", _Silent)
    with pytest.raises(AccumcheckError, match="the silent backend writes no reproduction scripts; use --framework "
                                              "mxnet or torch"):
        check_request(_config(frameworks=("silent",)), tmp_path / "r.py", False)
    with pytest.raises(AccumcheckError, match="writes no reproduction scripts"):
        _Silent().repro_source(_config(), None)


# ----------------------------------------------------------------------------- the fault's lines


def _script_fault(fault: Fault, steps: int, grads: list[np.ndarray]) -> np.ndarray:
    """The native total as the script's fault lines make it (numpy stands in for the framework)."""
    space: dict = {"N": steps, "bfloat16": round_to_bfloat16}
    exec(fault_source(fault, steps, "bfloat16(total)"), space)
    total = None
    for k, grad in enumerate(grads):
        added = space["contribution"](k, grad.copy(), total)
        total = added.copy() if total is None else total + added
        total = space["after_add"](k, total)
    return total


def _injected(fault: Fault, steps: int, grads: list[np.ndarray]) -> np.ndarray:
    """The native total as accumcheck's FaultInjector makes it."""
    injector, total = FaultInjector(fault, steps, round_to_bfloat16), None
    for k, grad in enumerate(grads):
        added = injector.contribution(k, grad.copy(), total)
        total = added.copy() if total is None else total + added
        replaced = injector.after_add(k, total)
        total = total if replaced is None else replaced
    return total


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_every_fault_kind_is_written_as_accumcheck_injects_it(kind):
    """A fault kind added to FAULT_KINDS without its lines in the script fails here."""
    assert kind in fault_kinds_written(), f"reprotext has no lines for the fault {kind!r}"
    rng = np.random.default_rng(7)
    for steps in (2, 5, 9):
        grads = [rng.standard_normal(6).astype(np.float32) for _ in range(steps)]
        fault = Fault(kind, "w", steps // 2 if kind not in ("bf16", "roundoff") else None)
        assert np.array_equal(_script_fault(fault, steps, grads), _injected(fault, steps, grads)), (kind, steps)


def test_a_fault_kind_the_writer_does_not_know_fails_loudly():
    with pytest.raises(AccumcheckError, match="cannot carry the fault 'new-kind' yet"):
        check_fault_kind("new-kind")
    with pytest.raises(AccumcheckError):
        fault_source(Fault("new-kind", "w", 1), 4, "total")
    assert "FAULT_PARAM = None" in fault_source(None, 4, "total")


# ----------------------------------------------------------------------------- the judging code


def _judge_space(steps: int, allowance: float, flagged: dict | None = None) -> dict:
    space = {"N": steps, "KERNEL_ALLOWANCE": allowance, "FLAGGED": flagged or {}, "FRAMEWORK": "fake 1.0",
             "DEVICE": "cpu", "CASE": "fake", "WRITTEN_UNDER": "fake 1.0"}
    exec("import math\nimport numpy as np\n" + JUDGE.replace('if __name__ == "__main__":', "if False:"), space)
    return space


@pytest.mark.parametrize("allowance", [0.0, 4.0])
def test_the_scripts_ratios_are_accumchecks(allowance):
    rng = np.random.default_rng(3)
    steps = 16
    grads = rng.standard_normal((steps, 5, 7)).astype(np.float32) * np.float32(1e-3)
    manual = np.zeros((5, 7), np.float32)
    for g in grads:
        manual += g
    exact = grads.astype(np.float64).sum(axis=0)
    absum = np.abs(grads.astype(np.float64)).sum(axis=0)
    native = manual.copy()
    native[2, 3] += np.float32(1e-6)  # beyond round-off
    space = _judge_space(steps, allowance)
    rows = space["judge"]({"w": native}, {"w": manual}, {"w": exact}, {"w": absum})
    figures = tensor_figures("w", "weight", native, manual, exact, absum, ModeBound.for_sum("float32", steps, allowance),
                             ModeBound.for_sum("float32", steps))
    assert rows["w"]["native"] == figures["ratio_native"] and rows["w"]["manual"] == figures["ratio_manual"]
    assert rows["w"]["diff"] == figures["max_abs_diff"] and rows["w"]["where"] == figures["max_abs_diff_index"]
    assert rows["w"]["beyond"] and rows["w"]["native"] > 1.0 >= rows["w"]["manual"]


def test_the_verdict_line_and_exit_status(capsys):
    space = _judge_space(4, 0.0, {"a": ("diverged", 12.5, 0.3)})
    rows = {"a": {"diff": 1e-3, "where": [1, 2], "finite": True, "native": 12.5, "manual": 0.3, "beyond": True},
            "b": {"diff": 0.0, "where": [], "finite": True, "native": 0.2, "manual": 0.2, "beyond": False}}
    assert space["show"](rows) == 1
    out = capsys.readouterr().out
    assert "DIVERGED: native accumulation" in out and "a " in out and "12.5" in out and "[1, 2]" in out
    rows["a"].update(native=0.5, beyond=False)
    assert space["show"](rows) == 0
    assert "AGREE:" in capsys.readouterr().out
    rows["b"].update(finite=False, beyond=True)
    assert space["show"](rows) == 1
    assert "non-finite" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the case as TOML


@pytest.mark.parametrize("name", builtin_case_names())
def test_every_built_in_case_round_trips_through_its_toml(name):
    case = builtin_case(name)
    again = parse_case(case_toml(case.to_document()), "again.toml")
    assert again.to_document() == case.to_document()
    assert again.parameters() == case.parameters()


def test_odd_text_survives_the_toml():
    doc = builtin_case("shared-weight").to_document()
    doc["description"] = 'quotes " and \\ backslash, tab\t, line\nbreak, DEL \x7f, é and 🙂'
    assert parse_case(case_toml(doc)).description == doc["description"]


# ----------------------------------------------------------------------------- the shrink loop


def _fake_trial(needs: dict, calls: list, flags: tuple[str, str] = ("shared.weight", "weight")):
    """A run that flags ``flags`` (name, kind) while the case keeps at least ``needs``'s measures, and
    refuses (AccumcheckError) a batch of 1."""

    def trial(case, accum_steps):
        calls.append((size(case, accum_steps), case.text))
        measures = size(case, accum_steps)
        if measures["batch"] == 1:
            raise AccumcheckError("cannot run")
        kept = all(measures[m] >= v for m, v in needs.items())
        tensors = [SimpleNamespace(name=flags[0], kind=flags[1], ratio=9.0)] if kept else []
        return SimpleNamespace(flagged=tensors)

    return trial


def test_the_shrink_keeps_what_the_finding_needs_and_ends_smaller_and_flagged():
    case = builtin_case("shared-weight")
    calls: list = []
    lines: list = []
    result = shrink(case, 16, _fake_trial({"uses": 5, "N": 4}, calls), ("shared.weight", "weight"), "s.toml",
                    max_trials=200, log=lines.append)
    before, after = size(case, 16), size(result.case, result.accum_steps)
    assert smaller(after, before) and after["uses"] == 5 and result.accum_steps == 4
    assert after["batch"] == 2  # a batch of 1 could not run
    assert after["parameters"] < before["parameters"] and after["layers"] < before["layers"]
    assert result.target == ("shared.weight", "weight") and len(lines) == len(result.kept) > 0
    assert all(line.startswith("shrink: kept ") for line in lines)
    assert "shrunk shared-weight: " in result.line("shared-weight")
    # every run was of a case no larger than the one kept before it, and none ran twice
    assert len({text for _, text in calls}) == len(calls) == result.trials
    again = parse_case(result.case.text, "s.toml")
    assert again.to_document() == result.case.to_document() and again.name == "shared-weight-shrunk"


def test_the_shrink_stops_at_its_trial_bound_and_never_below_two_steps():
    calls: list = []
    target = ("embed.weight", "embedding")
    result = shrink(builtin_case("transformer-small"), 32, _fake_trial({}, calls, target), target, "t.toml",
                    max_trials=5)
    assert result.trials == len(calls) == 5 and len(result.kept) == 5
    target = ("inp.weight", "weight")
    result = shrink(builtin_case("conditional-branch"), 32, _fake_trial({}, [], target), target, "t.toml", max_trials=300)
    assert result.accum_steps == 2


def test_a_shrink_that_finds_nothing_to_keep_returns_the_case_as_it_was():
    case = builtin_case("shared-weight")
    result = shrink(case, 16, _fake_trial({"parameters": 10**9}, []), ("shared.weight", "weight"), "s.toml",
                    max_trials=10)
    assert result.report is None and result.kept == [] and result.case is case and result.accum_steps == 16


def test_another_tensor_of_the_same_kind_carries_the_finding_on():
    report = SimpleNamespace(flagged=[SimpleNamespace(name="b.bias", kind="bias"),
                                      SimpleNamespace(name="out.weight", kind="weight")])
    assert still_flagged(report, ("shared.weight", "weight")) == ("out.weight", "weight")
    assert still_flagged(report, ("b.bias", "bias")) == ("b.bias", "bias")
    assert still_flagged(report, ("ln.gamma", "norm")) is None
    assert target_of(report, "out.weight") == ("out.weight", "weight")
    assert target_of(report, None) == ("b.bias", "bias")
    assert target_of(SimpleNamespace(flagged=[]), None) is None


def test_reductions_cover_layers_widths_heads_uses_n_batch_and_sequence():
    whats = [what for what, _, _ in reductions(builtin_case("transformer-small").to_document(), 32, 2)]
    for words in ("N 32 -> 16", "drop block layer 'block0'", "drop attention layer 'attn'",
                  "width 128 -> 64 in every layer", "heads of 'attn' 4 -> 2", "vocab 512 -> 256", "batch_size 4 -> 2",
                  "seq_len 32 -> 16"):
        assert words in whats, words
    shared = [what for what, _, _ in reductions(builtin_case("shared-weight").to_document(), 2, 2)]
    assert "drop use 0 (scale 1.0) of 'shared'" in shared and not any(w.startswith("N ") for w in shared)


def test_a_reduction_that_would_grow_the_case_is_never_run():
    """Dropping the narrow first layer would give the wide one more inputs: more parameters."""
    case = parse_case('''name = "narrow-wide"
accum_steps = 4
[input]
kind = "features"
features = 4
batch_size = 4
[[layers]]
type = "dense"
name = "narrow"
units = 2
[[layers]]
type = "dense"
name = "wide"
units = 100
''', "narrow-wide.toml")
    calls: list = []
    target = ("wide.weight", "weight")
    result = shrink(case, 4, _fake_trial({}, calls, target), target, "n.toml", max_trials=100)
    before = size(case, 4)
    assert calls and all(measures[m] <= before[m] for measures, _ in calls for m in before)
    assert "narrow" in [layer.name for layer in result.case.layers]
    assert all(result.after[m] <= before[m] for m in before) and result.after["parameters"] < before["parameters"]


def test_a_write_that_fails_is_one_line_naming_the_file(tmp_path, monkeypatch):
    import accumcheck.repro.request as repro

    def refuse(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(repro.tempfile, "mkstemp", refuse)
    with pytest.raises(AccumcheckError, match=r"--repro: cannot write .*r.npz \(No space left on device\)"):
        write_data(tmp_path / "r.npz", {"a": np.zeros(2)})
    files = repro_files(tmp_path / "r.py")
    assert files.says() == f"reproduction written: {files.script} (with {files.data}); run it with: python {files.script}"
    assert ", the case " in dataclasses.replace(files, shrunk=True).says()
