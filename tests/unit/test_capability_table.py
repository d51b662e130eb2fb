"""docs/mxnet.md's table of what each backend takes says what their Capabilities declare."""

from pathlib import Path

import pytest

from accumcheck.run.registry import get_backend

DOC = Path(__file__).resolve().parents[2] / "docs" / "mxnet.md"
# table row -> the Capabilities field it shows (train's row is docs/trajectory.md's to say)
ROWS = {"`--dtype`": "dtypes", "`--accum-dtype`": "accum_dtypes", "`--mode`": "modes", "`--oracle`": "oracle",
        "`--full-batch`": "full_batch", "`--memory-budget`": "memory_budget", "`--world-size`": "data_parallel"}


def _table(doc: Path = DOC, heading: str = "## What MXNet runs here") -> dict[str, list[str]]:
    text = doc.read_text().split(heading, 1)[1]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]
    return {row[0]: row[1:] for row in rows}


def _shown(cell: str):
    return {"yes": True, "no": False}.get(cell, tuple(v.strip() for v in cell.split(",")))


@pytest.mark.parametrize("row, field", ROWS.items())
def test_each_row_is_what_the_backends_declare(row, field):
    table = _table()
    assert row in table, f"docs/mxnet.md has no row {row}"
    torch, mxnet, why = table[row]
    for cell, name in ((torch, "torch"), (mxnet, "mxnet")):
        declared = getattr(get_backend(name, installed=False).capabilities, field)
        assert _shown(cell) == declared, (row, name, cell, declared)
    # a gap says why; where MXNet takes all PyTorch does, the column is empty or a remark in parentheses
    if _shown(mxnet) != _shown(torch):
        assert why and not why.startswith("("), (row, why)
    else:
        assert not why or why.startswith("("), (row, why)


@pytest.mark.parametrize("row, field", ROWS.items())
def test_docs_jax_table_is_what_the_jax_backend_declares(row, field):
    table = _table(DOC.parent / "jax.md", "## What JAX runs here")
    assert row in table, f"docs/jax.md has no row {row}"
    torch, jax, why = table[row]
    for cell, name in ((torch, "torch"), (jax, "jax")):
        declared = getattr(get_backend(name, installed=False).capabilities, field)
        assert _shown(cell) == declared, (row, name, cell, declared)
    assert bool(why) == (_shown(jax) != _shown(torch)), (row, why)
