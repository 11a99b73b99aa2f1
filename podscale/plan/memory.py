"""Memory per device: model states per ZeRO stage and activations per transformer layer.

Model states are ZeRO's (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC'20, Sec. 3 and Fig. 1): 2 + 2 + K = 12 bytes per parameter of 16-bit parameters,
16-bit gradients and fp32 Adam state, partitioned over the data-parallel ranks by stage. There is one
ZeRO memory model in podscale, :func:`podscale.parallel.zero.memory.estimate_model_states`, which
``podscale memory`` prints and which is tested against what ZeRO runs allocate; the planner sums its
lines by where they live (:func:`zero_model_state_bytes`). DeepSpeed's own estimators
(``deepspeed_zero2_estimate`` / ``deepspeed_zero3_estimate``) live there too and are re-exported here.

Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), Sec. 4 and Table 2, bytes per layer with s = sequence, b = micro-batch, h = hidden,
a = heads, t = tensor-parallel size:

    no parallelism            s b h (34 + 5 a s / h)
    tensor parallel           s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence par.    s b h (34 + 5 a s / h) / t
    selective recompute       the 5 a s / h term disappears
    full recompute            2 s b h (the layer input only; / t with sequence parallelism)

The 24 of "10 + 24/t" is the tensor-parallel part of the attention (8) and MLP (16 = 4 ffn/h)
blocks; a general ffn width and MoE layers (the busiest ep rank's expert rows per token, top_k times
:meth:`podscale.plan.models.GPT.expert_load`) scale the MLP part, which reduces to Korthikanti's numbers
at ffn = 4h, dense.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from podscale.parallel.zero.memory import (deepspeed_zero2_estimate, deepspeed_zero3_estimate,  # noqa: F401
                                          estimate_model_states)

@dataclass(frozen=True)
class ModelStateBytes:
    device: float
    host: float          # CPU memory (offload)
    nvme: float          # NVMe (offload to nvme)

    @property
    def total(self) -> float:
        return self.device + self.host + self.nvme


def precision_of(dtype_bytes: int) -> str:
    """The training precision a device's element size stands for: 16-bit mixed precision or fp32 (CPU)."""
    return "fp32" if dtype_bytes == 4 else "bf16"


@lru_cache(maxsize=65536)
def zero_model_state_bytes(params: float, dp: int, stage: int, offload_optimizer: str = "none",
                           offload_param: str = "none", precision: str = "bf16") -> ModelStateBytes:
    """Bytes of parameters, gradients and Adam state held per data-parallel rank, summed by where they
    live. The formulas are :func:`podscale.parallel.zero.memory.estimate_model_states` (ZeRO paper,
    Fig. 1, with what podscale's ZeRO allocates), the one ZeRO memory model that ``podscale memory``
    prints too; ``params`` is what this rank's replica holds (already divided by tp and pp)."""
    est = estimate_model_states(params, dp, stage, precision, offload_optimizer, offload_param)
    return ModelStateBytes(device=est.device_states, host=sum(est.host.values()), nvme=sum(est.nvme.values()))


def zero3_gathered_bytes(largest_layer: float, precision: str = "bf16") -> float:
    """Stage 3's gathered blocks on the device (current + prefetched), from the same estimator."""
    return estimate_model_states(largest_layer, 1, 3, precision, largest_layer=largest_layer).device["gather"]


def activation_bytes_per_layer(seq: int, microbatch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               ffn: int | None = None, mlp_scale: float = 1.0, gelu_recompute: bool = False,
                               shared_ffn: int = 0, expert_rows_gathered: int = 1) -> float:
    """Activation bytes one transformer layer keeps for its backward pass (Korthikanti et al. 2022,
    Table 2; module docstring). ``mlp_scale`` is top_k * ``GPT.expert_load(ep)`` for an MoE layer;
    ``gelu_recompute``: the MLP keeps its GELU's input only (the output is evaluated again in the backward:
    podscale's ``model.expert_recompute``, Megatron-core's ``recompute_modules = ["moe_act"]``);
    ``shared_ffn``: an MoE layer's shared-expert MLP, which every token passes through and which keeps its
    GELU's input and output as a dense MLP of that width does (its input is the routed experts');
    ``expert_rows_gathered``: the tp ranks whose exchanged rows each rank's experts run (expert tensor
    parallelism: tp, the experts 1/tp as wide, so their GELU keeps the same bytes as whole experts on a rank's
    own rows), whose gathered inputs, beyond the rank's own, the experts keep for their weight gradients, and
    so does the shared-expert MLP, split the same way, of its gathered tokens."""
    s, b, h, a, t = seq, microbatch, hidden, heads, tp
    f = 4 * h if ffn is None else ffn
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    replicated = 10 * sbh                                 # layer-norm inputs, linear inputs, dropout masks
    gelu = 2 if gelu_recompute else 4                     # the GeLU's input (and output): 2 bytes x f each
    # Q, K, V, attention-out input, MLP GeLU in/out (the routed rows', then the shared experts' on every token)
    gathered = mlp_scale + (1 if shared_ffn else 0)      # rows per token that split MLPs gather over tp
    sharded = (8 + (gelu * f * mlp_scale + 4 * shared_ffn) / h + 2 * gathered * (expert_rows_gathered - 1)) * sbh
    attention = 5 * a * s * s * b                         # softmax output, dropout mask and output
    if recompute == "selective":
        attention = 0.0
    elif recompute != "none":
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if sequence_parallel:
        return (replicated + sharded + attention) / t
    return replicated + (sharded + attention) / t


def pipeline_inflight_layers(layers_per_stage: float, pp: int, microbatches: int, schedule: str,
                             interleave: int = 1, rank: int = 0) -> float:
    """Layers' worth of activations pipeline rank ``rank`` holds at its peak (Korthikanti et al. 2022,
    Sec. 4.2.3; Narayanan et al. SC'21, Sec. 2.2): GPipe keeps all m micro-batches; 1F1B keeps the
    pp - rank micro-batches it runs forward before its first backward; interleaved 1F1B warms up
    2 (pp - rank - 1) + (v - 1) pp chunk passes, plus the one in flight, of layers/v each, which is
    p (1 + (p-1)/(p v)) micro-batches' worth on rank 0."""
    if pp == 1:
        return layers_per_stage
    if schedule == "gpipe":
        return layers_per_stage * microbatches
    if schedule == "interleaved":
        chunks = min(microbatches * interleave, 2 * (pp - rank - 1) + (interleave - 1) * pp + 1)
        return layers_per_stage / interleave * chunks
    return layers_per_stage * min(microbatches, pp - rank)
