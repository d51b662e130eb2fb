import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TORCH = importlib.util.find_spec("torch") is not None


def run_cli(*args: str, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the installed ``accumcheck`` console script (through this interpreter's environment)."""
    exe = os.path.join(os.path.dirname(sys.executable), "accumcheck")
    return subprocess.run([exe, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install 'accumcheck[torch]')")


@pytest.fixture
def cli():
    return run_cli
