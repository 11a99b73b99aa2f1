"""Learning-rate schedules."""
import math


def cosine_lr(step: int, lr: float, min_lr: float, warmup: int, decay_steps: int) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine decay to ``min_lr`` at ``decay_steps``
    (Loshchilov & Hutter 2017, without restarts); ``min_lr`` afterwards."""
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup) / max(1, decay_steps - warmup)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
