"""Reproduce Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21, Table 1: weak scaling of GPT from 1.7B to 1T parameters on Selene (DGX A100 80GB,
HDR InfiniBand), seq 2048, vocab 51,200, fp16, full activation recomputation; throughput counts the
recompute FLOPs, 96 B s l h^2 (1 + s/6h + V/16lh) per iteration.

Every row uses the same system description (``dgx-a100-80g``) and the same software settings of
Megatron-LM at the time: gradients all-reduced after the backward pass (its "local" DDP, no overlap),
no sequence parallelism (introduced in 2022). Micro-batch sizes and interleaving are those of the
paper's artifact (the issue lists them): 16,16,16,8,4,2,2,1,1,1 and 5,5,3,1 layers per virtual stage
for the 76B, 145B, 310B and 530B models.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cost import predict
from .hardware import load_system
from .layout import Layout
from .models import GPT, MEGATRON_TABLE1

# name: (tp, pp, gpus, batch, microbatch, layers per virtual stage or 0, published TFLOP/s per GPU)
TABLE1_LAYOUTS = {
    "megatron-1.7b": (1, 1, 32, 512, 16, 0, 137),
    "megatron-3.6b": (2, 1, 64, 512, 16, 0, 138),
    "megatron-7.5b": (4, 1, 128, 512, 16, 0, 142),
    "megatron-18b": (8, 1, 256, 1024, 8, 0, 135),
    "megatron-39b": (8, 2, 512, 1536, 4, 0, 138),
    "megatron-76b": (8, 4, 1024, 1792, 2, 5, 140),
    "megatron-146b": (8, 8, 1536, 2304, 2, 5, 148),
    "megatron-310b": (8, 16, 1920, 2160, 1, 3, 155),
    "megatron-530b": (8, 35, 2520, 2520, 1, 1, 163),
    "megatron-1t": (8, 64, 3072, 3072, 1, 0, 163),
}
PUBLISHED_PARAMS_B = {"megatron-1.7b": 1.7, "megatron-3.6b": 3.6, "megatron-7.5b": 7.5, "megatron-18b": 18.4,
                      "megatron-39b": 39.1, "megatron-76b": 76.1, "megatron-146b": 145.6,
                      "megatron-310b": 310.1, "megatron-530b": 529.6, "megatron-1t": 1008.0}


@dataclass
class Row:
    name: str
    layout: Layout
    gpus: int
    batch: int
    published: float
    predicted: float
    params_b: float

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


def narayanan_flops(model: GPT, batch: int) -> float:
    """96 B s l h^2 (1 + s/6h + V/16lh): FLOPs per iteration with full recomputation (Sec. 5.1)."""
    B, s, l, h, V = batch, model.seq, model.layers, model.hidden, model.vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def table1(system="dgx-a100-80g") -> list[Row]:
    system = load_system(system) if isinstance(system, str) else system
    rows = []
    for name, (tp, pp, gpus, batch, mb, per_virtual, published) in TABLE1_LAYOUTS.items():
        heads, hidden, layers = MEGATRON_TABLE1[name]
        model = GPT(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200, name=name)
        v = layers // pp // per_virtual if per_virtual else 1
        lay = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), microbatch=mb, interleave=v, recompute="full",
                     overlap_grad_reduce=False)
        pred = predict(system, gpus, model, lay, batch)
        tflops = narayanan_flops(model, batch) / (pred.step_time_s * gpus) / 1e12
        rows.append(Row(name, lay, gpus, batch, published, tflops, model.params / 1e9))
    return rows


def summary(rows: list[Row]) -> tuple[float, float]:
    errs = [abs(r.error) for r in rows]
    return sum(errs) / len(errs), max(errs)


def format_table(rows: list[Row]) -> str:
    lines = [f"{'model':<15}{'params':>8} {'layout':<24}{'GPUs':>6}{'batch':>7}{'published':>11}"
             f"{'predicted':>11}{'error':>9}"]
    for r in rows:
        lines.append(f"{r.name:<15}{r.params_b:>7.1f}B {r.layout.short():<24}{r.gpus:>6}{r.batch:>7}"
                     f"{r.published:>11.0f}{r.predicted:>11.1f}{100 * r.error:>+8.1f}%")
    mean, worst = summary(rows)
    lines.append(f"TFLOP/s per GPU; mean |error| {100 * mean:.1f}%, max |error| {100 * worst:.1f}% "
                 "(goal: mean <= 3%, max <= 8%)")
    return "\n".join(lines)
