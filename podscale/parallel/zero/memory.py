"""Per-rank memory of model states under ZeRO, from the parameter count alone.

ZeRO (Rajbhandari et al. 2020, section 3.1 and Figure 1): mixed-precision Adam keeps 2Ψ bytes of 16-bit
parameters, 2Ψ of 16-bit gradients and KΨ = 12Ψ of fp32 master weights, momentum and variance; stage 1
divides the K term by N_d, stage 2 also the gradients, stage 3 also the parameters.  DeepSpeed's
``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs`` follow the same
formulas.  This estimator states what :class:`~podscale.parallel.zero.ZeroStrategy` actually allocates;
it is the paper's table, with these refinements:

* the gradient shard has the reduce dtype (``train.reduce_dtype``, default the compute dtype): 2Ψ/N_d in
  mixed precision; ``zero.grad_accum_dtype = fp32`` or an fp32 reduction make it 4Ψ/N_d.  Stage 1's
  shard is a view of its full gradient buffer when the dtypes agree (no extra bytes), else it is extra;
* in fp32 training the parameter buffer is its own master where it is whole (stages 1/2; stage 3's
  persistent small parameters), so K = 8 there; stage 3 gathers fp32 blocks straight from the master;
* stage 3 keeps parameters below ``param_persistence_threshold`` whole (``persistent_params``).

Offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021) moves the gradient shard,
master and moments to host memory (``cpu``) or to disk (``nvme``: the gradient shard in fp32, written as
it is reduced); the device then keeps a compute-dtype copy of its shard for stage 3's gathers.

Buffers outside the formulas are separate device lines, alive only during a step:

* ``gather``: stage 3's gathered blocks, the one in use plus the prefetched one, and the root unit
  (embeddings, head) gathered for the whole forward and backward; stages 1/2: the compute-dtype copies
  of the updated shards that the post-step all-gather sends (alive until the next forward);
* ``reduce``: stages 2/3's gradient staging buckets in the reduce dtype (``max_inflight_reduce + 1`` of
  them, 2 for units above 64 MiB, :func:`reduce_buffers`: a bucket (stage 2) or a block (stage 3) each);
* ``step``: the 1 MiB fp32 chunk a 16-bit gradient shard is upcast through at the optimizer step.

Not counted: activations, autograd's own per-parameter gradients before they are copied into a bucket
(at most one block's), and library workspaces (oneDNN's JIT kernels and primitive cache for 16-bit
matmuls: ~11 MiB the first time a process runs bf16 matmuls of new shapes, measured on a 7.3M model).
"""
from __future__ import annotations

from dataclasses import dataclass

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
STATES = ("params", "grads", "optim")


@dataclass
class MemoryEstimate:
    device: dict[str, int]   # params, grads, optim; gather, reduce, step buffers (the process, on a CPU)
    host: dict[str, int]     # offloaded to host memory
    nvme: dict[str, int]     # offloaded to disk

    @property
    def device_states(self) -> int:
        return sum(self.device[k] for k in STATES)

    @property
    def device_buffers(self) -> int:
        return sum(v for k, v in self.device.items() if k not in STATES)

    @property
    def total_states(self) -> int:
        return self.device_states + sum(self.host.values()) + sum(self.nvme.values())


#: units larger than this keep one reduction in flight instead of ``max_inflight`` (see :func:`reduce_buffers`)
LARGE_REDUCE_BYTES = 64 << 20


def reduce_buffers(unit_bytes: int, max_inflight: int = 2) -> int:
    """Stages 2/3's gradient staging buffers alive at once for units of ``unit_bytes``: ``max_inflight``
    reductions in flight plus the one being filled; units above :data:`LARGE_REDUCE_BYTES` (a wide model's
    blocks) keep one in flight, as FSDP2 does, since a block's reduction then has the whole backward of the
    next block to finish in.  On bench/zero.py's shallow-wide GPT (4 x 1536: 113 MB blocks) the third
    buffer was 113 MB of a 1918 MiB peak, above FSDP2's 1803 MiB.  The strategy and the estimator both use
    this rule."""
    return 2 if unit_bytes > LARGE_REDUCE_BYTES else max_inflight + 1


def estimate_model_states(params: int, dp: int, stage: int, precision: str = "bf16",
                          offload_optimizer: str = "none", offload_param: str = "none",
                          persistent_params: int = 0, largest_layer: int = 0, root_params: int = 0,
                          bucket_mb: float = 25.0, max_inflight: int = 2, reduce_dtype: str | None = None,
                          grad_accum_dtype: str | None = None) -> MemoryEstimate:
    """Bytes per rank of parameters, gradients, optimizer state and transient buffers.

    ``persistent_params`` (stage 3): elements of parameters below the persistence threshold, kept whole;
    ``largest_layer``/``root_params`` (stage 3): elements of the largest gathered block and of the root
    unit (embeddings, head), for the working set.  Without them stage 3's buffers are not counted.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (got {stage})")
    if offload_param != "none" and stage != 3:
        raise ValueError("offload_param needs stage 3")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError("offload_optimizer needs stage >= 1")
    c = _BYTES[precision]
    r = _BYTES[reduce_dtype or precision]
    g = 4 if grad_accum_dtype == "fp32" else r  # the gradient shard's bytes per element
    n = max(1, dp)
    psi = params
    off = offload_optimizer != "none"
    dev = {"params": 0, "grads": 0, "optim": 0, "gather": 0, "reduce": 0, "step": 0}
    host = {"params": 0, "grads": 0, "optim": 0}
    nvme = {"params": 0, "grads": 0, "optim": 0}
    if stage == 0:  # replicated: the parameter is its own fp32 master, gradients fp32 (autocast)
        dev.update(params=4 * psi, grads=4 * psi, optim=8 * psi)
        return MemoryEstimate(dev, host, nvme)
    sharded = psi - (persistent_params if stage == 3 else 0)
    # parameters the model computes with
    if stage in (1, 2):
        dev["params"] = c * psi
    else:
        dev["params"] = c * persistent_params + (c * sharded // n if (c != 4 or off or offload_param != "none") else 0)
    # gradients: the shard (+ the full compute-dtype buffer of stage 1, which holds the shard when it can)
    if offload_optimizer == "nvme":  # fp32 gradient shards go to the swap file as they are reduced
        nvme["grads"] += 4 * psi // n
    elif not (stage == 1 and g == c and not off):
        (host if off else dev)["grads"] += g * psi // n
    if stage == 1:
        dev["grads"] += c * psi
    # optimizer: moments, and the fp32 master where the parameter buffer cannot serve as it
    aliased = 0 if (c != 4 or off) else (psi if stage in (1, 2) else persistent_params)
    optim = 8 * psi // n + 4 * (psi - aliased) // n
    if offload_optimizer == "nvme":
        nvme["optim"] = optim
    elif off:
        host["optim"] = optim
    else:
        dev["optim"] = optim
    if stage in (1, 2):  # the updated parameters' all-gather sources, alive from the step to the next forward
        dev["gather"] = c * psi // n
    if stage == 2:
        bucket = min(int(bucket_mb * 2**20) // 4, psi)
        dev["reduce"] = reduce_buffers(r * bucket, max_inflight) * r * bucket
    if stage == 3:
        dev["reduce"] = reduce_buffers(r * largest_layer, max_inflight) * r * largest_layer
        dev["gather"] = c * (2 * largest_layer + root_params)
        if offload_param == "nvme":
            nvme["params"], dev["params"] = dev["params"] - c * persistent_params, c * persistent_params
        elif offload_param == "cpu":
            host["params"], dev["params"] = dev["params"] - c * persistent_params, c * persistent_params
    if g != 4 and offload_optimizer != "nvme":
        dev["step"] = 4 << 18  # flat_adam.UPCAST_CHUNK fp32 elements
    return MemoryEstimate(dev, host, nvme)


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


def format_estimate(est: MemoryEstimate, params: int, dp: int, stage: int) -> str:
    def gib(b):
        return f"{b / 2**30:9.3f} GiB"
    lines = [f"ZeRO stage {stage}, {params:,} parameters, dp={dp}: per-rank model states"]
    for where, d in (("device", est.device), ("host", est.host), ("nvme", est.nvme)):
        for k, v in d.items():
            if k in STATES and (v or where == "device"):
                lines.append(f"  {where:6s} {k:8s} {gib(v)}")
    lines.append(f"  total states      {gib(est.total_states)}  (device {gib(est.device_states).strip()})")
    lines.append("buffers during a step (device):")
    names = {"gather": "stage 3: gathered blocks (current + prefetch) and root; 1/2: all-gather sources",
             "reduce": "gradient staging buckets in flight", "step": "optimizer upcast chunk"}
    for k, label in names.items():
        lines.append(f"  {k:15s} {gib(est.device[k])}  {label}")
    return "\n".join(lines)
