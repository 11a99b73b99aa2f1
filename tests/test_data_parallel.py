"""Data parallelism matches one process with the same global batch, step for step, on Tiny Shakespeare
(fp32, bf16 autocast and fp16 with dynamic loss scaling; with and without gradient accumulation)."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import shakespeare
from dp_workers import make_config, train_podscale
from podscale.config import parse_config
from podscale.models.gpt import GPT
from podscale.optim import cosine_lr
from podscale.optim.build import param_groups
from podscale.runtime.launcher import launch
from podscale.train.data import ShardedLoader, load_tokens, split_tokens
from podscale.train.loop import gpt_config

STEPS = 20
GLOBAL_BATCH = 16
# fp32: identical math up to the order of the gradient sum over ranks, so only rounding differs
# (measured: losses within 1e-6, parameters within 3e-6 after 20 steps).
# bf16: autocast matmuls round to 8 mantissa bits and different batch splits round differently
# (measured: losses within 2e-4, parameters within 1.5e-2).
TOL = {"fp32": 2e-5, "bf16": 2e-3, "fp16": 2e-3}
PARAM_TOL = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 5e-2}


def reference_run(d: dict) -> dict:
    """The same model trained by a plain PyTorch loop on one process, one forward per global batch."""
    cfg = parse_config(d)
    torch.manual_seed(cfg.run.seed)
    model = GPT(gpt_config(cfg))
    t = cfg.train
    opt = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                            eps=t.eps, fused=True)
    tokens, _ = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
    loader = ShardedLoader(tokens, cfg.model.block_size, t.global_batch, t.global_batch, seed=cfg.run.seed)
    # fp16: torch's own GradScaler with podscale's default schedule (start 2^16, double after a window)
    scaler = torch.amp.GradScaler("cpu", init_scale=t.loss_scale_init, growth_interval=t.loss_scale_window,
                                  enabled=t.precision == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    losses, norms = [], []
    for step in range(cfg.run.steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, t.lr, t.min_lr, t.warmup_steps, t.decay_steps)
        (x, y), = loader.next_step()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits, _ = model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "grad_norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _layouts(nproc: int, path: str) -> list[tuple[str, dict]]:
    """(label, config) pairs: each precision, without and with gradient accumulation."""
    out = []
    for precision in ("fp32", "bf16"):
        for accum in (1, 2):
            micro = GLOBAL_BATCH // (nproc * accum)
            out.append((f"dp={nproc} accum={accum} {precision}",
                        make_config(path, STEPS, GLOBAL_BATCH, micro, precision, nproc)))
    return out


@pytest.fixture(scope="module")
def references():
    path = shakespeare()
    return {p: reference_run(make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH, p, 1)) for p in TOL}


def _fp16_layout(path: str) -> tuple[str, dict]:
    return "dp=2 accum=2 fp16", make_config(path, STEPS, GLOBAL_BATCH, GLOBAL_BATCH // 4, "fp16", 2)


@pytest.mark.parametrize("nproc", [2, 4])
def test_dp_matches_single_process(nproc, references):
    layouts = _layouts(nproc, shakespeare()) + ([_fp16_layout(shakespeare())] if nproc == 2 else [])
    results = launch(train_podscale, ([d for _, d in layouts],), nproc=nproc)
    for i, (label, d) in enumerate(layouts):
        precision = d["train"]["precision"]
        ref, tol = references[precision], TOL[precision]
        ours = results[0][i]
        # every rank reports the same (all-reduced) loss
        for r in range(1, nproc):
            assert results[r][i]["losses"] == ours["losses"], label
        assert len(ours["losses"]) == STEPS
        for step, (a, b) in enumerate(zip(ours["losses"], ref["losses"])):
            assert math.isclose(a, b, rel_tol=tol, abs_tol=tol), f"{label}: step {step + 1} loss {a} vs {b}"
        for step, (a, b) in enumerate(zip(ours["grad_norms"], ref["grad_norms"])):
            assert math.isclose(a, b, rel_tol=10 * tol), f"{label}: step {step + 1} grad norm {a} vs {b}"
        worst = max((ours["params"][n] - p).abs().max().item() for n, p in ref["params"].items())
        assert worst < PARAM_TOL[precision], f"{label}: parameters differ by {worst}"
        # the loss went down: this is training, not a constant
        assert ours["losses"][-1] < ours["losses"][0] - 0.5, label
        # small buckets: several all-reduces per step, launched from backward hooks
        assert ours["buckets"] > 1
        assert ours["comm"]["dp/all_reduce"]["calls"] >= STEPS * ours["buckets"]


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    from podscale.train.precision import DynamicLossScaler
    s = DynamicLossScaler(init_scale=1024.0, window=2)
    grads = [torch.tensor([2048.0, 1.0]), torch.tensor([float("inf")])]
    assert s.unscale_and_check(grads) is True
    s.update(True)
    assert s.scale == 512.0
    grads = [torch.tensor([512.0, 1024.0])]
    assert s.unscale_and_check(grads) is False and grads[0].tolist() == [1.0, 2.0]
    s.update(False)
    s.update(False)
    assert s.scale == 1024.0  # doubled after a clean window
