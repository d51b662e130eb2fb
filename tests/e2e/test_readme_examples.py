"""The README's test files for your own model run as written, under `pytest --accum-steps 16,32`."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n(# (test_\w+\.py): pytest --accum-steps 16,32\n.*?)```", re.S)


def readme_tests():
    return {name: code for code, name in BLOCK.findall((ROOT / "README.md").read_text())}


def test_the_readme_has_both_test_files():
    assert sorted(readme_tests()) == ["test_my_llama.py", "test_my_resnet.py"]


@pytest.mark.slow  # tens of seconds: run by ci/slow.sh
@pytest.mark.parametrize("name, needs", [("test_my_llama.py", "transformers"), ("test_my_resnet.py", "mxnet")])
def test_a_readme_test_file_passes_at_16_and_32(pytester, name, needs):
    pytest.importorskip(needs)
    pytester.makepyfile(**{name[:-3]: readme_tests()[name]})
    result = pytester.runpytest_subprocess("--accum-steps", "16,32", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
