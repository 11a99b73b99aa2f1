"""The training engine: one optimizer step over a list of micro-batches, on any layout of the mesh.

``Engine.step`` runs forward/backward on each micro-batch (communication only on the last, through the
strategy's ``no_sync``), waits for the gradient reduction, unscales and checks fp16 overflow, clips by the
global gradient norm, steps the optimizer with the scheduled learning rate and returns the loss averaged
over the whole global batch.

A *strategy* (:class:`~podscale.parallel.strategy.Strategy`) owns how gradients are reduced and how the
optimizer steps; the engine only sequences it.  A *loss function* ``loss_fn(module, batch)`` says what a
micro-batch is: by default (:func:`model_computes_loss`) a tuple of tensors moved to the device and passed
to the model, which returns ``(output, loss)``; a task passes its own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from podscale.config import TrainSection
from podscale.models.gpt import sample
from podscale.optim import build_adamw, cosine_lr
from podscale.parallel.data import DataParallel
from podscale.parallel.strategy import LossFn, Strategy
from podscale.runtime import comm
from podscale.runtime.mesh import AXES
from podscale.train.precision import DynamicLossScaler, autocast


def model_computes_loss(precision: str, device: torch.device) -> LossFn:
    """The default loss function: ``batch`` is a tuple of tensors, moved to ``device`` and passed to the
    model under ``precision``'s autocast; the model returns ``(output, loss)``."""
    def loss_fn(module: nn.Module, batch) -> torch.Tensor:
        with autocast(precision, device):
            return module(*(t.to(device, non_blocking=True) for t in batch))[1]
    return loss_fn


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

    def __init__(self, model: nn.Module, mesh, train: TrainSection, bucket_mb: float = 25.0,
                 strategy: Strategy | None = None, loss_fn: LossFn | None = None):
        self.mesh, self.cfg = mesh, train
        self.device = mesh.device
        self.model = model.to(self.device)
        if strategy is None:
            optimizer = build_adamw(self.model, train.lr, (train.beta1, train.beta2), train.eps,
                                    train.weight_decay)
            strategy = DataParallel(self.model, mesh, ("dp",), bucket_mb=bucket_mb,
                                    reduce_dtype=train.reduce_dtype, optimizer=optimizer)
        self.strategy = strategy
        self.loss_fn = loss_fn if loss_fn is not None else model_computes_loss(train.precision, self.device)
        self.scaler = DynamicLossScaler(train.loss_scale_init, train.loss_scale_window) \
            if train.precision == "fp16" else None
        self.step_count = 0

    def lr_at(self, step: int) -> float:
        c = self.cfg
        return cosine_lr(step, c.lr, c.min_lr, c.warmup_steps, c.decay_steps or 1)

    def step(self, micro_batches: list) -> StepResult:
        t0 = time.perf_counter()
        self.model.train()
        lr = self.lr_at(self.step_count)
        n = len(micro_batches)
        loss_scale = self.scaler.scale if self.scaler is not None else None
        loss_sum = self.strategy.forward_backward(micro_batches, loss_scale, self.loss_fn)
        self.strategy.finish_grad_sync()

        skipped, scale = False, None
        if self.scaler is not None:
            scale = self.scaler.scale
            self.strategy.scale_grads(1.0 / scale)
            skipped = self.scaler.check(self.strategy.found_inf(), self.mesh, AXES)
            self.scaler.update(skipped)
        norm = self.strategy.grad_norm()
        if not skipped:
            if self.cfg.grad_clip > 0:
                # Same rule as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), capped at 1.
                self.strategy.scale_grads(torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0))
            self.strategy.step(lr)
        self.strategy.zero_grad()

        mean_loss = loss_sum / n
        comm.all_reduce(mean_loss, self.mesh, "dp")
        mean_loss /= self.mesh.size("dp")
        self.step_count += 1
        return StepResult(self.step_count, float(mean_loss), lr, float(norm), skipped,
                          time.perf_counter() - t0, scale)

    @torch.no_grad()
    def evaluate(self, batches: list) -> float:
        """Mean loss over ``batches`` (this rank's shares), averaged over the dp axis."""
        self.model.eval()
        total = self.strategy.forward_only(batches, self.loss_fn)
        total = total if total is not None else torch.zeros((), device=self.device)
        total = total / max(1, len(batches))
        comm.all_reduce(total, self.mesh, "dp")
        return float(total) / self.mesh.size("dp")

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample from the model as :meth:`GPT.generate` does, on any layout: every rank must call it (tp
        and pp forwards are collective) and every rank gets the same tokens for the same ``generator``
        seed (the strategy's ``next_logits`` gathers vocabulary shards and broadcasts the last stage's)."""
        self.model.eval()
        gpt = self.model[0] if isinstance(self.model, nn.ModuleList) else self.model
        return sample(self.strategy.next_logits, idx.to(self.device), max_new_tokens, gpt.cfg.block_size,
                      temperature, top_k, generator)

    def close(self) -> None:
        """Release the strategy's scratch state (swap files) and drain its communication."""
        self.strategy.close()

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
