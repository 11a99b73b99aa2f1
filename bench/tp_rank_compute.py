"""A tensor-parallel rank's compute alone, beside the planner's price for it (the tp 2 "compute shortfall").

`podscale train`'s metrics give a step's exposed collective time per axis (``comm.<axis>.exposed_s``: the time
a rank blocks in ``Handle.wait``); ``step_time_s - exposed_s`` is not the step's compute, because it keeps each
collective's launch and bookkeeping (outside the wait) and the slowdown the collectives' gloo threads cause
while they run under compute. This times the compute itself: the bench's GPT (4 x 128, sequence 128, vocab 256)
and GPT-MoE (8 experts, top-2, every other block, capacity 1.25, no random routing) on one process, one thread,
as one rank of tp 1 or tp 2 builds them (``apply_tensor_parallel`` on a mesh without a process group), with
``podscale.runtime.comm``'s collectives replaced by no-ops for this process only (shapes stay right: every
output buffer is allocated by the caller), forward + backward of one micro-batch of 8 samples, A/B alternated;
and prints the planner's forward and backward for the same layouts (its step's components less the collectives,
the optimizer and the gradient passes, which this does not time; the layouts as ``bench/plan_local_vs_train.py``
predicts them: ``as_trained``) per micro-batch.

    python bench/tp_rank_compute.py [--reps 40] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

SMALL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256)
MOE = dict(experts=8, top_k=2, moe_every=2, capacity_factor=1.25, random_routing=False)
#: the planner's step components (``Prediction.components_s``) that a micro-batch's forward and backward run
FORWARD_BACKWARD = ("gemm", "attention", "elementwise", "host", "routing", "loss")


class _Done:
    def wait(self):
        return None

    def is_completed(self):
        return True


def _no_collectives() -> None:
    """This process's collectives become no-ops (a measurement of compute alone; never in a training run)."""
    from podscale.runtime import comm

    def skip(*args, async_op=False, **kw):
        return _Done() if async_op else None
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        setattr(comm, name, skip)


def _build(moe: bool, tp: int):
    from podscale.runtime.mesh import Mesh
    from podscale.parallel.tensor import apply_tensor_parallel
    torch.manual_seed(0)
    mesh = Mesh(sizes={"pp": 1, "dp": 1, "ep": 1, "tp": tp}, rank=0)
    if moe:
        from podscale.models.gpt_moe import GPTMoE, GPTMoEConfig
        model = GPTMoE(GPTMoEConfig(**SMALL, **MOE), mesh, False)
    else:
        from podscale.models.gpt import GPT, GPTConfig
        model = GPT(GPTConfig(**SMALL))
    if tp > 1:
        apply_tensor_parallel(model, mesh)
    return model.train()


def _time(model, reps: int) -> list[float]:
    idx, tgt = torch.randint(0, 256, (8, 128)), torch.randint(0, 256, (8, 128))
    out = []
    for _ in range(reps + 5):
        start = time.perf_counter()
        _, loss = model(idx, tgt)[:2]
        loss.backward()
        out.append(time.perf_counter() - start)
    return out[5:]


def _priced(moe: bool, tp: int) -> float:
    from podscale.plan.auto import as_trained
    from podscale.plan.cost import predict
    from podscale.plan.layout import Layout
    from podscale.plan.models import model_from_dict
    m = {"layers": 4, "hidden": 128, "heads": 4, "seq": 128, "vocab": 256}
    if moe:
        m.update(experts=8, top_k=2, moe_every=2, capacity_factor=1.25)
    p = predict("local", 2, model_from_dict(m), as_trained(Layout(tp=tp, pp=1, dp=2 // tp, microbatch=8)), 16)
    # the forward and backward alone, what this bench times: the step's components less its collectives and its
    # once-a-step work on parameters (optimizer, gradient passes), per micro-batch (tp of them: global batch 16)
    return sum(p.components_s[k] for k in FORWARD_BACKWARD) / tp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    _no_collectives()
    times: dict = {}
    for _ in range(a.rounds):
        for moe in (False, True):
            for tp in (1, 2):
                times.setdefault((moe, tp), []).extend(_time(_build(moe, tp), a.reps))
    print(f"one micro-batch (8 x 128) forward + backward, 1 thread, collectives skipped; load {os.getloadavg()[0]:.1f}")
    for (moe, tp), ts in times.items():
        med, p20 = statistics.median(ts), sorted(ts)[len(ts) // 5]
        priced = _priced(moe, tp)
        print(f"{'GPT-MoE' if moe else 'GPT':8} tp{tp}: median {med * 1e3:6.2f} ms, p20 {p20 * 1e3:6.2f} ms; planner "
              f"{priced * 1e3:6.2f} ms a micro-batch (forward + backward) = {priced / med:.2f} of the median")


if __name__ == "__main__":
    main()
