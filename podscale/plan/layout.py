"""A parallel layout, in the trainer's vocabulary.

Mesh axes ``pp, dp, ep, tp`` (outermost to innermost), so devices = pp * dp * ep * tp. Expert
parallelism splits the batch like data parallelism for the dense layers (they are replicated over
dp * ep) and shards the experts over ep (with ``fold_tp_into_ep``, over ep x tp: :attr:`Layout.expert_group`;
with ``expert_tensor_parallel``, over ep and each expert's hidden width over tp). ``expert_dispatch`` says
how an MoE layer's tokens travel to the expert group's ranks and back (:data:`EXPERT_DISPATCHES`).
``microbatch`` is the micro-batch size per pipeline micro-step, and the global batch = dp * ep * microbatch
* num_microbatches.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from podscale.config import expert_dispatch_problem
from podscale.plan.models import non_bool_field
# how an MoE layer exchanges its tokens over the expert group, the trainer's ``parallel.expert_dispatch`` (priced
# in gpt_cost: ``expected_ranks_per_token``)
from podscale.parallel.moe.layer import EXPERT_DISPATCHES

RECOMPUTE = ("none", "selective", "full")
OFFLOAD = ("none", "cpu", "nvme")
SCHEDULES = ("gpipe", "1f1b", "interleaved")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    microbatch: int = 1
    interleave: int = 1
    schedule: str = ""            # "" -> 1f1b, or interleaved when interleave > 1
    recompute: str = "none"
    sequence_parallel: bool = False
    fold_tp_into_ep: bool = False  # MoE parallel folding (Liu et al. 2025; Megatron-core's expert tensor
                                  # parallel size 1): each MoE layer's experts sharded over ep x tp and its
                                  # tokens exchanged over that group, not replicated over tp (expert_group)
    expert_tensor_parallel: bool = False  # expert tensor parallelism (Megatron-core's expert_tensor_parallel_size
                                  # = tp): each tp rank holds 1/tp of the hidden width of its ep rank's experts
                                  # and runs all the tp ranks' exchanged rows through it (all-gathered over tp,
                                  # partial outputs reduce-scattered back); exclusive with fold_tp_into_ep
    expert_dispatch: str = "choice"  # one of EXPERT_DISPATCHES: one row per kept choice
                                  # ("choice"), one per (token, expert-group rank), summed there (DeepEP's
                                  # "rank"), or one per (token, node) to the same-index rank there, then per rank
                                  # inside the node (DeepEP's internode "node"); the last two not with
                                  # expert_tensor_parallel
    zero_stage: int = 0
    offload_optimizer: str = "none"
    offload_param: str = "none"
    overlap_grad_reduce: bool = True
    tp_overlap: bool = False      # Megatron-LM's asynchronous tensor-parallel backward: the input
                                  # gradient's collective under the weight-gradient GEMM (2022 on)
    fused_attention: bool = False   # FlashAttention / torch SDPA (what podscale's GPT runs) instead of
                                    # Megatron's separate score GEMM, softmax, dropout and value GEMM
    pp_scatter_gather: bool = True  # pipeline sends split over the tp ranks and all-gathered on arrival
                                    # (Megatron; DeepSpeed's pipe_partitioned, its default); False: whole
    parallel_block: bool = False  # attention and MLP read the same layer norm and are summed (GPT-J, PaLM):
                                  # one tensor-parallel collective per pass and layer instead of two
    grad_accumulation_fusion: bool = True   # Megatron-LM's: the weight-gradient GEMM accumulates into the
                                  # gradient buffer; False (podscale's trainer): autograd writes each
                                  # micro-batch's gradient and adds it in, a pass over them per micro-batch
    pipeline_layers: tuple = ()   # blocks per model chunk (pp * interleave of them), as the trainer's
                                  # parallel.pipeline_layers; () -> the trainer's parameter-balanced split

    def __post_init__(self):
        for f in ("tp", "pp", "dp", "ep", "microbatch", "interleave"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise LayoutError(f"layout {f!r} must be a positive integer, got {v!r}")
        if (name := non_bool_field(self)) is not None:
            raise LayoutError(f"layout {name!r} must be true or false, got {getattr(self, name)!r}")
        sched = self.schedule or ("interleaved" if self.interleave > 1 else "1f1b")
        object.__setattr__(self, "schedule", sched)
        if sched not in SCHEDULES:
            raise LayoutError(f"schedule must be one of {SCHEDULES}, got {sched!r}")
        if (sched == "interleaved") != (self.interleave > 1):
            raise LayoutError("schedule 'interleaved' needs interleave > 1 and interleave > 1 needs it")
        if self.recompute not in RECOMPUTE:
            raise LayoutError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise LayoutError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for f in ("offload_optimizer", "offload_param"):
            if getattr(self, f) not in OFFLOAD:
                raise LayoutError(f"{f} must be one of {OFFLOAD}, got {getattr(self, f)!r}")
        if self.offload_param != "none" and self.zero_stage != 3:
            raise LayoutError("offload_param needs zero_stage 3 (only ZeRO-3 partitions parameters)")
        if self.offload_optimizer != "none" and self.zero_stage == 0:
            raise LayoutError("offload_optimizer needs zero_stage >= 1")
        if not isinstance(self.pipeline_layers, tuple):
            object.__setattr__(self, "pipeline_layers", tuple(self.pipeline_layers))
        if any(not isinstance(n, int) or isinstance(n, bool) for n in self.pipeline_layers):
            raise LayoutError(f"pipeline_layers must be a list of integers, got {list(self.pipeline_layers)}")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("sequence_parallel needs tp > 1")
        if self.fold_tp_into_ep and self.tp == 1:
            raise LayoutError("fold_tp_into_ep needs tp > 1 (it shards the experts over the tp ranks too; at tp = 1 "
                              "there is nothing to fold): set tp > 1 or fold_tp_into_ep false")
        if self.expert_dispatch not in EXPERT_DISPATCHES:
            raise LayoutError(f"expert_dispatch must be one of {EXPERT_DISPATCHES}, got {self.expert_dispatch!r}: "
                              "set expert_dispatch to 'choice' (one row per kept choice), 'rank' (one per rank) or "
                              "'node' (one per node, then per rank inside it)")
        if expert_dispatch_problem(self.expert_dispatch, self.expert_tensor_parallel):
            raise LayoutError(f"expert_dispatch {self.expert_dispatch!r} does not run with expert_tensor_parallel (the "
                              "trainer refuses it too): set expert_dispatch 'choice' or expert_tensor_parallel false")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp * self.ep

    @property
    def data_parallel(self) -> int:
        """Replicas of the dense weights: the batch is split dp * ep ways."""
        return self.dp * self.ep

    @property
    def expert_group(self) -> int:
        """Ranks an MoE layer's experts are sharded over and its tokens exchanged among: ep, or with
        ``fold_tp_into_ep`` ep x tp (MoE parallel folding, Liu et al. 2025: the expert-parallel group spans the
        tp ranks, Megatron-core's expert_tensor_parallel_size = 1; its tp ranks are neighbours, the innermost
        mesh axis, so the group is ep x tp consecutive ranks). Without folding every tp rank holds the same
        experts (replicated over tp)."""
        return self.ep * self.tp if self.fold_tp_into_ep else self.ep

    @property
    def expert_group_stride(self) -> int:
        """Global ranks between consecutive members of :attr:`expert_group`: tp for an ep group (the ranks of one
        tp index), 1 folded (ep x tp consecutive ranks). With the devices per node it says which members share a
        node (``network.node_members``), what ``expert_dispatch`` "node" prices."""
        return 1 if self.fold_tp_into_ep else self.tp

    @property
    def expert_tensor_parallel_size(self) -> int:
        """Ranks one expert's hidden width is split over: tp with ``expert_tensor_parallel`` (Megatron-core's
        expert_tensor_parallel_size = tp, its alltoall token dispatcher), else 1 (whole experts)."""
        return self.tp if self.expert_tensor_parallel else 1

    def num_microbatches(self, batch: int) -> int:
        per = self.data_parallel * self.microbatch
        if batch % per:
            raise LayoutError(f"global batch {batch} is not a multiple of dp*ep*microbatch = {per}")
        return batch // per

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in _FIELDS}
        d["pipeline_layers"] = list(self.pipeline_layers)
        return d

    def short(self) -> str:
        s = f"tp{self.tp} pp{self.pp} dp{self.dp}"
        if self.ep > 1:
            s += f" ep{self.ep}"
        s += f" mb{self.microbatch}"
        if self.interleave > 1:
            s += f" v{self.interleave}"
        if self.schedule == "gpipe":
            s += " gpipe"
        if self.zero_stage:
            s += f" z{self.zero_stage}"
        if self.offload_optimizer != "none":
            s += f" opt->{self.offload_optimizer}"
        if self.offload_param != "none":
            s += f" param->{self.offload_param}"
        if self.recompute != "none":
            s += f" rc-{self.recompute}"
        if self.sequence_parallel:
            s += " sp"
        if self.fold_tp_into_ep:
            s += " fold"
        if self.expert_tensor_parallel:
            s += " etp"
        if self.expert_dispatch != "choice":
            s += f" per-{self.expert_dispatch}"
        if self.fused_attention:
            s += " flash"
        if self.parallel_block:
            s += " parallel"
        if self.pipeline_layers and len(set(self.pipeline_layers)) > 1:
            s += " layers " + "/".join(map(str, self.pipeline_layers))
        return s


_FIELDS = fields(Layout)


def layout_from_dict(data: dict) -> Layout:
    known = {f.name for f in fields(Layout)}
    unknown = set(data) - known
    if unknown:
        raise LayoutError(f"unknown layout keys {sorted(unknown)}; allowed: {sorted(known)}")
    missing = {"tp", "pp", "dp", "microbatch"} - set(data)
    if missing:
        raise LayoutError(f"layout lacks keys {sorted(missing)} (need tp, pp, dp, microbatch)")
    return Layout(**data)
