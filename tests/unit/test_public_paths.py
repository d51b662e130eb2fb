"""``accumcheck.<framework>`` is the framework's package itself, found without a table entry."""

import importlib
from pathlib import Path

import pytest

import accumcheck.frameworks as frameworks

PACKAGES = sorted(p.parent.name for p in Path(frameworks.__file__).parent.glob("*/__init__.py"))


def test_every_framework_package_is_here():
    assert {"torch", "mxnet", "jax"} <= set(PACKAGES)


@pytest.mark.parametrize("name", PACKAGES)
def test_the_public_path_is_the_same_module(name):
    assert importlib.import_module(f"accumcheck.{name}") is importlib.import_module(f"accumcheck.frameworks.{name}")


@pytest.mark.parametrize("name", ["accumcheck.nope", "accumcheck.hostsums", "accumcheck.__pycache__"])
def test_other_names_are_not_found(name):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(name)
