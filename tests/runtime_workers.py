"""Worker functions for tests/test_runtime.py (importable by spawned workers)."""
import torch
import torch.nn as nn

from podscale.parallel.data import DataParallel
from podscale.runtime import comm
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process


def collectives_on_a_2x2_mesh() -> dict:
    info = init_process()
    mesh = Mesh.build(info.device, dp=2, tp=2)
    r = info.rank
    out = {"coords": mesh.coords(), "tp_ranks": mesh.group_ranks("tp"), "dp_ranks": mesh.group_ranks("dp")}
    t = torch.tensor([float(r)], device=mesh.device)
    comm.all_reduce(t, mesh, "tp")
    out["tp_sum"] = t.item()
    t = torch.tensor([float(r)], device=mesh.device)
    comm.all_reduce(t, mesh, "dp")
    out["dp_sum"] = t.item()
    t = torch.tensor([float(r)], device=mesh.device)
    comm.all_reduce(t, mesh, ("dp", "tp"))
    out["world_sum"] = t.item()
    full = torch.arange(8, dtype=torch.float32, device=mesh.device) * (r + 1)
    shard = torch.empty(4, device=mesh.device)
    comm.reduce_scatter(shard, full, mesh, "tp")
    out["rs"] = shard.tolist()
    gathered = torch.empty(8, device=mesh.device)
    comm.all_gather(gathered, shard, mesh, "tp")
    out["ag"] = gathered.tolist()
    splits_in = [1, 3] if mesh.local_rank("tp") == 0 else [2, 2]
    inp = torch.full((4,), float(r), device=mesh.device)
    # rank receives splits: from tp-peer 0 its splits_in[me], from peer 1 theirs
    out_splits = [1, 2] if mesh.local_rank("tp") == 0 else [3, 2]
    recv = torch.empty(sum(out_splits), device=mesh.device)
    comm.all_to_all(recv, inp, mesh, "tp", out_splits, splits_in)
    out["a2a"] = recv.tolist()
    out["stats"] = mesh.stats.snapshot()
    out["large"] = large_gloo_collectives_match_torch(mesh)
    out["backends"] = {"+".join(k): mesh.axis_group(*k).backend for k in (("tp",), ("dp",), ("dp", "tp"))}
    return out


def large_gloo_collectives_match_torch(mesh) -> dict:
    """Tensors of at least comm.GLOO_INPLACE_MIN_BYTES take gloo's in-place path (a broadcast / reduce per
    rank): the results equal torch's flat collectives on the same group, on a sub-group (tp) and on the
    world (dp x tp), for a scratch-input reduce-scatter too."""
    import torch.distributed as dist
    res = {}
    for axes in ("tp", ("dp", "tp")):
        key = (axes,) if isinstance(axes, str) else axes
        n, g = mesh.size(*key), mesh.group(*key)
        per = comm.GLOO_INPLACE_MIN_BYTES // 4 + 3  # elements per rank: the path applies, odd sizes
        gen = torch.Generator().manual_seed(mesh.rank)
        dev = mesh.device
        shard = torch.randn(per, generator=gen).to(dev)
        full = torch.randn(per * n, generator=gen).to(dev)
        ours, ref = torch.empty(per * n, device=dev), torch.empty(per * n, device=dev)
        comm.all_gather(ours, shard, mesh, axes)
        dist.all_gather_into_tensor(ref, shard, group=g)
        rs_ours, rs_ref = torch.empty(per, device=dev), torch.empty(per, device=dev)
        comm.reduce_scatter(rs_ours, full.clone(), mesh, axes, scratch_input=True)
        h = comm.reduce_scatter(rs_ref, full.clone(), mesh, axes, async_op=True)  # torch's flat collective
        h.wait()
        res["+".join(key)] = {"ag": torch.equal(ours, ref), "rs": torch.allclose(rs_ours, rs_ref, rtol=0, atol=1e-5)}
    return res


def buckets_launch_during_backward() -> dict:
    """A 6-layer MLP with tiny buckets: buckets go on the wire before backward ends."""
    info = init_process()
    torch.manual_seed(0)
    mesh = Mesh.build(info.device, dp=info.world_size)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    dp = DataParallel(model, mesh, bucket_mb=64 * 65 * 4 / 2**20)  # one layer per bucket
    launched_in_backward = []

    class Probe(torch.autograd.Function):
        # runs in backward after every layer's gradient exists except the first layer's
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            launched_in_backward.append(dp._next_launch)
            return g

    x = torch.randn(8, 64) * (info.rank + 1)
    h = model[0](x)
    h = Probe.apply(h)
    for layer in model[1:]:
        h = layer(h)
    h.pow(2).mean().backward()
    dp.finish_grad_sync()
    grads = [b.buffer.clone() for b in dp.buckets]
    # every rank ends with the same, averaged gradient
    check = torch.cat(grads)
    ref = check.clone()
    comm.all_reduce(ref, mesh, "dp")
    return {"buckets": len(dp.buckets), "launched_before_end": launched_in_backward[0],
            "same_on_all": torch.allclose(ref / mesh.size("dp"), check, atol=1e-6)}


def python_api_trains(data_path: str) -> list[float]:
    """The README's Python API: load_config, init, parallelize, step."""
    import podscale
    from podscale.models.gpt import GPT, GPTConfig
    from podscale.train.data import ShardedLoader, load_tokens

    cfg = podscale.load_config(None, ["parallel.nproc=2", "train.global_batch=8", "train.micro_batch=4",
                                      "model.block_size=32", "model.n_embd=32", "model.n_layer=1"])
    mesh = podscale.init(cfg)
    torch.manual_seed(0)
    engine = podscale.parallelize(GPT(GPTConfig(n_layer=1, n_embd=32, block_size=32)), mesh, cfg)
    loader = ShardedLoader(load_tokens(data_path), 32, 8, 4, mesh.local_rank("dp"), mesh.size("dp"))
    return [engine.step(loader.next_step()).loss for _ in range(5)]


def environment_and_imports(names: list[str]) -> dict:
    """What a launched worker sees: the given environment variables, its rank and its parent process (the
    fork server, or the launching process itself for a spawned worker), and what a full garbage collection
    in it walks (the objects it tracks, those frozen out of collection, the seconds it took)."""
    import gc
    import os
    import time
    t0 = time.perf_counter()
    gc.collect()
    return {"env": {n: os.environ.get(n) for n in names}, "rank": os.environ["RANK"], "parent": os.getppid(),
            "gc_tracked": len(gc.get_objects()), "gc_frozen": gc.get_freeze_count(),
            "gc_collect_s": time.perf_counter() - t0}


def print_and_return(text: str) -> int:
    """Prints ``text`` on standard output and standard error; returns the rank."""
    import os
    import sys
    print(text, flush=True)
    print(text, file=sys.stderr, flush=True)
    return int(os.environ["RANK"])
