"""The command line under bad and unusual input, as a hostile tester drives it.

Every row of the table is one command. Each ends in one of two ways: exit code 2 with exactly one
line on stderr that names what was wrong (no traceback), or the documented verdict (0 faithful, 1
flagged, with its summary line). Nothing may exit 1 without a verdict, and nothing may exit 3 (an
internal error). The rows run in-process through ``accumcheck.cli.main`` (seconds for the whole
table); the resource rows, whose point is the memory a fresh process reaches, are in
test_resource_bounds.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
from pathlib import Path

import pytest
from conftest import HAS_TORCH, linear_case
from hostile import Refused, Verdict, assert_outcome

from accumcheck.cli import main

HAS_MXNET = importlib.util.find_spec("mxnet") is not None

LINEAR = linear_case("lin", 0, 4)


def _layers(body: str, top: str = "") -> str:
    """A features case with ``body`` after its input table (``top``: top-level keys before it)."""
    return f'name = "x"\n{top}[input]\nkind = "features"\nbatch_size = 4\nfeatures = 5\n' + body


def _dense(name: str = '"d"', units: str = "3", extra: str = "") -> str:
    return f'[[layers]]\ntype = "dense"\nname = {name}\nunits = {units}\n{extra}'


def _nested(depth: int) -> str:
    body = '{type = "dense", name = "d", units = 3}'
    for i in range(depth):
        body = f'{{type = "block", name = "b{i}", body = [{body}]}}'
    return _layers("", top=f"layers = [{body}]\n")


# name -> text of a case file written into the test's folder
CASE_FILES = {
    "lin.toml": LINEAR,
    "latin1.toml": None,  # bytes, written below
    "utf16.toml": None,
    "empty.toml": "",
    "syntax.toml": "name = \n",
    "noname.toml": LINEAR.replace('name = "lin"', ""),
    "nulname.toml": LINEAR.replace('name = "lin"', 'name = "a\\u0000b"'),
    "escape.toml": LINEAR.replace('name = "lin"', 'name = "../../escape"'),
    "deep200.toml": _nested(200),
    "deep17.toml": _nested(17),
    "deep3.toml": _nested(3),
    "slash.toml": _layers(_dense('"d/x"')),
    "nul.toml": _layers(_dense('"d\\u0000x"')),
    "space.toml": _layers(_dense('"d x"')),
    "dot.toml": _layers(_dense('"d.x"')),
    "noname-layer.toml": _layers(_dense('""')),
    "twice.toml": _layers(_dense() + _dense()),
    "units0.toml": _layers(_dense(units="0")),
    "units-neg.toml": _layers(_dense(units="-5")),
    "units-float.toml": _layers(_dense(units="1.5")),
    "units-text.toml": _layers(_dense(units='"ten"')),
    "units-bool.toml": _layers(_dense(units="true")),
    "huge-layer.toml": _layers(_dense('"d"', "100000") + _dense('"e"', "100000")),
    "huge-batch.toml": _layers(_dense()).replace("batch_size = 4", "batch_size = 10000000000"),
    "huge-vocab.toml": 'name = "v"\n[input]\nkind = "tokens"\nbatch_size = 2\nvocab = 1000000000000\nseq_len = 4\n'
                       '[[layers]]\ntype = "embedding"\nname = "e"\ndim = 8\n' + _dense(),
    "huge-seq.toml": 'name = "s"\n[input]\nkind = "tokens"\nbatch_size = 2\nvocab = 10\nseq_len = 10000000\n'
                     '[[layers]]\ntype = "embedding"\nname = "e"\ndim = 8\n'
                     '[[layers]]\ntype = "attention"\nname = "a"\nheads = 2\n' + _dense(),
    "seed-neg.toml": LINEAR.replace("seed = 0", "seed = -1"),
    "seed-big.toml": LINEAR.replace("seed = 0", "seed = 1099511627776"),
    "seed-float.toml": LINEAR.replace("seed = 0", "seed = 1.5"),
    "steps0.toml": LINEAR.replace("accum_steps = 4", "accum_steps = 0"),
    "batch0.toml": _layers(_dense()).replace("batch_size = 4", "batch_size = 0"),
    "scale-nan.toml": _layers(_dense()).replace("features = 5", "features = 5\nscale = nan"),
    "scale-inf.toml": _layers(_dense()).replace("features = 5", "features = 5\nscale = inf"),
    "spread-neg.toml": _layers(_dense()).replace("features = 5", "features = 5\nspread = -1.0"),
    "magnitude0.toml": _layers(_dense()) + "[init]\nmagnitude = 0.0\n",
    "init-inf.toml": _layers(_dense()) + "[init]\nscale = -inf\n",
    "unknown-key.toml": _layers(_dense(extra="colour = 'red'\n")),
    "unknown-type.toml": _layers('[[layers]]\ntype = "conv2d"\nname = "c"\n'),
    "unknown-top.toml": "answer = 42\n" + _layers(_dense()),
    "kind-images.toml": _layers(_dense()).replace('kind = "features"', 'kind = "images"'),
    "labels-odd.toml": _layers(_dense()).replace("features = 5", 'features = 5\nlabels = "sorted"'),
    "distinct-neg.toml": _layers(_dense()).replace("features = 5", "features = 5\ndistinct_batches = -1"),
    "one-class.toml": _layers(_dense(units="1")),
    "min-len.toml": 'name = "m"\n[input]\nkind = "tokens"\nbatch_size = 2\nvocab = 10\nseq_len = 4\nmin_len = 9\n'
                    '[[layers]]\ntype = "embedding"\nname = "e"\ndim = 8\n' + _dense(),
    "heads.toml": 'name = "h"\n[input]\nkind = "tokens"\nbatch_size = 2\nvocab = 10\nseq_len = 4\n'
                  '[[layers]]\ntype = "embedding"\nname = "e"\ndim = 8\n'
                  '[[layers]]\ntype = "attention"\nname = "a"\nheads = 3\n' + _dense(),
    "tie.toml": _layers('[[layers]]\ntype = "tied_output"\nname = "t"\ntie = "nowhere"\n'),
    "embed-late.toml": 'name = "e"\n[input]\nkind = "tokens"\nbatch_size = 2\nvocab = 10\nseq_len = 4\n'
                       '[[layers]]\ntype = "embedding"\nname = "e"\ndim = 8\n' + _dense()
                       + '[[layers]]\ntype = "embedding"\nname = "e2"\ndim = 8\n',
    "layers-none.toml": 'name = "x"\n[input]\nkind = "features"\nbatch_size = 4\nfeatures = 5\n',
    "layers-text.toml": _layers("", top='layers = "dense"\n'),
    "reduction.toml": LINEAR + "[loss]\nreduction = 'median'\n",
    "fullbatch-cond.toml": _layers('[[layers]]\ntype = "conditional"\nname = "c"\nevery = 2\n'
                                   '[[layers.body]]\ntype = "dense"\nname = "d"\nunits = 5\n' + _dense('"e"')),
}


def _reports(tmp: Path) -> None:
    """Report files good and bad, made from one real report."""
    good = json.loads((tmp / "report-lin.json").read_text())
    bad: dict[str, object] = {
        "r-array.json": [good],
        "r-string.json": "report",
        "r-null.json": None,
        "r-empty-object.json": {},
        "r-version.json": {**good, "schema_version": 99},
        "r-version-text.json": {**good, "schema_version": "2"},
        "r-kind.json": {**good, "kind": "weird"},
        "r-tensors-text.json": {**good, "tensors": "abc"},
        "r-tensors-empty.json": {**good, "tensors": []},
        "r-tensors-number.json": {**good, "tensors": [1]},
        "r-tensor-missing.json": {**good, "tensors": [{"name": "x"}]},
        "r-tensor-extra.json": {**good, "tensors": [{**good["tensors"][0], "colour": "red"}]},
        "r-ratio-text.json": {**good, "tensors": [{**good["tensors"][0], "ratio": "high"}]},
        "r-steps-text.json": {**good, "accum_steps": "x"},
        "r-steps-bool.json": {**good, "accum_steps": True},
        "r-bound-list.json": {**good, "bound": [1, 2]},
        "r-config-list.json": {**good, "config": []},
        "r-notes-number.json": {**good, "notes": 5},
        "r-cross-empty.json": {"schema_version": 2, "kind": "cross", "frameworks": ["torch", "mxnet"],
                               "reports": [], "agreement": [], "forward": None, "allowance": 1.0},
        "r-sweep-empty.json": {"schema_version": 2, "kind": "sweep", "reports": []},
        "r-sweep-holds-empty.json": {"schema_version": 2, "kind": "sweep",
                                     "reports": [{**good, "tensors": []}]},
        "r-trajectory-empty.json": {"schema_version": 2, "kind": "trajectory", "case": "x", "optimizer": "adam",
                                    "lr": 0.001, "accum_steps": 2, "steps": 0, "inject": None, "versions": {},
                                    "losses": {}, "max_diff": {}, "band_ratio": {}, "first_out_of_band": {}},
    }
    for name, data in bad.items():
        (tmp / name).write_text(json.dumps(data))
    (tmp / "r-not-json.json").write_text("{not json")
    (tmp / "r-latin1.json").write_bytes(b'{"case": "caf\xe9"}')
    (tmp / "r-deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with open(tmp / "r-huge.json", "wb") as handle:  # sparse: 300 MB that take no room
        handle.truncate(300 * 1024 * 1024)


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A folder with every file the table names, and two real reports."""
    tmp = tmp_path_factory.mktemp("hostile")
    for name, text in CASE_FILES.items():
        if text is not None:
            (tmp / name).write_text(text)
    (tmp / "latin1.toml").write_bytes(LINEAR.replace('"lin"', '"caf\xe9"').encode("latin-1"))
    (tmp / "utf16.toml").write_bytes(LINEAR.encode("utf-16"))
    (tmp / "big.toml").write_text(LINEAR + "#" * (2 * 1024 * 1024) + "\n")
    (tmp / "afile").write_text("not a folder\n")
    (tmp / "adir").mkdir()
    (tmp / "target.json").write_text("{}\n")
    (tmp / "link.json").symlink_to(tmp / "target.json")
    (tmp / "dangling").symlink_to(tmp / "nowhere" / "at-all")
    os.mkfifo(tmp / "fifo")
    if HAS_TORCH:
        for case, file in (("lin", "lin.toml"), ("other", "tiny-grads")):
            argv = ["compare", "--case", str(tmp / file) if file.endswith(".toml") else file, "--accum-steps", "2",
                    "--format", "json", "--output", str(tmp / f"report-{case}.json")]
            assert main(argv) == 0
        _reports(tmp)
    return tmp


# (argv with {d} for the test's folder, the expected outcome). Grouped by what they try.
ROWS: list[tuple[str, object]] = [
    # ---- numbers and names the parser takes
    ("compare --accum-steps 0", Refused("--accum-steps: '0' is not a positive integer")),
    ("compare --accum-steps -3", Refused("--accum-steps: '-3' is not a positive integer")),
    ("compare --accum-steps abc", Refused("--accum-steps: 'abc' is not a positive integer")),
    ("compare --accum-steps 1.5", Refused("--accum-steps: '1.5' is not a positive integer")),
    ("compare --accum-steps 1e3", Refused("--accum-steps: '1e3' is not a positive integer")),
    ("compare --seed -1", Refused("--seed: '-1' is not a seed")),
    ("compare --seed 4294967296", Refused("--seed: '4294967296' is not a seed")),
    ("compare --seed 99999999999999999999999", Refused("is not a seed")),
    ("compare --seed abc", Refused("--seed: 'abc' is not a seed")),
    ("compare --seed 0x10", Refused("--seed: '0x10' is not a seed")),
    ("compare --device tpu", Refused("unknown device 'tpu'")),
    ("compare --device cuda:x", Refused("unknown device 'cuda:x'")),
    ("compare --device cpu:0", Refused("unknown device 'cpu:0'")),
    ("compare --framework tensorflow", Refused("unknown framework 'tensorflow'")),
    ("compare --framework ,", Refused("--framework")),
    ("compare --framework torch,,mxnet", Refused("--framework")),
    ("compare --format yaml", Refused("argument --format: invalid choice: 'yaml'")),
    ("compare --frobnicate", Refused("unrecognized arguments: --frobnicate")),
    ("compare --inject explode", Refused("unknown fault 'explode'")),
    ("compare --inject scale:nope.weight", Refused("no parameter named 'nope.weight'")),
    ("compare --inject ''", Refused("--inject")),
    ("compare --loss-reduction median", Refused("--loss-reduction: 'median' is not one of mean, sum, token_count")),
    ("compare --dtype float8", Refused("--dtype: 'float8' is not one of float32, bfloat16, float16")),
    ("compare --accum-dtype float16", Refused("--accum-dtype: 'float16' is not one of float32, float64")),
    ("compare --mode turbo", Refused("--mode: 'turbo' is not one of native, accumulator, compensated")),
    ("compare --reduce-dtype bfloat16", Refused("--reduce-dtype bfloat16: applies to data-parallel runs")),
    ("compare --inject-rank 1 --inject scale", Refused("--inject-rank 1: applies to data-parallel runs")),
    ("compare --world-size 0", Refused("--world-size: '0' is not a positive integer")),
    ("compare --world-size -1", Refused("--world-size: '-1' is not a positive integer")),
    ("compare --world-size 100000", Refused("--world-size 100000: more ranks than the")),
    ("compare --world-size 2 --inject scale --inject-rank 2 --force", Refused("--inject-rank 2: ranks are 0..1")),
    ("compare --case tiny-grads --grad-norms ''", Refused("--grad-norms")),
    ("compare --case nope", Refused("unknown case 'nope'")),
    ("compare --case ''", Refused("--case")),
    ("sweep --accum-steps 0", Refused("--accum-steps: '0' is not a positive integer")),
    ("sweep --accum-steps 4,,8", Refused("is not a comma list")),
    ("sweep --accum-steps x", Refused("--accum-steps: 'x' is not a positive integer")),
    ("sweep --dtype bfloat16", Refused("unrecognized arguments: --dtype")),
    ("train --steps 0", Refused("--steps: '0' is not a positive integer")),
    ("train --lr 0", Refused("--lr: '0' is not a positive number")),
    ("train --lr -1", Refused("--lr: '-1' is not a positive number")),
    ("train --lr inf", Refused("--lr: 'inf' is not a positive number")),
    ("train --lr nan", Refused("--lr: 'nan' is not a positive number")),
    ("train --optimizer lbfgs", Refused("--optimizer: 'lbfgs' is not one of adam, sgd")),
    ("train --dtype bfloat16", Refused("train --dtype bfloat16: the torch backend trains float32 parameters only")),
    ("train --framework mxnet --dtype bfloat16", Refused("--dtype bfloat16: not available with the mxnet backend")),
    ("train --framework mxnet --multi-precision", Refused("--multi-precision: float32 parameters need no float32")),
    ("diff {d}/report-lin.json", Refused("the following arguments are required: B.json")),
    ("show", Refused("the following arguments are required: REPORT.json")),
    ("", Refused("give a command")),
    ("frobnicate", Refused("invalid choice: 'frobnicate'")),
    # ---- two frameworks: every option is applied or refused, never dropped
    ("compare --framework torch,mxnet --dtype bfloat16", Refused("--dtype bfloat16: works with one framework")),
    ("compare --framework torch,mxnet --dtype float16", Refused("--dtype float16: works with one framework")),
    ("compare --framework torch,mxnet --full-batch", Refused("--full-batch: works with one framework")),
    ("compare --framework torch,mxnet --mode accumulator", Refused("--mode accumulator: works with one framework")),
    ("compare --framework torch,mxnet --mode compensated", Refused("--mode compensated: works with one framework")),
    ("compare --framework torch,mxnet --accum-dtype float64",
     Refused("--accum-dtype float64: works with one framework")),
    ("compare --framework torch,mxnet --world-size 2", Refused("--world-size 2: works with one framework")),
    ("compare --framework torch,mxnet --world-size 2 --reduce-dtype bfloat16",
     Refused("works with one framework")),
    ("compare --framework torch,mxnet --inject scale --inject-rank 0", Refused("--inject-rank 0: applies to")),
    ("compare --framework torch,mxnet --grad-norms {d}/norms", Refused("--grad-norms")),
    ("compare --framework torch --no-hybridize", Refused("--no-hybridize: an option of the mxnet backend")),
    ("compare --framework torch,mxnet --case {d}/lin.toml --accum-steps 2 --loss-reduction sum",
     Verdict(0, "torch: OK; mxnet: OK")),
    # ---- case files
    ("compare --case {d}/latin1.toml", Refused("latin1.toml: not UTF-8 text (byte 0xe9")),
    ("compare --case {d}/utf16.toml", Refused("utf16.toml: not UTF-8 text")),
    ("compare --case {d}/empty.toml", Refused("empty.toml: name: missing required key")),
    ("compare --case {d}/syntax.toml", Refused("syntax.toml: not valid TOML")),
    ("compare --case {d}/big.toml", Refused("big.toml: larger than any case file")),
    ("compare --case {d}/noname.toml", Refused("noname.toml: name: missing required key")),
    ("compare --case {d}/nulname.toml", Refused("nulname.toml: name: 'a\\x00b' must be printable text")),
    ("compare --case {d}/deep200.toml", Refused("deep200.toml: nests too deeply")),
    ("compare --case {d}/deep17.toml", Refused("layers nest more than 16 deep")),
    ("compare --case {d}/slash.toml", Refused("layers[0].name: 'd/x' is not a layer name")),
    ("compare --case {d}/nul.toml", Refused("layers[0].name: 'd\\x00x' is not a layer name")),
    ("compare --case {d}/space.toml", Refused("layers[0].name: 'd x' is not a layer name")),
    ("compare --case {d}/dot.toml", Refused("layers[0].name: 'd.x' is not a layer name")),
    ("compare --case {d}/noname-layer.toml", Refused("layers[0].name: '' is not a layer name")),
    ("compare --case {d}/twice.toml", Refused("'d' is used twice")),
    ("compare --case {d}/units0.toml", Refused("units: must be a positive integer, got 0")),
    ("compare --case {d}/units-neg.toml", Refused("units: must be a positive integer, got -5")),
    ("compare --case {d}/units-float.toml", Refused("units: expected int, got 1.5")),
    ("compare --case {d}/units-text.toml", Refused("units: expected int, got 'ten'")),
    ("compare --case {d}/units-bool.toml", Refused("units: expected int, got True")),
    ("compare --case {d}/huge-layer.toml", Refused("of memory is available")),
    ("compare --case {d}/huge-batch.toml", Refused("of memory is available")),
    ("compare --case {d}/huge-vocab.toml", Refused("of memory is available")),
    ("compare --case {d}/huge-seq.toml", Refused("of memory is available")),
    ("compare --case {d}/seed-neg.toml", Refused("seed: must be between 0 and 2**32 - 1, got -1")),
    ("compare --case {d}/seed-big.toml", Refused("seed: must be between 0 and 2**32 - 1")),
    ("compare --case {d}/seed-float.toml", Refused("seed: expected int, got 1.5")),
    ("compare --case {d}/steps0.toml", Refused("accum_steps: must be a positive integer, got 0")),
    ("compare --case {d}/batch0.toml", Refused("batch_size: must be a positive integer, got 0")),
    ("compare --case {d}/scale-nan.toml", Refused("[input].scale: must be a finite number, got nan")),
    ("compare --case {d}/scale-inf.toml", Refused("[input].scale: must be a finite number, got inf")),
    ("compare --case {d}/spread-neg.toml", Refused("spread: must be >= 0")),
    ("compare --case {d}/magnitude0.toml", Refused("magnitude: must be non-zero and magnitude positive")),
    ("compare --case {d}/init-inf.toml", Refused("[init].scale: must be a finite number, got -inf")),
    ("compare --case {d}/unknown-key.toml", Refused("colour: unknown key")),
    ("compare --case {d}/unknown-type.toml", Refused("'conv2d' is not one of")),
    ("compare --case {d}/unknown-top.toml", Refused("answer: unknown key")),
    ("compare --case {d}/kind-images.toml", Refused("'images' is not one of")),
    ("compare --case {d}/labels-odd.toml", Refused("'sorted' is not one of")),
    ("compare --case {d}/distinct-neg.toml", Refused("distinct_batches: must be >= 0")),
    ("compare --case {d}/one-class.toml", Refused("softmax cross-entropy needs at least 2 classes")),
    ("compare --case {d}/min-len.toml", Refused("min_len: must be between 0")),
    ("compare --case {d}/heads.toml", Refused("heads = 3 must divide the width 8")),
    ("compare --case {d}/tie.toml", Refused("tie = 'nowhere' names no earlier embedding")),
    ("compare --case {d}/embed-late.toml", Refused("an embedding must be the first top-level layer")),
    ("compare --case {d}/layers-none.toml", Refused("layers: expected a non-empty array of tables")),
    ("compare --case {d}/layers-text.toml", Refused("layers: expected a non-empty array of tables")),
    ("compare --case {d}/reduction.toml", Refused("'median' is not one of")),
    ("compare --case {d}/fullbatch-cond.toml --full-batch", Refused("--full-batch: case 'x' routes each")),
    ("compare --case {d}/nowhere.toml", Refused("nowhere.toml: cannot read case file: No such file")),
    ("compare --case {d}/adir", Refused("adir: is a folder; give a case file")),
    ("compare --case {d}/fifo", Refused("fifo: is a FIFO, not a regular file; give a case file")),
    ("compare --case /dev/zero", Refused("/dev/zero: is a device, not a regular file")),
    ("compare --case /dev/null", Refused("/dev/null: is a device, not a regular file")),
    ("compare --case {d}/dangling", Refused("dangling: cannot read case file")),
    # ---- reports read back
    ("show {d}/r-array.json", Refused("not an accumcheck report (top level is not an object)")),
    ("show {d}/r-string.json", Refused("not an accumcheck report (top level is not an object)")),
    ("show {d}/r-null.json", Refused("not an accumcheck report (top level is not an object)")),
    ("show {d}/r-empty-object.json", Refused("report schema_version None is not supported")),
    ("show {d}/r-version.json", Refused("report schema_version 99 is not supported")),
    ("show {d}/r-version-text.json", Refused("report schema_version '2' is not supported")),
    ("show {d}/r-kind.json", Refused("unknown report kind 'weird'")),
    ("show {d}/r-tensors-text.json", Refused("not an accumcheck report (expected a list, got 'abc')")),
    ("show {d}/r-tensors-empty.json", Refused("an empty report (no tensors)")),
    ("show {d}/r-tensors-number.json", Refused("not an accumcheck report (TensorResult expects an object")),
    ("show {d}/r-tensor-missing.json", Refused("not an accumcheck report")),
    ("show {d}/r-tensor-extra.json", Refused("TensorResult has no field 'colour'")),
    ("show {d}/r-ratio-text.json", Refused("not an accumcheck report (expected a number, got 'high')")),
    ("show {d}/r-steps-text.json", Refused("not an accumcheck report (expected int, got 'x')")),
    ("show {d}/r-steps-bool.json", Refused("not an accumcheck report (expected int, got True)")),
    ("show {d}/r-bound-list.json", Refused("not an accumcheck report (expected an object")),
    ("show {d}/r-config-list.json", Refused("not an accumcheck report (expected an object")),
    ("show {d}/r-notes-number.json", Refused("not an accumcheck report (expected a list, got 5)")),
    ("show {d}/r-cross-empty.json", Refused("an empty cross-framework report (no reports)")),
    ("show {d}/r-sweep-empty.json", Refused("an empty sweep report (no reports)")),
    ("show {d}/r-sweep-holds-empty.json", Refused("an empty sweep report (no tensors)")),
    ("show {d}/r-trajectory-empty.json", Refused("an empty trajectory report (no optimizer steps)")),
    ("show {d}/r-not-json.json", Refused("not JSON (")),
    ("show {d}/r-latin1.json", Refused("r-latin1.json: not UTF-8 text (byte 0xe9")),
    ("show {d}/r-deep.json", Refused("nests too deeply to be an accumcheck report")),
    ("show {d}/r-huge.json", Refused("r-huge.json: larger than any report (300.0 MiB; at most 256.0 MiB)")),
    ("show {d}/nowhere.json", Refused("nowhere.json: cannot read report: No such file")),
    ("show {d}/adir", Refused("adir: is a folder; give a report")),
    ("show {d}/fifo", Refused("fifo: is a FIFO, not a regular file; give a report")),
    ("show /dev/zero", Refused("/dev/zero: is a device, not a regular file; give a report")),
    ("show {d}/lin.toml", Refused("lin.toml: not JSON")),
    ("show {d}/report-lin.json --format yaml", Refused("argument --format: invalid choice")),
    ("show {d}/report-lin.json", Verdict(0, "OK: all 2 tensors faithful")),
    ("diff {d}/report-lin.json {d}/report-other.json", Refused("report-lin.json is case 'lin'")),
    ("diff {d}/report-lin.json {d}/r-tensors-empty.json", Refused("an empty report (no tensors)")),
    ("diff {d}/report-lin.json {d}/r-not-json.json", Refused("not JSON")),
    ("diff {d}/report-lin.json {d}/report-lin.json", Verdict(0, "no verdict changed (2 tensors in both)")),
    # ---- where results go
    ("compare --case {d}/lin.toml --output {d}/adir", Refused("--output {d}/adir: is a folder; give a file name")),
    ("compare --case {d}/lin.toml --output {d}/nowhere/r.json", Refused("folder {d}/nowhere does not exist")),
    ("compare --case {d}/lin.toml --output {d}/afile/r.json", Refused("folder {d}/afile is not a folder")),
    ("compare --case {d}/lin.toml --output {d}/link.json", Refused("link.json: is a symbolic link; accumcheck "
                                                                   "replaces only regular files")),
    ("compare --case {d}/lin.toml --output {d}/dangling", Refused("dangling: is a symbolic link")),
    ("compare --case {d}/lin.toml --output {d}/fifo", Refused("fifo: is a FIFO; accumcheck replaces only")),
    ("compare --case {d}/lin.toml --output /dev/null", Refused("/dev/null: is a device; accumcheck replaces only")),
    ("compare --case {d}/lin.toml --output /proc/r.json", Refused("--output /proc/r.json: folder /proc takes no")),
    ("compare --case {d}/lin.toml --plot {d}/afile", Refused("--plot {d}/afile: is a file; give a folder")),
    ("compare --case {d}/lin.toml --plot {d}/afile/plots", Refused("{d}/afile is a file, not a folder")),
    ("compare --case {d}/lin.toml --plot /proc/plots", Refused("--plot /proc/plots: folder /proc takes no")),
    ("compare --case {d}/lin.toml --plot {d}/dangling/plots", Refused("dangling is a broken symbolic link")),
    ("compare --case {d}/lin.toml --grad-norms {d}/afile", Refused("--grad-norms {d}/afile: is a file")),
    ("compare --case {d}/lin.toml --grad-norms {d}/afile/x", Refused("{d}/afile is a file, not a folder")),
    ("sweep --case {d}/lin.toml --accum-steps 2 --output {d}/fifo", Refused("fifo: is a FIFO")),
    ("sweep --case {d}/lin.toml --accum-steps 2 --plot {d}/afile", Refused("is a file; give a folder")),
    ("train --case {d}/lin.toml --steps 1 --output {d}/link.json", Refused("link.json: is a symbolic link")),
    ("train --case {d}/lin.toml --steps 1 --output {d}/adir/../fifo", Refused("fifo: is a FIFO")),
    ("train --case {d}/lin.toml --steps 1 --output /proc/t.json", Refused("folder /proc takes no new files")),
    ("show {d}/report-lin.json --output {d}/link.json", Refused("link.json: is a symbolic link")),
    # ---- verdicts that must read as what they are
    ("compare --case {d}/lin.toml --accum-steps 2", Verdict(0, "OK: all 2 tensors faithful")),
    ("compare --case {d}/lin.toml --accum-steps 2 --inject double-step", Verdict(1, "FLAGGED")),
    ("compare --case {d}/escape.toml --accum-steps 2", Verdict(0, "OK: all 2 tensors faithful")),
    ("compare --case {d}/deep3.toml --accum-steps 2", Verdict(0, "OK:")),
    ("compare --case {d}/lin.toml --accum-steps 2 --seed 4294967295", Verdict(0, "OK:")),
    ("train --case tiny-grads --accum-steps 2 --steps 3 --lr 1e30", Verdict(1, "NON-FINITE at step 1 (loss (manual)")),
    ("train --case {d}/lin.toml --accum-steps 2 --steps 3 --lr 1e38",
     Verdict(1, "NON-FINITE at step 0 (optimizer update (overflow), optimizer update (overflow, manual)")),
    ("train --case {d}/lin.toml --accum-steps 2 --steps 2", Verdict(0, "OK: native and manual identical")),
    ("train --case {d}/lin.toml --accum-steps 2 --steps 2 --inject double-step", Verdict(1, "FLAGGED at step 1 (linear.weight)")),
]


def _needs(argv: list[str]) -> str | None:
    """Why a row cannot run here, or None."""
    words = " ".join(argv)
    if "mxnet" in words and not HAS_MXNET and "hybridize" not in words:
        return "mxnet is not installed"
    if not HAS_TORCH and argv and argv[0] in ("compare", "sweep", "train", "show", "diff"):
        return "torch is not installed"
    return None


def _argv(row: str, place: Path) -> list[str]:
    import shlex

    return shlex.split(row.replace("{d}", str(place)))


def test_the_table_has_at_least_a_hundred_rows():
    assert len(ROWS) >= 100
    assert len({row for row, _ in ROWS}) == len(ROWS), "a row is listed twice"


@pytest.mark.parametrize("row, expected", ROWS, ids=[row or "<none>" for row, _ in ROWS])
def test_bad_input_is_refused_in_one_line_or_gets_its_verdict(row, expected, place, capsys, monkeypatch):
    argv = _argv(row, place)
    why = _needs(argv)
    if why:
        pytest.skip(why)
    monkeypatch.chdir(place)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    out, err = capsys.readouterr()
    if isinstance(expected, Refused):
        expected = Refused(expected.fragment.replace("{d}", str(place)))
    assert_outcome(expected, code, out, err)


def test_nothing_in_the_folder_changed_kind(place):
    """After the whole table: the symlinks, the FIFO and the file-that-is-not-a-folder are as they were."""
    assert (place / "link.json").is_symlink() and (place / "target.json").read_text() == "{}\n"
    assert (place / "dangling").is_symlink()
    assert stat.S_ISFIFO(os.lstat(place / "fifo").st_mode)
    assert (place / "afile").read_text() == "not a folder\n"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


@pytest.mark.parametrize("command", [["compare", "--case", "tiny-grads", "--accum-steps", "2"],
                                     ["sweep", "--case", "tiny-grads", "--accum-steps", "2"],
                                     ["train", "--case", "tiny-grads", "--accum-steps", "2", "--steps", "1"]])
def test_an_internal_error_exits_3_in_one_line_with_its_traceback_saved(command, tmp_path, monkeypatch, capsys):
    """A bug in accumcheck (here: the run raising ZeroDivisionError) is never exit 1, a finding."""
    import tempfile

    import accumcheck.api

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def bug(*args, **kwargs):
        return 1 / 0

    for name in ("run", "_report", "get_backend"):
        monkeypatch.setattr(accumcheck.api, name, bug)
    code = main(command)
    out, err = capsys.readouterr()
    assert code == 3, (code, out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "internal error (ZeroDivisionError: division by zero); this is not an accumulation finding" in err
    saved = re.search(r"the full traceback is in (\S+);", err)
    assert saved and Path(saved.group(1)).parent == tmp_path, err
    text = Path(saved.group(1)).read_text()
    assert "Traceback (most recent call last)" in text and "ZeroDivisionError" in text
