"""accumcheck.jax.check on JAX models written here as people write them (flax-like nested dicts,
haiku-like dicts with lists): faithful at N = 16, every fault kind flagged on the injected tensor
and only there, bfloat16 parameters losing precision in MultiSteps' own accumulator, and the
user's params, batches and JAX's x64 flag left as found."""

import random
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from attribution_checks import assert_explained  # noqa: E402

import accumcheck  # noqa: E402
import accumcheck.jax  # noqa: E402
from accumcheck.jax.multisteps import accumulator_dtype  # noqa: E402
from accumcheck.options.choices import FAULT_KINDS

N = 16
FAULTS = [kind for kind in FAULT_KINDS if kind != "roundoff"]
FAITHFUL = {"round-off", "identical"}


def mlp_params(dtype=jnp.float32):
    """A flax-like variables dict: {"params": {"Dense_0": {"kernel", "bias"}, ...}}."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    tree = {"params": {"Dense_0": {"kernel": jax.random.normal(k[0], (8, 16)) * 0.3,
                                   "bias": jax.random.normal(k[1], (16,)) * 0.1},
                       "LayerNorm_0": {"scale": jnp.ones(16), "bias": jnp.zeros(16)},
                       "Dense_1": {"kernel": jax.random.normal(k[2], (16, 4)) * 0.3, "bias": jnp.zeros(4)}}}
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), tree)


def mlp_loss(params, batch):
    x, y = batch
    p = params["params"]
    h = jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    mean = h.mean(-1, keepdims=True)
    h = (h - mean) / jnp.sqrt(((h - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    h = h * p["LayerNorm_0"]["scale"] + p["LayerNorm_0"]["bias"]
    logits = h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))


def mlp_batches(count=N):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((6, 8)).astype(np.float32), rng.integers(0, 4, 6).astype(np.int32))
            for _ in range(count)]


def embed_params():
    """A haiku-like dict with a list of layers: names embed.embeddings, layers.0.w, ..."""
    k = jax.random.split(jax.random.PRNGKey(1), 3)
    return {"embed": {"embeddings": jax.random.normal(k[0], (20, 8)) * 0.5},
            "layers": [{"w": jax.random.normal(k[1], (8, 8)) * 0.3, "b": jnp.zeros(8)},
                       {"w": jax.random.normal(k[2], (8, 3)) * 0.3, "b": jnp.zeros(3)}]}


def embed_loss(params, batch):
    tokens, labels = batch["tokens"], batch["labels"]
    h = jnp.take(params["embed"]["embeddings"], tokens, axis=0)
    first, last = params["layers"]
    h = jax.nn.gelu(h @ first["w"] + first["b"])
    logits = h @ last["w"] + last["b"]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1)
    return -jnp.mean(picked)


def embed_batches(count=N):
    rng = np.random.default_rng(1)
    return [{"tokens": rng.integers(0, 20, (4, 6)).astype(np.int32), "labels": rng.integers(0, 3, (4, 6)).astype(np.int32)}
            for _ in range(count)]


def snapshot(tree):
    """Every leaf's dtype, shape and bytes: a bitwise picture."""
    return [(str(leaf.dtype), leaf.shape, np.asarray(leaf).tobytes()) for leaf in jax.tree_util.tree_leaves(tree)]


def verdicts(report):
    return {t.name: t.verdict for t in report.tensors}


def flagged(report):
    return [t.name for t in report.flagged]


def test_a_flax_like_mlp_is_faithful_and_its_tensors_are_named_from_their_paths():
    report = accumcheck.jax.check(mlp_params(), mlp_loss, mlp_batches(), accum_steps=N)
    assert report.exit_code == 0 and set(verdicts(report).values()) <= FAITHFUL, verdicts(report)
    accumcheck.assert_faithful(report)
    assert {t.name: t.kind for t in report.tensors} == {
        "params.Dense_0.bias": "bias", "params.Dense_0.kernel": "weight", "params.Dense_1.bias": "bias",
        "params.Dense_1.kernel": "weight", "params.LayerNorm_0.bias": "norm", "params.LayerNorm_0.scale": "norm"}
    assert report.framework == "jax" and report.param_dtype == "float32" and report.accum_dtype == "float32"
    assert report.accum_steps == N and report.config == {"model": "mlp_loss", "loss": "loss_fn(params, batch)"}
    assert report.reproduce_command() == f"accumcheck.jax.check(params, <your mlp_loss>, batches, accum_steps={N})"
    assert "every_k_schedule=16" in report.settings["native"] and "mlp_loss" in report.reproduce_command()


def test_an_embedding_model_with_a_list_of_layers_is_faithful():
    report = accumcheck.jax.check(embed_params(), embed_loss, embed_batches())
    assert report.exit_code == 0 and set(verdicts(report).values()) <= FAITHFUL, verdicts(report)
    assert {t.name: t.kind for t in report.tensors} == {
        "embed.embeddings": "embedding", "layers.0.b": "bias", "layers.0.w": "weight", "layers.1.b": "bias",
        "layers.1.w": "weight"}


@pytest.mark.parametrize("kind", FAULTS)
def test_every_fault_is_flagged_on_the_injected_tensor_only(kind):
    report = accumcheck.jax.check(embed_params(), embed_loss, embed_batches(), inject=f"{kind}:layers.0.w")
    assert flagged(report) == ["layers.0.w"], (kind, verdicts(report))
    assert report.exit_code == 1 and report.inject.startswith(f"{kind}:layers.0.w")
    if kind != "bf16":  # MultiSteps' running mean rounded to bfloat16 is not a running sum's pattern
        assert_explained(report.flagged[0], kind, N)  # the second pass (replay) names the fault


def test_a_bfloat16_running_sum_is_explained_and_the_default_target_is_the_embedding():
    report = accumcheck.jax.check(embed_params(), embed_loss, embed_batches(), inject="bf16", grad_mean=False)
    assert flagged(report) == ["embed.embeddings"]
    assert_explained(report.flagged[0], "bf16", N)
    assert report.config == {"model": "embed_loss", "loss": "loss_fn(params, batch)", "inject": "bf16", "grad_mean": False}


def test_the_roundoff_control_is_not_flagged():
    for loss_fn, params, batches, target in ((embed_loss, embed_params(), embed_batches(), "embed.embeddings"),
                                             (mlp_loss, mlp_params(), mlp_batches(), "params.Dense_1.kernel")):
        report = accumcheck.jax.check(params, loss_fn, batches, inject=f"roundoff:{target}")
        assert report.exit_code == 0 and report.inject.startswith("roundoff"), verdicts(report)


def test_bfloat16_parameters_lose_precision_in_multisteps_and_the_float32_buffer_keeps_it():
    report = accumcheck.jax.check(mlp_params(jnp.bfloat16), mlp_loss, mlp_batches())
    if accumulator_dtype("bfloat16") != "bfloat16":  # a later optax sums in float32, emits the sum cast to bfloat16
        assert report.exit_code == 1 and set(verdicts(report).values()) == {"precision-loss"}, verdicts(report)
        assert any("accumulator is float32" in note for note in report.notes)
        return
    assert report.param_dtype == "bfloat16" and report.accum_dtype == "float32" and report.exit_code == 1
    assert set(verdicts(report).values()) == {"precision-loss"}, verdicts(report)
    for t in report.tensors:
        assert t.precision_ratio is not None
        assert t.err_ulps_native > 100 and t.err_ulps_manual <= 1.0  # in float32 ulps of E
        assert t.ratio_manual <= 1.0
    assert "MultiSteps' accumulator takes the parameters' dtype (bfloat16)" in report.notes


def test_float16_parameters_lose_precision_too():
    report = accumcheck.jax.check(mlp_params(jnp.float16), mlp_loss, mlp_batches())
    assert report.param_dtype == "float16" and report.exit_code == 1
    assert set(verdicts(report).values()) <= {"precision-loss", "identical"} and report.flagged


def test_mixed_dtypes_are_each_judged_by_their_own():
    params = mlp_params()
    for layer in ("Dense_0", "Dense_1"):
        params["params"][layer]["kernel"] = params["params"][layer]["kernel"].astype(jnp.bfloat16)
    report = accumcheck.jax.check(params, mlp_loss, mlp_batches())
    assert report.param_dtype == "float32" and report.accum_dtype == "float32"
    for name, verdict in verdicts(report).items():
        assert verdict == ("precision-loss" if name.endswith("kernel") else "round-off"), (name, verdict)
    assert any(note.startswith("mixed parameter dtypes (2 bfloat16, 4 float32)") for note in report.notes)


def test_float64_parameters_run_in_x64_mode_for_the_check_only():
    params = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), mlp_params())  # numpy: x64 is off here
    before = snapshot(params)
    report = accumcheck.jax.check(params, mlp_loss, mlp_batches(), inject="scale:params.Dense_0.kernel", oracle=True)
    assert report.param_dtype == "float64" and report.accum_dtype == "float64"
    if accumulator_dtype("float64") == "float64":  # optax 0.2.1: MultiSteps accumulates in the parameters' dtype
        assert flagged(report) == ["params.Dense_0.kernel"]
        assert_explained(report.flagged[0], "scale", N)
    else:  # later optax accumulates float64 gradients in float32: every tensor is off by float32's round-off
        assert sorted(flagged(report)) == sorted(verdicts(report)) and any("accumulator is float32" in n for n in report.notes)
    assert jax.config.jax_enable_x64 is False and jnp.asarray(np.zeros(1)).dtype == jnp.float32
    assert snapshot(params) == before


@pytest.mark.parametrize("inject", [None, pytest.param("drop-step:params.Dense_1.kernel", marks=pytest.mark.slow)])
def test_jit_off_gives_the_same_verdicts(inject):
    on = accumcheck.jax.check(mlp_params(), mlp_loss, mlp_batches(), inject=inject)
    off = accumcheck.jax.check(mlp_params(), mlp_loss, mlp_batches(), inject=inject, jit=False)
    assert verdicts(off) == verdicts(on) and off.exit_code == on.exit_code
    assert off.settings["jit"] is False and off.config["jit"] is False and "op by op (no jit)" in off.notes


def test_the_users_params_batches_and_x64_flag_are_left_as_found():
    params, batches = embed_params(), embed_batches()
    numpy_params = jax.tree_util.tree_map(np.asarray, mlp_params())
    before = snapshot(params), snapshot(batches), snapshot(numpy_params)
    x64 = jax.config.jax_enable_x64
    report = accumcheck.jax.check(params, embed_loss, batches, oracle=True, inject="double-step:layers.1.w")
    assert flagged(report) == ["layers.1.w"] and report.oracle
    assert all(t.oracle_err_native is not None and t.oracle_err_manual is not None for t in report.tensors)
    assert report.losses["oracle_mean_loss"] == pytest.approx(report.losses["mean_loss"], rel=1e-5)
    accumcheck.jax.check(numpy_params, mlp_loss, mlp_batches(), oracle=True)
    assert (snapshot(params), snapshot(batches), snapshot(numpy_params)) == before
    assert jax.config.jax_enable_x64 == x64 and jnp.asarray(np.zeros(1)).dtype == jnp.float32


def float32_only(params, batch):
    if params["w"].dtype != jnp.float32:
        raise ValueError("this model runs in float32 only")
    return jnp.sum(batch @ params["w"]) ** 2


def non_scalar(params, batch):
    return batch @ params["w"]


def with_aux(params, batch):
    return jnp.sum(batch @ params["w"]), {"aux": 1}


def shapes_wrong(params, batch):
    return jnp.sum(batch.T @ params["w"])


def python_branch(params, batch):
    loss = jnp.sum(batch @ params["w"])
    return loss if loss > 0 else -loss


W = {"w": jnp.ones((3, 2))}
X = [np.ones((4, 3), np.float32)] * 4


@pytest.mark.parametrize("args, kwargs, match", [
    (("w", float32_only, X), {}, r"params leaf 'params' is a str, not an array"),
    (({"w": jnp.ones(3, jnp.int32)}, float32_only, X), {}, r"params leaf 'w' is int32; every array"),
    (({"w": 1.0}, float32_only, X), {}, r"params leaf 'w' is a float, not an array"),
    (({"w": None}, float32_only, X), {}, r"params holds no arrays"),
    ((float32_only, W, X), {}, r"accumcheck.jax.check takes check\(params, loss_fn, batches\): the parameters first"),
    ((W, W, X), {}, r"loss_fn must be a function, got a dict"),
    ((W, None, X), {}, r"loss_fn is missing; pass loss_fn\(params, batch\)"),
    ((W,), {"batches": X}, r"loss_fn is missing"),
    ((W, float32_only, []), {}, r"batches is empty"),
    ((W, float32_only, None), {}, r"batches is missing"),
    ((W, float32_only, X), {"accum_steps": 8}, r"accum_steps=8 but only 4 batches were given"),
    ((W, float32_only, X), {"accum_steps": 0}, r"accum_steps must be a positive integer"),
    ((W, float32_only, lambda k: X[0]), {}, r"batches is a function; pass accum_steps"),
    ((W, non_scalar, X), {}, r"loss_fn returned an array of shape \(4, 2\) on micro-batch 0, not a scalar"),
    ((W, with_aux, X), {}, r"loss_fn returned a tuple of 2 items .* it must return the scalar loss alone"),
    ((W, shapes_wrong, X), {}, r"loss_fn raised TypeError on micro-batch 0: .*takes your params and batches"),
    ((W, python_branch, X), {}, r"loss_fn raised \w+ on micro-batch 0: .*pass jit=False"),
    ((W, float32_only, X), {"inject": "scale:v"}, r"no parameter named 'v'; this case has w"),
    ((W, float32_only, X), {"jit": "yes"}, r"jit must be True or False"),
    ((W, float32_only, X), {"step": float32_only}, r"accumcheck.jax.check cannot honour step=<function> "
                                                   r"\(loss_fn\(params, batch\) is the step"),
    ((W, float32_only, X), {"mode": "compensated"}, r"cannot honour mode='compensated' \(optax.MultiSteps is"),
    ((W, float32_only, X), {"full_batch": True}, r"cannot honour full_batch=True"),
    ((W, float32_only, X), {"collate": list}, r"cannot honour collate="),
    ((W, float32_only, X), {"loss_reduction": "sum"}, r"cannot honour loss_reduction='sum'"),
    ((W, float32_only, X), {"train_mode": True}, r"cannot honour train_mode=True \(loss_fn\(params, batch\) is "
                                                 r"a pure function"),
    ((W, float32_only, X), {"memory_budget": "1G"}, r"cannot honour memory_budget='1G' .*; leave it out"),
    ((W, float32_only, X), {"device": "tpu"}, r"device 'tpu' is not a device name"),
    ((W, float32_only, X), {"device": "gpu:7"}, r"device 'gpu:7': jax .* sees \d gpu device"),
    ((W, float32_only, X), {"oracle": True}, r"oracle=True runs loss_fn on a float64 copy of params .* raised "
                                             r"ValueError on micro-batch 0: this model runs in float32 only"),
])
def test_bad_input_is_one_clear_line(args, kwargs, match):
    x64 = jax.config.jax_enable_x64
    with pytest.raises(accumcheck.AccumcheckError, match=match) as info:
        accumcheck.jax.check(*args, **kwargs)
    assert "\n" not in str(info.value)
    assert jax.config.jax_enable_x64 == x64


@pytest.mark.parametrize("device", ["cpu", "cpu-object"])
def test_the_device_where_params_are_is_honoured_and_numpy_params_go_there(device):
    where = jax.devices("cpu")[0] if device == "cpu-object" else device
    for params in (W, {"w": np.ones((3, 2), np.float32)}):
        report = accumcheck.jax.check(params, float32_only, X, device=where)
        assert report.exit_code == 0 and report.device == "cpu"


def test_python_branches_run_with_jit_off_and_batches_may_be_a_function():
    report = accumcheck.jax.check(W, python_branch, lambda k: X[0] * (k + 1), accum_steps=4, jit=False)
    assert report.exit_code == 0 and report.accum_steps == 4


def test_names_are_readable_and_unique():
    from collections import namedtuple

    from accumcheck.jax.paramtree import ParamTree

    Pair = namedtuple("Pair", "w b")
    tree = ParamTree({"a.b": jnp.ones(2), "a": {"b": jnp.ones(2)}, "t": (Pair(jnp.ones((2, 2)), jnp.ones(2)),)})
    assert tree.names == ["['a']['b']", "['a.b']", "t.0.w", "t.0.b"]
    assert ParamTree(jnp.ones((2, 2))).names == ["params"]


def test_accumcheck_jax_exports_check_lazily_and_the_backend_hands_it_out():
    from accumcheck.jax.backend import JaxBackend
    from accumcheck.jax.usercheck import check

    assert accumcheck.jax.check is check and JaxBackend().model_check() is check
    code = "import sys, accumcheck.jax; assert 'jax' not in sys.modules and 'optax' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# ------------------------------------------------------------------------------- the user's code, left as found


def small_numpy_params(dtype=np.float32):
    rng = np.random.default_rng(4)
    return {"w": rng.standard_normal((3, 2)).astype(dtype), "b": np.zeros(2, dtype)}


def small_loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


# micro-batch k's target holds k, so that the user's code knows where it is
SMALL_BATCHES = [(np.random.default_rng(k).standard_normal((4, 3)).astype(np.float32), np.full((4, 2), k, np.float32))
                 for k in range(8)]


def _index(batch):
    return int(batch[1][0, 0])


def _host_states():
    python, numpy = random.getstate(), np.random.get_state()
    return python, (numpy[0], numpy[1].tobytes(), *numpy[2:]), jax.config.jax_enable_x64


JAX_RUNS = [("jit", None), ("no jit", None), ("no jit", "the pass"), ("oracle", None), ("oracle", "the pass"),
            ("oracle", "the float64 pass"), ("float64 params", None), ("float64 params", "the pass")]


@pytest.mark.parametrize("path, fails", JAX_RUNS, ids=[f"{p}-{f or 'succeeds'}" for p, f in JAX_RUNS])
def test_a_loss_that_draws_random_numbers_leaves_both_generators_params_and_x64_as_found(path, fails):
    """Python's and NumPy's random states bit for bit, the NumPy params and JAX's x64 flag as
    found, whether the check succeeds or the loss raises at micro-batch 5."""
    def loss_fn(params, batch):
        np.random.rand(3)
        random.random()
        wide = params["w"].dtype == jnp.float64
        if fails is not None and _index(batch) == 5 and (fails == "the float64 pass") == (wide and path == "oracle"):
            raise ValueError("micro-batch 5 is bad")
        return small_loss(params, batch)

    params = small_numpy_params(np.float64 if path == "float64 params" else np.float32)
    kwargs = {"jit": path == "jit", "oracle": path == "oracle"}
    random.seed(1)
    np.random.seed(1)
    before, held = _host_states(), snapshot(params)
    if fails is None:
        # a later optax's MultiSteps accumulates float64 gradients in float32, which the check flags
        narrowed = path == "float64 params" and accumulator_dtype("float64") != "float64"
        assert accumcheck.jax.check(params, loss_fn, SMALL_BATCHES, **kwargs).exit_code == (1 if narrowed else 0)
    else:
        with pytest.raises(accumcheck.UserCodeError, match="raised ValueError on micro-batch 5: micro-batch 5 is bad"):
            accumcheck.jax.check(params, loss_fn, SMALL_BATCHES, **kwargs)
    assert _host_states() == before and snapshot(params) == held


@pytest.mark.parametrize("fails", [False, True], ids=["succeeds", "raises"])
def test_numpy_params_the_users_code_edits_in_place_are_put_back_and_the_check_does_not_see_the_edits(fails):
    """On the CPU a jax array made from a NumPy array may share its memory: the check works on
    copies, so edits to the user's arrays neither reach its gradients nor outlast it."""
    params = small_numpy_params()
    held = snapshot(params)

    def editing(p, batch):
        params["w"] += 1.0  # the user's own arrays, edited in place
        params["b"][:] = np.nan
        if fails and _index(batch) == 5:
            raise ValueError("micro-batch 5 is bad")
        return small_loss(p, batch)

    if fails:
        with pytest.raises(accumcheck.UserCodeError, match="micro-batch 5"):
            accumcheck.jax.check(params, editing, SMALL_BATCHES, jit=False)
    else:
        edited = accumcheck.jax.check(params, editing, SMALL_BATCHES, jit=False)
        clean = accumcheck.jax.check(small_numpy_params(), small_loss, SMALL_BATCHES, jit=False)
        assert [t.max_abs_grad for t in edited.tensors] == [t.max_abs_grad for t in clean.tensors]
        assert edited.exit_code == 0
    assert snapshot(params) == held


CONSTANT_LOSSES = {"1.0": lambda p, b: 1.0, "times zero": lambda p, b: jnp.float32(2.0) + 0 * jnp.sum(p["w"]),
                   "stop_gradient": lambda p, b: small_loss(jax.lax.stop_gradient(p), b)}
# op by op, a bare float is refused before the run: it is not an array
CONSTANT_RUNS = [("1.0", True), ("times zero", True), ("times zero", False), ("stop_gradient", True),
                 ("stop_gradient", False)]


@pytest.mark.parametrize("loss, jit", CONSTANT_RUNS, ids=[f"{n}-{'jit' if j else 'no jit'}" for n, j in CONSTANT_RUNS])
def test_a_loss_that_does_not_depend_on_params_is_refused_naming_the_fix(loss, jit):
    with pytest.raises(accumcheck.NothingJudgedError) as info:
        accumcheck.jax.check(small_numpy_params(), CONSTANT_LOSSES[loss], SMALL_BATCHES, jit=jit)
    text = str(info.value)
    assert "\n" not in text and text.startswith("check: nothing was judged: loss_fn's gradient was zero for all 2 "
                                                "arrays of params in the 8 micro-batches")
    assert "make loss_fn depend on params" in text


def test_sys_exit_in_the_loss_is_the_users_error_naming_the_micro_batch():
    def leaving(params, batch):
        if _index(batch) == 5:
            sys.exit(3)
        return small_loss(params, batch)

    with pytest.raises(accumcheck.UserCodeError) as info:
        accumcheck.jax.check(small_numpy_params(), leaving, SMALL_BATCHES, jit=False)
    assert "loss_fn raised SystemExit on micro-batch 5: exit code 3" in str(info.value)
    assert isinstance(info.value.__cause__, SystemExit)
