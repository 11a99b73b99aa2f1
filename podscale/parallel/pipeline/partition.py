"""Splitting the GPT into pipeline stages.

The transformer blocks are cut into ``pp * virtual_stages`` contiguous groups (model chunks); chunk ``k``
runs on pipeline rank ``k % pp`` as its virtual stage ``k // pp`` (Narayanan et al. 2021, section 2.2).  The
first chunk also holds the embeddings, the last the final norm, the output layer and the loss.  Groups are
balanced by parameter count (embeddings counted with the first block, the output layer with the last) or by
measured forward+backward time, or given by the user as a list of block counts.

A chunk is the same :class:`~podscale.models.gpt.GPT` class with the layers it does not own set to None,
so every layout runs the same model code.  When the first and last chunks are on different ranks, the last
holds its own copy of the tied embedding (``pipeline_duplicate``); the schedule keeps the two in sync by
summing their gradients after backward, as Megatron-LM does (Shoeybi et al. 2019, section 3).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from podscale.models.gpt import GPT
from podscale.parallel.param_tags import tag


class PipelineError(ValueError):
    """A pipeline layout that cannot run; the message names the fix."""


def contiguous_partition(costs: list[float], parts: int) -> list[int]:
    """Sizes of ``parts`` contiguous non-empty groups of ``costs`` minimising the largest group sum (among
    equal choices, the earliest cut), in O(parts n log n) rather than the plain dynamic program's
    O(parts n^2) (the planner partitions thousands of layouts): best[k][i] = min over j of max(best[k-1][j], S_i - S_j), where best[k-1][j] does
    not decrease in j and S_i - S_j decreases, so the minimum sits where the two cross (binary search).
    Tests check it against the plain dynamic program."""
    n = len(costs)
    if parts > n:
        raise PipelineError(f"{n} layers cannot fill {parts} pipeline stages (pp * virtual_stages): "
                            f"use at least {parts} layers or fewer stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    prev = [inf] * (n + 1)
    prev[0] = 0.0
    cuts = []
    for k in range(1, parts + 1):
        cur, cut = [inf] * (n + 1), [0] * (n + 1)
        for i in range(k, n - (parts - k) + 1):
            lo, hi = k - 1, i - 1                 # j ranges over [k-1, i-1]; find the first j with f >= g
            while lo < hi:
                mid = (lo + hi) // 2
                if prev[mid] >= prefix[i] - prefix[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            best_v, best_j = inf, 0
            for j in (lo - 1, lo, lo + 1):        # the crossing and its neighbours, earliest first
                if k - 1 <= j <= i - 1:
                    v = max(prev[j], prefix[i] - prefix[j])
                    if v < best_v - 1e-12:
                        best_v, best_j = v, j
            # the trainer keeps the earliest j within 1e-12 of the minimum: walk back over a plateau
            while best_j - 1 >= k - 1 and max(prev[best_j - 1], prefix[i] - prefix[best_j - 1]) < best_v + 1e-12 \
                    and not max(prev[best_j - 1], prefix[i] - prefix[best_j - 1]) < best_v - 1e-12:
                best_j -= 1
            cur[i], cut[i] = best_v, best_j
        prev = cur
        cuts.append(cut)
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cuts[k - 1][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def layer_costs(model: GPT, balance: str = "params", sample: torch.Tensor | None = None) -> list[float]:
    """Cost of each block, with the embeddings added to the first and the output layer to the last."""
    blocks = list(model.blocks.values())
    if balance == "params":
        costs = [float(sum(p.numel() for p in b.parameters())) for b in blocks]
        costs[0] += model.wte.weight.numel() + model.wpe.weight.numel()
        costs[-1] += model.lm_head.weight.numel() + sum(p.numel() for p in model.ln_f.parameters())
        return costs
    if balance == "time":
        x = sample if sample is not None else torch.randn(2, model.cfg.block_size, model.cfg.n_embd)
        costs = []
        for b in blocks:
            costs.append(_time(lambda: b(x.detach().requires_grad_()).sum().backward()))
        head = _time(lambda: model.lm_head(model.ln_f(x.detach().requires_grad_())).float().logsumexp(-1)
                     .sum().backward())
        idx = torch.zeros(x.shape[:2], dtype=torch.long)
        emb = _time(lambda: (model.wte(idx) + model.wpe(torch.arange(x.shape[1]))).sum().backward())
        costs[0] += emb
        costs[-1] += head
        model.zero_grad(set_to_none=True)
        return costs
    raise PipelineError(f"unknown pipeline balance '{balance}': use 'params' or 'time'")


def _time(fn, repeat: int = 3) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def stage_layers(model: GPT, chunks: int, balance: str = "params", layers: list[int] | None = None,
                 costs: list[float] | None = None) -> list[list[int]]:
    """Block indices of each of ``chunks`` model chunks: the user's ``layers`` counts, or balanced by
    ``costs`` (default: :func:`layer_costs` of ``balance``; every rank must use the same costs)."""
    n = model.cfg.n_layer
    if layers is not None:
        if len(layers) != chunks or sum(layers) != n or min(layers) < 1:
            raise PipelineError(f"parallel.pipeline_layers={layers} must give {chunks} positive block counts "
                                f"(pp * virtual_stages) summing to model.n_layer={n}")
        sizes = list(layers)
    else:
        if n < chunks:
            raise PipelineError(f"model.n_layer={n} is fewer than the {chunks} pipeline stages "
                                f"(pp * virtual_stages): use at least {chunks} layers or fewer stages")
        sizes = contiguous_partition(costs if costs is not None else layer_costs(model, balance), chunks)
    out, start = [], 0
    for s in sizes:
        out.append(list(range(start, start + s)))
        start += s
    return out


def split_chunk(model: GPT, layers: list[int], first: bool, last: bool) -> GPT:
    """A GPT (of ``model``'s class) holding only ``layers`` (and the embeddings if ``first``, the head and loss if ``last``).

    Shares the modules of ``model`` (which should not be used afterwards).
    """
    chunk = model.empty_chunk()  # the model's own class (a GPT-MoE stage is a GPTMoE)
    chunk.wte = model.wte if first else None
    chunk.wpe = model.wpe if first else None
    chunk.drop = model.drop if first else None
    chunk.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in layers})
    chunk.ln_f = model.ln_f if last else None
    chunk.loss_fn = model.loss_fn if last else None
    if last and not first:
        src = model.lm_head.weight
        head = nn.Linear(model.cfg.n_embd, model.cfg.vocab_size, bias=False, device=src.device, dtype=src.dtype)
        with torch.no_grad():
            head.weight.copy_(src)  # on the meta device a no-op: materialising gives the tied init
        tag(head.weight, pipeline_duplicate=True)
        chunk.lm_head = head
    else:
        chunk.lm_head = model.lm_head if last else None
    return chunk
