"""How the planner splits a GPT's layers over pipeline stages: as ``podscale train`` does.

The trainer cuts the blocks into pp * interleave contiguous chunks (model chunk k on pipeline rank
k % pp, Narayanan et al. SC'21, Sec. 2.2), either as the user lists them (``parallel.pipeline_layers``)
or balanced by parameter count with the embeddings counted with the first block and the output layer
with the last (:func:`podscale.parallel.pipeline.partition.layer_costs` /
:func:`~podscale.parallel.pipeline.partition.contiguous_partition`). The planner computes the same
partition of the same costs (a faster search for it, tested equal to the trainer's), so a 70-layer model
on 12 stages gets the trainer's uneven split, and a layout may name the split with ``pipeline_layers``
as training does.
"""
from __future__ import annotations

from functools import lru_cache

from podscale.parallel.pipeline.partition import PipelineError

from .layout import Layout, LayoutError
from .models import GPT


def layer_param_costs(model: GPT) -> list[float]:
    """Parameters of each block, embeddings added to the first and the output layer (its own copy of
    the tied embedding when pipelined) and final norm to the last: the trainer's ``balance = "params"``."""
    dense, moe = model.layer_params(moe=False), model.layer_params(moe=True)
    costs = [float(moe if model.experts > 1 and (i + 1) % model.moe_every == 0 else dense)
             for i in range(model.layers)]
    costs[0] += model.embedding_params
    costs[-1] += model.vocab * model.hidden + 2 * model.hidden
    return costs


def balanced_partition(costs: list[float], parts: int) -> list[int]:
    """The same partition as the trainer's :func:`~podscale.parallel.pipeline.partition.contiguous_partition`
    (smallest possible largest group; among equal choices, the earliest cut), found in O(parts n log n)
    instead of O(parts n^2): best[k][i] = min over j of max(best[k-1][j], S_i - S_j), where best[k-1][j] does
    not decrease in j and S_i - S_j decreases, so the minimum sits where the two cross (binary search).
    A search predicts thousands of layouts with many stage counts; tests check it against the trainer's."""
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


@lru_cache(maxsize=4096)
def _balanced(model: GPT, chunks: int) -> tuple:
    return tuple(balanced_partition(layer_param_costs(model), chunks))


def pipeline_chunks(model: GPT, lay: Layout) -> tuple:
    """Block counts of the pp * interleave model chunks, in order."""
    chunks = lay.pp * lay.interleave
    if lay.pipeline_layers:
        given = tuple(lay.pipeline_layers)
        if len(given) != chunks or sum(given) != model.layers or min(given) < 1:
            raise LayoutError(f"pipeline_layers={list(given)} must give {chunks} positive block counts "
                              f"(pp * interleave) summing to the model's {model.layers} layers")
        return given
    if chunks == 1:
        return (model.layers,)
    try:
        return _balanced(model, chunks)
    except PipelineError as e:
        raise LayoutError(str(e)) from None


def pipeline_rank_layers(model: GPT, lay: Layout) -> list[int]:
    """Layers held by each pipeline rank (chunk k runs on rank k % pp)."""
    return list(_rank_layers(pipeline_chunks(model, lay), lay.pp))


@lru_cache(maxsize=4096)
def _rank_layers(sizes: tuple, pp: int) -> tuple:
    return tuple(sum(sizes[r::pp]) for r in range(pp))
