"""A JAX loss function reaches accumcheck.jax.check from the places that route a user's model by
its framework: the pytest plugin's ``accum_check`` and ``accumcheck check FILE.py``. A loss
function is told by its parameters' arrays, since a Python function names no framework."""

import textwrap

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
import accumcheck.jax  # noqa: E402
from accumcheck.errors import AccumcheckError  # noqa: E402
from accumcheck.run.setupfile import user_check  # noqa: E402

MODEL = textwrap.dedent('''
    import jax
    import jax.numpy as jnp
    import numpy as np


    def loss_fn(params, batch):
        x, y = batch
        h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
        logits = h @ params["out"]["kernel"]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


    def make_params():
        k = jax.random.split(jax.random.PRNGKey(0), 2)
        return {"dense": {"kernel": jax.random.normal(k[0], (8, 16)) * 0.3, "bias": jnp.zeros(16)},
                "out": {"kernel": jax.random.normal(k[1], (16, 4)) * 0.3}}


    def make_batches(count=32):
        rng = np.random.default_rng(0)
        return [(rng.standard_normal((6, 8)).astype(np.float32), rng.integers(0, 4, 6).astype(np.int32))
                for _ in range(count)]
''')


def _model():
    namespace: dict = {}
    exec(MODEL, namespace)
    return namespace["loss_fn"], namespace["make_params"](), namespace["make_batches"]()


def test_a_loss_function_of_jax_arrays_is_routed_to_jax():
    loss_fn, params, _ = _model()
    assert user_check(loss_fn, "accum_check", params) == ("jax", accumcheck.jax.check)
    assert user_check(loss_fn, "accum_check", ((), [{}, params]))[0] == "jax"  # haiku-like lists, tuples


def test_a_function_of_numpy_arrays_is_refused_in_one_line():
    loss_fn, params, _ = _model()
    host = {"dense": {"kernel": np.ones((8, 16), np.float32)}}
    for args in ((loss_fn, "accum_check", host), (loss_fn, "accum_check")):
        with pytest.raises(AccumcheckError) as raised:
            user_check(*args)
        assert "function is not a model of a framework accumcheck checks here" in str(raised.value)
        assert "or a loss function with its jax parameters" in str(raised.value) and "\n" not in str(raised.value)


def test_accum_check_runs_a_jax_loss_function_at_each_step_count(pytester):
    pytester.makepyfile(model=MODEL)
    pytester.makepyfile(test_user=textwrap.dedent('''
        from model import loss_fn, make_batches, make_params


        def test_faithful(accum_check, accum_steps):
            report = accum_check(loss_fn, make_params(), make_batches())
            assert report.exit_code == 0 and report.accum_steps == accum_steps
            assert report.framework == "jax" and len(report.tensors) == 3


        def test_fault_is_caught(accum_check):
            report = accum_check(loss_fn, make_params(), make_batches(), inject="scale:out.kernel")
            assert report.exit_code == 1 and [t.name for t in report.flagged] == ["out.kernel"]
    '''))
    result = pytester.runpytest_subprocess("--accum-steps", "4,8", "-q")
    result.assert_outcomes(passed=4)


def test_check_file_with_a_loss_function(tmp_path, cli):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "setup_jax.py").write_text(textwrap.dedent('''
        from model import loss_fn, make_batches, make_params


        def accumcheck_setup():
            return {"loss_fn": loss_fn, "params": make_params(), "batches": make_batches()}
    '''))
    done = cli("check", str(tmp_path / "setup_jax.py"), "--accum-steps", "8", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: all 3 tensors faithful" in done.stdout
    wrong = cli("check", str(tmp_path / "setup_jax.py"), "--accum-steps", "8", "--memory-budget", "1000", cwd=tmp_path)
    assert wrong.returncode == 2 and "--memory-budget is not an argument of accumcheck.jax.check" in wrong.stderr
