"""The training engine: one optimizer step over a list of micro-batches, on any layout of the mesh.

``Engine.step`` runs forward/backward on each micro-batch (communication only on the last, through the
data-parallel wrapper's ``no_sync``), waits for the gradient reduction, unscales and checks fp16
overflow, clips by the global gradient norm, steps the optimizer with the scheduled learning rate and
returns the loss averaged over the whole global batch.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from podscale.config import TrainSection
from podscale.optim import build_adamw, cosine_lr
from podscale.parallel.data import DataParallel
from podscale.runtime import comm
from podscale.train.precision import DynamicLossScaler, autocast


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

    def __init__(self, model: nn.Module, mesh, train: TrainSection, bucket_mb: float = 25.0):
        self.mesh, self.cfg = mesh, train
        self.device = mesh.device
        self.model = model.to(self.device)
        self.dp = DataParallel(self.model, mesh, ("dp",), bucket_mb=bucket_mb, reduce_dtype=train.reduce_dtype)
        self.optimizer = build_adamw(self.model, train.lr, (train.beta1, train.beta2), train.eps,
                                     train.weight_decay)
        self.scaler = DynamicLossScaler(train.loss_scale_init, train.loss_scale_window) \
            if train.precision == "fp16" else None
        self.step_count = 0
        names = {id(p): n for n, p in self.model.named_parameters()}
        self._param_names = [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def lr_at(self, step: int) -> float:
        c = self.cfg
        return cosine_lr(step, c.lr, c.min_lr, c.warmup_steps, c.decay_steps or 1)

    def step(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        t0 = time.perf_counter()
        self.model.train()
        lr = self.lr_at(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        n = len(micro_batches)
        loss_sum = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro_batches):
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            sync = contextlib.nullcontext() if i == n - 1 else self.dp.no_sync()
            with sync:
                with autocast(self.cfg.precision, self.device):
                    _, loss = self.model(x, y)
                scaled = loss / n
                if self.scaler is not None:
                    scaled = scaled * self.scaler.scale
                scaled.backward()
            loss_sum += loss.detach().float()
        self.dp.finish_grad_sync()

        skipped, scale = False, None
        if self.scaler is not None:
            scale = self.scaler.scale
            skipped = self.scaler.unscale_and_check(self.dp.grads(), self.mesh, ("dp",))
            self.scaler.update(skipped)
        norm = self.dp.grad_norm()
        if not skipped:
            if self.cfg.grad_clip > 0:
                # Same rule as torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6), capped at 1.
                coef = torch.clamp(self.cfg.grad_clip / (norm + 1e-6), max=1.0)
                for g in self.dp.grads():
                    g.mul_(coef)
            self.optimizer.step()
        self.dp.zero_grad()

        mean_loss = loss_sum / n
        comm.all_reduce(mean_loss, self.mesh, "dp")
        mean_loss /= self.mesh.size("dp")
        self.step_count += 1
        return StepResult(self.step_count, float(mean_loss), lr, float(norm), skipped,
                          time.perf_counter() - t0, scale)

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss over ``batches`` (this rank's shares), averaged over the dp axis."""
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            with autocast(self.cfg.precision, self.device):
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += loss.float()
        total /= max(1, len(batches))
        comm.all_reduce(total, self.mesh, "dp")
        return float(total) / self.mesh.size("dp")

    # state for checkpoints: tensors only (DCP would pickle anything else) ---------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict()

    def optim_state(self) -> dict[str, torch.Tensor]:
        """Optimizer state as flat ``"<param index>.<key>"`` tensors, in optimizer parameter order."""
        out = {}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            for key, value in self.optimizer.state.get(p, {}).items():
                out[f"{self._param_names[i]}.{key}"] = value
        return out

    def optim_template(self) -> dict[str, torch.Tensor]:
        """Tensors shaped like the AdamW state, for loading a checkpoint into a fresh optimizer."""
        out = {}
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            name = self._param_names[i]
            out[f"{name}.step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            out[f"{name}.exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out[f"{name}.exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return out

    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        for i, p in enumerate(params):
            name = self._param_names[i]
            self.optimizer.state[p] = {k: flat[f"{name}.{k}"] for k in ("step", "exp_avg", "exp_avg_sq")}
