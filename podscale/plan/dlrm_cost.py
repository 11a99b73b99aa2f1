"""Step time and memory of DLRM (Naumov et al. 2019) with the usual hybrid layout: embedding tables
sharded row-wise over all devices (model parallel), MLPs replicated (data parallel).

Per step of B samples on N devices (each device owns B/N samples and 1/N of every table):
    embedding lookups + sparse update   B * T * L * d * 4 bytes * 3 (gather, grad, row update) / N,
                                        memory-bound on the owning device
    all-to-all                          pooled vectors B/N * T * d * 4 bytes, forward and backward
    MLPs + interaction                  2 * 3 * B/N * (MLP weights) FLOPs as GEMMs of B/N rows
    gradient all-reduce of MLP weights  fp32, overlapped with the backward of the top MLP
Memory per device: 1/N of the fp32 tables + row-wise Adagrad state (one float per row), fully
replicated MLPs with Adam (16 bytes/param), and activations of B/N samples.
"""
from __future__ import annotations

from . import network as net
from .compute import gemm_time, stream_time
from .hardware import System
from .layout import Layout, LayoutError
from .models import DLRM
from .prediction import Prediction


def predict_dlrm(system: System, devices: int, model: DLRM, lay: Layout, batch: int) -> Prediction:
    if (lay.tp, lay.pp, lay.ep) != (1, 1, 1) or lay.dp != devices:
        raise LayoutError("DLRM layouts are data parallel for the MLPs with tables sharded over all devices: "
                          f"use tp=1, pp=1, ep=1, dp={devices}")
    m = lay.num_microbatches(batch)
    dev, n = system.device, devices
    local = lay.microbatch
    T, d = len(model.tables), model.bottom_mlp[-1]
    lookups = local * T * model.lookups_per_table
    emb = 3 * stream_time(dev, lookups * d * 4)
    a2a = 2 * net.all_to_all_time(system, local * T * d * 4, n, 1) if n > 1 else 0.0
    mlp = 0.0
    for widths in (model.bottom_mlp, model.interaction_mlp_widths):
        for k_in, k_out in zip(widths[:-1], widths[1:]):
            mlp += 3 * gemm_time(dev, local, k_out, k_in, bytes_per_element=4)
    f = T + 1
    mlp += 3 * gemm_time(dev, f, f, d, batch=local, bytes_per_element=4)    # pairwise dot interaction
    allreduce = net.all_reduce_time(system, 4 * model.mlp_params, n, 1) if n > 1 else 0.0
    exposed_ar = max(0.0, allreduce - m * mlp / 3)
    optimizer = stream_time(dev, 30 * model.mlp_params)
    breakdown = {"embedding": m * emb, "all_to_all": m * a2a, "mlp": m * mlp,
                 "dp_communication": exposed_ar, "optimizer": optimizer}
    rows = sum(r for r, _ in model.tables)
    memory = {"embedding_tables": (4 * model.embedding_params + 4 * rows) / n,
              "mlp_states": 16 * model.mlp_params,
              "activations": 4 * local * (sum(model.bottom_mlp) + sum(model.interaction_mlp_widths) + T * d) * 2,
              "reserved": dev.reserved_bytes}
    total_mem = sum(memory.values())
    mlp_flops = 2 * 3 * batch * model.mlp_params
    notes = [] if total_mem <= dev.memory_bytes else ["does not fit in device memory"]
    return Prediction(
        system=system.name, devices=devices, batch=batch, model=model.name, layout=lay.to_dict(),
        step_time_s=sum(breakdown.values()), time_breakdown_s=breakdown, memory_per_device_bytes=total_mem,
        memory_breakdown_bytes=memory, memory_capacity_bytes=dev.memory_bytes, host_memory_per_device_bytes=0.0,
        hardware_flops_per_step=mlp_flops, model_flops_per_step=mlp_flops, tokens_per_step=batch,
        peak_flops_per_device=dev.peak_flops, notes=notes)
