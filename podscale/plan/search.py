"""Layout search: enumerate tp x pp x dp x ep x ZeRO stage x micro-batch x recompute x schedule x
interleave (x sequence parallelism x MoE parallel folding or expert tensor parallelism x expert dispatch: per
choice, per rank, and per node where the expert group spans nodes x optimizer offload),
drop layouts that do not fit in device memory, rank the rest by predicted throughput (tokens/s; samples/s for DLRM).

Tensor parallelism is limited to one node's fast domain on switched systems (tp <= devices per node),
as Narayanan et al. SC'21 (Sec. 3.3, takeaway #1) recommend; every other axis is unrestricted apart
from divisibility of the devices and the batch: pipeline stages need not divide the layers (the
trainer's uneven split, ``stages.py``). Each layout costs one pure-Python ``predict`` call (tens of microseconds).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from . import network as net
from .cost import predict
from .hardware import System, as_system
from .layout import Layout, LayoutError
from .models import DLRM, as_model
from podscale.config import expert_dispatch_problem


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class SearchResult:
    ranked: list                 # Predictions that fit, best first
    evaluated: int               # layouts predicted
    rejected_memory: int         # predicted but did not fit
    seconds: float
    notes: list = field(default_factory=list)


def candidate_layouts(system: System, devices: int, model, batch: int, microbatches=(1, 2, 4, 8, 16, 32),
                      max_interleave: int = 8):
    """Yield every valid Layout (valid = divisibility rules of the trainer hold)."""
    if isinstance(model, DLRM):
        for mb in microbatches:
            if batch % (devices * mb) == 0:
                yield Layout(dp=devices, microbatch=mb)
        return
    tp_max = system.devices_per_node if system.topology in ("switch", "fat-tree", "host") else 64
    ws = system.data_parallel_only
    if ws:   # a wafer runs whole micro-batches layer by layer: larger ones amortise the streamed weights
        microbatches = tuple(sorted(set(microbatches) | {64, 128, 256, 512}))
    eps = _divisors(model.experts) if model.experts > 1 else [1]
    # On a CPU system the optimizer state is already in host memory: "offload to CPU" gains nothing and
    # only adds the copies podscale makes between the master and the compute buffers (gpt_cost).
    offloads = ("none",) if system.device_is_host else ("none", "cpu")
    for tp in ([1] if ws else [d for d in _divisors(model.heads) if d <= tp_max and model.ffn % d == 0]):
        # pipelines need not divide the layers (the trainer splits them unevenly); a stage needs one layer
        for pp in ([1] if ws else [d for d in _divisors(devices) if d <= model.layers]):
            for ep in ([1] if ws else eps):
                if devices % (tp * pp * ep):
                    continue
                dp = devices // (tp * pp * ep)
                for mb in microbatches:
                    if batch % (dp * ep * mb):
                        continue
                    m = batch // (dp * ep * mb)
                    scheds = [("1f1b", 1)]
                    if pp > 1:
                        scheds.append(("gpipe", 1))
                        scheds += [("interleaved", v) for v in range(2, max_interleave + 1)
                                   if pp * v <= model.layers and m % pp == 0]
                    for sched, v in scheds:
                        for rc in ("none", "selective", "full"):
                            for sp, fold, etp in _tp_options(model, tp, ep):
                                # Weight streaming keeps weights and optimizer in MemoryX: no ZeRO.
                                for zero in ((0,) if ws else (0, 1, 2, 3)):
                                    for off in offloads if zero else ("none",):
                                        lay = Layout(tp=tp, pp=pp, dp=dp, ep=ep, microbatch=mb, interleave=v,
                                                     schedule=sched, recompute=rc, sequence_parallel=sp,
                                                     fold_tp_into_ep=fold, expert_tensor_parallel=etp,
                                                     zero_stage=zero, offload_optimizer=off)
                                        yield lay
                                        if _tries_per_rank_dispatch(model, lay):
                                            yield dataclasses.replace(lay, expert_dispatch="rank")
                                        if _tries_per_node_dispatch(system, model, lay):
                                            yield dataclasses.replace(lay, expert_dispatch="node")


def _tp_options(model, tp: int, ep: int) -> list[tuple[bool, bool, bool]]:
    """(sequence_parallel, fold_tp_into_ep, expert_tensor_parallel) triples to try at this tp and ep:
    sequence parallelism whenever tp > 1; for an MoE model, its experts either replicated over tp, folded
    (MoE parallel folding, Liu et al. 2025: sharded over ep x tp, where ep x tp divides the experts) or split
    over tp by width (expert tensor parallelism, Megatron-core's expert_tensor_parallel_size = tp, where tp
    divides the experts' width: the one way to shard experts over tp when they are fewer than ep x tp).
    Folding and splitting hold less of the experts a rank and sum no expert gradient over tp, but exchange
    tokens over a larger group or gather them over tp: the cost model weighs them like the other knobs."""
    if tp == 1:
        return [(False, False, False)]
    experts = [(False, False)]
    if model.experts > 1:
        if model.experts % (ep * tp) == 0:
            experts.append((True, False))
        if model.ffn % tp == 0:
            experts.append((False, True))
    return [(sp, fold, etp) for sp in (False, True) for fold, etp in experts]


def _tries_per_rank_dispatch(model, lay: Layout) -> bool:
    """Whether to try ``lay`` with per-rank expert dispatch as well as per choice (DeepEP's dispatch/combine,
    DeepSeek-AI 2025, github.com/deepseek-ai/DeepEP; DeepSeek-V3, Sec. 3.2.2): where the two can differ, for an
    MoE model with top_k > 1 exchanging tokens over an expert group > 1, and not with expert tensor parallelism
    (which the trainer does not run per rank). Per rank sends a token once to each rank of its choices, fewer
    bytes than one row per choice, plus each choice's metadata: the cost model weighs it
    (gpt_cost.expected_ranks_per_token)."""
    return (model.experts > 1 and model.top_k > 1 and lay.expert_group > 1
            and expert_dispatch_problem("rank", lay.expert_tensor_parallel) is None)


def _tries_per_node_dispatch(system: System, model, lay: Layout) -> bool:
    """Whether to try ``lay`` with per-node expert dispatch too (DeepEP's internode dispatch/combine, DeepSeek-AI
    2025, github.com/deepseek-ai/DeepEP: once to the same-index GPU of each node over RDMA, then per rank over
    NVLink; DeepSeek-V3, Sec. 3.2.2): where per rank is tried and the expert group spans more than one node
    (``network.node_members`` of the group at its stride); within one node it is per rank (gpt_cost._node_exchanges)."""
    return (_tries_per_rank_dispatch(model, lay)
            and net.node_members(system, lay.expert_group, lay.expert_group_stride) < lay.expert_group)


def search(system: System | str, devices: int, model, batch: int, top: int = 10,
           include_unfit: bool = False) -> SearchResult:
    """Predict every candidate layout and rank those that fit by throughput."""
    system, model = as_system(system), as_model(model)
    system.check_devices(devices)
    start = time.perf_counter()
    ranked, evaluated, rejected = [], 0, 0
    for lay in candidate_layouts(system, devices, model, batch):
        try:
            pred = predict(system, devices, model, lay, batch)
        except LayoutError:
            continue
        evaluated += 1
        if pred.fits or include_unfit:
            ranked.append(pred)
        else:
            rejected += 1
    ranked.sort(key=lambda p: -p.tokens_per_s)
    notes = [] if ranked else ["no layout fits in device memory; add devices, or a ZeRO stage / offload"]
    return SearchResult(ranked=ranked[:top] if top else ranked, evaluated=evaluated, rejected_memory=rejected,
                        seconds=time.perf_counter() - start, notes=notes)


def published_gpt175b_layout() -> Layout:
    """GPT-3 175B on 1024 A100s, global batch 1536: tp 8, pp 16, micro-batch 1, full recomputation —
    Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (the layout behind Narayanan et al.
    SC'21, Sec. 5.1: 140 TFLOP/s per GPU, 34 days for 300B tokens on 1024 GPUs)."""
    return Layout(tp=8, pp=16, dp=8, microbatch=1, recompute="full", overlap_grad_reduce=False)
