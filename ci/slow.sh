#!/usr/bin/env bash
# The long checks, after the test suite (uses the .venv the README's test command built):
# every figure the README and docs/ quote, regenerated from its runs and compared with the text,
# in one process (-p no:xdist): the figures' runs are timed and measured with the machine to
# themselves. Then, on a pytest-xdist worker per core as the default suite: the heaviest checks of
# users' own models (every fault on the ResNets and the Llama, the test files of the README and
# examples/ run as written), the reproduction scripts of every built-in case and fault at the
# case's own N in both frameworks, torchrun, every data-parallel stack and fault of accumcheck
# stack --world-size 2 not in the default suite, JAX's every fault on every case and three
# frameworks on every case, the judge's parallel kernel compiled into a fresh cache; and the
# property tests with the long hypothesis profile (2,000 examples per property, drawn afresh at
# every run; `--hypothesis-profile thorough`, 10,000 each, is for a run by hand).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -p no:xdist -m slow -v -p no:cacheprovider tests/unit/test_figures.py
.venv/bin/python -m pytest -m slow -v -p no:cacheprovider tests/frameworks/mxnet/test_mxnet_user_models.py \
    tests/frameworks/torch/test_user_models.py tests/e2e/test_readme_examples.py \
    tests/frameworks/torch/test_accumulator.py tests/frameworks/torch/test_torch_repro.py \
    tests/frameworks/mxnet/test_mxnet_repro.py tests/frameworks/torch/test_distributed.py \
    tests/frameworks/jax/test_jax_backend.py tests/frameworks/jax/test_jax_check.py tests/unit/test_kernel.py \
    tests/frameworks/torch/test_data_parallel_stacks.py
.venv/bin/python -m pytest --hypothesis-profile long -v -p no:cacheprovider --durations=0 tests/unit/test_properties.py
