"""What podscale's communication layer adds per collective: ``comm.all_reduce`` vs ``dist.all_reduce``.

Every collective podscale issues goes through :mod:`podscale.runtime.comm`, which checks devices, counts
bytes and time, and keeps the hang watchdog's ledger (what each group's collectives have reached).  This
issues the same tiny all-reduce (one float, where the layer's Python cost is the largest share) through
both, in alternating rounds on 2 gloo ranks, with the watchdog thread running as under ``podscale train``,
and prints the median time per call of each and their ratio (podscale / torch).

    python bench/comm_overhead.py [--nproc 2] [--calls 2000] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from podscale.runtime import comm, watchdog
from podscale.runtime.launcher import launch
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process


def _worker(calls: int, rounds: int) -> dict:
    info = init_process()
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, dp=info.world_size)
    dog = watchdog.start(mesh, 300.0)
    t = torch.ones(1, device=mesh.device)
    group = mesh.group("dp")
    ours, theirs = [], []
    for _ in range(rounds):
        for timed, issue in ((theirs, lambda: dist.all_reduce(t, group=group)),
                             (ours, lambda: comm.all_reduce(t, mesh, "dp"))):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                issue()
            timed.append((time.perf_counter() - start) / calls)
    if dog is not None:
        dog.stop()
    return {"podscale_us": statistics.median(ours) * 1e6, "torch_us": statistics.median(theirs) * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    r = launch(_worker, (a.calls, a.rounds), nproc=a.nproc)[0]
    print(f"all_reduce of 1 float on {a.nproc} gloo ranks, median of {a.rounds} rounds x {a.calls} calls: "
          f"podscale comm {r['podscale_us']:.1f} us, torch.distributed {r['torch_us']:.1f} us, "
          f"ratio {r['podscale_us'] / r['torch_us']:.3f}")


if __name__ == "__main__":
    main()
