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

import dataclasses
from dataclasses import dataclass

from .cost import predict
from .hardware import System, as_system, load_system
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
    published: float            # TFLOP/s per GPU, or seconds per iteration when ``metric`` is "seconds"
    predicted: float
    params_b: float
    metric: str = "tflops"
    system: str = "dgx-a100-80g"
    source: str = ""

    @property
    def error(self) -> float:
        """Relative error of the predicted throughput (positive: predicted faster than published)."""
        if self.metric == "seconds":
            return self.published / self.predicted - 1
        return (self.predicted - self.published) / self.published


def narayanan_flops(model: GPT, batch: int) -> float:
    """96 B s l h^2 (1 + s/6h + V/16lh): FLOPs per iteration with full recomputation (Sec. 5.1)."""
    B, s, l, h, V = batch, model.seq, model.layers, model.hidden, model.vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def table1(system="dgx-a100-80g") -> list[Row]:
    system = as_system(system)
    rows = []
    for name, (tp, pp, gpus, batch, mb, per_virtual, published) in TABLE1_LAYOUTS.items():
        heads, hidden, layers = MEGATRON_TABLE1[name]
        model = GPT(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200, name=name)
        v = layers // pp // per_virtual if per_virtual else 1
        lay = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), microbatch=mb, interleave=v, recompute="full",
                     overlap_grad_reduce=False)
        pred = predict(system, gpus, model, lay, batch)
        tflops = narayanan_flops(model, batch) / (pred.step_time_s * gpus) / 1e12
        rows.append(Row(name, lay, gpus, batch, published, tflops, model.params / 1e9, system=system.name,
                        source="Narayanan et al. SC'21, Table 1"))
    return rows


# Published large-model training runs the planner is *not* fitted to. Each entry:
# (name, model, system, layout, GPUs, global batch, published value, metric, source).
_K22 = "Korthikanti et al. 2022 (arXiv:2205.05198), Table 3 (layouts) and Table 5 (iteration time)"
_KLAY = "; micro-batch and interleaving as in Calculon's validation configs (Isaev et al. SC'23)"


def _k(name, layers, hidden, heads):
    return GPT(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=51200, name=name)


def _korthikanti():
    runs = []
    models = {"22B": (_k("megatron-22b", 48, 6144, 64), 1, 8, 4, 4, 1, 1.42, 1.10),
              "175B": (_k("gpt-175b", 96, 12288, 96), 8, 64, 64, 1, 3, 18.13, 13.75),
              "530B": (_k("mt-nlg-530b", 105, 20480, 128), 35, 280, 280, 1, 3, 49.05, 37.83),
              "1T": (_k("megatron-1t", 128, 25600, 160), 64, 512, 512, 1, 1, 94.42, 71.49)}
    for label, (model, pp, gpus, batch, mb, v, full, seqsel) in models.items():
        even = (model.layers // (pp * v),) * (pp * v)      # Megatron's even split
        # Megatron-LM of 2022: asynchronous tensor-parallel backward (--async-tensor-model-parallel-allreduce)
        base = dict(tp=8, pp=pp, dp=gpus // (8 * pp), microbatch=mb, interleave=v, overlap_grad_reduce=False,
                    pipeline_layers=even, tp_overlap=True)
        runs.append((f"{label} full recompute", model, "dgx-a100-80g", Layout(**base, recompute="full"),
                     gpus, batch, full, "seconds", _K22 + _KLAY))
        runs.append((f"{label} seq-par + selective", model, "dgx-a100-80g",
                     Layout(**base, recompute="selective", sequence_parallel=True),
                     gpus, batch, seqsel, "seconds", _K22 + _KLAY))
    return runs


def _mt_nlg():
    # Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B" (arXiv:2201.11990),
    # Sec. 2.4: batch 1920 on 280 / 350 / 420 DGX A100 nodes, 60.1 / 50.2 / 44.4 s per iteration
    # (126 / 121 / 113 TFLOP/s per GPU); tp 8 x pp 35, data parallel across the remaining nodes, micro-batch 1,
    # activation checkpointing, DeepSpeed's pipeline engine (no interleaving, even split of the 105 layers).
    # Its stage sends are partitioned over the tensor-parallel group and all-gathered on arrival
    # (deepspeed/runtime/pipe/engine.py: PartitionedTensor when ``pipeline.pipe_partitioned``, default True
    # in deepspeed/runtime/config.py), like Megatron's scatter-gather; its gradient all-reduce runs after the
    # last micro-batch (schedule.py TrainSchedule: ReduceTiedGrads, ReduceGrads, OptimizerStep at the last
    # step), which overlap_grad_reduce = False models.
    model = _k("mt-nlg-530b", 105, 20480, 128)
    runs = []
    for nodes, sec in ((280, 60.1), (350, 50.2), (420, 44.4)):
        gpus = nodes * 8
        lay = Layout(tp=8, pp=35, dp=gpus // 280, microbatch=1, recompute="full", overlap_grad_reduce=False,
                     pipeline_layers=(3,) * 35)
        runs.append((f"MT-NLG 530B, {gpus} GPUs", model, "dgx-a100-80g", lay, gpus, 1920, sec, "seconds",
                     "Smith et al. 2022 (arXiv:2201.11990), Sec. 2.4"))
    return runs


def _bloom():
    # Le Scao et al. 2022, "BLOOM" (arXiv:2211.05100), Sec. 3.4 and the BigScience 176B training page: 70 layers,
    # hidden 14336, 112 heads, vocabulary 250,880, seq 2048, global batch 2048, 384 A100 80GB on Jean Zay,
    # tp 4 x pp 12 x dp 8, micro-batch 2, activation checkpointing, ZeRO-1, bf16: "about 150 TFLOP/s" per GPU.
    # 70 layers on 12 stages do not divide: Megatron-DeepSpeed balances them (the planner's default split);
    # DeepSpeed's pipeline engine partitions its stage sends over tp as MT-NLG's (above).
    model = GPT(layers=70, hidden=14336, heads=112, seq=2048, vocab=250880, name="bloom-176b")
    lay = Layout(tp=4, pp=12, dp=8, microbatch=2, recompute="full", zero_stage=1, overlap_grad_reduce=False)
    return [("BLOOM 176B", model, "jean-zay-a100", lay, 384, 2048, 150.0, "tflops",
             "Le Scao et al. 2022 (arXiv:2211.05100), Sec. 3.4; bigscience.notion.site 176B training page")]


def _palm():
    # Chowdhery et al. 2022, "PaLM" (arXiv:2204.02311): 540B, 118 layers, d_model 18,432, 48 heads of 256
    # (multi-query), SwiGLU d_ff 73,728, vocabulary 256k, seq 2048, no biases, "parallel" layers (attention and
    # MLP on the same layer norm, summed). Sec. 4 / Table 3: 6144 TPU v4 chips in two pods of 3072, 46.2 % MFU
    # (57.8 % HFU, rematerialisation included); within a pod 12-way model parallelism x 256-way fully sharded
    # data parallelism (weights sharded over both axes: tensor parallelism + ZeRO-3 here), 2-way data
    # parallelism across the pods over the data-centre network. MFU counts 6N + 12 L H Q T FLOPs per token
    # (Appendix B), so 46.2 % of 6144 x 275 TFLOP/s is 238k tokens/s: 17.6 s for the final 2048-sequence batch.
    # Modelled: one pod, its 1024 sequences, on a 12 x 16 x 16 slice of the 3-D torus (3 x 4 x 4 cubes of
    # 4 x 4 x 4 chips); the cross-pod gradient exchange is not modelled. The GPT description carries PaLM's
    # parameters and GEMM FLOPs: multi-query attention has 2 h x 12,288 + 2 h x 256 weights rather than 4 h^2,
    # so ffn = 86,256 in the two-matrix form gives 540.35B parameters (PaLM: 540.35B). Its attention scores
    # are counted over h = 18,432 (PaLM: 12,288), +0.6 % of the FLOPs. PaLM does not state a micro-batch:
    # 4 sequences per chip-group would need 41 GiB of the 32, 2 fit (two micro-batches). Rematerialisation:
    # HFU / MFU = 1.25 means about 3/4 of a forward is recomputed; "full" recomputes all of it (the model is
    # ~6 % slow on that account). XLA overlaps the input-gradient collective with the weight gradient, as
    # tp_overlap does.
    model = GPT(layers=118, hidden=18432, heads=48, seq=2048, vocab=256000, ffn=86256, name="palm-540b")
    mfu_flops_per_token = 6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048
    seconds = 2048 * 2048 / (0.462 * 6144 * 275e12 / mfu_flops_per_token)
    lay = Layout(tp=12, dp=256, microbatch=2, zero_stage=3, recompute="full", tp_overlap=True,
                 parallel_block=True)
    return [("PaLM 540B, 2 x 3072 TPU v4", model, ("tpu-v4-pod", {"torus": (12, 16, 16), "max_devices": 3072}),
             lay, 3072, 1024, seconds, "seconds",
             "Chowdhery et al. 2022, PaLM (arXiv:2204.02311), Sec. 4, Table 3 and Appendix B")]


# MosaicML's MPT benchmarks (mosaicml/llm-foundry, scripts/train/benchmarking/README.md, 2023): the same
# training code on H100 80GB, A100 80GB and A100 40GB nodes of 8 GPUs (H100: 8 x 400 Gb/s InfiniBand; A100:
# "1600 Gbps node-node interconnect", 8 x 200 Gb/s, as dgx-a100-80g / dgx-a100-40g), bf16, PyTorch FSDP
# FULL_SHARD over all GPUs (ZeRO-3), FlashAttention, vocabulary 50,432. MPT: 7B 32 x 4096 (32 heads), 13B
# 40 x 5120 (40), 30B 48 x 7168 (64), 70B 80 x 8192 (64). Rows taken, chosen before predicting any: for each
# system and size, the sequence-2048 row with the most GPUs. Published: tokens/s per GPU; here seconds per
# global batch = batch x 2048 / (tokens/s/GPU x GPUs).
MPT_DIMS = {"7b": (32, 4096, 32), "13b": (40, 5120, 40), "30b": (48, 7168, 64), "70b": (80, 8192, 64)}
# system: [(size, GPUs, micro-batch, accumulation, activation checkpointing, tokens/s/GPU)], README tables
# "H100 80GB BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "A100 40GB with 1600 Gbps ..."
MPT_RUNS = {
    "dgx-h100": [("7b", 8, 6, 1, False, 10643), ("13b", 64, 2, 1, False, 4800), ("30b", 32, 14, 3, True, 2308),
                 ("70b", 64, 8, 4, True, 1039)],
    "dgx-a100-80g": [("7b", 8, 6, 2, False, 4641), ("13b", 8, 2, 3, False, 2262), ("30b", 8, 3, 21, True, 916),
                     ("70b", 64, 8, 4, True, 410)],
    "dgx-a100-40g": [("7b", 128, 18, 1, True, 3623), ("13b", 128, 16, 1, True, 1972),
                     ("30b", 128, 6, 1, True, 865), ("70b", 128, 4, 1, True, 376)],
}
_MPT_GPU = {"dgx-h100": "H100", "dgx-a100-80g": "A100-80GB", "dgx-a100-40g": "A100-40GB"}


def _mpt():
    runs = []
    for system, rows in MPT_RUNS.items():
        for size, gpus, mb, accum, ckpt, tps in rows:
            layers, hidden, heads = MPT_DIMS[size]
            model = GPT(layers=layers, hidden=hidden, heads=heads, seq=2048, vocab=50432, name=f"mpt-{size}")
            batch = gpus * mb * accum
            lay = Layout(dp=gpus, microbatch=mb, zero_stage=3, recompute="full" if ckpt else "none",
                         fused_attention=True)
            runs.append((f"MPT {size.upper()}, {gpus} {_MPT_GPU[system]}", model, system, lay, gpus, batch,
                         batch * 2048 / (tps * gpus), "seconds",
                         "MosaicML llm-foundry 2023, scripts/train/benchmarking/README.md"))
    return runs


def validation_runs() -> list:
    return _korthikanti() + _mt_nlg() + _bloom() + _palm() + _mpt()


def _resolve(sysname, systems: dict) -> System:
    """A system by name, or (name, overrides) for the slice of a larger machine a run used (PaLM's pod)."""
    name, overrides = (sysname, {}) if isinstance(sysname, str) else sysname
    system = systems.get(name) or load_system(name)
    return dataclasses.replace(system, **overrides) if overrides else system


def system_label(sysname) -> str:
    if isinstance(sysname, str):
        return sysname
    name, overrides = sysname
    torus = overrides.get("torus")
    return f"{name} [{'x'.join(map(str, torus))}]" if torus else name


def validation_set(systems: dict | None = None) -> list[Row]:
    """Predict every run of the validation set (nothing in the planner is fitted to these)."""
    rows = []
    systems = dict(systems or {})
    for name, model, sysname, lay, gpus, batch, published, metric, source in validation_runs():
        system = _resolve(sysname, systems)
        pred = predict(system, gpus, model, lay, batch)
        value = pred.step_time_s if metric == "seconds" else \
            narayanan_flops(model, batch) / (pred.step_time_s * gpus) / 1e12
        rows.append(Row(name, lay, gpus, batch, published, value, model.params / 1e9, metric,
                        system_label(sysname), source))
    return rows


# A system description counts as validated when at least one published run on it, outside the fitting set,
# is predicted within this relative error (its TOML file lists those runs under ``validated``).
VALIDATED_WITHIN = 0.10


def best_error_by_system(rows: list[Row]) -> dict:
    """{system name: smallest |error| of its validation runs} (a slice such as PaLM's counts for its system)."""
    best: dict = {}
    for r in rows:
        name = r.system.split(" [")[0]
        best[name] = min(best.get(name, float("inf")), abs(r.error))
    return best


EFFICIENCY_GRID = tuple(i / 100 for i in range(60, 91))


def _with_efficiency(system: System, e: float) -> System:
    return dataclasses.replace(system, device=dataclasses.replace(system.device, matmul_efficiency=e))


def fitting_curve(system="dgx-a100-80g", grid=EFFICIENCY_GRID) -> dict:
    """Table 1 errors for each candidate matmul efficiency: {e: [error of each row]}."""
    system = as_system(system)
    return {e: [r.error for r in table1(_with_efficiency(system, e))] for e in grid}


def fit_efficiency(curve: dict, rows: list[int] | None = None) -> float:
    """The grid value with the smallest mean |error| over ``rows`` (all rows by default)."""
    n = len(next(iter(curve.values())))
    keep = range(n) if rows is None else rows
    return min(curve, key=lambda e: sum(abs(curve[e][i]) for i in keep))


def leave_one_out(system="dgx-a100-80g", curve: dict | None = None) -> list[tuple[float, float]]:
    """Fit the matmul efficiency on nine Table 1 rows and predict the tenth, for each row:
    [(efficiency fitted without the row, the row's error with it)]."""
    curve = curve or fitting_curve(system)
    n = len(next(iter(curve.values())))
    out = []
    for k in range(n):
        e = fit_efficiency(curve, [i for i in range(n) if i != k])
        out.append((e, curve[e][k]))
    return out


def summary(rows: list) -> tuple[float, float]:
    """(mean |error|, max |error|) of Rows or of plain error values."""
    errs = [abs(r.error if isinstance(r, Row) else r) for r in rows]
    return sum(errs) / len(errs), max(errs)


def format_table(rows: list[Row], goal: bool = True) -> str:
    lines = [f"{'run':<30}{'params':>8} {'layout':<38}{'GPUs':>6}{'batch':>7}{'published':>11}"
             f"{'predicted':>11}{'error':>9}"]
    for r in rows:
        unit = "s" if r.metric == "seconds" else ""
        lines.append(f"{r.name:<30}{r.params_b:>7.1f}B {r.layout.short():<38}{r.gpus:>6}{r.batch:>7}"
                     f"{r.published:>10.2f}{unit or ' '}{r.predicted:>10.2f}{unit or ' '}{100 * r.error:>+8.1f}%")
    mean, worst = summary(rows)
    lines.append(f"TFLOP/s per GPU (s: seconds per iteration); error of the predicted throughput; "
                 f"mean |error| {100 * mean:.1f}%, max |error| {100 * worst:.1f}%"
                 + (" (goal: mean <= 3%, max <= 8%)" if goal else ""))
    return "\n".join(lines)
