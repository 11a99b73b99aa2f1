"""Workers for the distributed graph tests (importable by spawned ranks): the feature store and the
distributed sampler over partitions written by the test."""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from pathlib import Path

from podscale.graph import load_planetoid
from podscale.graph.partition import load_book, load_partition
from podscale.graph.sampler import ALL, DistSampler, sample_blocks, sample_csc
from podscale.models.graphsage import GNN, GNNConfig
from podscale.graph.store import FeatureStore
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process


def store_and_sampler(path: str, seeds: list[int], fanout: int, rounds: int, cache_rows: int) -> dict:
    info = init_process(device="cpu")
    mesh = Mesh.build(info.device, dp=info.world_size)
    part = load_partition(path, info.rank)
    book = load_book(path)
    n = int(part.offsets[-1])
    # feature store: every node's row, in a shuffled order, twice (the second time partly from the cache)
    store = FeatureStore(part, mesh, cache_rows=cache_rows)
    ids = torch.from_numpy(np.random.default_rng(info.rank).permutation(n))
    first = store.fetch(ids)
    bytes1, rows1 = store.remote_bytes, store.remote_rows
    store.reset_stats()
    second = store.fetch(ids)
    out = {"ids": ids.numpy(), "rows": first.numpy(), "same": bool(torch.equal(first, second)),
           "bytes1": bytes1, "rows1": rows1, "bytes2": store.remote_bytes, "hits2": store.cache_hits,
           "inner": part.num_inner}
    store.close()
    # sampler: the same seeds (new ids, some owned here, some not) `rounds` times
    sampler = DistSampler(part.indptr, part.indices, part.offsets, mesh, seed=11)
    new = book["new_id"][np.asarray(seeds)]
    pairs = []
    for _ in range(rounds):
        counts, nbrs = sampler.hop(new, fanout)
        pairs.append(np.stack([np.repeat(new, counts), nbrs]))
    # ranks with different numbers of seeds (here: none on one rank) still sample together
    blocks = sampler.sample(new[:5] if info.rank == 0 else new[:0], [3, 2])
    out.update(pairs=book["orig_id"][np.concatenate(pairs, axis=1)], remote_sample_bytes=sampler.remote_bytes,
               block_shapes=[(b.num_src, b.num_dst, b.num_edges) for b in blocks],
               block_src=[book["orig_id"][b.src_ids.numpy()] for b in blocks],
               block_edges=[(b.indptr.numpy(), b.indices.numpy()) for b in blocks])
    out.update(embeddings_resume(path, part, mesh, new))
    return out


def embeddings_resume(path: str, part, mesh, ids) -> dict:
    """Node embeddings placed by the partition book: one training lookup of ``ids`` (owned here and
    elsewhere), saved with the table checkpointer, loaded into fresh embeddings of another seed; each
    rank's rows (weights) before the save and after the load."""
    from pathlib import Path

    from podscale.graph.store import NodeEmbeddings
    from podscale.table import RowWiseAdagrad
    from podscale.table.checkpoint import TableCheckpointer

    root = Path(path).parent / "emb-ckpt"
    step_dir = root / "step_00000001"
    step_dir.mkdir(parents=True, exist_ok=True)
    emb = NodeEmbeddings(part, mesh, 4, RowWiseAdagrad(0.5), seed=1, grad_divisor=2)
    emb(torch.from_numpy(ids)).pow(2).sum().backward()
    before = emb.table.local_rows(NodeEmbeddings.NAME)
    TableCheckpointer(emb.table).save(step_dir, root, 1)
    emb.close()
    fresh = NodeEmbeddings(part, mesh, 4, RowWiseAdagrad(0.5), seed=2)
    TableCheckpointer(fresh.table).load(step_dir)
    after = fresh.table.local_rows(NodeEmbeddings.NAME)
    fresh.close()

    def rows(pieces):
        keys = torch.cat([k for k, *_ in pieces])
        w = torch.cat([x for *_, x in pieces])
        order = torch.argsort(keys)
        return keys[order].numpy(), w[order].numpy()

    (kb, wb), (ka, wa) = rows(before), rows(after)
    return {"emb_keys_before": kb, "emb_rows_before": wb, "emb_keys_after": ka, "emb_rows_after": wa,
            "emb_start": part.start, "emb_inner": part.num_inner}


# -- runs of `podscale train` for the GNN task's layout tests ------------------------------------------------
def toml_of(d: dict) -> str:
    """A config dict as TOML (None values left out)."""
    import json
    lines = []
    for sec, vals in d.items():
        lines.append(f"[{sec}]")
        for k, v in vals.items():
            if v is not None:
                lines.append(f"{k} = {json.dumps(v) if not isinstance(v, bool) else str(v).lower()}")
    return "\n".join(lines) + "\n"


def train_launched(tmp_path, d: dict) -> None:
    """``podscale train`` of config ``d`` (its workers: ``parallel.nproc``) through the command's entry point,
    ``podscale.cli.main``, in the test process: the workers are forked as the command forks them, and the
    exit status is what ``python -m podscale`` exits with (test_gnn.py runs that command line itself)."""
    from pathlib import Path

    from podscale.cli import main
    toml = Path(tmp_path) / f"{d['run']['name']}.toml"
    toml.write_text(toml_of(d))
    assert main(["train", str(toml)]) == 0, "podscale train failed: its output is in the captured streams"


def metric_rows(run) -> list[dict]:
    import json
    from pathlib import Path
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]


DATA = Path(__file__).resolve().parent / "data"


def exact_blocks(g, seeds):
    """Blocks of every neighbour of ``seeds`` (2 layers): the full-graph outputs of those nodes, computed on
    their 2-hop neighbourhood only."""
    return sample_blocks(lambda dst, k: sample_csc(g.indptr, g.indices, dst, k, None), seeds, [ALL, ALL])


class Planetoid:
    """A Planetoid graph prepared once for every seed: the training nodes' exact 2-hop blocks and the blocks of
    the validation and test nodes together (one forward evaluates both), with their input features."""

    def __init__(self, name: str):
        g = self.g = load_planetoid(DATA / f"{name}.npz")
        self.x, self.y = torch.from_numpy(g.features), torch.from_numpy(g.labels)
        self.train = exact_blocks(g, g.splits["train"])
        self.train_x, self.train_y = self.x[self.train[0].src_ids], self.y[torch.from_numpy(g.splits["train"])]
        held = np.concatenate([g.splits["val"], g.splits["test"]])
        self.n_val = len(g.splits["val"])
        self.held = exact_blocks(g, held)
        self.held_x, self.held_y = self.x[self.held[0].src_ids], self.y[torch.from_numpy(held)]


def train_planetoid(kind: str, data: Planetoid, seed: int, epochs: int = 100, eval_every: int = 4) -> float:
    """Test accuracy at the best validation accuracy (Kipf and Welling's protocol: Adam, lr 0.01, L2 5e-4,
    dropout 0.5), full-batch over the training nodes' exact neighbourhoods (the full-graph computation)."""
    torch.manual_seed(seed)
    model = GNN(GNNConfig(kind, data.x.shape[1], 64, data.g.num_classes, 2, 0.5))
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    best = (-1.0, 0.0)
    for epoch in range(epochs):
        model.train()
        opt.zero_grad()
        F.cross_entropy(model(data.train, data.train_x), data.train_y).backward()
        opt.step()
        if epoch % eval_every == eval_every - 1:
            model.eval()
            with torch.no_grad():
                hit = (model(data.held, data.held_x).argmax(1) == data.held_y).float()
            acc = {"val": hit[: data.n_val].mean().item(), "test": hit[data.n_val:].mean().item()}
            if acc["val"] >= best[0]:
                best = (acc["val"], acc["test"])
    return best[1]


def planetoid_accuracies(jobs: list[list[tuple[str, int]]]) -> dict[tuple[str, int], float]:
    """test_gnn.py's accuracy runs: this rank's share ``jobs[rank]`` of (Planetoid graph, seed), each trained
    by :func:`train_planetoid` on one intra-op thread (as the test process runs it); their test accuracies."""
    torch.set_num_threads(1)
    mine = jobs[int(os.environ["RANK"])]
    graphs = {name: Planetoid(name) for name in dict.fromkeys(name for name, _ in mine)}
    return {(name, seed): train_planetoid("graphsage", graphs[name], seed) for name, seed in mine}
