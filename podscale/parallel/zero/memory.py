"""Per-rank memory of model states under ZeRO, from the parameter count alone.

ZeRO (Rajbhandari et al. 2020, section 3.1 and Figure 1): mixed-precision Adam keeps 2Ψ bytes of 16-bit
parameters, 2Ψ of 16-bit gradients and KΨ = 12Ψ of fp32 master weights, momentum and variance; stage 1
divides the K term by N_d, stage 2 also the gradients, stage 3 also the parameters.  DeepSpeed's
``estimate_zero2_model_states_mem_needs`` / ``estimate_zero3_model_states_mem_needs`` follow the same
formulas.  This estimator states what :class:`~podscale.parallel.zero.ZeroStrategy` actually allocates,
which differs from the paper's table in two places, both on purpose:

* the gradient shard is accumulated in fp32 (4Ψ/N_d, not 2Ψ/N_d) so gradient accumulation over
  micro-batches does not round in 16 bits; stage 1 additionally keeps the full compute-dtype gradient
  (cΨ) because it accumulates before reducing;
* in fp32 training the parameter buffer is its own master where it is whole (stages 1/2): K = 8.

Offload (ZeRO-Offload, Ren et al. 2021; ZeRO-Infinity, Rajbhandari et al. 2021) moves the fp32 gradient
shard, master and moments to host memory (``cpu``) or the master and moments to disk (``nvme``); the
device then keeps a compute-dtype copy of its shard for stage 3's gathers.

``buffers`` are the transient working set: stage 2/3 gradient staging buckets in flight, and for stage 3
the gathered blocks (current + prefetched) and the root unit.
"""
from __future__ import annotations

from dataclasses import dataclass

_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class MemoryEstimate:
    device: dict[str, int]   # params, grads, optim, buffers on the accelerator (the process, on a CPU)
    host: dict[str, int]     # offloaded to host memory
    nvme: dict[str, int]     # offloaded to disk

    @property
    def device_states(self) -> int:
        return self.device["params"] + self.device["grads"] + self.device["optim"]

    @property
    def total_states(self) -> int:
        return self.device_states + sum(self.host.values()) + sum(self.nvme.values())


def estimate_model_states(params: int, dp: int, stage: int, precision: str = "bf16",
                          offload_optimizer: str = "none", offload_param: str = "none",
                          persistent_params: int = 0, largest_layer: int = 0, root_params: int = 0,
                          bucket_mb: float = 25.0, max_inflight: int = 2) -> MemoryEstimate:
    """Bytes per rank of parameters, gradients, optimizer state and transient buffers.

    ``persistent_params`` (stage 3): elements of parameters below the persistence threshold, kept whole;
    ``largest_layer``/``root_params`` (stage 3): elements of the largest gathered block and of the root
    unit (embeddings, head), for the working set.  Without them the working set is not counted.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3 (got {stage})")
    if offload_param != "none" and stage != 3:
        raise ValueError("offload_param needs stage 3")
    if offload_optimizer != "none" and stage == 0:
        raise ValueError("offload_optimizer needs stage >= 1")
    c = _BYTES[precision]
    n = max(1, dp)
    psi = params
    off = offload_optimizer != "none"
    dev = {"params": 0, "grads": 0, "optim": 0, "buffers": 0}
    host = {"params": 0, "grads": 0, "optim": 0}
    nvme = {"optim": 0, "params": 0}
    bucket = int(bucket_mb * 2**20)
    if stage == 0:  # replicated: the parameter is its own fp32 master, gradients fp32 (autocast)
        dev.update(params=4 * psi, grads=4 * psi, optim=8 * psi)
        return MemoryEstimate(dev, host, nvme)
    sharded = psi - (persistent_params if stage == 3 else 0)
    # parameters the model computes with
    if stage in (1, 2):
        dev["params"] = c * psi
    else:
        dev["params"] = c * persistent_params + (c * sharded // n if (c != 4 or off or offload_param != "none") else 0)
    # gradients: the fp32 shard (+ the full compute-dtype buffer of stage 1)
    grad_shard = 4 * psi // n
    (host if off else dev)["grads"] += grad_shard
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
    if stage >= 2:
        dev["buffers"] += (max_inflight + 1) * min(bucket, c * psi)
    if stage == 3:
        dev["buffers"] += c * (2 * largest_layer + root_params)
        if offload_param == "nvme":
            nvme["params"], dev["params"] = dev["params"] - c * persistent_params, c * persistent_params
        elif offload_param == "cpu":
            host["params"], dev["params"] = dev["params"] - c * persistent_params, c * persistent_params
    return MemoryEstimate(dev, host, nvme)


def format_estimate(est: MemoryEstimate, params: int, dp: int, stage: int) -> str:
    def gib(b):
        return f"{b / 2**30:9.3f} GiB"
    lines = [f"ZeRO stage {stage}, {params:,} parameters, dp={dp}: per-rank model states"]
    for where, d in (("device", est.device), ("host", est.host), ("nvme", est.nvme)):
        for k, v in d.items():
            if v or where == "device":
                lines.append(f"  {where:6s} {k:8s} {gib(v)}")
    lines.append(f"  total states      {gib(est.total_states)}  (device {gib(est.device_states).strip()})")
    return "\n".join(lines)
