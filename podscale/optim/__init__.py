"""Optimizers and learning-rate schedules."""
from podscale.optim.schedule import cosine_lr
from podscale.optim.build import build_adamw

__all__ = ["cosine_lr", "build_adamw"]
