"""The single-process reference every parallel layout is tested against, and the comparison itself.

``reference_run`` trains the GPT with a plain PyTorch loop on one process — one forward per global batch,
torch's fused AdamW, ``clip_grad_norm_``, torch's GradScaler for fp16 — on the same data and schedule as
podscale.  ``compare`` asserts that a layout's run matches it step by step.
"""
from __future__ import annotations

import json
import math

import torch
import torch.nn.functional as F

from podscale.config import parse_config
from podscale.models.gpt import GPT
from podscale.optim import cosine_lr
from podscale.optim.build import param_groups
from podscale.train.data import ShardedLoader, load_tokens, split_tokens
from podscale.tasks.gpt import gpt_config


_RUNS: dict[str, dict] = {}


def reference_run(d: dict, compile_backend: str | None = None, micro_batches: int = 1) -> dict:
    """Losses and gradient norms per step, gradients after step 1 and parameters after the last step.
    ``compile_backend``: the GPT's blocks compiled with it as ``train.compile`` does; ``micro_batches``: each
    global batch run as that many equal forwards whose gradients add up (the loss is their mean).

    The run is deterministic, so it is kept for the rest of the session (per config): test modules that
    compare against the same single-process run train it once (the two pipeline modules share one; the
    data-parallel, ZeRO and NVMe modules another: it never reads a ``[zero]`` section, which is left out of
    the key).  The result is shared: callers read it and never change it."""
    key = json.dumps([{k: v for k, v in d.items() if k != "zero"}, compile_backend, micro_batches],
                     sort_keys=True, default=str)
    if key not in _RUNS:
        _RUNS[key] = _reference_run(d, compile_backend, micro_batches)
    return _RUNS[key]


def _reference_run(d: dict, compile_backend: str | None, micro_batches: int) -> dict:
    cfg = parse_config(d)
    torch.manual_seed(cfg.run.seed)
    model = GPT(gpt_config(cfg))
    if compile_backend is not None:
        from podscale.tasks.gpt import GPTTask
        from podscale.train.compile import compile_units
        compile_units(GPTTask(cfg).compile_units(model), compile_backend)
    t = cfg.train
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                            eps=t.eps, fused=True)
    tokens, _ = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
    loader = ShardedLoader(tokens, cfg.model.block_size, t.global_batch, t.global_batch, seed=cfg.run.seed)
    # fp16: torch's own GradScaler with podscale's default schedule (start 2^16, double after a window)
    scaler = torch.amp.GradScaler("cpu", init_scale=t.loss_scale_init, growth_interval=t.loss_scale_window,
                                  enabled=t.precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    losses, norms, grads1 = [], [], None
    for step in range(cfg.run.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, t.lr, t.min_lr, t.warmup_steps, t.decay_steps)
        (x, y), = loader.next_step()
        loss = 0.0
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                logits, _ = model(xm)
            part = F.cross_entropy(logits.float().view(-1, logits.size(-1)), ym.view(-1)) / micro_batches
            scaler.scale(part).backward()
            loss = loss + part
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        if step == 0:
            grads1 = {n: p.grad.clone() for n, p in model.named_parameters()}
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms, "grads1": grads1,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def compare(label: str, ours: dict, ref: dict, results: dict, index: int, nproc: int, loss_tol: float,
            param_tol: float, grad_tol: float | None = None) -> dict:
    """Assert that run ``index`` of a layout (``results[rank][index]``, rank 0's is ``ours``) matches ``ref``:
    every rank reports the same losses; losses within ``loss_tol`` and gradient norms within ``10 *
    loss_tol`` at every step; step-1 gradients within ``grad_tol`` (when the layout reports them); final
    parameters within ``param_tol``; and the loss went down.  Returns the worst differences seen."""
    for r in range(1, nproc):
        assert results[r][index]["losses"] == ours["losses"], f"{label}: ranks report different losses"
    assert len(ours["losses"]) == len(ref["losses"])
    for step, (a, b) in enumerate(zip(ours["losses"], ref["losses"])):
        assert math.isclose(a, b, rel_tol=loss_tol, abs_tol=loss_tol), f"{label}: step {step + 1} loss {a} vs {b}"
    for step, (a, b) in enumerate(zip(ours["grad_norms"], ref["grad_norms"])):
        assert math.isclose(a, b, rel_tol=10 * loss_tol), f"{label}: step {step + 1} grad norm {a} vs {b}"
    seen = {"loss": max(abs(a - b) for a, b in zip(ours["losses"], ref["losses"]))}
    if grad_tol is not None:
        assert set(ours["grads1"]) >= set(ref["grads1"]), \
            f"{label}: missing {set(ref['grads1']) - set(ours['grads1'])}"
        seen["grad"] = max((ours["grads1"][n] - g).abs().max().item() for n, g in ref["grads1"].items())
        assert seen["grad"] < grad_tol, f"{label}: step-1 gradients differ by {seen['grad']}"
    seen["param"] = max((ours["params"][n] - p).abs().max().item() for n, p in ref["params"].items())
    assert seen["param"] < param_tol, f"{label}: parameters differ by {seen['param']}"
    assert ours["losses"][-1] < ours["losses"][0] - 0.5, f"{label}: did not train"
    return seen
