"""Where the time of `bench/moe.py`'s two MoE layers goes at one point: expert GEMMs, all-to-alls, the rest.

The same setup as `bench/moe.py` (2 gloo ranks, ep = 2, one thread a rank, d_model 128, expert width 512, fp32,
the same router and expert weights, DeepSpeed without noise or random token selection, one routing group a
rank), at one (experts, tokens per rank, top-k, capacity factor) point. Each round times forward + backward of
`sum(y * g)` for both layers, taking turns to go first, and splits each rank's time with `time.perf_counter`:

  experts    podscale: its expert kernel's forward and backward calls (the layer is given a kernel that wraps
             the CPU's `CacheTiledKernel` and times each call: the `ExpertKernel` interface); DeepSpeed: its
             `experts` module's forward and backward (module hooks)
  all-to-all every `torch.distributed.all_to_all_single` from its call until the caller's wait returns (what
             the rank spends in or blocked on the exchanges; podscale's count exchange included)
  rest       the layer's time less the two: routing, dispatch, combine, bookkeeping, autograd

Printed per rank: the medians over the rounds (ms), the rows each layer's experts ran on that rank, and a lower
bound on podscale's time ratio at this point: its experts and all-to-alls alone (as if everything else in the
layer cost nothing) over DeepSpeed's measured total.

Also printed: each exchange's median time, in the order of the step, and each layer's minor page faults a step. `--bind-cores` pins each rank to its own share
of the cores, as `parallel.bind_cores` does in training (both layers run in the same processes).

    python bench/moe_time_split.py [--experts 64] [--tokens 1024] [--top-k 1] [--capacity-factor 1.25] [--rounds 15]
                                   [--bind-cores]
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))
from moe import copy_weights  # noqa: E402  (bench/moe.py: the same weights in both layers)

from podscale.parallel.moe import MoELayer  # noqa: E402
from podscale.parallel.moe.kernels import CacheTiledKernel  # noqa: E402
from podscale.runtime.launcher import launch  # noqa: E402
from podscale.runtime.mesh import Mesh  # noqa: E402
from podscale.runtime.process import bind_local_cores, init_process  # noqa: E402

#: milliseconds per piece of the round in progress
SPENT: dict[str, float] = collections.defaultdict(float)
ROWS: dict[str, int] = collections.defaultdict(int)
#: each exchange of the round in progress, in order: seconds from its call until its wait returned
EXCHANGES: list[float] = []


class TimedKernel:
    """podscale's CPU expert kernel, each call timed into SPENT["experts"] (an ``ExpertKernel``)."""

    def __init__(self):
        self.inner = CacheTiledKernel()

    def forward(self, x, bounds, weights, El, bias, out):
        t = time.perf_counter()
        try:
            return self.inner.forward(x, bounds, weights, El, bias, out)
        finally:
            SPENT["experts"] += time.perf_counter() - t
            ROWS["podscale"] += x.shape[0]

    def backward(self, grad, x, saved, bounds, weights, El, acc, g_x):
        t = time.perf_counter()
        try:
            return self.inner.backward(grad, x, saved, bounds, weights, El, acc, g_x)
        finally:
            SPENT["experts"] += time.perf_counter() - t


class _TimedWork:
    def __init__(self, work, start: float):
        self.work, self.start = work, start

    def wait(self, *a, **k):
        out = self.work.wait(*a, **k)
        SPENT["all-to-all"] += time.perf_counter() - self.start
        EXCHANGES.append(time.perf_counter() - self.start)
        return out

    def is_completed(self):
        return self.work.is_completed()

    def get_future(self):
        return self.work.get_future()


def _timed_all_to_all(raw):
    def call(*a, async_op=False, **k):
        start = time.perf_counter()
        work = raw(*a, async_op=async_op, **k)
        if async_op:
            return _TimedWork(work, start)
        SPENT["all-to-all"] += time.perf_counter() - start
        EXCHANGES.append(time.perf_counter() - start)
        return work
    return call


def _hook_module(module, name: str) -> None:
    t: dict[str, float] = {}
    module.register_forward_pre_hook(lambda m, i: t.__setitem__("f", time.perf_counter()))
    module.register_forward_hook(lambda m, i, o: SPENT.__setitem__(name, SPENT[name] + time.perf_counter() - t["f"]))
    module.register_full_backward_pre_hook(lambda m, g: t.__setitem__("b", time.perf_counter()))
    module.register_full_backward_hook(lambda m, gi, go: SPENT.__setitem__(name, SPENT[name] + time.perf_counter() - t["b"]))


def worker(a) -> dict:
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    info = init_process()
    if a.bind_cores:
        bind_local_cores(info.local_rank, info.world_size)
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.moe.layer import MoE
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    mesh = Mesh.build(info.device, ep=info.world_size)
    dist.all_to_all_single = _timed_all_to_all(dist.all_to_all_single)   # both layers exchange through it
    torch.manual_seed(1)
    ours = MoELayer(a.d_model, a.d_hidden, a.experts, top_k=a.top_k, capacity_factor=a.capacity_factor,
                    random_routing=False, mesh=mesh, kernel=TimedKernel())
    with torch.no_grad():  # bench/moe.py's uneven router and biases
        ours.router.weight.normal_(0.0, 0.1)
        for name, p in ours.experts.named_parameters():
            if ".b_" in name:
                p.normal_(0.0, 0.02)
    expert = nn.Sequential(nn.Linear(a.d_model, a.d_hidden), nn.GELU(approximate="tanh"),
                           nn.Linear(a.d_hidden, a.d_model))
    theirs = MoE(a.d_model, expert, num_experts=a.experts, ep_size=info.world_size, k=a.top_k,
                 capacity_factor=a.capacity_factor, eval_capacity_factor=a.capacity_factor, min_capacity=0,
                 noisy_gate_policy=None, drop_tokens=True, use_rts=False, top2_2nd_expert_sampling=False)
    theirs.set_deepspeed_parallelism()
    copy_weights(ours, theirs)
    _hook_module(theirs.deepspeed_moe.experts, "experts")
    g = torch.Generator().manual_seed(100 + info.rank)
    x = torch.randn(1, a.tokens, a.d_model, generator=g).requires_grad_(True)
    gy = torch.randn(1, a.tokens, a.d_model, generator=g)
    layers = {"podscale": lambda t: ours(t)[0], "deepspeed": lambda t: theirs(t)[0]}
    out = {n: collections.defaultdict(list) for n in layers}
    exchanges: dict[str, list[list[float]]] = {n: [] for n in layers}
    for r in range(a.rounds + 1):
        names = list(layers)[::1 if r % 2 else -1]
        for name in names:
            ours.zero_grad(set_to_none=True)
            theirs.zero_grad(set_to_none=True)
            x.grad = None
            SPENT.clear()
            EXCHANGES.clear()
            ROWS.clear()
            dist.barrier()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            (layers[name](x) * gy).sum().backward()
            total = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            if r:   # round 0 warms up
                split = {"total": total, "experts": SPENT["experts"], "all-to-all": SPENT["all-to-all"]}
                split["rest"] = total - split["experts"] - split["all-to-all"]
                split["faults"] = faults
                if name == "podscale":
                    split["rows"] = ROWS["podscale"]
                for k, v in split.items():
                    out[name][k].append(v)
                exchanges[name].append(list(EXCHANGES))
    # DeepSpeed's experts run every slot: E/ep experts x ep ranks x C on every rank
    C = ours.capacity(a.tokens)
    # each exchange's median over the rounds, in the order of the step (every round runs the same ones)
    return {n: {k: statistics.median(v) for k, v in d.items()} for n, d in out.items()} | \
        {"deepspeed_rows": a.experts * C,
         "exchanges": {n: [statistics.median(r[i] for r in rounds) for i in range(len(rounds[0]))]
                       for n, rounds in exchanges.items()}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    ap.add_argument("--top-k", type=int, default=1)
    ap.add_argument("--capacity-factor", type=float, default=1.25)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--d-hidden", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--bind-cores", action="store_true",
                    help="pin each rank's main thread to its own share of the cores once the process group exists "
                         "(podscale's bind_local_cores; gloo's threads stay unbound; both layers)")
    a = ap.parse_args(argv)
    res = launch(worker, (a,), nproc=2)
    print(f"E={a.experts} tokens/rank={a.tokens} k={a.top_k} cf={a.capacity_factor}, {a.rounds} rounds, medians in ms "
          f"(load average {os.getloadavg()[0]:.1f})")
    ds_total = max(res[r]["deepspeed"]["total"] for r in res)
    for rank in sorted(res):
        p, d = res[rank]["podscale"], res[rank]["deepspeed"]
        rows = int(p["rows"])
        print(f"rank {rank}: podscale total {1e3 * p['total']:6.2f} = experts {1e3 * p['experts']:6.2f} "
              f"({rows} rows) + all-to-all {1e3 * p['all-to-all']:5.2f} + rest {1e3 * p['rest']:5.2f}   |   "
              f"DeepSpeed total {1e3 * d['total']:6.2f} = experts {1e3 * d['experts']:6.2f} "
              f"({res[rank]['deepspeed_rows']} rows) + all-to-all {1e3 * d['all-to-all']:5.2f} + rest {1e3 * d['rest']:5.2f}")
    for rank in sorted(res):
        print(f"rank {rank}: each exchange, from its call to its wait's return (ms): " + "; ".join(
            f"{name} " + ", ".join(f"{1e3 * t:.2f}" for t in ts) for name, ts in res[rank]["exchanges"].items())
            + f"; minor page faults a step: podscale {res[rank]['podscale']['faults']:.0f}, "
            f"DeepSpeed {res[rank]['deepspeed']['faults']:.0f}")
    bound = max(res[r]["podscale"]["experts"] + res[r]["podscale"]["all-to-all"] for r in res) / ds_total
    ratio = max(res[r]["podscale"]["total"] for r in res) / ds_total
    print(f"time ratio (slowest rank's medians) {ratio:.2f}; podscale's experts and all-to-alls alone over "
          f"DeepSpeed's total: {bound:.2f} (the ratio if the rest of podscale's layer cost nothing)")
    return res


if __name__ == "__main__":
    main()
