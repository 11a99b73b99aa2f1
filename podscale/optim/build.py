"""Building optimizers with the usual parameter groups."""
from __future__ import annotations

import torch
import torch.nn as nn


def param_groups(module: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (dim >= 2) only; biases, norms and 1-D parameters are not decayed."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_adamw(module: nn.Module, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter 2019) with torch's fused kernel, which runs on CPU and CUDA."""
    return torch.optim.AdamW(param_groups(module, weight_decay), lr=lr, betas=betas, eps=eps, fused=True)
