"""Parameter-server throughput: a DLRM-like model on 2 gloo ranks, podscale's sharded tables against
``nn.EmbeddingBag`` + a sparse optimizer under DDP, against TorchRec's sharded EmbeddingBagCollection
(table-wise and column-wise; TorchRec refuses row-wise on CPU) when it is installed, and podscale with the
table 10x its DRAM budget (SSD tier: the default engine, the log-structured store of storage/log.py, or
``--ssd-engine rocksdb``).  podscale runs row-, table- and column-wise over keyed stores
(arbitrary int64 ids, rows created as ids arrive) and table- and column-wise over dense-range stores
(``TableSpec(num_keys=rows, storage="dense")``: the id is the slot, rows created up front, as TorchRec's
tables are); table- and column-wise bags take the pooled exchange (owners pool).

    python bench/ps.py --small --skip ssd --skip row-keyed   # variants by name: see --skip

    python bench/ps.py            # 8 tables x 1M rows x dim 64, Zipf(1.05), 10-20 ids per bag
    python bench/ps.py --small    # 8 tables x 50k rows, a quick check
    python bench/ps.py --skip table-keyed --skip column-keyed --skip table-dense --skip column-dense \
        --skip ddp --skip torchrec --ssd-engine rocksdb   # the SSD variant and its in-memory twin only

TorchRec (optional; pinned in the ``torchrec`` extra of pyproject.toml, installed without dependencies):
``pip install --no-deps fbgemm-gpu-cpu==1.8.0 torchrec==1.8.0 tensordict==0.10.0 pyvers==0.2.3
pyre-extensions==0.0.32``.

All variants train the same dense part (DLRM's bottom MLP, dot interaction, top MLP; Adagrad, averaged over
the ranks) on the same batches; the tables use row-wise Adagrad (podscale, TorchRec's fused
EXACT_ROWWISE_ADAGRAD) or torch's sparse Adagrad (``nn.EmbeddingBag(sparse=True)``; DDP all-gathers its
sparse gradients).  Prints samples/s (global batch over the median step time after warm-up) per variant and
the ratios of podscale against each peer.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from podscale.models.dlrm import DLRMDense  # noqa: E402
from podscale.table.data import CriteoLike, make_batch  # noqa: E402

DIM = 64


def setting(small: bool) -> dict:
    return {"tables": 8, "rows": 50_000 if small else 1_000_000, "batch": 256 if small else 1024,
            "steps": 6 if small else 20, "warmup": 2 if small else 4, "min_ids": 10, "max_ids": 20,
            "alpha": 1.05}


def gen(s: dict) -> CriteoLike:
    return CriteoLike(cardinalities=(s["rows"],) * s["tables"], alpha=s["alpha"], min_ids=s["min_ids"],
                      max_ids=s["max_ids"], seed=7, ranks_as_ids=True)


def rank_batch(s: dict, step: int, rank: int, n: int):
    from podscale.table.data import slice_batch
    d, sp, y = make_batch(gen(s), step, s["batch"] * n)
    return slice_batch(d, sp, y, rank * s["batch"], (rank + 1) * s["batch"])


def dense_model(s: dict) -> nn.Module:
    torch.manual_seed(0)
    return DLRMDense(13, s["tables"], DIM, (128, 64), (128, 64))


def _timed(step_fn, s: dict) -> float:
    times = []
    for i in range(s["warmup"] + s["steps"]):
        t0 = time.perf_counter()
        step_fn(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[s["warmup"]:])


# -- variants (each runs inside a worker) ---------------------------------------------------------------
def run_podscale(s: dict, budget_fraction: float | None, ssd_root: str | None, sharding: str = "row",
                 storage: str = "keyed", ssd_engine: str | None = None) -> dict:
    from podscale.parallel.data import DataParallel
    from podscale.runtime import comm
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.table import RowWiseAdagrad, ShardedEmbeddingBags, TableSpec
    from podscale.table.hashing import init_rows, name_seed

    info = init_process()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // info.world_size))
    mesh = Mesh.build(info.device, dp=info.world_size)
    n, r = info.world_size, info.rank
    names = list(gen(s).names)
    row_bytes = 4 * (DIM + 2)
    batches = [rank_batch(s, i, r, n) for i in range(s["warmup"] + s["steps"] + 1)]
    budget, preload = None, 0
    if budget_fraction is not None:
        # the DRAM tier holds twice a step's rows per shard (the ids of the global batch that this rank
        # owns: every rank's batch asks the owner); the table holds 1/budget_fraction times that
        from podscale.table.hashing import owner_of
        ws = max(int((owner_of(torch.unique(make_batch(gen(s), i, s["batch"] * n)[1][nm][0]), n) == r).sum())
                 for i in range(len(batches)) for nm in names)
        t = torch.tensor([ws], device=mesh.device)
        comm.all_reduce(t, mesh, "dp", op=torch.distributed.ReduceOp.MAX)
        budget = int(2 * int(t) * row_bytes)
        preload = int(budget / budget_fraction / row_bytes) * n
    engine = {} if ssd_engine is None else {"ssd_engine": ssd_engine}  # (None: TableSpec's default)
    specs = [TableSpec(nm, DIM, "sum", sharding, dram_budget_bytes=budget, storage=storage, **engine,
                       num_keys=s["rows"] if storage == "dense" else None,
                       ssd_path=None if ssd_root is None else os.path.join(ssd_root, f"r{r}")) for nm in names]
    emb = ShardedEmbeddingBags(specs, mesh, RowWiseAdagrad(0.05), seed=0)
    emb.clear()
    if budget is not None:  # rows exist before training, 10x what the DRAM tier holds
        keys = torch.arange(preload, dtype=torch.int64)
        for nm in names:
            for a in range(0, len(keys), 8192):
                k = keys[a: a + 8192]
                emb.load_rows(nm, k, init_rows(name_seed(0, nm), k, 0, DIM, DIM ** -0.5))
    dense = dense_model(s)
    dp = DataParallel(dense, mesh, ("dp",), optimizer=torch.optim.Adagrad(dense.parameters(), lr=0.01))

    def step(i):
        d, sp, y = batches[i]
        pooled = emb(sp)
        emb.prefetch(batches[i + 1][1])
        loss = F.binary_cross_entropy_with_logits(dense(d, [pooled[k] / n for k in names]), y)
        loss.backward()
        dp.finish_grad_sync()
        dp.step(0.01)
        dp.zero_grad()

    t = _timed(step, s)
    held = sum(len(st) for st in emb.stores.values()) if budget is not None else None
    emb.close()
    return {"step_s": t, "rows_held": held, "budget": budget, "preload": preload}


def run_ddp_embeddingbag(s: dict) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from podscale.runtime.process import init_process

    info = init_process()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // info.world_size))
    n, r = info.world_size, info.rank
    names = list(gen(s).names)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(1)
            self.bags = nn.ModuleList(nn.EmbeddingBag(s["rows"], DIM, mode="sum", sparse=True) for _ in names)
            for b in self.bags:
                nn.init.uniform_(b.weight, -DIM ** -0.5, DIM ** -0.5)
            self.dense = dense_model(s)

        def forward(self, d, sp):
            return self.dense(d, [b(*sp[k]) for b, k in zip(self.bags, names)])

    model = DDP(Model())
    sparse_opt = torch.optim.Adagrad(list(model.module.bags.parameters()), lr=0.05)
    dense_opt = torch.optim.Adagrad(model.module.dense.parameters(), lr=0.01)
    batches = [rank_batch(s, i, r, n) for i in range(s["warmup"] + s["steps"])]

    def step(i):
        d, sp, y = batches[i]
        loss = F.binary_cross_entropy_with_logits(model(d, sp), y)
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        sparse_opt.zero_grad()
        dense_opt.zero_grad()

    t = _timed(step, s)
    dist.barrier()
    return {"step_s": t}


def run_torchrec(s: dict, sharding: str) -> dict:
    """TorchRec's EmbeddingBagCollection sharded ``table_wise`` or ``column_wise`` by DistributedModelParallel
    on gloo, fused row-wise Adagrad (FBGEMM's CPU kernels)."""
    import torch.distributed as dist
    import torchrec
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import Awaitable
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    from torch.nn.parallel import DistributedDataParallel as DDP
    from podscale.runtime.process import init_process

    info = init_process()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // info.world_size))
    n, r = info.world_size, info.rank
    names = list(gen(s).names)
    ebc = torchrec.EmbeddingBagCollection(tables=[
        torchrec.EmbeddingBagConfig(name=nm, embedding_dim=DIM, num_embeddings=s["rows"], feature_names=[nm],
                                    pooling=torchrec.PoolingType.SUM) for nm in names], device=torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.Adagrad, ebc.parameters(), {"lr": 0.05})
    constraints = {nm: ParameterConstraints(sharding_types=[sharding]) for nm in names}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=n, compute_device="cpu"),
                                       constraints=constraints)
    sharder = EmbeddingBagCollectionSharder()
    plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    dense = DDP(dense_model(s))
    dense_opt = torch.optim.Adagrad(dense.parameters(), lr=0.01)
    batches = []
    for i in range(s["warmup"] + s["steps"]):
        d, sp, y = rank_batch(s, i, r, n)
        lengths = torch.cat([torch.diff(torch.cat([o, torch.tensor([len(v)])])) for v, o in sp.values()])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=torch.cat([v for v, _ in sp.values()]),
                                                  lengths=lengths)
        batches.append((d, kjt, y))

    def step(i):
        d, kjt, y = batches[i]
        out = model(kjt)  # sharded modules return an Awaitable of the pooled KeyedTensor
        pooled = out.wait() if isinstance(out, Awaitable) else out
        loss = F.binary_cross_entropy_with_logits(dense(d, [pooled[k] for k in names]), y)
        loss.backward()
        dense_opt.step()
        dense_opt.zero_grad()

    t = _timed(step, s)
    dist.barrier()
    return {"step_s": t}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="8 tables x 50k rows, few steps (a quick check)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--skip", action="append", default=[], help="variants to skip: ddp, torchrec, ssd, "
                    "and podscale's <sharding>-<storage> (row-keyed, table-keyed, column-keyed, table-dense, column-dense)")
    ap.add_argument("--ssd-engine", choices=("log", "rocksdb"), default=None,
                    help="the SSD variant's engine (default: TableSpec's default, the log store)")
    args = ap.parse_args(argv)
    from podscale.runtime.launcher import launch
    from podscale.table import TableSpec

    s = setting(args.small)
    n = args.nproc
    gb = s["batch"] * n
    print(f"bench/ps.py: {s['tables']} tables x {s['rows']:,} rows x dim {DIM}, Zipf({s['alpha']}), "
          f"{s['min_ids']}-{s['max_ids']} ids per bag, global batch {gb} on {n} gloo ranks", flush=True)
    res: dict[str, float] = {}

    def report(name, out):
        t = max(o["step_s"] for o in out.values())
        res[name] = gb / t
        print(f"  {name:40s} {gb / t:10,.0f} samples/s", flush=True)

    variants = [("row", "keyed"), ("table", "keyed"), ("column", "keyed"), ("table", "dense"), ("column", "dense")]
    for sharding, storage in variants:
        if f"{sharding}-{storage}" in args.skip:
            continue
        name = f"podscale {sharding}-wise{', dense' if storage == 'dense' else ''} (in memory)"
        report(name, launch(run_podscale, (s, None, None, sharding, storage), nproc=n, start_method="spawn"))
        if (sharding, storage) == ("row", "keyed"):
            # the SSD variant right after its in-memory twin: on a shared machine the two see the most similar load
            if "ssd" not in args.skip:
                root = tempfile.mkdtemp(prefix="podscale-bench-ssd-")
                try:
                    out = launch(run_podscale, (s, 0.1, root, "row", "keyed", args.ssd_engine), nproc=n,
                                 start_method="spawn")
                    report("podscale row-wise, table 10x DRAM", out)
                    print(f"    (SSD engine: {args.ssd_engine or TableSpec.ssd_engine})", flush=True)
                    o = out[0]
                    print(f"    (rank 0: {o['rows_held']:,} rows held in {s['tables']} table shards, DRAM budget "
                          f"{o['budget'] / 2 ** 20:.2f} MiB per table shard = {o['budget'] // (4 * (DIM + 2)):,} rows: "
                          f"{o['rows_held'] / s['tables'] / (o['budget'] // (4 * (DIM + 2))):.1f}x)", flush=True)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
    if "ddp" not in args.skip:
        report("nn.EmbeddingBag sparse + DDP", launch(run_ddp_embeddingbag, (s,), nproc=n, start_method="spawn"))
    if "torchrec" not in args.skip:
        try:
            import torchrec  # noqa: F401
            for sh in ("table_wise", "column_wise"):
                report(f"TorchRec {sh}", launch(run_torchrec, (s, sh), nproc=n, start_method="spawn"))
        except Exception as err:  # not installed, or its FBGEMM kernels do not load with this torch
            print(f"  TorchRec: not run ({type(err).__name__}: {str(err).splitlines()[0][:160]})", flush=True)
    ours = max(v for k, v in res.items() if k.startswith("podscale") and "(in memory)" in k)
    print("ratios (podscale's best in-memory layout over the peer; > 1: podscale faster):")
    for k, v in res.items():
        if not k.startswith("podscale"):
            print(f"  vs {k:30s} {ours / v:6.2f}x")
    if "podscale row-wise, table 10x DRAM" in res and "podscale row-wise (in memory)" in res:
        ssd = res["podscale row-wise, table 10x DRAM"]
        print(f"  SSD tier / in memory (row-wise)   {ssd / res['podscale row-wise (in memory)']:6.2f}x")
        print(f"  SSD tier / best in memory         {ssd / ours:6.2f}x")


if __name__ == "__main__":
    main()
