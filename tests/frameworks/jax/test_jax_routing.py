"""JAX parameters reach accumcheck.jax.check from the places that route a user's model by its
framework: the pytest plugin's ``accum_check`` and ``accumcheck check FILE.py``. They are told by
their arrays, since a pytree of dicts and a Python function name no framework."""

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


def test_jax_parameters_are_routed_to_jax_and_so_is_the_former_order():
    loss_fn, params, _ = _model()
    assert user_check(params, "accum_check") == ("jax", accumcheck.jax.check)
    assert user_check(((), [{}, params]), "accum_check")[0] == "jax"  # haiku-like lists, tuples
    assert user_check(loss_fn, "accum_check", params)[0] == "jax"  # whose check names the order it takes


def test_numpy_parameters_and_a_lone_function_are_refused_in_one_line():
    loss_fn, params, _ = _model()
    host = {"dense": {"kernel": np.ones((8, 16), np.float32)}}
    for args, name in (((host, "accum_check"), "dict"), ((loss_fn, "accum_check", host), "function"),
                       ((loss_fn, "accum_check"), "function")):
        with pytest.raises(AccumcheckError) as raised:
            user_check(*args)
        assert f"{name} is not a model of a framework accumcheck checks here" in str(raised.value)
        assert "or the jax parameters of a loss function" in str(raised.value) and "\n" not in str(raised.value)


def test_accum_check_runs_a_jax_loss_function_at_each_step_count(pytester):
    pytester.makepyfile(model=MODEL)
    pytester.makepyfile(test_user=textwrap.dedent('''
        from model import loss_fn, make_batches, make_params


        def test_faithful(accum_check, accum_steps):
            report = accum_check(make_params(), loss_fn, make_batches())
            assert report.exit_code == 0 and report.accum_steps == accum_steps
            assert report.framework == "jax" and len(report.tensors) == 3


        def test_fault_is_caught(accum_check):
            report = accum_check(make_params(), loss_fn, make_batches(), inject="scale:out.kernel")
            assert report.exit_code == 1 and [t.name for t in report.flagged] == ["out.kernel"]


        def test_no_budget_is_given_to_a_check_that_cannot_honour_it(accum_check):
            assert accum_check(make_params(), loss_fn, make_batches()).exit_code == 0


        def test_the_former_order_is_refused_naming_the_new_one(accum_check):
            accum_check(loss_fn, make_params(), make_batches())
    '''))
    result = pytester.runpytest_subprocess("--accum-steps", "4,8", "--accum-memory-budget", "1G", "-q")
    result.assert_outcomes(passed=6, errors=2)
    result.stdout.fnmatch_lines(["*accumcheck.jax.check takes check(params, loss_fn, batches)*"])


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
    assert wrong.returncode == 2, wrong.stderr
    assert wrong.stderr.strip() == ("accumcheck: error: check: accumcheck.jax.check cannot honour memory_budget=1000 "
                                    "(it runs every parameter at once); leave it out")
