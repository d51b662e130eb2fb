"""The README's commands are the ones CI runs."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line and not line.startswith(("#", "set ", "cd ", "export ", "bash ci/"))]
    assert len(ci_lines) == 1, ci_lines
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, flags=re.S)
    assert any(ci_lines[0] in block.splitlines() for block in blocks), ci_lines[0]
    assert "pytest" in ci_lines[0]


def test_ci_scripts_it_calls_exist():
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        if line.startswith("bash ci/"):
            assert (ROOT / line.split()[1]).is_file(), line


def test_every_subpackage_is_packaged():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "accumcheck").rglob("__init__.py")}
    assert found <= listed, found - listed  # a wheel would leave the others out
