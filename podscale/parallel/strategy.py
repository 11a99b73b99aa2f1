"""The strategy seam: what the engine, the checkpoints and the model-parallel wrappers ask of a parallel
training strategy, declared once.

A *strategy* owns how one rank's gradients are reduced and how its optimizer steps; the
:class:`~podscale.train.engine.Engine` only sequences it (Megatron-core and torchtitan keep the same split:
the training loop knows an interface, each parallelism implements it).  Every strategy implements every
abstract method explicitly; nothing is found by attribute probing or forwarded by ``__getattr__``.

Two levels:

* :class:`Strategy` — what the engine and the checkpoint code call.  Implemented by the replicated
  :class:`~podscale.parallel.data.DataParallel` (one replica: :class:`~podscale.parallel.data.SingleReplica`), :class:`~podscale.parallel.zero.ZeroStrategy`, the
  tensor-parallel wrapper and the pipeline.
* :class:`DataParallelStrategy` — a strategy over the ``dp`` axis that a model-parallel wrapper (tensor or
  pipeline parallelism) can wrap: it also says how its gradients relate to the tp/pp sums, gives the pieces
  of the gradient it holds for the global norm, and has the explicit per-step entry points a pipeline
  schedule needs (it runs the model chunks itself, so no ``module.forward`` fires the strategy's hooks).

A *loss function* ``loss_fn(module, batch) -> scalar tensor`` comes from the task (its batch moved to the
device, run under the precision's autocast); a strategy that runs micro-batches the usual way
(:class:`LocalMicroBatches`) calls it once per micro-batch; the pipeline runs its own schedule.
"""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from podscale.parallel.sharded_state import CheckpointSource

LossFn = Callable[[nn.Module, Any], torch.Tensor]
"""``loss_fn(module, batch)``: the scalar loss of one micro-batch (autograd graph attached)."""


class Strategy(ABC):
    """One rank's training strategy.  ``module`` is the model (or this rank's part of it) it trains."""

    module: nn.Module

    # the step ---------------------------------------------------------------------------------------
    @abstractmethod
    def forward_backward(self, micro_batches: Sequence[Any], loss_scale: float | None,
                         loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of every micro-batch, gradients accumulated as the mean over all of them
        (each loss multiplied by ``loss_scale`` when given, fp16); communication only where the strategy
        overlaps it.  Returns the sum of the micro-batch losses (a 0-dim fp32 tensor, this rank's)."""

    @abstractmethod
    def forward_only(self, batches: Sequence[Any], loss_fn: LossFn) -> torch.Tensor:
        """The sum of ``batches``' losses without autograd (validation), the same on every rank that
        takes part in the model's forward (tp, pp)."""

    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context: accumulate gradients locally, no communication."""

    @abstractmethod
    def finish_grad_sync(self) -> None:
        """Wait until this rank's gradients are reduced."""

    @abstractmethod
    def grads(self) -> list[torch.Tensor]:
        """The gradient tensors this rank steps (in memory; empty where they live on disk)."""

    @abstractmethod
    def scale_grads(self, coef: float | torch.Tensor) -> None:
        """Multiply every gradient this rank steps by ``coef`` (fp16 unscaling, clipping); a strategy whose
        gradients are not in memory may defer the factor to its step."""

    @abstractmethod
    def found_inf(self) -> torch.Tensor:
        """A 1-element float tensor on the mesh's device, > 0 when this rank's gradients hold inf/NaN."""

    @abstractmethod
    def grad_norm(self) -> torch.Tensor:
        """The true global L2 norm of the whole model's gradient (every rank gets the same value)."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @abstractmethod
    def step(self, lr: float) -> None:
        """Optimizer step on what this rank owns, at learning rate ``lr``."""

    # sampling (autoregressive tasks) ------------------------------------------------------------------
    @abstractmethod
    def next_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """The (B, vocab) logits of the last position of ``idx``, on every rank (model-parallel strategies
        gather vocabulary shards and broadcast from the last stage).  Collective: every rank calls it."""

    # checkpoints: tensors only (DCP would pickle anything else) ---------------------------------------
    @abstractmethod
    def model_state(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def load_model_state(self, state: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def optim_state(self) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def optim_template(self) -> dict[str, torch.Tensor]:
        """Tensors shaped like :meth:`optim_state`'s, for DCP to load a checkpoint into."""

    @abstractmethod
    def load_optim_state(self, flat: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Release scratch state (ZeRO-Infinity swap files, hooks' pending work); safe to call twice."""


class DataParallelStrategy(Strategy):
    """A strategy over ``dp`` that tensor and pipeline parallelism wrap (replicated or ZeRO)."""

    #: True when the dp reduction is a mean that commutes with sums over tp and pp (replicated data
    #: parallelism: its all-reduce may overlap backward and the tp/pp sums follow).
    reduce_commutes: bool
    #: True when the strategy sums sequence-parallel gradients over tp itself, before its reduction (ZeRO).
    sums_sequence_parallel: bool

    @abstractmethod
    def grad_pieces(self, params: Sequence[nn.Parameter]
                    ) -> tuple[list[tuple[nn.Parameter, torch.Tensor]], bool]:
        """(parameter, the part of its reduced gradient this rank holds — or a 1-element tensor with that
        part's L2 norm where it is not in memory) for ``params``, and whether those parts are disjoint
        slices over dp (summed over dp for the norm) or replicas."""

    @abstractmethod
    def pending_grad_scale(self) -> float:
        """The factor given to :meth:`scale_grads` but applied only at the step (1.0 when none): the stored
        gradients times it are the true ones."""

    @abstractmethod
    def accumulate_locally(self, deferred: Sequence[nn.Parameter] = ()) -> None:
        """Switch to a pipeline's accumulation: micro-batches add up locally and the backward outside
        ``no_sync`` starts the reduction; gradients of ``deferred`` parameters (the tied embedding's
        pipeline copies) are reduced only in :meth:`finish_grad_sync`, after the caller summed them."""

    @abstractmethod
    def begin_forward(self) -> None:
        """Per-step work before the first forward of a step or a validation pass that a schedule runs
        without calling ``module.forward`` (ZeRO: wait for the updated parameters, gather the root)."""

    @abstractmethod
    def checkpoint_source(self) -> "CheckpointSource":
        """What this rank holds of each parameter and its optimizer state, for the checkpoint publisher of
        a model-parallel wrapper (:class:`~podscale.parallel.sharded_state.CheckpointPublisher`)."""

    @abstractmethod
    def end_forward(self) -> None:
        """Per-step work after the forwards begun by :meth:`begin_forward` (ZeRO-3: free the root unit
        after a forward without autograd)."""


class LocalMicroBatches:
    """The usual micro-batch loop, for strategies whose ``module`` runs a whole micro-batch on this rank
    (replicated, ZeRO, tensor parallelism).  Mixed into a :class:`Strategy`."""

    module: nn.Module

    def forward_backward(self, micro_batches, loss_scale, loss_fn) -> torch.Tensor:
        n = len(micro_batches)
        loss_sum = None
        for i, batch in enumerate(micro_batches):
            sync = contextlib.nullcontext() if i == n - 1 else self.no_sync()
            with sync:
                loss = loss_fn(self.module, batch)
                scaled = loss / n
                if loss_scale is not None:
                    scaled = scaled * loss_scale
                scaled.backward()
            d = loss.detach().float()
            loss_sum = d if loss_sum is None else loss_sum + d
        return loss_sum

    @torch.no_grad()
    def forward_only(self, batches, loss_fn) -> torch.Tensor:
        total = None
        for batch in batches:
            d = loss_fn(self.module, batch).float()
            total = d if total is None else total + d
        return total

    @torch.no_grad()
    def next_logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.module(idx)[0][:, -1, :]


__all__ = ["Strategy", "DataParallelStrategy", "LocalMicroBatches", "LossFn"]
