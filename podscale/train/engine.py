"""The training engine: one optimizer step over a list of micro-batches, on any layout of the mesh.

``Engine.step`` first tells every module of the model that keeps state over a step's micro-batches that a
step begins (:class:`~podscale.parallel.model_protocols.StepState`), then runs forward/backward on each
micro-batch (communication only on the last, through the strategy's ``no_sync``), waits for the gradient
reduction, unscales and checks fp16 overflow, clips by the global gradient norm, steps the optimizer with
the scheduled learning rate and returns the loss averaged over the whole global batch.

A *strategy* (:class:`~podscale.parallel.strategy.Strategy`) owns how gradients are reduced and how the
optimizer steps; the engine only sequences it, through the protocol's methods.

The engine knows no model family: batches are opaque and the loss is the task's ``loss_fn`` (see
:mod:`podscale.tasks`); sampling text is the GPT task's (:func:`podscale.tasks.gpt.generate`).
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from podscale.config import TrainSection
from podscale.optim import cosine_lr
from podscale.parallel.model_protocols import StepState
from podscale.parallel.strategy import LossFn, Strategy
from podscale.runtime import comm
from podscale.runtime.exit import at_exit
from podscale.runtime.mesh import AXES
from podscale.train.precision import DynamicLossScaler


_OPEN: "weakref.WeakSet[Engine]" = weakref.WeakSet()


@at_exit
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
    """Owns the parallel model, the strategy and the loss scaler; ``step(micro_batches)`` trains."""

    def __init__(self, model: nn.Module, mesh, train: TrainSection, strategy: Strategy, loss_fn: LossFn):
        """``strategy`` reduces gradients and steps the optimizer (:mod:`podscale.parallel.strategy`);
        ``loss_fn(module, batch)`` is the task's loss for one of the task's batches, moved to the device and
        run under the precision's autocast (:meth:`podscale.tasks.Task.loss_fn`).  The engine never looks
        inside a batch."""
        self.mesh, self.cfg = mesh, train
        self.device = mesh.device
        self.model = model.to(self.device)
        #: the modules that keep state over a step's micro-batches, told at every step's start
        self.step_states = [m for m in self.model.modules() if isinstance(m, StepState)]
        self.strategy = strategy
        self.loss_fn = loss_fn
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

    def step(self, micro_batches: list) -> StepResult:
        """One optimizer step over this rank's ``micro_batches`` (the task's batches)."""
        if self.closed:
            raise RuntimeError("Engine.step after close(): build a new engine with podscale.parallelize")
        t0 = time.perf_counter()
        self.model.train()
        for m in self.step_states:
            m.start_step()
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
        comm.all_reduce(mean_loss, self.mesh, self.mesh.data_axes)
        mean_loss /= self.mesh.size(*self.mesh.data_axes)
        self.step_count += 1
        # one device-to-host copy for both figures (each float() of a device tensor is a synchronisation)
        loss_f, norm_f = torch.stack([mean_loss.reshape(()).float(), norm.reshape(()).float()]).tolist()
        return StepResult(self.step_count, loss_f, lr, norm_f, skipped, time.perf_counter() - t0, scale)

    @torch.no_grad()
    def evaluate(self, batches: list, metric: LossFn | None = None) -> float:
        """The mean of ``metric(module, batch)`` (default: the loss) over ``batches`` (this rank's shares),
        averaged over the data ranks (dp, and ep when > 1); every rank gets the same value.  A pipeline runs only the GPT, whose
        chunks compute its loss themselves (its only metric)."""
        self.model.eval()
        total = self.strategy.forward_only(batches, metric if metric is not None else self.loss_fn)
        total = total if total is not None else torch.zeros((), device=self.device)
        total = total / max(1, len(batches))
        comm.all_reduce(total, self.mesh, self.mesh.data_axes)
        return float(total) / self.mesh.size(*self.mesh.data_axes)

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
