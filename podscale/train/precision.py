"""Mixed precision: autocast contexts and dynamic loss scaling for fp16.

bf16 and fp16 run the forward/backward matmuls in 16 bits under ``torch.autocast`` while parameters,
gradients and optimizer state stay fp32 (the master weights of Micikevicius et al. 2018).  fp16 needs loss
scaling: the loss is multiplied by ``S`` before backward; a step whose gradients overflow is skipped and
``S`` halves; after ``window`` clean steps ``S`` doubles (the dynamic scheme of Micikevicius et al. 2018,
section 3.2).  The overflow decision is all-reduced so every rank skips the same steps even when gradients
are sharded.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from podscale.runtime import comm

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    """The autocast context for ``precision`` ("fp32" runs without one)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def nonfinite_flag(grads: list[torch.Tensor]) -> torch.Tensor:
    """A 1-element float tensor, > 0 when any of ``grads`` holds inf or NaN."""
    found = torch.zeros(1, device=grads[0].device if grads else "cpu")
    for g in grads:
        found += (~torch.isfinite(g)).any().float()
    return found


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, window: int = 1000, factor: float = 2.0,
                 min_scale: float = 1.0):
        self.scale, self.window, self.factor, self.min_scale = float(init_scale), window, factor, min_scale
        self.good_steps = 0

    def unscale_and_check(self, grads: list[torch.Tensor], mesh=None, axes=()) -> bool:
        """Divide ``grads`` by the scale in place; True when any rank (over ``axes``) saw inf or NaN."""
        for g in grads:
            g.mul_(1.0 / self.scale)
        return self.check(nonfinite_flag(grads), mesh, axes)

    def check(self, found: torch.Tensor, mesh=None, axes=()) -> bool:
        """True when ``found`` (this rank's 1-element inf/NaN flag) is set on any rank over ``axes``."""
        found = found.float().reshape(1).clone()
        if mesh is not None and axes:
            found = found.to(mesh.device)  # NCCL reduces device tensors; offloaded flags are on the host
            comm.all_reduce(found, mesh, axes, op=dist.ReduceOp.MAX)
        return bool(found.item() > 0)

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / self.factor, self.min_scale)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= self.factor
                self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
