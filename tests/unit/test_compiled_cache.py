"""accumcheck.judge.compiled.njit: a kernel whose cache file cannot be written (a full disk) still
runs, where numba's own njit ends the call with the OSError."""

from __future__ import annotations

import errno
import importlib.util
import sys

import numba
import pytest
from numba.core import caching

from accumcheck.judge.compiled import njit

SOURCE = "def add_one(x):\n    return x + 1\n"


@pytest.fixture
def full_disk(monkeypatch, tmp_path):
    """Every numba cache file write fails as on a full disk; a fresh source file per test, so
    nothing is cached yet."""
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "cache"))

    def no_space(self, key, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(caching.IndexDataCacheFile, "save", no_space)
    path = tmp_path / "kernels_for_cache_test.py"
    path.write_text(SOURCE)
    spec = importlib.util.spec_from_file_location("kernels_for_cache_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module.add_one
    sys.modules.pop(spec.name, None)


def test_a_cache_that_cannot_be_written_does_not_end_the_run(full_disk):
    assert njit()(full_disk)(41) == 42


def test_numbas_own_njit_ends_the_call_there(full_disk):
    with pytest.raises(OSError, match="No space left"):  # what the wrapper is for
        numba.njit(cache=True)(full_disk)(41)
