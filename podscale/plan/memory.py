"""Memory per device: model states per ZeRO stage and activations per transformer layer.

Model states follow Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (SC'20), Sec. 3 and Fig. 1: mixed-precision Adam keeps 2 bytes of fp16 parameters,
2 bytes of fp16 gradients and K = 12 bytes of fp32 optimizer state (master weights, momentum,
variance) per parameter; ZeRO stage 1 partitions the optimizer state over the Nd data-parallel ranks,
stage 2 also the gradients, stage 3 also the parameters:

    stage 0: (2 + 2 + K) P        stage 1: 2P + 2P + K P / Nd
    stage 2: 2P + (2 + K) P / Nd  stage 3: (2 + 2 + K) P / Nd

``deepspeed_zero2_estimate`` / ``deepspeed_zero3_estimate`` reproduce the formulas of DeepSpeed's
``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs`` (which assume
fp32 gradient partitions, hence 16 and 18 bytes), so ``podscale memory`` can print both.

Activations follow Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models" (2022), Sec. 4 and Table 2, bytes per layer with s = sequence, b = micro-batch, h = hidden,
a = heads, t = tensor-parallel size:

    no parallelism            s b h (34 + 5 a s / h)
    tensor parallel           s b h (10 + 24/t + 5 a s / (h t))
    tensor + sequence par.    s b h (34 + 5 a s / h) / t
    selective recompute       the 5 a s / h term disappears
    full recompute            2 s b h (the layer input only; / t with sequence parallelism)

The 24 of "10 + 24/t" is the tensor-parallel part of the attention (8) and MLP (16 = 4 ffn/h)
blocks; a general ffn width and MoE layers (top_k * capacity_factor tokens per expert MLP) scale the
MLP part, which reduces to Korthikanti's numbers at ffn = 4h, dense.
"""
from __future__ import annotations

from dataclasses import dataclass

PARAM_BYTES = 2          # fp16/bf16 weights
GRAD_BYTES = 2           # fp16/bf16 gradients
OPTIMIZER_BYTES = 12     # fp32 master weights + Adam m + v


@dataclass(frozen=True)
class ModelStateBytes:
    device: float
    host: float          # CPU memory (offload)
    nvme: float          # NVMe (offload to nvme)

    @property
    def total(self) -> float:
        return self.device + self.host + self.nvme


def zero_model_state_bytes(params: float, dp: int, stage: int, offload_optimizer: str = "none",
                           offload_param: str = "none", param_bytes: int = PARAM_BYTES,
                           grad_bytes: int = GRAD_BYTES, optimizer_bytes: int = OPTIMIZER_BYTES
                           ) -> ModelStateBytes:
    """Bytes of parameters, gradients and Adam state held per data-parallel rank (ZeRO paper, Fig. 1).

    ``params`` is the number of parameters this rank's replica holds (already divided by tensor and
    pipeline parallelism). Offloaded optimizer state (ZeRO-Offload, Ren et al. 2021) moves the K-byte
    partition, and for stage >= 2 the gradient partition it updates, to CPU or NVMe; offloaded
    parameters (ZeRO-Infinity, Rajbhandari et al. 2021) move the stage-3 parameter partition too.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0..3, got {stage}")
    if dp < 1:
        raise ValueError("dp must be >= 1")
    p, g, k = params * param_bytes, params * grad_bytes, params * optimizer_bytes
    shard_p = p / dp if stage >= 3 else p
    shard_g = g / dp if stage >= 2 else g
    shard_k = k / dp if stage >= 1 else k
    moved = {"none": 0.0, "cpu": 0.0, "nvme": 0.0}   # bytes moved off the device, by target
    device_bytes = shard_p + shard_g + shard_k
    if offload_optimizer != "none":
        # The optimizer runs where its state lives, so the gradient partition it consumes goes along.
        opt = shard_k + (shard_g if stage >= 2 else 0.0)
        device_bytes -= opt
        moved[offload_optimizer] += opt
    if offload_param != "none":
        if stage != 3:
            raise ValueError("offload_param needs ZeRO stage 3")
        device_bytes -= shard_p
        moved[offload_param] += shard_p
    return ModelStateBytes(device=device_bytes, host=moved["cpu"], nvme=moved["nvme"])


def deepspeed_zero2_estimate(total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1,
                             cpu_offload: bool = True, additional_buffer_factor: float = 1.5
                             ) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes) as DeepSpeed's ZeRO-2 estimator computes them (stage_1_and_2.py):
    GPU 4P + 16P/N without offload, 2P with; CPU 4P per GPU of a node (buffer factor 1.5), or
    max(4N, 16) P with offload."""
    n = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * n, 16) * additional_buffer_factor
    else:
        gpu = 4 * total_params + int(16 * total_params / n)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def deepspeed_zero3_estimate(total_params: float, largest_layer_params: float, num_gpus_per_node: int = 1,
                             num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                             zero_init: bool = True, additional_buffer_factor: float = 1.5
                             ) -> tuple[int, int]:
    """(cpu_bytes, gpu_bytes) as DeepSpeed's ZeRO-3 estimator computes them (stage3.py): the GPU
    always holds the largest layer gathered in fp32-equivalent 4 bytes, plus 18P/N (no offload) or
    2P/N (optimizer offloaded, parameters kept); CPU needs 18 or 16 bytes per parameter per node."""
    n = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload:
        k = 18 if cpu_offload_params else 16
        gpu = largest if cpu_offload_params else largest + int(2 * total_params / n)
        if zero_init:
            cpu = total_params * k * per_node * additional_buffer_factor
        else:
            cpu = total_params * max(4 * num_gpus_per_node, k * per_node) * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / n)
        if zero_init:
            cpu = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def activation_bytes_per_layer(seq: int, microbatch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none",
                               ffn: int | None = None, mlp_scale: float = 1.0) -> float:
    """Activation bytes one transformer layer keeps for its backward pass (Korthikanti et al. 2022,
    Table 2; module docstring). ``mlp_scale`` is top_k * capacity_factor for an MoE layer."""
    s, b, h, a, t = seq, microbatch, hidden, heads, tp
    f = 4 * h if ffn is None else ffn
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    replicated = 10 * sbh                                 # layer-norm inputs, linear inputs, dropout masks
    sharded = (8 + 4 * f / h * mlp_scale) * sbh           # Q, K, V, attention-out input, MLP GeLU in/out
    attention = 5 * a * s * s * b                         # softmax output, dropout mask and output
    if recompute == "selective":
        attention = 0.0
    elif recompute != "none":
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if sequence_parallel:
        return (replicated + sharded + attention) / t
    return replicated + (sharded + attention) / t


def pipeline_inflight_layers(layers_per_stage: float, pp: int, microbatches: int, schedule: str,
                             interleave: int = 1) -> float:
    """Layers' worth of activations the first pipeline stage holds at its peak (Korthikanti et al. 2022,
    Sec. 4.2.3): GPipe keeps all m micro-batches, 1F1B at most p, interleaved 1F1B p (1 + (p-1)/(p v))."""
    if pp == 1:
        return layers_per_stage
    if schedule == "gpipe":
        return layers_per_stage * microbatches
    inflight = min(microbatches, pp)
    if schedule == "interleaved" and microbatches >= pp:
        return layers_per_stage * pp * (1 + (pp - 1) / (pp * interleave))
    return layers_per_stage * inflight
