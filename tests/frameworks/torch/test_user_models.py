"""accumcheck.torch.check on models written as people write them (tests/frameworks/torch/zoo.py):
faithful at N = 16, every fault kind flagged on them, the round-off control not, and the model
left as found."""

import pytest

import accumcheck

torch = pytest.importorskip("torch")
from attribution_checks import assert_explained  # noqa: E402
from zoo import GPT, GPTConfig, ResNet18, gpt_batches, image_batches, tiny_llama, token_batches  # noqa: E402

import accumcheck.torch  # noqa: E402
from accumcheck.options.choices import FAULT_KINDS

N = 16
FAULTS = [kind for kind in FAULT_KINDS if kind != "roundoff"]


def state(model):
    """Everything a check could change: parameters, .grad, buffers, every module's training flag."""
    return ([(n, p.detach().clone(), None if p.grad is None else p.grad.clone())
             for n, p in model.named_parameters(remove_duplicate=False)],
            [(n, b.clone()) for n, b in model.named_buffers()], [m.training for m in model.modules()])


def assert_same_state(a, b):
    params_a, buffers_a, flags_a = a
    params_b, buffers_b, flags_b = b
    assert flags_a == flags_b
    for (name, value_a, grad_a), (_, value_b, grad_b) in zip(params_a, params_b, strict=True):
        assert torch.equal(value_a, value_b), name
        assert (grad_a is None) == (grad_b is None), name
        assert grad_a is None or torch.equal(grad_a, grad_b), name
    for (name, value_a), (_, value_b) in zip(buffers_a, buffers_b, strict=True):
        assert torch.equal(value_a, value_b), name


def gpt(dtype=torch.float32):
    torch.manual_seed(0)
    return GPT(GPTConfig()).to(dtype)


def gpt_step(model, batch):
    return model(*batch)[1]  # nanoGPT's forward returns (logits, loss)


def flagged(report):
    return [t.name for t in report.flagged]


def check_faults(model, target, **kwargs):
    """Every fault kind on ``target``: flagged there and only there, and explained by the second
    pass (which leaves the model as found); the round-off control not."""
    for kind in FAULTS:
        before = state(model)
        report = accumcheck.torch.check(model, accum_steps=N, inject=f"{kind}:{target}", **kwargs)
        assert flagged(report) == [target], (kind, [(t.name, t.verdict) for t in report.flagged])
        assert report.exit_code == 1
        assert_same_state(before, state(model))
        if report.tensors[0].dtype == "float32" or report.config.get("mode"):  # a float32 sum: the fault's pattern
            assert_explained(report.flagged[0], kind, N)
    control = accumcheck.torch.check(model, accum_steps=N, inject=f"roundoff:{target}", **kwargs)
    assert control.exit_code == 0 and control.inject.startswith("roundoff")


def test_gpt_with_tied_embeddings_is_faithful_and_reports_the_tied_weight_once():
    model, batches = gpt(), gpt_batches(N)
    model.train()
    gpt_step(model, batches[0]).backward()  # gradients already there, and training mode
    before = state(model)
    report = accumcheck.torch.check(model, batches=batches, accum_steps=N, step=gpt_step)
    assert_same_state(before, state(model))
    accumcheck.assert_faithful(report)
    tied = [t for t in report.tensors if t.aliases]
    assert [(t.name, t.aliases) for t in tied] == [("transformer.wte.weight", ["lm_head.weight"])]
    assert tied[0].title == "transformer.wte.weight = lm_head.weight"
    assert len(report.tensors) == len(list(model.parameters()))  # each tensor once
    assert "step=step" in report.reproduce_command()


def test_every_fault_is_flagged_on_the_gpt_and_the_tied_weight_answers_to_both_names():
    model, batches = gpt(), gpt_batches(N)
    before = state(model)
    check_faults(model, "transformer.h.1.mlp.0.weight", batches=batches, step=gpt_step)
    report = accumcheck.torch.check(model, batches=batches, accum_steps=N, step=gpt_step, inject="scale:lm_head.weight")
    assert flagged(report) == ["transformer.wte.weight"]
    assert_same_state(before, state(model))


def test_bfloat16_parameters_lose_precision_natively_and_a_float32_accumulator_keeps_it():
    model, batches = gpt(torch.bfloat16), gpt_batches(N)
    native = accumcheck.torch.check(model, batches=batches, accum_steps=N, step=gpt_step)
    assert native.param_dtype == "bfloat16" and native.accum_dtype == "float32"
    losses = [t for t in native.tensors if t.verdict == "precision-loss"]
    assert losses and all(t.verdict in ("precision-loss", "identical") for t in native.tensors)
    assert not [t for t in native.tensors if t.verdict == "diverged"]
    worst = max(losses, key=lambda t: t.err_ulps_native)
    assert worst.err_ulps_native > 100 and worst.err_ulps_manual <= 1.0  # in float32 ulps of E
    fixed = accumcheck.torch.check(model, batches=batches, accum_steps=N, step=gpt_step, mode="accumulator")
    accumcheck.assert_faithful(fixed)
    assert fixed.param_dtype == "float32" and fixed.tensors[0].err_ulps_native is not None


def test_every_fault_is_flagged_through_the_float32_accumulator_of_a_bfloat16_gpt():
    check_faults(gpt(torch.bfloat16), "transformer.h.0.attn.c_attn.weight", batches=gpt_batches(N), step=gpt_step,
                 mode="accumulator")


def test_float32_gpt_under_bfloat16_autocast():
    model, batches = gpt(), gpt_batches(N)
    report = accumcheck.torch.check(model, batches=batches, accum_steps=N, step=gpt_step, autocast=torch.bfloat16)
    accumcheck.assert_faithful(report)
    assert report.param_dtype == "float32" and "forward under bfloat16 autocast" in report.notes
    assert "autocast=torch.bfloat16" in report.reproduce_command()
    check_faults(model, "transformer.wpe.weight", batches=batches, step=gpt_step, autocast="bfloat16")


def test_autocast_really_runs_the_forward_in_bfloat16():
    model, batches = gpt(), gpt_batches(4)
    plain = accumcheck.torch.check(model, batches=batches, accum_steps=4, step=gpt_step)
    cast = accumcheck.torch.check(model, batches=batches, accum_steps=4, step=gpt_step, autocast=torch.bfloat16)
    assert abs(plain.losses["mean_loss"] - cast.losses["mean_loss"]) > 1e-6


def test_hugging_face_llama_with_dict_batches_and_its_own_loss():
    pytest.importorskip("transformers")
    model, batches = tiny_llama(), token_batches(N)
    before = state(model)
    report = accumcheck.torch.check(model, batches=batches, accum_steps=N)
    assert_same_state(before, state(model))
    accumcheck.assert_faithful(report)
    assert report.case == "LlamaForCausalLM" and len(report.tensors) == 21
    assert report.reproduce_command().startswith("accumcheck.torch.check(<your LlamaForCausalLM>, batches=batches")


@pytest.mark.slow  # seconds: run by ci/slow.sh
def test_every_fault_is_flagged_on_the_llama():
    pytest.importorskip("transformers")
    check_faults(tiny_llama(), "model.layers.0.mlp.up_proj.weight", batches=token_batches(N))


def test_resnet18_with_batchnorm_in_eval_and_in_train_mode():
    torch.manual_seed(0)
    model, batches = ResNet18(), image_batches(N)
    model.train()
    model.layer2.eval()  # a mixed set of flags, to come back as they were
    before = state(model)
    loss_fn = torch.nn.functional.cross_entropy
    for train_mode in (False, True):
        report = accumcheck.torch.check(model, loss_fn, batches, accum_steps=N, train_mode=train_mode)
        assert_same_state(before, state(model))  # running statistics too
        accumcheck.assert_faithful(report)
        assert report.notes[0] == ("model in training mode, dropout off" if train_mode else "model in eval mode")


@pytest.mark.slow  # seconds: run by ci/slow.sh
def test_every_fault_is_flagged_on_the_resnet18_in_eval_and_in_train_mode():
    torch.manual_seed(0)
    model, batches = ResNet18(), image_batches(N)
    before = state(model)
    loss_fn = torch.nn.functional.cross_entropy
    check_faults(model, "layer3.0.conv1.weight", loss_fn=loss_fn, batches=batches)
    check_faults(model, "fc.weight", loss_fn=loss_fn, batches=batches, train_mode=True)
    assert_same_state(before, state(model))


def test_train_mode_uses_batch_statistics_and_eval_mode_the_running_ones():
    torch.manual_seed(0)
    model, batches = ResNet18(), image_batches(2)
    loss_fn = torch.nn.functional.cross_entropy
    eval_loss = accumcheck.torch.check(model, loss_fn, batches, accum_steps=2).losses["mean_loss"]
    train_loss = accumcheck.torch.check(model, loss_fn, batches, accum_steps=2, train_mode=True).losses["mean_loss"]
    model.eval()
    with torch.no_grad():
        expected = sum(float(loss_fn(model(x), y)) for x, y in batches) / 2
    assert eval_loss == pytest.approx(expected, rel=1e-6) and abs(train_loss - eval_loss) > 1e-3


def test_a_check_that_fails_midway_in_train_mode_leaves_the_running_statistics_as_found():
    torch.manual_seed(0)
    model, batches = ResNet18(), image_batches(4)
    batches[2] = (batches[2][0][:, :2], batches[2][1])  # two channels: the first conv cannot take it
    before = state(model)
    with pytest.raises(accumcheck.AccumcheckError, match="raised RuntimeError on micro-batch 2"):
        accumcheck.torch.check(model, torch.nn.functional.cross_entropy, batches, accum_steps=4, train_mode=True)
    assert_same_state(before, state(model))


def test_float16_parameters_too_and_a_grad_scaler_that_overflows_them_skips_the_step():
    model, batches = gpt(torch.float16), gpt_batches(N)
    native = accumcheck.torch.check(model, batches=batches, accum_steps=N, step=gpt_step)
    assert native.param_dtype == "float16" and {t.verdict for t in native.tensors} <= {"precision-loss", "identical"}
    assert max(t.err_ulps_native for t in native.tensors) > 100
    accumcheck.assert_faithful(accumcheck.torch.check(model, batches=batches, accum_steps=N, step=gpt_step,
                                                      mode="accumulator"))
    # 2^16 times a float16 gradient overflows float16's 65504: every tensor's step would be skipped
    scaled = accumcheck.torch.check(model, batches=batches, accum_steps=N, step=gpt_step,
                                    grad_scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16))
    assert scaled.exit_code == 0 and {t.verdict for t in scaled.tensors} == {"overflow"}
