"""Ground truth for the three Trainer runs of examples/trainer_models.py, measured with no accumcheck code.

    python ci/ground_truth_models.py [bert-classification|bert-masked-lm|mixtral ...]   # default: all three

Each model runs in float64 with every dropout set to 0, under the example's own Trainer (trainer_for).
At each optimizer step, before clipping (or, with clipping off, before the step), the script reads the
accumulated gradient A (p.grad of every trainable parameter) and, with the parameters as they are, computes
    F  = gradient of model(**joined).loss, the window's micro-batches joined as ONE batch (right-padded:
         input_ids/attention_mask with 0, labels with -100; 1-D class labels concatenated);
    S  = sum over the window's micro-batches of the gradient of model(**micro_batch).loss, each alone;
and for Mixtral also T1 = gradient of the joined batch's CE part (loss - coef*aux_loss) and
T2 = sum over micro-batches of the gradient of coef*aux_loss of each alone (coef = router_aux_loss_coef).
It prints the least-squares fits A = c F, A = c' S (and A = a T1 + b T2 for Mixtral) with their residuals.
Fits leave out "round-off tensors": those with max|F_t| <= 1e-7 max|F| and max|A_t| <= 1e-7 max|A|.
(In BERT these are the attention key biases, whose gradient is zero analytically.) Mixtral is not
float64 throughout: transformers computes its router softmax, aux loss and CE in float32, so its
residuals stop near 1e-8 (float32 round-off); the BERT fits are exact to float64 round-off.

The example module imports accumcheck at its top but uses it only under __main__; it is loaded here with
stub modules in place of accumcheck (they raise if called), and the script asserts at the end that no
accumcheck module was ever imported. The gradients come from torch.autograd.grad, so p.grad is never
touched and training proceeds untouched (asserted as well).
"""

import importlib.util
import pathlib
import sys
import time
import types

import torch

MODELS = ("bert-classification", "bert-masked-lm", "mixtral")
ROUND_OFF = 1e-7


def load_example():
    """examples/trainer_models.py, with stubs standing in for the accumcheck modules it imports."""
    def refuse(*args, **kwargs):
        raise AssertionError("ground_truth_models.py must not call accumcheck")
    names = ("accumcheck", "accumcheck.integrations", "accumcheck.integrations.transformers", "accumcheck.render")
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["accumcheck.integrations.transformers"].check = refuse
    sys.modules["accumcheck.render"].render = refuse
    try:
        path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "trainer_models.py"
        spec = importlib.util.spec_from_file_location("trainer_models_example", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name)
            else:
                sys.modules[name] = previous
    return module


def no_dropout(model):
    """Every nn.Dropout's p, every float attribute named *dropout* (SDPA's dropout_prob), and the config's."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for attr, value in list(vars(module).items()):
            if "dropout" in attr and isinstance(value, float):
                setattr(module, attr, 0.0)
    for attr in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "attention_dropout"):
        if getattr(model.config, attr, None) is not None:
            setattr(model.config, attr, 0.0)


def join(batches):
    """The micro-batches as one batch, each 2-D tensor right-padded to the longest (labels with -100)."""
    width = max(b["input_ids"].shape[1] for b in batches)
    joined = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if parts[0].dim() == 2:
            fill = -100 if key == "labels" else 0
            parts = [torch.nn.functional.pad(p, (0, width - p.shape[1]), value=fill) for p in parts]
        joined[key] = torch.cat(parts)
    return joined


def grads(value, params):
    with torch.enable_grad():
        got = torch.autograd.grad(value, params, allow_unused=True, retain_graph=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, got)]


def add(xs, ys):
    return [x + y for x, y in zip(xs, ys)]


def dot(xs, ys, keep):
    return sum(float((x * y).sum()) for x, y, k in zip(xs, ys, keep) if k)


def residual(A, fit, keep):
    diff = [a - f for a, f in zip(A, fit)]
    return dot(diff, diff, keep) ** 0.5 / dot(A, A, keep) ** 0.5


def one_factor(A, F, keep):
    """c, the per-tensor spread max|c_t - c|/|c|, and the residual |A - cF|/|A| over the kept tensors."""
    c = dot(A, F, keep) / dot(F, F, keep)
    per_tensor = [float((a * f).sum() / (f * f).sum()) if float((f * f).sum()) > 0 else float("inf")
                  for a, f, k in zip(A, F, keep) if k]
    spread = max(abs(ct - c) for ct in per_tensor) / abs(c)
    return c, spread, residual(A, [c * f for f in F], keep)


def measure(model, window, A):
    params = [p for p in model.parameters() if p.requires_grad]
    joined = model(**join(window))
    F = grads(joined.loss, params)
    S, T2 = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    for micro in window:
        out = model(**micro)
        S = add(S, grads(out.loss, params))
        if getattr(out, "aux_loss", None) is not None:
            T2 = add(T2, grads(model.config.router_aux_loss_coef * out.aux_loss, params))
    top_F, top_A = max(float(f.abs().max()) for f in F), max(float(a.abs().max()) for a in A)
    keep = [float(f.abs().max()) > ROUND_OFF * top_F or float(a.abs().max()) > ROUND_OFF * top_A
            for f, a in zip(F, A)]
    c, spread, res = one_factor(A, F, keep)
    c2, spread2, res2 = one_factor(A, S, keep)
    line = (f"(k={len(window)}): c={c:.6f} spread={spread:.0e} residual={res:.0e} "
            f"({keep.count(False)} round-off tensors left out); "
            f"sum of micro-batch losses: c'={c2:.6f} spread={spread2:.0e} residual={res2:.0e}")
    if getattr(joined, "aux_loss", None) is not None:
        T1 = grads(joined.loss - model.config.router_aux_loss_coef * joined.aux_loss, params)
        g = [[dot(T1, T1, keep), dot(T1, T2, keep)], [dot(T1, T2, keep), dot(T2, T2, keep)]]
        a, b = torch.linalg.solve(torch.tensor(g, dtype=torch.float64),
                                  torch.tensor([dot(A, T1, keep), dot(A, T2, keep)], dtype=torch.float64)).tolist()
        res3 = residual(A, [a * t1 + b * t2 for t1, t2 in zip(T1, T2)], keep)
        line += f"; A = a*CE(joined) + b*sum coef*aux(alone): a={a:.6f} b={b:.6f} residual={res3:.0e}"
    return line


def run(example, name):
    trainer = example.trainer_for(name)
    model = trainer.model
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")  # grouped_mm has no float64 on CPU (transformers 5.x)
    model.double()
    no_dropout(model)
    window, hooked, state = [], [], {"captured": False, "step": 0}

    def capture():
        if state["captured"] or not window:
            return
        state["captured"] = True
        params = [p for p in model.parameters() if p.requires_grad]
        A = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
        print(f"{name} step {state['step']} {measure(model, list(window), A)}", flush=True)
        assert all(torch.equal(a, p.grad) for a, p in zip(A, params) if p.grad is not None), "p.grad changed"
        window.clear()
        state["step"] += 1

    def install_hooks():
        clip = trainer.accelerator.clip_grad_norm_
        def clip_after_capture(*args, **kwargs):
            capture()
            return clip(*args, **kwargs)
        trainer.accelerator.clip_grad_norm_ = clip_after_capture
        optimizer = trainer.optimizer
        while hasattr(optimizer, "optimizer"):  # AcceleratedOptimizer wraps the torch optimizer
            optimizer = optimizer.optimizer
        optimizer.register_step_pre_hook(lambda *_: capture())
        hooked.append(True)

    step_micro_batch = trainer.training_step
    def training_step(*args, **kwargs):
        if not hooked:
            install_hooks()
        inputs = kwargs["inputs"] if "inputs" in kwargs else args[1]
        window.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in inputs.items()})
        state["captured"] = False
        return step_micro_batch(*args, **kwargs)
    trainer.training_step = training_step
    trainer.train()


def main():
    import transformers
    names = sys.argv[1:] or list(MODELS)
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        sys.exit(f"usage: python ci/ground_truth_models.py [{'|'.join(MODELS)} ...] (got {unknown})")
    example = load_example()
    print(f"transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    for name in names:
        start = time.perf_counter()
        run(example, name)
        print(f"{name}: {time.perf_counter() - start:.1f}s", flush=True)
    assert not any(m == "accumcheck" or m.startswith("accumcheck.") for m in sys.modules), "accumcheck was imported"


if __name__ == "__main__":
    main()
