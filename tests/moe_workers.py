"""Worker functions for the mixture-of-experts tests (a module of its own so spawned workers import it).

``train_gpt_moe`` trains the GPT-MoE on a (dp, ep) mesh with a plain loop (forward, backward,
``reduce_gradients``, SGD) and reports what the single-process run must reproduce; with dp = ep = 1 it is
that single-process run.  The no-hang cases run one MoE layer on inputs built so that the routing is
lopsided in a known way.
"""
from __future__ import annotations

import contextlib
import itertools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from podscale.models.gpt_moe import GPTMoE, GPTMoEConfig
from podscale.parallel.moe import MoELayer, grad_norm, reduce_gradients
from podscale.parallel.moe import layer as moe_layer
from podscale.parallel.moe.kernels import CacheTiledKernel, GroupedGemmKernel, SegmentKernel
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process
from podscale.train.data import ShardedLoader, load_tokens, split_tokens

MODEL = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, experts=8, moe_every=1, expert_hidden=48)
MODES = {
    "top1": dict(top_k=1, capacity_factor=1.0, random_routing=False),
    "top2": dict(top_k=2, capacity_factor=1.25, random_routing=True),
    "dropless": dict(top_k=2, dropless=True, random_routing=False),
    "priority": dict(top_k=1, capacity_factor=1.0, random_routing=False, drop_policy="priority"),
    "probs": dict(top_k=2, capacity_factor=1.0, random_routing=True, drop_policy="probs"),
}
GLOBAL_BATCH = 8
SEED = 11
LR = 0.3


class CrossEntropy64(nn.Module):
    """The GPT's loss without its cast to fp32, so an fp64 run stays fp64 end to end."""

    def forward(self, logits, targets):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _tokens():
    tokens, _ = split_tokens(load_tokens(None), 0.1)
    return tokens


def train_gpt_moe(modes: list[str], steps: int, dp: int, ep: int, mesh: Mesh | None = None,
                  min_segment_rows: int | None = None, expert_dispatch: str = "choice",
                  ranks_per_node: int | None = None) -> list[dict]:
    """Train with SGD at ``LR``; for each mode: losses (global mean) and gradient norms per step, routing
    counts per step and layer (summed over the mesh), gradients after step 1 and parameters after the last
    step (by name: experts are named by global id).  ``min_segment_rows``: the exchange's
    ``MIN_SEGMENT_ROWS`` for this run (0: own rows always overlapped with the exchange; a huge value: never);
    ``expert_dispatch``: the MoE layers' (``"choice"``, ``"rank"`` or ``"node"``); ``ranks_per_node``: the
    launcher's local world size this worker reports (simulated nodes: the per-node dispatch's)."""
    if ranks_per_node is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)
    if min_segment_rows is not None:
        moe_layer.MIN_SEGMENT_ROWS = min_segment_rows
    if mesh is None:
        info = init_process()
        torch.set_num_threads(1)
        mesh = Mesh.build(info.device, dp=dp, ep=ep)
    tokens = _tokens()
    n = dp * ep
    out = []
    for mode in modes:
        torch.manual_seed(SEED)
        model = GPTMoE(GPTMoEConfig(**MODEL, **MODES[mode]), mesh, expert_dispatch=expert_dispatch).double()
        model.loss_fn = CrossEntropy64()
        loader = ShardedLoader(tokens, MODEL["block_size"], GLOBAL_BATCH, GLOBAL_BATCH // n,
                               mesh.local_rank("dp", "ep"), n, seed=SEED)
        losses, counts, norms, grads1 = [], [], [], None
        for step in range(steps):
            (x, y), = loader.next_step()
            _, lm, moe_loss, stats = model.forward_detailed(x, y)
            loss = lm + moe_loss
            loss.backward()
            reduce_gradients(model, mesh)
            total = loss.detach().clone().view(1)
            from podscale.runtime import comm
            comm.all_reduce(total, mesh, ("dp", "ep"))
            losses.append(float(total) / n)
            counts.append({name: (s.all_reduce(mesh, ("dp", "ep")).wanted.tolist(),
                                  s.all_reduce(mesh, ("dp", "ep")).kept.tolist()) for name, s in stats.items()})
            norms.append(float(grad_norm(model, mesh)))
            if step == 0:
                grads1 = _by_global_id(model, lambda p: p.grad)
            with torch.no_grad():  # plain SGD (torch.optim's first use imports dynamo: ~30 s on a busy CPU)
                for p in model.parameters():
                    p.sub_(LR * p.grad)
                    p.grad = None
        out.append({"losses": losses, "counts": counts, "grad_norms": norms, "grads1": grads1,
                    "params": _by_global_id(model, lambda p: p.detach()), "comm": mesh.stats.snapshot()})
        mesh.stats.reset()
    return out


def _by_global_id(model: GPTMoE, get) -> dict[str, torch.Tensor]:
    """Tensors by parameter name (experts are named by global expert id, the same in every layout)."""
    return {name: get(p).clone() for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------
# no-hang cases: one layer, E = 4, d = 8; router logits 10 * x[:, e], so a token goes where its input is large

E, D, S = 4, 8, 6


def layer_inputs(case: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s (G, S, D) input.  Experts 0, 1 live on ep rank 0, experts 2, 3 on ep rank 1.

    * ``one_expert``: every token of every rank prefers expert 0 (then 1);
    * ``no_remote``: rank 0's tokens prefer its own experts 0/1, rank 1's tokens also go to 0/1, so rank 0
      sends nothing to a remote expert and experts 2, 3 receive nothing on any rank;
    * ``empty_rank``: rank 1 has no tokens at all (G = 0), rank 0 spreads its tokens over all experts.
    """
    g = torch.Generator().manual_seed(100 + rank)
    G = 0 if case == "empty_rank" and rank == 1 else 2
    x = torch.randn(G, S, D, generator=g, dtype=torch.float64) * 0.1
    if case in ("one_expert", "no_remote"):
        x[..., 0] += 3.0
        x[..., 1] += 1.5
        if case == "no_remote" and rank == 0:
            x[:, ::2, 0] -= 1.5   # half of rank 0's tokens prefer expert 1, then 0 (both local)
            x[:, ::2, 1] += 1.5
    elif case == "empty_rank":
        x[..., :E] += torch.arange(G * S * E, dtype=torch.float64).view(G, S, E).remainder(3)
    return x


def build_layer(top_k: int, dropless: bool, mesh=None, kernel=None, aux_loss_scope: str = "group",
                expert_dispatch: str = "choice") -> MoELayer:
    """The layer with the same weights in every layout: one process builds all experts, a rank of an
    ep layout copies its experts' slices."""
    torch.manual_seed(5)
    full = MoELayer(D, 16, E, top_k=top_k, capacity_factor=1.0, dropless=dropless,
                    aux_loss_coef=0.1, z_loss_coef=0.01, aux_loss_scope=aux_loss_scope).double()
    with torch.no_grad():
        full.router.weight.zero_()
        full.router.weight[:, :E] = 10 * torch.eye(E, dtype=torch.float64)
    if mesh is None:
        return full
    layer = MoELayer(D, 16, E, top_k=top_k, capacity_factor=1.0, dropless=dropless, mesh=mesh,
                     aux_loss_coef=0.1, z_loss_coef=0.01, kernel=kernel, aux_loss_scope=aux_loss_scope,
                     expert_dispatch=expert_dispatch, ranks_per_node=1).double()
    with torch.no_grad():
        layer.router.weight.copy_(full.router.weight)
        for name, p in layer.experts.named_parameters():   # names carry the global expert id
            p.copy_(full.experts.get_parameter(name))
    return layer


def layer_loss(layer: MoELayer, x: torch.Tensor):
    """A loss of the layer's output and its extra loss; ``x`` becomes a leaf that wants its gradient
    (as a model's hidden states do, so the dispatch exchange has a backward on every rank)."""
    x.requires_grad_(True)
    y, out = layer(x)
    c = torch.linspace(-1, 1, D, dtype=torch.float64)
    return (y * c).sum() + out.loss, y, out


#: ``MIN_SEGMENT_ROWS`` of ep ranks 0 and 1 in the no-hang runs: both keep their own rows out of the
#: exchange (and overlap them with it), neither does, and each its own way (a rank's choice is its own)
OVERLAP = ((0, 0), (10**9, 10**9), (0, 10**9))

#: the expert kernels the no-hang runs use: the CPU's (tiles of 3 rows, so segments span several) and the
#: accelerators' (run here on the CPU), each also keeping only the pre-activation
KERNELS = {"tiled": CacheTiledKernel(row_tile=3), "segment": SegmentKernel(),
           "tiled-recompute": CacheTiledKernel(row_tile=3, recompute=True),
           "segment-recompute": SegmentKernel(recompute=True)}

#: the no-hang runs' layouts: (``MIN_SEGMENT_ROWS`` of the two ranks, kernel name, expert dispatch); the per-rank
#: dispatch on two of the kernels (the rest of its kernel calls are the per-choice dispatch's), the per-node one
#: with each rank a node of its own (:func:`build_layer`)
RUNS = [(rows, kernel, "choice") for rows, kernel in itertools.product(OVERLAP, KERNELS)] + \
    [(rows, kernel, "rank") for rows, kernel in itertools.product(OVERLAP, ("tiled", "segment-recompute"))] + \
    [(rows, "tiled", "node") for rows in OVERLAP]


def no_hang_worker(cases: list[tuple[str, int, bool]]) -> list[dict]:
    info = init_process(timeout_s=120)
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, ep=2)
    out = []
    for case, top_k, dropless in cases:
        for rows, kernel, dispatch in RUNS:
            moe_layer.MIN_SEGMENT_ROWS = rows[info.rank]
            layer = build_layer(top_k, dropless, mesh, KERNELS[kernel], expert_dispatch=dispatch)
            x = layer_inputs(case, info.rank)
            loss, y, o = layer_loss(layer, x)
            loss.backward()
            reduce_gradients(layer, mesh)
            out.append({"y": y.detach(), "x_grad": x.grad, "first": layer.experts.first, "kept": o.stats.kept,
                        "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
                        "calls": {k: v["calls"] for k, v in mesh.stats.snapshot().items()},
                        "bytes": mesh.stats.snapshot()["ep/all_to_all"]["bytes"]})
            # the rows this rank's experts ran, and the busiest rank's over the mean (collective)
            out[-1]["peak"] = (o.stats.peak_rows, o.stats.all_reduce(mesh, "ep").peak_load)
            mesh.stats.reset()
            # the same with an input that wants no gradient: the backward returns none over the exchange
            layer.zero_grad(set_to_none=True)
            y, o = layer(layer_inputs(case, info.rank))
            c = torch.linspace(-1, 1, D, dtype=torch.float64)
            ((y * c).sum() + o.loss).backward()
            reduce_gradients(layer, mesh)
            out[-1]["no_input_grad"] = {"grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
                                        "calls": mesh.stats.snapshot()["ep/all_to_all"]["calls"]}
            mesh.stats.reset()
    out.append(global_scope(mesh, info.rank))
    out.append(split_rows(Mesh.build(info.device, tp=2), info.rank))
    return out


#: the no-hang inputs the global aux-loss scope runs on (empty_rank: rank 1 has no token)
GLOBAL_CASES = ("one_expert", "no_remote", "empty_rank")


def global_scope(mesh: Mesh, rank: int) -> list[dict]:
    """The load-balancing loss over the global batch (``aux_loss_scope = "global"``; Qiu et al. 2025) on the
    ep = 2 mesh for each of :data:`GLOBAL_CASES`, top-2 with capacity: this rank's aux loss, the all-reduces its
    forward entered, and the router's gradient of the mean of the ranks' losses (:func:`layer_loss`)."""
    out = []
    for case in GLOBAL_CASES:
        mesh.stats.reset()
        layer = build_layer(2, False, mesh, SegmentKernel(), aux_loss_scope="global")
        loss, _, o = layer_loss(layer, layer_inputs(case, rank))
        reduces = {k: v["calls"] for k, v in mesh.stats.snapshot().items() if k.endswith("/all_reduce")}
        loss.backward()
        reduce_gradients(layer, mesh)
        out.append({"aux": o.aux_loss.detach(), "reduces": reduces, "router_grad": layer.router.weight.grad.clone()})
    mesh.stats.reset()
    return out


#: rows each of the two tp ranks holds in :func:`split_rows`: a rank with none, both with none, uneven
SPLIT_ROWS = ((3, 0), (0, 0), (0, 2), (4, 5))


def split_rows(mesh: Mesh, rank: int) -> list[dict]:
    """Expert tensor parallelism's row collectives on a tp = 2 mesh for each of :data:`SPLIT_ROWS`: this
    rank's rows ``x`` all-gathered over tp, scaled by ``rank + 1`` (a stand-in for this rank's part of the
    experts) and reduce-scattered back, then the backward of ``(out * c).sum()``: the gathered rows, the
    output and ``x``'s gradient."""
    out = []
    for sizes in SPLIT_ROWS:
        x = split_rows_input(sizes, rank).requires_grad_(True)
        rows = moe_layer._GatherRowsTP.apply(x, mesh, list(sizes))
        y = moe_layer._ReduceScatterRowsTP.apply(rows * (rank + 1), mesh, list(sizes))
        (y * torch.linspace(-1, 1, D, dtype=torch.float64)).sum().backward()
        out.append({"rows": rows.detach(), "y": y.detach(), "x_grad": x.grad})
    return out


def split_rows_input(sizes: tuple[int, int], rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``sizes[rank]`` rows of :func:`split_rows`."""
    return torch.randn(sizes[rank], D, generator=torch.Generator().manual_seed(7 + rank), dtype=torch.float64)


def autocast_worker(_) -> dict:
    """One MoE layer at ep = 2, fp32 and under bf16 autocast (the fp32 weights of :func:`build_layer`, the
    ``one_expert`` inputs), with the CPU's kernel and the grouped-GEMM kernel, each with every row
    exchanged and with the own rows overlapped (``MIN_SEGMENT_ROWS`` 10**9 and 0), under each expert dispatch
    (per node: each rank a node): outputs, input and expert gradients, and the bytes the ep exchanges carried."""
    info = init_process(timeout_s=120)
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, ep=2)
    out = {}
    for kernel, rows, dispatch in itertools.product(("cpu", "grouped"), (10**9, 0), ("choice", "rank", "node")):
        moe_layer.MIN_SEGMENT_ROWS = rows
        for name, ctx in (("fp32", contextlib.nullcontext), ("bf16", lambda: torch.autocast("cpu", torch.bfloat16))):
            layer = build_layer(2, False, mesh, GroupedGemmKernel() if kernel == "grouped" else None,
                                expert_dispatch=dispatch).float()
            x = layer_inputs("one_expert", info.rank).float().requires_grad_(True)
            with ctx():
                y, o = layer(x)
            (y.float() * torch.linspace(-1, 1, D)).sum().backward()
            reduce_gradients(layer, mesh)
            out[kernel, rows, dispatch, name] = {
                "y": y.detach(), "x_grad": x.grad,
                "grads": {n: p.grad.clone() for n, p in layer.experts.named_parameters()},
                "bytes": mesh.stats.snapshot()["ep/all_to_all"]["bytes"]}
            mesh.stats.reset()
    return out


def dispatch_under_tp_worker(_) -> list[dict]:
    """One top-2 MoE layer on tp = 2 x ep = 2, its experts held per tp rank or folded over ep x tp, with nodes of
    2 ranks (torchrun's numbering: ranks 0, 1 and 2, 3), under each expert dispatch: outputs and gradients (the
    parameters' before any reduction) for the test to compare across dispatches."""
    info = init_process(timeout_s=120)
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, ep=2, tp=2)
    out = []
    for fold, dispatch in itertools.product((False, True), ("choice", "rank", "node")):
        torch.manual_seed(5)
        layer = MoELayer(D, 16, 8, top_k=2, capacity_factor=1.0, mesh=mesh, fold_tp=fold, expert_dispatch=dispatch,
                         ranks_per_node=2).double()
        g = torch.Generator().manual_seed(100 + mesh.local_rank("ep"))
        x = torch.randn(4, S, D, generator=g, dtype=torch.float64).requires_grad_(True)
        y, o = layer(x)
        ((y * torch.linspace(-1, 1, D, dtype=torch.float64)).sum() + o.loss).backward()
        out.append({"fold": fold, "dispatch": dispatch, "kind": type(layer.dispatch).__name__, "y": y.detach(),
                    "x_grad": x.grad, "grads": {n: p.grad.clone() for n, p in layer.named_parameters()}})
    return out
