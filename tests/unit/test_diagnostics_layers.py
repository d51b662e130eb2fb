"""accumcheck.diagnostics.layers on parameter names: which layer each belongs to, which layers a
spec watches, and the per-layer norms (no framework)."""

import numpy as np
import pytest

from accumcheck.diagnostics.layers import _index, _is_index, _numbered, layer_groups, layer_norms, select_layers
from accumcheck.errors import AccumcheckError


def blocks(n, prefix=""):
    """Names of a model with an embedding, n numbered blocks of two parameters, and a head."""
    names = [f"{prefix}embed.weight"]
    for i in range(n):
        names += [f"{prefix}layers.{i}.weight", f"{prefix}layers.{i}.bias"]
    return names + [f"{prefix}head.weight"]


def test_numbered_components_of_dotted_and_gluon_names():
    assert _numbered("enc.layers.3.w") == [("enc.layers.3", "enc.layers.", 3)]
    assert _numbered("block0.attn.w") == [("block0", "block", 0)]
    assert _numbered("enc.block12.layers.4.w") == [("enc.block12", "enc.block", 12),
                                                   ("enc.block12.layers.4", "enc.block12.layers.", 4)]
    assert _numbered("dense0_weight") == [("dense0", "dense", 0)]
    assert _numbered("net_dense10_bias") == [("net_dense10", "net_dense", 10)]
    # The last component is the parameter itself, never a layer; a name without digits has none.
    assert _numbered("layers.7") == [] and _numbered("embed.weight") == [] and _numbered("weight") == []
    assert _numbered("a1b.w") == []  # letters, digits, letters: no layer number


def test_blocks_are_the_numbered_layers_of_the_commonest_stem_in_numeric_order():
    names = ["embed.weight"] + [f"layers.{i}.weight" for i in (10, 2, 0, 1)] + ["head.0.w", "head.1.w"]
    groups, order = layer_groups(names)
    assert order == ["layers.0", "layers.1", "layers.2", "layers.10"]  # by number, not as text
    # head.0 and head.1 are numbered too, but fewer: they are layers of their own, not blocks.
    assert groups == {"embed": [0], "layers.10": [1], "layers.2": [2], "layers.0": [3], "layers.1": [4],
                      "head.0": [5], "head.1": [6]}


def test_a_single_numbered_layer_makes_no_blocks():
    groups, order = layer_groups(["embed.weight", "layers.0.weight", "layers.0.bias", "bias"])
    assert order == []
    assert groups == {"embed": [0], "layers.0": [1, 2], "bias": [3]}


def test_a_prefix_every_name_shares_names_no_layer():
    gluon = ["net0_dense0_weight", "net0_dense0_bias", "net0_dense1_weight", "net0_dense1_bias"]
    assert layer_groups(gluon) == ({"dense0": [0, 1], "dense1": [2, 3]}, ["dense0", "dense1"])
    wrapped = blocks(2, prefix="model.")
    groups, order = layer_groups(wrapped)
    assert order == ["layers.0", "layers.1"] and list(groups) == ["embed", "layers.0", "layers.1", "head"]
    # The prefix is kept where cutting it would leave a bare parameter name.
    assert layer_groups(["a.w", "a.b"]) == ({"a": [0, 1]}, [])
    assert layer_groups(["a_w", "a_b"]) == ({"a": [0, 1]}, [])
    assert layer_groups(["conv.weight"]) == ({"conv": [0]}, [])  # one name: no common prefix to cut


def test_the_default_spec_watches_blocks_0_1_middle_and_last_two():
    names = blocks(5)
    assert select_layers(names) == ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4"]
    assert select_layers(blocks(7)) == ["layers.0", "layers.1", "layers.3", "layers.5", "layers.6"]
    # With three blocks the indices name some twice; each layer is listed once, in spec order.
    assert select_layers(blocks(3), "2, 0, n//2, -1, 0") == ["layers.2", "layers.0", "layers.1"]


def test_index_specs_count_over_the_blocks_from_either_end():
    names = blocks(4)
    assert select_layers(names, [0, -1]) == ["layers.0", "layers.3"]
    assert select_layers(names, ["-4", "n-1", "n - 2"]) == ["layers.0", "layers.3", "layers.2"]
    assert select_layers(names, "3") == ["layers.3"]
    for bad in (4, -5, "n//1", "n-0"):  # n // 1 = n - 0 = 4, one past the last
        with pytest.raises(AccumcheckError, match=f"index {bad} is out of range for 4 repeated blocks"):
            select_layers(names, [bad])


def test_without_blocks_an_index_spec_watches_every_layer():
    names = ["embed.weight", "head.weight", "head.bias"]
    assert select_layers(names, [0]) == ["embed", "head"]
    assert select_layers(names, "all") == select_layers(names, None) == ["embed", "head"]


def test_name_globs_match_layers_or_their_parameters():
    names = blocks(3)
    assert select_layers(names, "head*,embed*") == ["embed", "head"]
    assert select_layers(names, ["*.1"]) == ["layers.1"]
    assert select_layers(names, "*.bias") == ["layers.0", "layers.1", "layers.2"]  # by a parameter's name
    assert select_layers(names, "all") == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    with pytest.raises(AccumcheckError) as error:
        select_layers(names, "nothing*")
    assert str(error.value) == ("layers: no layer matches 'nothing*'; layers are embed, layers.0, layers.1, "
                                "layers.2, head")


def test_index_items_and_their_values():
    assert all(_is_index(s) for s in ("0", "-12", "n//2", "n-1", "n // 3", " n - 2 "))
    assert not any(_is_index(s) for s in ("n/2", "n+1", "x", "1.5", "", "n", "head*", 3))
    assert (_index("n//3", 7), _index("n - 2", 7), _index("-1", 7), _index(" 4 ", 7)) == (2, 5, -1, 4)


def test_layer_norms_sum_squares_per_layer_in_float64():
    names = ["a.w", "a.b", "b.w"]
    grads = [np.array([3.0, 0.0], np.float32), np.array([[4.0]], np.float32), np.array([-2.0, 1.0, 2.0])]
    assert layer_norms(names, grads) == {"a": 5.0, "b": 3.0}
    # 1e20 squared overflows float32 but not the float64 the squares are summed in.
    big = np.float32(1e20)
    norms = layer_norms(["x.w"], [np.array([big, big], np.float32)])
    assert norms == {"x": pytest.approx(float(big) * 2**0.5, rel=1e-15)}


def test_every_numbered_component_counts_whatever_its_case():
    assert _numbered("layers.3.sub.1.w") == [("layers.3", "layers.", 3), ("layers.3.sub.1", "layers.3.sub.", 1)]
    assert _numbered("Block2.Dense10.W") == [("Block2", "Block", 2), ("Block2.Dense10", "Block2.Dense", 10)]


def test_the_common_prefix_is_cut_at_its_last_separator():
    assert layer_groups(["model.enc.layers.0.w", "model.enc.layers.1.w"]) == ({"0": [0], "1": [1]}, ["0", "1"])
    gluon = ["net0_block_dense0_weight", "net0_block_dense1_weight"]
    assert layer_groups(gluon) == ({"dense0": [0], "dense1": [1]}, ["dense0", "dense1"])
    assert layer_groups(["net.a.w", "net.b.w"]) == ({"a": [0], "b": [1]}, [])  # two names share a prefix too


def test_the_parameters_of_a_block_s_sub_layers_belong_to_the_block():
    names = ["layers.0.attn.w", "layers.0.mlp.w", "layers.1.attn.w", "head.w"]
    assert layer_groups(names) == ({"layers.0": [0, 1], "layers.1": [2], "head": [3]}, ["layers.0", "layers.1"])
