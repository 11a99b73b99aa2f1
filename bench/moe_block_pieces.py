"""What an MoE layer's step costs on this CPU, piece by piece, against a dense MLP of the same width.

Two gloo ranks on this machine (one torch thread each, as `podscale train --nproc 2` runs them), an MoE layer
of `bench/plan_local_vs_train.py`'s GPT-MoE (h 128, 8 experts of width 512, top-2, capacity 1.25, no random
routing) at ep = 2 on a rank's micro-batch of 8 x 128 tokens, and the dense GELU MLP it replaces. Every piece
is timed with `time.perf_counter` around it (no profiler: on this CPU it inflates small element-wise kernels
and misattributes collective waits), all pieces in turn in each of ``--reps`` rounds that start with a
barrier, and each piece's median over the rounds is printed (milliseconds, rank 0; the ranks agree within
the noise).

Pieces (forward, then backward through the same graph):
  layer          the whole MoE layer, forward; its backward (the output's and the aux/z losses' gradient)
  dense MLP      the dense block's MLP (two linears, tanh GELU) on the same tokens, forward; backward
  router         the router's linear (fp32)
  route          top-k routing with capacity (gate.route: softmax, k max passes, gather, normalisation, the sort,
                 bincount, cumsum, slots, scatter, order)
  losses         load-balancing and z losses
  counts         the count exchange as the layer issues it: all_to_all_single of E integers, then the counts
                 read on the host (.tolist())
  dispatch       the kept choices' tokens gathered (index_select of N k rows)
  combine        gate values gathered, rows scaled, index_add onto the tokens
  gate bwd       backward of router + route + losses alone
  disp+comb bwd  backward of dispatch + combine alone (index_add of the rows' gradients, index_select back)
  experts        the experts alone (Experts.forward, the layer's kernel) on a rank's share of the choices,
                 N k rows, in even segments, forward; backward
  a2a rows       one all_to_all_single of half those rows (ep = 2's dispatch), issued between kernels
The rest of the layer (the exchange's bookkeeping, its overlap) is the layer less these.

    python bench/moe_block_pieces.py [--reps 200] [--ep 2 | --ep 1 --tp 2]
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, reps: int, ep: int, tp: int, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from podscale.parallel.moe import MoELayer
    from podscale.parallel.moe.gate import load_balancing_loss, route, router_z_loss
    from podscale.runtime import comm
    from podscale.runtime.mesh import Mesh

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=world, is_master=rank == 0,
                          timeout=dt.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=dt.timedelta(seconds=120))
    mesh = Mesh.build(dp=world // (ep * tp), ep=ep, tp=tp)
    torch.manual_seed(0)
    B, T, d, f, E, k = 8, 128, 128, 512, 8, 2
    layer = MoELayer(d, f, E, top_k=k, capacity_factor=1.25, random_routing=False, mesh=mesh, seed=1)
    fc, proj = torch.nn.Linear(d, f), torch.nn.Linear(f, d)
    g = torch.Generator().manual_seed(100 + rank // tp)     # a tp group's ranks hold the same tokens
    x = torch.randn(B, T, d, generator=g).requires_grad_()
    gy = torch.randn(B, T, d, generator=g)
    cap = layer.capacity(T)
    times: dict[str, list[float]] = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        r = fn()
        times.setdefault(name, []).append(time.perf_counter() - t0)
        return r

    for it in range(reps + 5):
        dist.barrier()
        y, out = timed("layer fwd", lambda: layer(x))
        loss = (y * gy).sum() + out.loss
        timed("layer bwd", lambda: loss.backward())
        dist.barrier()
        hdn = timed("dense MLP fwd", lambda: proj(F.gelu(fc(x), approximate="tanh")))
        timed("dense MLP bwd", lambda: hdn.backward(gy))
        # the layer's own pieces, on the tokens this rank routes (under tp its 1/tp of the samples)
        Bl = B // tp
        flat = x[Bl * (rank % tp): Bl * (rank % tp + 1)].reshape(-1, d)
        logits = timed("router", lambda: layer.router(flat).view(Bl, T, E))
        r, probs = timed("route", lambda: route(logits, k, cap))
        aux = timed("losses", lambda: load_balancing_loss(probs, r.expert[:, 0]) + router_z_loss(logits))
        dist.barrier()

        def counts():
            send = r.counts.view(ep, E // ep)
            recv = torch.empty_like(send)
            sent = send.tolist()
            h = comm.all_to_all(recv.view(-1), send.reshape(-1).contiguous(), mesh, ("ep",), async_op=True)
            h.wait()
            return sent, recv.tolist()
        timed("counts", counts)
        token = r.order // k
        rows = timed("dispatch", lambda: flat.index_select(0, token))

        def combine():
            w = r.weight.reshape(-1).index_select(0, r.order).to(rows.dtype)
            return rows.new_zeros(Bl * T, d).index_add_(0, token, rows * w.unsqueeze(1))
        yc = timed("combine", combine)
        gate_loss = aux + (r.weight * torch.randn_like(r.weight)).sum()
        timed("gate bwd", lambda: gate_loss.backward(retain_graph=True))
        timed("disp+comb bwd", lambda: yc.backward(gy[:Bl].reshape(-1, d)))
        # the experts alone on a rank's share of the choices, N k rows, evenly in their segments (no exchange),
        # and one exchange of half of them (what ep = 2 sends), between kernels
        n_rows = Bl * T * k
        seg = [(j, n_rows // layer.experts.num_local) for j in range(layer.experts.num_local)]
        xr = torch.randn(sum(n for _, n in seg), d, generator=g).requires_grad_()
        yr = timed("experts fwd", lambda: layer.experts(xr, seg))
        timed("experts bwd", lambda: yr.backward(torch.ones_like(yr)))
        half = xr.detach()[: n_rows // 2].contiguous()
        got = torch.empty_like(half)
        dist.barrier()
        timed("a2a rows", lambda: comm.all_to_all(got, half, mesh, ("ep",), [len(half) // 2] * 2, [len(half) // 2] * 2))
        for p in (x, *layer.parameters(), *fc.parameters(), *proj.parameters()):
            p.grad = None
        if it < 5:
            times.clear()
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    p20 = {name: sorted(v)[len(v) // 5] * 1e3 for name, v in times.items()}
    mean = {name: statistics.fmean(v) * 1e3 for name, v in times.items()}
    if rank == 0:
        results.put((med, p20, mean))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    import torch.multiprocessing as mp
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="tp = 2 (with --ep 1): each rank routes half the samples")
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, args.reps, args.ep, args.tp, q)) for r in range(2)]
    for p in procs:
        p.start()
    import queue
    while True:
        try:
            med, p20, mean = q.get(timeout=5)
            break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.terminate()
                raise SystemExit("a worker failed (its traceback is above)")
    for p in procs:
        p.join()
    print(f"{'piece (ms, rank 0)':<18}{'median':>9}{'p20':>9}{'mean':>9}")
    for name in med:
        print(f"{name:<18}{med[name]:>9.3f}{p20[name]:>9.3f}{mean[name]:>9.3f}")
    gate = sum(med[n] for n in ("router", "route", "losses", "counts", "dispatch", "combine"))
    print(f"gate+counts+dispatch+combine fwd (median sum) {gate:.3f} ms; their backward "
          f"{med['gate bwd'] + med['disp+comb bwd']:.3f} ms; layer fwd+bwd less dense MLP fwd+bwd "
          f"{med['layer fwd'] + med['layer bwd'] - med['dense MLP fwd'] - med['dense MLP bwd']:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
