"""How the planner splits a GPT's layers over pipeline stages: as ``podscale train`` does.

The trainer cuts the blocks into pp * interleave contiguous chunks (model chunk k on pipeline rank
k % pp, Narayanan et al. SC'21, Sec. 2.2), either as the user lists them (``parallel.pipeline_layers``)
or balanced by parameter count with the embeddings counted with the first block and the output layer
with the last (:func:`podscale.parallel.pipeline.partition.layer_costs` /
:func:`~podscale.parallel.pipeline.partition.contiguous_partition`). The planner computes the same
partition of the same costs with the same function, so a 70-layer model
on 12 stages gets the trainer's uneven split, and a layout may name the split with ``pipeline_layers``
as training does.
"""
from __future__ import annotations

from functools import lru_cache

from podscale.parallel.pipeline.partition import PipelineError, contiguous_partition

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


@lru_cache(maxsize=4096)
def _balanced(model: GPT, chunks: int) -> tuple:
    return tuple(contiguous_partition(layer_param_costs(model), chunks))


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


def pipeline_message_time(schedule: str, p: int, m: int, v: int, msg: float) -> float:
    """Seconds a step's point-to-point messages add to a pipeline of ``p`` ranks running ``m`` micro-batches,
    each message (one micro-batch boundary, one way) taking ``msg`` seconds.

    The executor sends asynchronously (``podscale.parallel.pipeline.schedule``): a rank goes on computing while
    its message travels, and waits only for the messages its next action needs. On equal stages of ``t_f + t_b``
    per micro-batch the schedule simulator (``schedule.simulate`` with ``t_msg``) then gives a makespan of
    ``(m + p - 1)(t_f + t_b)`` plus exactly (``tests/test_plan_pipeline.py`` checks it against the simulator for p up
    to 16, m up to 3p + 1, several t_f, t_b and msg):

    * GPipe: ``2 (p - 1) msg``: the fill and the drain each cross p - 1 boundaries; in between a rank's
      messages travel while it runs its next micro-batch.
    * 1F1B: ``2 msg (m + p - 3 - floor((m - 2) / p))``: rank 0 has only p micro-batches in flight, so each
      round trip of a micro-batch (2 (p - 1) messages) stalls it; on average ``2 (p - 1) / p`` msg a
      micro-batch, not the 2 msg of both sends.
    * Interleaved 1F1B: ``2 msg (m v + p - 1)``, every message on the critical path (an upper bound: its
      messages hide under the other chunks' work up to a size that depends on the stage times, piecewise).
    """
    if p == 1:
        return 0.0
    if schedule == "gpipe":
        return 2 * (p - 1) * msg
    if schedule == "1f1b":
        return 2 * msg * (m + p - 3 - (m - 2) // p)
    return 2 * msg * (m * v + p - 1)
