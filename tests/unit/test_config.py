"""One run configuration: options checked once, combinations refused centrally by the backends'
declared capabilities, and a reproduce line that rebuilds the same configuration."""

from __future__ import annotations

import importlib.metadata

import pytest

from accumcheck.cli import build_parser
from accumcheck.errors import AccumcheckError
from accumcheck.options.spec import RUN_OPTIONS, command_line
from accumcheck.run import registry
from accumcheck.run.config import RunConfig
from accumcheck.run.validation import configure


def _skip_where_not_installed(options):
    for name in str(options.get("framework", "torch")).split(","):
        if name in registry.backend_names() and not registry.get_backend(name, installed=False).available():
            pytest.skip(f"{name} is not installed")


def test_a_config_is_resolved_and_frozen():
    config = configure({"case": "shared-weight", "seed": 4, "inject": "scale", "loss_reduction": "sum"})
    assert isinstance(config, RunConfig)
    assert config.frameworks == ("torch",)  # the first installed backend by preference
    assert config.accum_steps == 16 and config.case.seed == 4 and config.case.loss_reduction == "sum"
    assert str(config.fault) == "scale:shared.weight@8"
    with pytest.raises(AttributeError):
        config.device = "gpu"


@pytest.mark.parametrize("options, message", [
    ({"framework": "mxnet", "dtype": "bfloat16"}, "--dtype bfloat16: not available with the mxnet backend (it runs "
                                                  "float32 and float16: MXNet 1.x has no bfloat16 kernels for "
                                                  "these operators); use --framework jax or torch"),
    ({"framework": "mxnet", "case": "conditional-branch", "full_batch": True}, "routes each micro-batch through "
                                                                              "its conditional layers"),
    ({"framework": "mxnet", "world_size": 2}, "--world-size 2: not available with the mxnet backend"),
    ({"framework": "torch", "hybridize": False}, "--no-hybridize: an option of the mxnet backend; --framework torch "
                                                 "has no such option"),
    ({"framework": "torch,mxnet", "dtype": "float16"}, "--dtype float16: works with one framework at a time"),
    ({"framework": "torch,mxnet", "grad_norms": "runs"}, "--grad-norms runs: works with one framework at a time"),
    ({"world_size": 2, "mode": "accumulator"}, "--mode accumulator: not available with --world-size on the torch "
                                               "backend"),
    ({"reduce_dtype": "bfloat16"}, "--reduce-dtype bfloat16: applies to data-parallel runs; add --world-size W"),
    ({"world_size": 2, "inject_rank": 1}, "--inject-rank 1: names the rank of an --inject fault; add --inject KIND"),
    ({"world_size": 2, "inject": "scale", "inject_rank": 2}, "--inject-rank 2: ranks are 0..1"),
    ({"case": "conditional-branch", "full_batch": True}, "routes each micro-batch through its conditional layers"),
    ({"accum_steps": 0}, "--accum-steps: 0 is not a positive integer (e.g. 32)"),
    ({"seed": -1}, "--seed: -1 is not a seed (an integer from 0 to 2**32 - 1, e.g. 0)"),
    ({"dtype": "float8"}, "--dtype: 'float8' is not one of float32, bfloat16, float16"),
    ({"device": "tpu"}, "--device: unknown device 'tpu'; use cpu, gpu, cuda or cuda:N"),
    ({"framework": "tensorflow"}, "--framework: unknown framework 'tensorflow'; choose one of jax, mxnet, torch"),
    ({"inject": "double-step", "accum_steps": 1}, "--inject double-step needs --accum-steps 2 or more"),
    ({"colour": "red"}, "unknown option 'colour'; the options are framework, device, case"),
])
def test_what_cannot_run_is_refused_once_in_one_line(options, message):
    _skip_where_not_installed(options)
    with pytest.raises(AccumcheckError) as info:
        configure(options)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("options", [
    {"case": "shared-weight"},
    {"case": "tiny-grads", "framework": "torch", "accum_steps": 8, "seed": 3, "oracle": True, "inject": "drop-step"},
    {"case": "padded-tokens", "full_batch": True, "loss_reduction": "token_count", "dtype": "bfloat16",
     "accum_dtype": "float64"},
    {"case": "embed-attention", "mode": "compensated", "dtype": "float16"},
    {"case": "shared-weight", "world_size": 2, "reduce_dtype": "float16", "inject": "scale:out.bias", "inject_rank": 1},
    {"case": "transformer-small", "framework": "mxnet", "hybridize": False, "device": "cpu"},
    {"case": "embed-attention", "framework": "torch,mxnet", "hybridize": True},
])
def test_the_reproduce_line_rebuilds_the_same_configuration(options):
    _skip_where_not_installed(options)
    config = configure(options)
    line = command_line(config.record())
    args = build_parser().parse_args(line.split()[1:])
    again = configure({name: getattr(args, name) for name in [o.name for o in RUN_OPTIONS] + ["hybridize"]
                       if hasattr(args, name)})
    assert again.record() == config.record()
    assert again == config


def test_the_reproduce_line_says_what_matters_and_nothing_else():
    line = command_line(configure({"case": "shared-weight", "inject": "scale"}).record())
    assert line == ("accumcheck compare --framework torch --device cpu --case shared-weight --accum-steps 16 "
                    "--seed 0 --inject scale:shared.weight")
    full = command_line(configure({"case": "padded-tokens", "full_batch": True}).record())
    assert full.endswith("--full-batch --loss-reduction mean")  # the normalisation it judged


def test_the_builtin_backends_are_found_from_a_source_checkout_too(monkeypatch):
    def nowhere(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", nowhere)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(registry, "_instances", {})
    registry._entry_points.cache_clear()
    try:
        assert registry.backend_names() == ["jax", "mxnet", "torch"]
        assert registry.get_backend("torch", installed=False).name == "torch"
    finally:
        registry._entry_points.cache_clear()


def test_the_default_framework_is_the_installed_one_preferred(monkeypatch):
    torch = registry.get_backend("torch", installed=False)
    assert registry.default_backend() == "torch"
    monkeypatch.setattr(type(torch), "available", lambda self: False)
    assert registry.default_backend() == "mxnet"
