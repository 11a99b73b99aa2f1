"""The training engine: one optimizer step over a list of micro-batches, on any layout of the mesh.

``Engine.step`` runs forward/backward on each micro-batch (communication only on the last, through the
strategy's ``no_sync``), waits for the gradient reduction, unscales and checks fp16 overflow, clips by the
global gradient norm, steps the optimizer with the scheduled learning rate and returns the loss averaged
over the whole global batch.

A *strategy* owns how gradients are reduced and how the optimizer steps; the engine only sequences it.
It provides::

    no_sync()            context: accumulate locally, no communication
    finish_grad_sync()   wait until this rank's gradients are reduced
    grads()              the gradient tensors this rank steps (fp16 unscaling, overflow check, clipping)
    scale_grads(coef)    optional: multiply every gradient this rank steps by ``coef`` (float or 0-dim
                         tensor); default: ``g.mul_(coef)`` for g in grads().  A strategy whose gradients
                         are not in memory (ZeRO NVMe offload) defers the factor to its step.
    found_inf()          optional: 1-element float tensor, > 0 when this rank's gradients hold inf/NaN;
                         default: checks grads()
    grad_norm()          the true global L2 norm of all gradients
    zero_grad()
    step(lr)             optimizer step on what this rank owns
    model_state() / load_model_state(sd); optim_state() / optim_template() / load_optim_state(sd)
                         checkpoint tensors (DCP reshards them when the layout changes)

:class:`~podscale.parallel.data.DataParallel` with an optimizer is the replicated strategy.
"""
from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from podscale.config import TrainSection
from podscale.models.gpt import sample
from podscale.optim import build_adamw, cosine_lr
from podscale.parallel.data import DataParallel
from podscale.runtime import comm
from podscale.runtime.mesh import AXES
from podscale.train.precision import DynamicLossScaler, autocast, nonfinite_flag


def scale_grads(strategy, coef) -> None:
    """``strategy.scale_grads(coef)`` where provided, else an in-place multiply of ``strategy.grads()``."""
    hook = getattr(strategy, "scale_grads", None)
    if hook is not None:
        hook(coef)
        return
    for g in strategy.grads():  # (offloaded gradients live in host memory)
        g.mul_(coef.to(g.device) if torch.is_tensor(coef) else coef)


def found_inf(strategy) -> torch.Tensor:
    """``strategy.found_inf()`` where provided, else whether any of ``strategy.grads()`` is not finite."""
    hook = getattr(strategy, "found_inf", None)
    return hook() if hook is not None else nonfinite_flag(strategy.grads())


_OPEN: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@atexit.register
def _close_open_engines() -> None:
    """A script that never closes its engine still exits cleanly: at interpreter exit (also after the user
    destroyed the process group) every open engine drains what it has in flight, and torch's communication
    threads get the GIL to drop their finished work before the interpreter finalizes."""
    for engine in list(_OPEN):
        engine.close()


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    skipped: bool
    step_time_s: float
    loss_scale: float | None = None


class Engine:
    """Owns the parallel model, the optimizer and the loss scaler; ``step(micro_batches)`` trains."""

    def __init__(self, model: nn.Module, mesh, train: TrainSection, bucket_mb: float = 25.0, strategy=None):
        self.mesh, self.cfg = mesh, train
        self.device = mesh.device
        self.model = model.to(self.device)
        if strategy is None:
            optimizer = build_adamw(self.model, train.lr, (train.beta1, train.beta2), train.eps,
                                    train.weight_decay)
            strategy = DataParallel(self.model, mesh, ("dp",), bucket_mb=bucket_mb,
                                    reduce_dtype=train.reduce_dtype, optimizer=optimizer)
        self.strategy = strategy
        self.scaler = DynamicLossScaler(train.loss_scale_init, train.loss_scale_window) \
            if train.precision == "fp16" else None
        self.step_count = 0
        self.closed = False
        _OPEN.add(self)

    # lifetime: ``with podscale.parallelize(...) as engine:`` or ``engine.close()`` -----------------------
    def close(self) -> None:
        """Wait for the collectives still in flight (ZeRO's post-step all-gathers, prefetches), release the
        strategy's scratch state (swap files, hooks) and let the communication threads finish; call it
        before ``dist.destroy_process_group()``.  Safe to call twice; the engine cannot step afterwards."""
        if self.closed:
            return
        self.closed = True
        _OPEN.discard(self)
        try:
            self.strategy.close()
        finally:
            comm.settle()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def lr_at(self, step: int) -> float:
        c = self.cfg
        return cosine_lr(step, c.lr, c.min_lr, c.warmup_steps, c.decay_steps or 1)

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        if self.closed:
            raise RuntimeError("Engine.step after close(): build a new engine with podscale.parallelize")
        t0 = time.perf_counter()
        self.model.train()
        lr = self.lr_at(self.step_count)
        n = len(micro_batches)
        loss_scale = self.scaler.scale if self.scaler is not None else None
        forward_backward = getattr(self.strategy, "forward_backward", self.forward_backward)
        loss_sum = forward_backward(micro_batches, loss_scale)
        self.strategy.finish_grad_sync()

        skipped, scale = False, None
        if self.scaler is not None:
            scale = self.scaler.scale
            scale_grads(self.strategy, 1.0 / scale)
            skipped = self.scaler.check(found_inf(self.strategy), self.mesh, AXES)
            self.scaler.update(skipped)
        norm = self.strategy.grad_norm()
        if not skipped:
            if self.cfg.grad_clip > 0:
                # Same rule as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), capped at 1.
                scale_grads(self.strategy, torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0))
            self.strategy.step(lr)
        self.strategy.zero_grad()

        mean_loss = loss_sum / n
        comm.all_reduce(mean_loss, self.mesh, "dp")
        mean_loss /= self.mesh.size("dp")
        self.step_count += 1
        return StepResult(self.step_count, float(mean_loss), lr, float(norm), skipped,
                          time.perf_counter() - t0, scale)

    def forward_backward(self, micro_batches, loss_scale: float | None) -> torch.Tensor:
        """Forward and backward of each micro-batch, gradients summed as the mean over all of them;
        returns the sum of the micro-batch losses.  A strategy that schedules micro-batches itself
        (pipeline parallelism) provides its own ``forward_backward`` with this contract."""
        n = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            sync = contextlib.nullcontext() if i == n - 1 else self.strategy.no_sync()
            with sync:
                with autocast(self.cfg.precision, self.device):
                    _, loss = self.model(x, y)
                scaled = loss / n
                if loss_scale is not None:
                    scaled = scaled * loss_scale
                scaled.backward()
            loss_sum += loss.detach().float()
        return loss_sum

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` (this rank's shares), averaged over the dp axis.  A strategy that
        runs the model itself (pipeline parallelism) provides ``forward_only(batches)``: the sum of the
        batches' losses, on every rank."""
        self.model.eval()
        forward_only = getattr(self.strategy, "forward_only", None)
        if forward_only is not None:
            total = forward_only(batches)
        else:
            total = torch.zeros((), device=self.device)
            for x, y in batches:
                with autocast(self.cfg.precision, self.device):
                    _, loss = self.model(x.to(self.device), y.to(self.device))
                total += loss.float()
        total /= max(1, len(batches))
        comm.all_reduce(total, self.mesh, "dp")
        return float(total) / self.mesh.size("dp")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample from the model as :meth:`GPT.generate` does, on any layout: every rank must call it (tp
        and pp forwards are collective) and every rank gets the same tokens for the same ``generator``
        seed.  A model-parallel strategy provides ``next_logits(context)`` (vocab shards gathered, the last
        pipeline stage's logits broadcast)."""
        self.model.eval()
        next_logits = getattr(self.strategy, "next_logits", None)
        if next_logits is None:
            def next_logits(ctx):
                return self.model(ctx.to(self.device))[0][:, -1, :]
        gpt = self.model[0] if isinstance(self.model, nn.ModuleList) else self.model
        return sample(next_logits, idx.to(self.device), max_new_tokens, gpt.cfg.block_size, temperature,
                      top_k, generator)

    # checkpoint state: tensors only (DCP would pickle anything else) --------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        return self.strategy.model_state()

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.strategy.load_model_state(state)

    def optim_state(self) -> dict[str, torch.Tensor]:
        return self.strategy.optim_state()

    def optim_template(self) -> dict[str, torch.Tensor]:
        return self.strategy.optim_template()

    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None:
        self.strategy.load_optim_state(flat)
