"""The GNN task: node classification with GraphSAGE or GCN (``[model] kind = "graphsage"`` or ``"gcn"``).

Everything the trunk needs to train :class:`~podscale.models.graphsage.GNN` on a graph
(:func:`~podscale.graph.source.load_graph`: a generated SBM by default, R-MAT, a Planetoid ``.npz`` or an
OGB-style folder):

* **full-graph training** (``fanouts = []``): every step is one epoch, the whole graph as one block per
  layer, the loss over the training nodes; with ``dp > 1`` each rank computes its partition's nodes over
  their full neighbourhood, the halo's states of every layer from their owners
  (:class:`~podscale.graph.halo.HaloExchange`), and the dense gradients are all-reduced by the strategy;
* **mini-batch training** (``fanouts = [f_1, ..., f_L]``): every step samples ``global_batch / dp`` seed nodes
  per rank and their neighbourhoods (:class:`~podscale.graph.sampler.DistSampler`), and fetches the input
  features (:class:`~podscale.graph.store.FeatureStore`).  With ``dp > 1`` each rank trains on its partition
  of ``[model] partitions`` (written by ``podscale graph partition``): its seeds are its own training nodes,
  remote neighbours are sampled by their owners and remote features fetched from them, as in DistDGL (Zheng
  et al. 2020).  The dense parameters are data-parallel under the trunk's strategy.

The next mini-batch is sampled and its features fetched on a background thread while the current one trains
(on a mesh of its own, so its collectives never interleave with the gradient all-reduce).  Ranks hold
different numbers of training nodes: they agree on the number of steps of an epoch with one all-reduce (max)
of their batch counts, and a rank that runs out of seeds first wraps around within its shuffled order (a rank
with none samples empty batches), so every rank makes the same collective calls and none hangs.  Each step's
loss is the sum over the rank's seeds divided by the global seed count over ``dp`` (one all-reduce of the
count with the sampling), so the data-parallel mean is the mean over all seeds of the step, whatever their
split over the ranks.

Metrics (``evaluate``): loss, accuracy and test accuracy over exactly-sampled neighbourhoods (every
neighbour), and for the last complete epoch its time, sampled edges per second and remote bytes (features
and sampling requests sent between ranks).
"""
from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from podscale.graph.core import Graph, GraphError
from podscale.graph.halo import HaloExchange, partition_block
from podscale.graph.partition import Partition, check_matches, load_partition, read_meta, whole_graph
from podscale.graph.sampler import ALL, Block, DistSampler, check_fanouts, full_block
from podscale.graph.source import load_graph
from podscale.graph.store import FeatureStore, NodeEmbeddings
from podscale.models.graphsage import GNN, GNNConfig
from podscale.runtime import comm
from podscale.runtime.env import under_launcher
from podscale.runtime.mesh import Mesh
from podscale.table import LazyAdam, RowWiseAdagrad, SparseSGD
from podscale.table.checkpoint import TableCheckpointer
from podscale.tasks.base import Task


@dataclass
class GraphBatch:
    """Blocks (input layer first), the input features of the first block's sources, and the labels ``y``
    of the last block's destinations at positions ``target``; ``scale`` turns the rank's loss sum into its
    share of the step's mean (``dp / global seed count``)."""

    blocks: list[Block]
    x: torch.Tensor
    target: torch.Tensor
    y: torch.Tensor
    scale: float
    sampled_edges: int = 0
    remote: int = 0          # bytes this batch sent between ranks (features and sampling requests)


def batch_to(b: GraphBatch, device: torch.device) -> GraphBatch:
    return GraphBatch([blk.to(device) for blk in b.blocks], b.x.to(device, non_blocking=True),
                      b.target.to(device), b.y.to(device), b.scale, b.sampled_edges, b.remote)


def graph_of(m) -> Graph:
    """The graph a ``[model]`` section names."""
    return load_graph(m.graph, m.graph_path, seed=m.graph_seed, nodes=m.nodes, scale=m.scale, features=m.features,
                      classes=m.classes)


def check_config(cfg) -> None:
    """GraphError (one line) for a GNN config that cannot run: called before workers start."""
    m, dp = cfg.model, cfg.dp
    if m.fanouts:
        check_fanouts(m.fanouts, m.layers)
    if m.node_embedding_dim:
        if cfg.train.precision == "fp16":
            raise GraphError("node_embedding_dim with train.precision='fp16': the loss scale would reach the "
                             "embeddings' sparse optimizer: use 'fp32' or 'bf16'")
        if cfg.grad_accum != 1:
            raise GraphError(f"node_embedding_dim={m.node_embedding_dim}: the embeddings are updated in each "
                             f"backward, so a step takes one micro-batch: set train.micro_batch = "
                             f"{cfg.train.global_batch // dp}")
    if dp > 1 and m.partitions and under_launcher():
        # inside the workers: the launching process checked the graph against the partitions before they
        # started; a worker reads only its partition, never the whole graph
        check_matches(read_meta(m.partitions), m.partitions, dp)
        return
    g = graph_of(m)
    if g.labels is None or "train" not in g.splits:
        raise GraphError(f"graph '{g.name}' needs labels and a train split for node classification")
    if (g.features is None or g.features.shape[1] == 0) and not m.node_embedding_dim:
        raise GraphError(f"graph '{g.name}' has no node features: set node_embedding_dim (e.g. 32) to learn an "
                         "embedding per node")
    if dp > 1:
        if not m.partitions:
            raise GraphError(f"dp={dp} trains on partitions: write them with `podscale graph partition ... --parts "
                             f"{dp}` and set model.partitions to the folder")
        meta = read_meta(m.partitions)
        check_matches(meta, m.partitions, dp, g)
        if meta["feature_dim"] != (0 if g.features is None else g.features.shape[1]):
            raise GraphError(f"'{m.partitions}' holds features of width {meta['feature_dim']} but the graph's are "
                             f"{0 if g.features is None else g.features.shape[1]} wide: partition this graph again")
    if m.fanouts and cfg.grad_accum != 1:
        raise GraphError(f"mini-batch GNN training takes one micro-batch per step: set train.micro_batch = "
                         f"global_batch / dp = {cfg.train.global_batch // dp}")


class _Context:
    """One rank's partition, sampler and feature store, on a mesh of their own (built once per process)."""

    def __init__(self, task: "GraphTask", dp_rank: int, dp: int):
        m = task.cfg.model
        self.part: Partition = load_partition(m.partitions, dp_rank) if dp > 1 else whole_graph(task.graph)
        device = torch.device("cpu")
        if dist.is_initialized() and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        # its own process groups: the sampling thread's collectives never meet the training ones
        self.mesh = Mesh.build(device, dp=dp)
        self.sampler = DistSampler(self.part.indptr, self.part.indices, self.part.offsets, self.mesh,
                                   seed=task.cfg.run.seed)
        self.store = FeatureStore(self.part, self.mesh, cache_rows=m.feature_cache_rows)
        self.dp = dp
        self._full: tuple[Block, torch.Tensor] | None = None

    def global_count(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64, device=self.mesh.device)
        comm.all_reduce(t, self.mesh, "dp")
        return int(t.item())

    def full_batch(self, split: str, layers: int) -> GraphBatch:
        """Full-graph training over partitions: the partition's whole neighbourhood (its nodes, their
        in-edges and the halo, whose states come from their owners before every layer) and the labels of
        its nodes of ``split`` - collective."""
        if self._full is None:
            ex = HaloExchange(self.part, self.mesh)
            blk = partition_block(self.part, ex)
            self._full = (blk, self.store.fetch(blk.src_ids))
        blk, x = self._full
        idx = self.part.splits[split]
        total = self.global_count(len(idx))
        return GraphBatch([blk] * layers, x, torch.from_numpy(idx), torch.from_numpy(self.part.labels[idx]),
                          self.dp / max(1, total), blk.num_edges * layers)

    def batch(self, seeds_local: np.ndarray, fanouts: list[int]) -> GraphBatch:
        """The batch of this rank's seeds (local ids) - collective."""
        p = self.part
        seeds = seeds_local.astype(np.int64) + p.start
        e0 = self.sampler.sampled_edges
        blocks = self.sampler.sample(seeds, fanouts)
        x = self.store.fetch(blocks[0].src_ids)
        total = self.global_count(len(seeds))
        return GraphBatch(blocks, x, torch.arange(len(seeds)), torch.from_numpy(p.labels[seeds_local]),
                          self.dp / max(1, total), self.sampler.sampled_edges - e0)


class MiniBatches:
    """Mini-batches of this rank's training seeds, one sampled ahead on a background thread; state: the
    number of batches consumed."""

    def __init__(self, ctx: _Context, fanouts: list[int], per_rank: int, seed: int):
        self.ctx, self.fanouts, self.per_rank, self.seed = ctx, fanouts, per_rank, seed
        self.seeds = ctx.part.splits["train"]
        mine = math.ceil(len(self.seeds) / per_rank)
        # ranks agree on the steps of an epoch: one all-reduce (max) of their batch counts
        t = torch.tensor([mine], dtype=torch.int64, device=ctx.mesh.device)
        comm.all_reduce(t, ctx.mesh, "dp", op=dist.ReduceOp.MAX)
        self.steps_per_epoch = max(1, int(t.item()))
        self.consumed = 0
        self._pool: ThreadPoolExecutor | None = None
        self._next: Future | None = None
        self._epoch_start = None
        self._acc = {"edges": 0, "bytes": 0}
        self.last_epoch: dict[str, float] = {}

    def _seeds_of(self, i: int) -> np.ndarray:
        """Seeds of this rank's batch ``i``: epoch ``i // steps_per_epoch`` shuffles the rank's training nodes
        and cuts them into batches of ``per_rank``; a rank with fewer seeds than the epoch's batches hold
        wraps around within its shuffled order (it pads with seeds of the same epoch)."""
        n = len(self.seeds)
        epoch, j = divmod(i, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, self.ctx.mesh.local_rank("dp"), epoch]).permutation(n)
        if n <= self.per_rank:
            return self.seeds[order]
        return self.seeds[order[np.arange(j * self.per_rank, (j + 1) * self.per_rank) % n]]

    def _make(self, i: int) -> GraphBatch:
        s = self.ctx.sampler.remote_bytes + self.ctx.store.remote_bytes
        b = self.ctx.batch(self._seeds_of(i), self.fanouts)
        b.remote = self.ctx.sampler.remote_bytes + self.ctx.store.remote_bytes - s
        return b

    def next_step(self) -> list[GraphBatch]:
        if self._pool is None:  # started at the first step: evaluation batches were sampled before, alone
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="podscale-sampler")
            self._next = self._pool.submit(self._make, self.consumed)
            self._epoch_start = time.perf_counter()
        batch = self._next.result()
        self.consumed += 1
        self._next = self._pool.submit(self._make, self.consumed)  # sampled while this one trains
        self._acc["edges"] += batch.sampled_edges
        self._acc["bytes"] += batch.remote
        if self.consumed % self.steps_per_epoch == 0:
            now = time.perf_counter()
            dt = now - self._epoch_start
            self.last_epoch = {"epoch_time_s": dt, "sampled_edges_per_s": self._acc["edges"] / max(dt, 1e-9),
                               "remote_bytes_per_epoch": float(self._acc["bytes"])}
            self._epoch_start, self._acc = now, {"edges": 0, "bytes": 0}
        return [batch]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint's data has seed {state['seed']} but this run has {self.seed}: resume "
                             "with the same run.seed")
        if self._pool is not None:
            raise ValueError("load the data position before the first step")
        self.consumed = int(state["consumed"])


class FullGraph:
    """Full-graph training: the same batch (the whole graph, the training nodes' labels) every step.
    ``halo``: over partitions, the exchange whose bytes (the halo's states and gradients) are the epoch's
    remote bytes."""

    def __init__(self, batch: GraphBatch, halo: HaloExchange | None = None):
        self.batch, self.consumed, self.halo = batch, 0, halo
        self.last_epoch: dict[str, float] = {}
        self._t = None
        self._bytes = 0

    def next_step(self) -> list[GraphBatch]:
        now = time.perf_counter()
        sent = self.halo.remote_bytes if self.halo is not None else 0
        if self._t is not None:
            dt = now - self._t
            self.last_epoch = {"epoch_time_s": dt, "sampled_edges_per_s": self.batch.sampled_edges / dt,
                               "remote_bytes_per_epoch": float(sent - self._bytes)}
        self._t, self._bytes = now, sent
        self.consumed += 1
        return [self.batch]

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])


def loss_sum(module: nn.Module, b: GraphBatch) -> torch.Tensor:
    logits = module(b.blocks, b.x)[b.target]
    return F.cross_entropy(logits.float(), b.y, reduction="sum") * b.scale


def correct_sum(module: nn.Module, b: GraphBatch) -> torch.Tensor:
    logits = module(b.blocks, b.x)[b.target]
    return (logits.argmax(dim=1) == b.y).float().sum() * b.scale


class GraphTask(Task):
    """Node classification: batches are :class:`GraphBatch` es; throughput counts seed nodes."""

    throughput_unit = "nodes"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.m = cfg.model
        self._ctx: _Context | None = None
        self._source = None
        self.embeddings: NodeEmbeddings | None = None
        self._train_nodes = 0   # full-graph training over partitions: the training nodes of all ranks
        self.checkpointer: TableCheckpointer | None = None

    @cached_property
    def graph(self) -> Graph:
        return graph_of(self.m)

    @property
    def distributed(self) -> bool:
        """Training over partitions: each rank reads its own, never the whole graph."""
        return self.cfg.dp > 1

    @cached_property
    def shape(self) -> dict:
        """Nodes, edges, feature width and classes: from the partitions' description when distributed."""
        if self.distributed:
            meta = read_meta(self.m.partitions)
            return {k: meta[k] for k in ("graph", "num_nodes", "num_edges", "feature_dim", "num_classes")}
        g = self.graph
        return {"graph": g.name, "num_nodes": g.num_nodes, "num_edges": g.num_edges,
                "feature_dim": 0 if g.features is None else g.features.shape[1], "num_classes": g.num_classes}

    @cached_property
    def gnn(self) -> GNNConfig:
        s = self.shape
        return GNNConfig(self.m.kind, s["feature_dim"], self.m.hidden, s["num_classes"], self.m.layers,
                         self.m.dropout, self.m.node_embedding_dim)

    def context(self, dp_rank: int, dp: int) -> _Context:
        if self._ctx is None:
            self._ctx = _Context(self, dp_rank, dp)
        return self._ctx

    def build_model(self) -> nn.Module:
        return GNN(self.gnn)

    # learnable node embeddings: rows of the sharded table outside the strategy's parameters ---------------
    def bind(self, model: nn.Module, mesh) -> None:
        """With ``node_embedding_dim``: the node embeddings over ``dp``, placed by the partition book, attached
        to the model (their sparse optimizer runs inside backward; the strategy sees the dense weights)."""
        if not self.m.node_embedding_dim:
            return
        dp = mesh.size("dp")
        part = self.context(mesh.local_rank("dp"), dp).part
        opt = {"adagrad": RowWiseAdagrad, "sgd": SparseSGD, "adam": LazyAdam}[self.m.node_embedding_optimizer]
        self.embeddings = NodeEmbeddings(part, mesh, self.m.node_embedding_dim, opt(self.m.node_embedding_lr),
                                         seed=self.cfg.run.seed, grad_divisor=dp)
        model.attach_embeddings(self.embeddings)
        self.checkpointer = TableCheckpointer(self.embeddings.table)

    def save_state(self, step_dir: Path, root: Path, step: int) -> None:
        if self.embeddings is not None:
            self.checkpointer.save(step_dir, root, step)

    def load_state(self, step_dir: Path) -> None:
        if self.embeddings is not None:
            self.checkpointer.load(step_dir)

    def close(self) -> None:
        if self.embeddings is not None:
            self.embeddings.close()

    def model_config(self) -> dict:
        return asdict(self.gnn)

    def describe(self, model: nn.Module) -> str:
        n = sum(p.numel() for p in model.parameters())
        s = self.shape
        how = f"fan-outs {list(self.m.fanouts)}, {self.cfg.train.global_batch} seeds a step" if self.m.fanouts \
            else "full graph"
        return f"{self.m.kind} {n / 1e3:.1f}K params on {s['graph']} ({s['num_nodes']} nodes, {s['num_edges']} edges), {how}"

    def _full_batch(self, split: str) -> GraphBatch:
        g = self.graph
        blk = full_block(g.indptr, g.indices)
        idx = torch.from_numpy(g.splits[split])
        x = g.features if g.features is not None else np.zeros((g.num_nodes, 0), np.float32)
        return GraphBatch([blk] * self.m.layers, torch.from_numpy(x), idx, torch.from_numpy(g.labels[idx]),
                          1.0 / max(1, len(idx)), g.num_edges * self.m.layers)

    def train_data(self, dp_rank: int, dp_size: int):
        if not self.m.fanouts and self.distributed:
            ctx = self.context(dp_rank, dp_size)
            batch = ctx.full_batch("train", self.m.layers)
            self._train_nodes = round(dp_size / batch.scale)
            self._source = FullGraph(batch, batch.blocks[0].halo)
        elif not self.m.fanouts:
            self._source = FullGraph(self._full_batch("train"))
        else:
            ctx = self.context(dp_rank, dp_size)
            self._source = MiniBatches(ctx, list(self.m.fanouts), self.cfg.train.global_batch // dp_size,
                                       self.cfg.run.seed)
        return self._source

    def eval_data(self, dp_rank: int, dp_size: int) -> list[GraphBatch]:
        """[validation batch, test batch]: every neighbour of every node (exact), this rank's nodes."""
        if not self.m.fanouts and self.distributed:
            return [self.context(dp_rank, dp_size).full_batch(s, self.m.layers) for s in ("val", "test")]
        if not self.m.fanouts:
            return [self._full_batch(s) for s in ("val", "test")]
        ctx = self.context(dp_rank, dp_size)
        return [ctx.batch(ctx.part.splits[s], [ALL] * self.m.layers) for s in ("val", "test")]

    def to_device(self, batch: GraphBatch, device: torch.device) -> GraphBatch:
        return batch_to(batch, device)

    def loss(self, module: nn.Module, batch: GraphBatch) -> torch.Tensor:
        return loss_sum(module, batch)

    def evaluate(self, engine, batches) -> dict[str, float]:
        acc = self.on_device(correct_sum, self.cfg.train.precision, engine.device)
        out = {"loss": engine.evaluate(batches[:1]), "accuracy": engine.evaluate(batches[:1], acc),
               "test_accuracy": engine.evaluate(batches[1:], acc)}
        if self._source is not None:
            out.update(self._source.last_epoch)
        return out

    def units_per_sample(self) -> float:
        # full graph: a step trains every training node, whatever global_batch says
        if not self.m.fanouts:
            n = self._train_nodes if self.distributed else len(self.graph.splits["train"])
            return n / self.cfg.train.global_batch
        return 1

    def flops_per_sample(self) -> float:
        fan = float(np.mean(self.m.fanouts)) if self.m.fanouts else self.shape["num_edges"] / self.shape["num_nodes"]
        return self.gnn.flops_per_node(fan)
