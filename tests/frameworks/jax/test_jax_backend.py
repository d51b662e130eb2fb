"""The JAX backend on the built-in cases: optax.MultiSteps' accumulator against a tree_map buffer.

Every built-in case at N = 16 and 32 is judged faithful by tests/e2e/test_accumulation.py (which
runs on every installed framework); here: what is JAX's own."""

import numpy as np
import pytest
from conftest import run_cli

import accumcheck
from accumcheck.case.reading import builtin_case_names
from accumcheck.errors import AccumcheckError

jax = pytest.importorskip("jax")
pytest.importorskip("optax")

from accumcheck.jax.multisteps import MultiStepsNative, mean_allowance  # noqa: E402

FAULTS = ("drop-step", "repeat-step", "double-step", "scale", "bf16")


def _fault_cases(fast: tuple[str, ...]) -> list:
    return [pytest.param(case, marks=() if case in fast else pytest.mark.slow) for case in builtin_case_names()]


@pytest.mark.parametrize("case", _fault_cases(("conditional-branch",)))
@pytest.mark.parametrize("fault", FAULTS)
def test_every_fault_is_flagged_on_the_injected_tensor(case, fault):
    report = accumcheck.compare(case, framework="jax", accum_steps=16, inject=fault)
    target = report.inject.split(":")[1].split("@")[0]
    assert report.exit_code == 1
    assert [t.name for t in report.flagged] == [target]


@pytest.mark.parametrize("case", _fault_cases(("padded-tokens",)))
def test_a_valid_reordering_is_not_a_bug(case):
    report = accumcheck.compare(case, framework="jax", accum_steps=16, inject="roundoff")
    assert report.exit_code == 0, [(t.name, t.verdict, t.ratio) for t in report.flagged]


def test_a_running_sum_is_bit_for_bit_the_manual_buffer():
    report = accumcheck.compare("embed-attention", framework="jax", accum_steps=16, grad_mean=False)
    assert report.settings["use_grad_mean"] is False
    assert all(t.verdict == "identical" for t in report.tensors)
    assert report.bound["native"]["kernel_allowance"] == 0.0


def test_the_running_mean_differs_by_round_off_inside_its_allowance():
    report = accumcheck.compare("embed-attention", framework="jax", accum_steps=32)
    assert report.exit_code == 0 and any(t.verdict == "round-off" for t in report.tensors)
    assert report.bound["native"]["kernel_allowance"] == pytest.approx(mean_allowance(32))
    assert max(t.ratio_native for t in report.tensors) < 0.5
    assert any("running mean" in note for note in report.notes)


def test_the_mean_allowance_is_derived_not_tuned():
    # 3 + 3 H_{N-1}, one more where N x the mean rounds (N not a power of two)
    assert mean_allowance(2) == pytest.approx(6.0)
    assert mean_allowance(3) == pytest.approx(3 + 3 * 1.5 + 1)
    assert mean_allowance(32) == pytest.approx(3 + 3 * sum(1 / k for k in range(1, 32)))


def test_multisteps_totals_are_its_accumulator():
    """MultiStepsNative reads MultiSteps' own sum: against a plain loop over optax written here."""
    import jax.numpy as jnp
    import optax

    rng = np.random.default_rng(0)
    grads = [{"w": jnp.asarray(rng.standard_normal(5).astype(np.float32))} for _ in range(6)]
    params = {"w": jnp.zeros(5, jnp.float32)}
    native = MultiStepsNative(params, 6, grad_mean=True, jit=False)
    for k, g in enumerate(grads):
        native.add(k, g)
    optimizer = optax.MultiSteps(optax.sgd(1.0), every_k_schedule=6)
    state = optimizer.init(params)
    for g in grads:
        updates, state = optimizer.update(g, state, params)
    expected = -np.asarray(updates["w"]) * np.float32(6)
    assert np.array_equal(native.totals()["w"], expected)


def test_no_jit_gives_the_same_verdicts():
    jit = accumcheck.compare("conditional-branch", framework="jax", accum_steps=16)
    eager = accumcheck.compare("conditional-branch", framework="jax", accum_steps=16, jit=False)
    assert eager.settings["jit"] is False and "op by op (no jit)" in eager.notes
    assert [(t.name, t.verdict) for t in eager.tensors] == [(t.name, t.verdict) for t in jit.tensors]


@pytest.mark.slow
def test_a_float64_buffer_leaves_the_global_64_bit_mode_off():
    before = jax.config.jax_enable_x64
    report = accumcheck.compare("padded-tokens", framework="jax", accum_steps=16, accum_dtype="float64", oracle=True)
    assert report.accum_dtype == "float64" and report.exit_code == 0
    assert all(t.oracle_err_manual is not None for t in report.tensors)
    assert jax.config.jax_enable_x64 == before


@pytest.mark.slow
def test_bfloat16_multisteps_is_precision_loss_in_float32_ulps():
    report = accumcheck.compare("transformer-small", framework="jax", dtype="bfloat16")
    assert report.param_dtype == "bfloat16" and report.exit_code == 1
    assert all(t.verdict == "precision-loss" for t in report.flagged) and len(report.flagged) >= 30
    assert min(t.err_ulps_native for t in report.flagged) > 1e3  # float32 ulps
    assert not any(t.over_bound_manual for t in report.tensors)  # the float32 buffer: round-off only
    assert max(t.err_ulps_manual for t in report.tensors) <= 32  # at most N float32 ulps
    assert any("accumulator takes the parameters' dtype (bfloat16)" in note for note in report.notes)


@pytest.mark.slow  # two bfloat16 runs with the second pass: about 20 s (ci/slow.sh runs it)
@pytest.mark.parametrize("grad_mean, kind, words", [(True, "narrow-mean", "mean kept in bfloat16"),
                                                    (False, "narrow-dtype", "sum kept in bfloat16")])
def test_bfloat16_accumulator_is_named_as_what_it_keeps(grad_mean, kind, words):
    report = accumcheck.compare("embed-attention", framework="jax", dtype="bfloat16", grad_mean=grad_mean)
    assert report.exit_code == 1 and report.flagged
    for t in report.flagged:
        assert (t.cause.kind, t.cause.mode, t.cause.words) == (kind, "native", words) and t.cause.fit > 0.999, t.name


def test_float32_master_weights_fix_it():
    report = accumcheck.compare("embed-attention", framework="jax", dtype="bfloat16", master_weights=True)
    assert report.exit_code == 0 and report.param_dtype == "float32"
    assert any("master weights" in note for note in report.notes)


def test_refusals_are_one_line(cli):
    for args, message in [
        (["--master-weights", "--case", "tiny-grads"], "--master-weights: float32 parameters are their own"),
        (["--mode", "compensated"], "--mode compensated: not available with the jax backend"),
        (["--full-batch"], "--full-batch: not available with the jax backend"),
        (["--dtype", "float16"], "--dtype float16: not available with the jax backend"),
    ]:
        result = cli("compare", "--framework", "jax", *args)
        assert result.returncode == 2, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr


def test_a_gpu_is_refused_cleanly_where_jax_sees_none():
    from accumcheck.jax.devices import has_gpu

    if has_gpu():
        pytest.skip("jax sees a GPU here")
    with pytest.raises(AccumcheckError, match="--device gpu: jax .* sees no GPU"):
        accumcheck.compare("tiny-grads", framework="jax", device="gpu")


@pytest.mark.gpu
def test_on_the_gpu():
    from accumcheck.jax.devices import has_gpu

    if not has_gpu():
        pytest.skip("jax sees no GPU")
    report = accumcheck.compare("transformer-small", framework="jax", device="gpu", accum_steps=16)
    assert report.exit_code == 0 and report.device.startswith("gpu")


def test_the_cli_runs_it():
    result = run_cli("compare", "--framework", "jax", "--case", "shared-weight", "--accum-steps", "16")
    assert result.returncode == 0, result.stderr
    assert "jax on cpu" in result.stdout and "faithful" in result.stdout


@pytest.mark.parametrize("case", _fault_cases(("shared-weight",)))
def test_three_frameworks_agree_on_every_case(case):
    pytest.importorskip("torch")
    pytest.importorskip("mxnet")
    cross = accumcheck.compare(case, framework="torch,mxnet,jax", accum_steps=16)
    assert cross.frameworks == ["torch", "mxnet", "jax"]
    assert cross.exit_code == 0 and not cross.flagged and not cross.odd_frameworks
    pairs = {tuple(a.frameworks) for a in cross.agreement}
    assert pairs == {("torch", "mxnet"), ("torch", "jax"), ("mxnet", "jax")}
    assert all(a.ratio <= 1.0 for a in cross.agreement)


def test_a_jax_that_computes_another_function_is_named(monkeypatch):
    """Negative control for the agreement: JAX's dense layer off by one part in 10^4."""
    pytest.importorskip("torch")
    pytest.importorskip("mxnet")
    from accumcheck.jax import casemodel as model

    dense = model.JaxOps.dense
    monkeypatch.setattr(model, "_COMPILED", {})  # functions compiled before the patch would not see it
    monkeypatch.setattr(model.JaxOps, "dense", lambda self, x, w, b, units: dense(self, x, w * 1.0001, b, units))
    cross = accumcheck.compare("shared-weight", framework="torch,mxnet,jax", accum_steps=16)
    assert cross.exit_code == 1
    assert set(cross.odd_frameworks.values()) == {"jax"} and cross.odd_frameworks
