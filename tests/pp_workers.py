"""Worker for the pipeline bubble measurement: the real schedule executor and point-to-point messages,
with model chunks whose forward and backward take a fixed time (sleeping, so 4 ranks on 2 cores do not
compete for the CPU and the measured idle time is the schedule's bubble, not contention)."""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from podscale.parallel.data import DataParallel
from podscale.parallel.pipeline.schedule import PipelineParallel
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t_f, t_b):
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.t_b)
        return g, None, None


class SleepChunk(nn.Module):
    """A model chunk taking ``t_f`` forward and ``t_b`` backward; the first makes its input from a
    parameter, the last returns a loss."""

    def __init__(self, first: bool, last: bool, t_f: float, t_b: float, shape):
        super().__init__()
        self.first, self.last, self.t_f, self.t_b, self.shape = first, last, t_f, t_b, shape
        self.w = nn.Parameter(torch.zeros(shape[-1]))
        # the pipeline's tied input embedding / output layer (first and last stage), unused by the timing
        if first:
            self.wte = nn.Linear(1, 1, bias=False)
        if last:
            self.lm_head = nn.Linear(1, 1, bias=False)

    def forward(self, x, targets=None, tokens=None):  # a pipeline chunk: (input, targets, tokens=ids)
        h = self.w.expand(self.shape) + 0.0 if self.first else x + self.w
        h = _Sleep.apply(h, self.t_f, self.t_b)
        return (h, h.mean()) if self.last else (h, None)


def measure_bubble(cases: list[dict]) -> list[dict]:
    """For each {schedule, m, v, t_f, t_b, steps}: the measured bubble of each step: the step time of the
    slowest rank minus the ranks' mean compute time, relative to that compute time."""
    info = init_process()
    torch.set_num_threads(1)
    mesh = Mesh.build(info.device, pp=info.world_size)
    p, r = mesh.size("pp"), mesh.local_rank("pp")
    shape = (2, 8, 16)
    out = []
    for c in cases:
        v = c["v"]
        chunks = [SleepChunk(k * p + r == 0, k * p + r == p * v - 1, c["t_f"], c["t_b"], shape) for k in range(v)]
        module = nn.ModuleList(chunks)
        strategy = PipelineParallel(chunks, mesh, DataParallel(module, mesh, ("dp",)), c["schedule"],
                                    activation_shape=shape)
        mbs = [(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))] * c["m"]
        bubbles = []
        for _ in range(c["steps"]):
            torch.distributed.barrier()
            strategy.forward_backward(mbs, None)
            st = strategy.stats
            t = torch.tensor([st.total_s, st.compute_s], dtype=torch.float64)
            gathered = [torch.zeros_like(t) for _ in range(p)]
            torch.distributed.all_gather(gathered, t)
            total = max(float(g[0]) for g in gathered)
            busy = sum(float(g[1]) for g in gathered) / p  # measured compute, about m v (t_f + t_b)
            bubbles.append((total - busy) / busy)
            strategy.inner.zero_grad()
        out.append({**c, "bubbles": bubbles, "wait_s": st.wait_s, "compute_s": st.compute_s,
                    "timeline": st.timeline})
    return out
