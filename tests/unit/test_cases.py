"""Case loading: the built-ins, determinism, and errors that name the file, the key and the fix."""

import numpy as np
import pytest

from accumcheck.case.definition import CaseError
from accumcheck.case.reading import builtin_case, builtin_case_names, load_case, parse_case, resolve_case

MINIMAL = """
name = "mini"
[input]
kind = "features"
features = 3
batch_size = 2
[[layers]]
type = "dense"
name = "fc"
units = 2
"""


def test_builtin_cases_are_listed():
    assert set(builtin_case_names()) >= {"tiny-grads", "embed-attention", "transformer-small", "shared-weight"}


def test_canonical_parameter_names():
    names = [p.name for p in builtin_case("embed-attention").parameters()]
    assert names[:4] == ["embed.weight", "ln0.gamma", "ln0.beta", "block0.attn.q.weight"]
    assert "block0.attn.v.weight" in names and "out.bias" in names
    kinds = {p.name: p.kind for p in builtin_case("transformer-small").parameters()}
    assert kinds["embed.weight"] == "embedding" and kinds["block1.ln_ffn.gamma"] == "norm"
    assert kinds["lm_head.bias"] == "bias" and "lm_head.weight" not in kinds  # tied to embed.weight


def test_shapes_of_the_issue_cases():
    tiny = {p.name: p.shape for p in builtin_case("tiny-grads").parameters()}
    assert tiny == {"dense0.weight": (1000, 10), "dense0.bias": (1000,), "dense1.weight": (2, 1000),
                    "dense1.bias": (2,)}
    embed = {p.name: p.shape for p in builtin_case("embed-attention").parameters()}
    assert embed["embed.weight"] == (13, 512) and embed["out.weight"] == (13, 512)
    assert "block0.attn.q.bias" not in embed  # bias-free q/k/v
    assert builtin_case("embed-attention").batch(0).inputs.shape == (2, 14)


def test_weights_and_batches_depend_only_on_the_seed():
    case = builtin_case("transformer-small")
    w1, w2 = case.weights(), builtin_case("transformer-small").weights()
    assert all(np.array_equal(w1[k], w2[k]) for k in w1)
    assert all(v.dtype == np.float32 for v in w1.values())
    assert np.array_equal(case.batch(5).inputs, case.batch(5).inputs)
    assert not np.array_equal(case.batch(5).inputs, case.batch(6).inputs)
    other = case.with_seed(1)
    assert not np.array_equal(other.weights()["embed.weight"], w1["embed.weight"])


def test_tiny_grads_alternates_two_samples_and_labels():
    case = builtin_case("tiny-grads")
    b0, b1, b2 = case.batch(0), case.batch(1), case.batch(2)
    assert b0.labels.tolist() == [0] and b1.labels.tolist() == [1] and b2.labels.tolist() == [0]
    assert np.array_equal(b0.inputs, b2.inputs) and not np.array_equal(b0.inputs, b1.inputs)
    w = case.weights()["dense0.weight"]
    assert 0 < np.abs(w).max() < 1e-6  # weights scaled by 1e-6


def test_resolve_case_accepts_name_path_and_case(tmp_path):
    path = tmp_path / "mini.toml"
    path.write_text(MINIMAL)
    assert resolve_case(str(path)).name == "mini"
    assert resolve_case("shared-weight").name == "shared-weight"
    case = parse_case(MINIMAL)
    assert resolve_case(case) is case


@pytest.mark.parametrize("edit, fragment", [
    (lambda t: t.replace('units = 2', 'units = "two"'), "layers[0].units: expected int, got 'two'"),
    (lambda t: t.replace('units = 2', 'units = 0'), "layers[0].units: must be a positive integer"),
    (lambda t: t.replace('units = 2', 'unit = 2'), "layers[0].units: missing required key; add units = ... (int); is 'unit' a misspelling of it?"),
    (lambda t: t.replace('units = 2', 'units = 2\nbiass = true'), "layers[0].biass: unknown key"),
    (lambda t: t.replace('type = "dense"', 'type = "conv"'), "layers[0].type: 'conv' is not one of"),
    (lambda t: t.replace('features = 3\n', ''), "[input].features: missing required key"),
    (lambda t: t.replace('name = "mini"\n', ''), "name: missing required key"),
    (lambda t: t + "[[layers]]\ntype = \"dense\"\nname = \"fc\"\nunits = 3\n", "'fc' is used twice"),
    (lambda t: t.replace('units = 2', 'units = 1'), "at least 2 classes"),
    (lambda t: t.replace('[input]', '[input\n'), "not valid TOML"),
    (lambda t: t + '[[layers]]\ntype = "attention"\nname = "a"\n', "attention needs sequences"),
])
def test_malformed_case_names_file_key_and_problem(tmp_path, edit, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(edit(MINIMAL))
    with pytest.raises(CaseError) as info:
        load_case(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert fragment in message, message
    assert "\n" not in message


def test_missing_case_file_and_unknown_name():
    with pytest.raises(CaseError, match="cannot read case file"):
        load_case("/nonexistent/case.toml")
    with pytest.raises(CaseError, match="unknown case 'nope'; built-in cases: conditional-branch, embed-attention"):
        resolve_case("nope")


def test_residual_must_keep_the_width(tmp_path):
    text = MINIMAL.replace('[[layers]]\ntype = "dense"\nname = "fc"\nunits = 2\n', """
[[layers]]
type = "residual"
name = "r"
  [[layers.body]]
  type = "dense"
  name = "inner"
  units = 5
[[layers]]
type = "dense"
name = "fc"
units = 2
""")
    with pytest.raises(CaseError, match="maps width 3 to 5"):
        parse_case(text, "r.toml")


def test_tied_output_needs_a_matching_embedding():
    text = """
name = "t"
[input]
kind = "tokens"
vocab = 7
seq_len = 3
batch_size = 1
[[layers]]
type = "embedding"
name = "emb"
dim = 4
[[layers]]
type = "tied_output"
name = "head"
tie = "missing"
"""
    with pytest.raises(CaseError, match="tie = 'missing' names no earlier embedding"):
        parse_case(text, "t.toml")
    case = parse_case(text.replace('"missing"', '"emb"'), "t.toml")
    assert case.num_classes == 7


CONDITIONAL = MINIMAL.replace('units = 2\n', '''units = 4
[[layers]]
type = "conditional"
name = "branch"
every = 3
body = [{ type = "dense", name = "proj", units = 4 }]
[[layers]]
type = "dense"
name = "out"
units = 2
''')


def test_a_conditional_branch_prefixes_its_parameters_and_gates_by_micro_batch_index():
    case = parse_case(CONDITIONAL)
    assert [p.name for p in case.parameters()] == ["fc.weight", "fc.bias", "branch.proj.weight", "branch.proj.bias",
                                                   "out.weight", "out.bias"]
    assert [case.gates(k) for k in range(7)] == [[True], [False], [False], [True], [False], [False], [True]]
    assert [case.batch(k).index for k in (0, 5)] == [0, 5]
    assert parse_case(CONDITIONAL).to_document()["layers"][1]["every"] == 3


@pytest.mark.parametrize("edit, fragment", [
    (("every = 3", "every = 0"), "every: must be a positive integer, got 0"),
    (("every = 3\n", ""), "every: missing required key"),
    (('units = 4 }', 'units = 5 }'), "its body maps width 4 to 5; a conditional branch needs equal widths"),
])
def test_a_malformed_conditional_branch_is_named(edit, fragment):
    with pytest.raises(CaseError, match=fragment.replace("(", r"\(")):
        parse_case(CONDITIONAL.replace(*edit))
