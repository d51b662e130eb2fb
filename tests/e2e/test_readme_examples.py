"""The README's examples are tested programs: its test file for your own model and
examples/test_gluon_resnet.py run as written under `pytest --accum-steps 16,32`, and every other
Python block of the README is an excerpt of a program in examples/ that ci/figures.py runs."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PYTHON = re.compile(r"```python\n(.*?)```", re.S)
TEST_FILE = re.compile(r"# (test_\w+\.py): pytest --accum-steps 16,32\n")
EXCERPT = re.compile(r"# (examples/\w+\.py) \(excerpt\)\n")


def readme_blocks():
    return PYTHON.findall(README.read_text())


def readme_tests():
    return {m.group(1): code for code in readme_blocks() if (m := TEST_FILE.match(code))}


def program_files():
    """Each test file by name, with its code: the README's and those in examples/."""
    files = dict(readme_tests())
    files["test_gluon_resnet.py"] = (ROOT / "examples" / "test_gluon_resnet.py").read_text()
    return files


def excerpt_lines(code: str) -> list[str]:
    """An excerpt's lines as the program holds them: stripped, with ``...`` (the elided lines) left out."""
    return [line.strip() for line in code.splitlines()[1:] if line.strip() not in ("", "...")]


def is_in_order(lines: list[str], program: list[str]) -> bool:
    position = iter(program)
    return all(line in position for line in lines)  # each found after the one before it


def test_every_python_block_of_the_readme_is_tested():
    blocks = readme_blocks()
    assert sorted(readme_tests()) == ["test_my_llama.py"]
    excerpts = [block for block in blocks if EXCERPT.match(block)]
    assert len(excerpts) == 4  # one per training stack
    assert len(blocks) == len(readme_tests()) + len(excerpts), "a README block that is neither a test file nor an excerpt"
    # What a program prints is quoted in docs/ as a console figure, which ci/figures.py regenerates by running it.
    consoles = "".join(m.group(1) for page in (ROOT / "docs").rglob("*.md")
                       for m in re.finditer(r"<!--fig [\w.\-]+-->(.*?)<!--/fig-->", page.read_text(), re.S))
    for block in excerpts:
        path = EXCERPT.match(block).group(1)
        program = [line.strip() for line in (ROOT / path).read_text().splitlines()]
        assert is_in_order(excerpt_lines(block), program), f"the README's excerpt of {path} is not in it"
        assert re.search(rf"(\$|&&) python {path}\b", consoles), f"no console figure in docs/ runs {path}"


def test_an_excerpt_that_left_its_program_is_caught():
    """Negative control: a line the program does not hold, or lines out of order, fail."""
    program = ["check = AccumulationCheck()", "with check:", "report = check.report"]
    assert is_in_order(["check = AccumulationCheck()", "report = check.report"], program)
    assert not is_in_order(["check = AccumulationCheck(steps=3)", "report = check.report"], program)
    assert not is_in_order(["report = check.report", "with check:"], program)


@pytest.mark.slow  # tens of seconds: run by ci/slow.sh
@pytest.mark.parametrize("name, needs", [("test_my_llama.py", "transformers"), ("test_gluon_resnet.py", "mxnet")])
def test_a_test_file_passes_at_16_and_32(pytester, name, needs):
    pytest.importorskip(needs)
    pytester.makepyfile(**{name[:-3]: program_files()[name]})
    result = pytester.runpytest_subprocess("--accum-steps", "16,32", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
