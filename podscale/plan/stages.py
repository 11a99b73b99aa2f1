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


def pipeline_message_time(schedule: str, p: int, m: int, v: int, msg: float, *, t_f: float = 0.0,
                          t_b: float = 0.0) -> float:
    """Seconds a step's point-to-point messages add to a pipeline of ``p`` ranks running ``m`` micro-batches,
    each message (one micro-batch boundary, one way) taking ``msg`` seconds. ``t_f``, ``t_b``: the forward and
    the backward (recompute included) of one model chunk for one micro-batch, which hide messages under the
    interleaved schedule (unused by GPipe and 1F1B, whose exposure does not depend on them).

    The executor sends asynchronously (``podscale.parallel.pipeline.schedule``): a rank goes on computing while
    its message travels, and waits only for the messages its next action needs. On equal stages the schedule
    simulator (``schedule.simulate`` with ``t_msg``) gives a makespan of (ideal work plus fill and drain)
    plus what this returns; ``tests/test_plan_pipeline.py`` checks each case against the simulator.

    * GPipe: ``2 (p - 1) msg``: the fill and the drain each cross p - 1 boundaries; in between a rank's
      messages travel while it runs its next micro-batch.
    * 1F1B: ``2 msg (m + p - 3 - floor((m - 2) / p))``: rank 0 has only p micro-batches in flight, so each
      round trip of a micro-batch (2 (p - 1) messages) stalls it; on average ``2 (p - 1) / p`` msg a
      micro-batch, not the 2 msg of both sends.
    * Interleaved 1F1B (Narayanan et al. SC'21, Sec. 2.2, Fig. 4 bottom; ``v`` chunks a rank): no closed form.
      Small messages hide under the other chunks' work and only the fill and the drain across the p v - 1
      virtual-stage boundaries remain, ``2 (p v - 1) msg`` whatever ``m``; larger ones stall the steady state
      too, by an amount that depends on ``t_f``, ``t_b`` and ``msg`` piecewise and grows with ``m``. The
      schedule is priced as the simulator runs it, the one model of the schedule: see
      :func:`_interleaved_exposure`. Every message on the critical path, ``2 msg (m v + p - 1)``, would
      over-price it several-fold where the messages hide.
    """
    if p == 1 or msg <= 0.0:
        return 0.0
    if schedule == "gpipe":
        return 2 * (p - 1) * msg
    if schedule == "1f1b":
        return 2 * msg * (m + p - 3 - (m - 2) // p)
    if t_f <= 0.0 or t_b <= 0.0:
        raise ValueError("the interleaved schedule's message time needs the chunk times t_f and t_b")
    return msg * _interleaved_exposure(p, m, v, _ratio(t_f / msg), _ratio(t_b / msg))


# Rounds (p micro-batches each) after which the interleaved schedule's steady state is taken to have set in:
# longer steps are extrapolated from two of about this length (see _interleaved_exposure).
STEADY_ROUNDS = 8


def _ratio(x: float) -> float:
    """A chunk time over the message time, to 10 significant digits: the memo's key (both makespans of an
    exposure are computed from the rounded value, so rounding moves it by about 1e-10 of the makespan)."""
    return float(f"{x:.10g}")


def _interleaved_exposure(p: int, m: int, v: int, a: float, b: float) -> float:
    """Exposed message time of interleaved 1F1B in units of the message time, on chunks of ``a`` (forward) and
    ``b`` (backward) message times: the simulator's makespan with messages less its makespan without.

    The simulator is a longest path through the step's actions (each action starts at the latest of its
    rank's previous action's end and its input's arrival), so the makespan is homogeneous of degree 1 in
    (t_f, t_b, msg): the exposure is msg times this function of the ratios, memoized on them. Without
    messages the makespan is ``(m v + p - 1)(t_f + t_b)`` (no path holds more forwards or backwards than
    that). With them, one path is that work plus the fill and drain's ``2 (p v - 1)`` messages (the whole
    makespan where messages are small); where it is the longest it stays so for any larger ``a`` and ``b``
    (every other path gains at most as much), so a point at or above one already found without stalls (or
    a segment between two: :func:`_hidden`) is answered without simulating.

    Beyond ``2 STEADY_ROUNDS - 2`` rounds (fewer cost no more to simulate in full) the steady state is
    extrapolated linearly over whole periods of two rounds from a simulation of k0 = :data:`STEADY_ROUNDS` or
    one less (of the parity of m / p) and one of k0 - 2 rounds. This is exact where the steady state repeats
    every one or two rounds, which includes every step whose messages hide (the exposure stays the fill and
    drain's). Where messages are comparable to a chunk or longer its period can be longer, and the last two
    rounds' increment then differs from the long-run one (``tests/test_plan_pipeline.py`` bounds the error).
    """
    k = m // p
    if k <= 2 * STEADY_ROUNDS - 2:
        return _simulated_exposure(p, k, v, a, b)
    k0 = STEADY_ROUNDS - (k - STEADY_ROUNDS) % 2
    e0, e1 = _simulated_exposure(p, k0 - 2, v, a, b), _simulated_exposure(p, k0, v, a, b)
    return e1 + (k - k0) // 2 * (e1 - e0)


_NO_STALL: dict = {}     # (p, rounds, v) -> [(a, b)] simulated with only the fill and drain's messages exposed


@lru_cache(maxsize=65536)
def _simulated_exposure(p: int, k: int, v: int, a: float, b: float) -> float:
    fill_drain = 2.0 * (p * v - 1)
    known = _NO_STALL.setdefault((p, k, v), [])
    if _hidden(known, a, b):
        return fill_drain
    from podscale.parallel.pipeline.schedule import simulate_schedule
    m = k * p
    e = simulate_schedule("interleaved", p, m, v, a, b, t_msg=1.0)["makespan"] - (m * v + p - 1) * (a + b)
    if abs(e - fill_drain) <= 1e-9 * (m * v + p) * (1.0 + a + b):
        known[:] = [(a0, b0) for a0, b0 in known if a0 < a or b0 < b] + [(a, b)]   # the minimal ones
        return fill_drain
    return e


def _hidden(known: list, a: float, b: float) -> bool:
    """Whether (a, b) is at or above a point of a segment between two ratios ``known`` to stall nothing (or one
    of them). The ratios that stall nothing are those where the fill and drain's path is the longest, which
    beats each other path by a linear function of (a, b) increasing in both: an intersection of half-planes,
    convex and closed upwards."""
    for i, (a1, b1) in enumerate(known):
        if a >= a1 and b >= b1:
            return True
        for a2, b2 in known[i + 1:]:
            if (a1 - a2) * (b1 - b2) >= 0:
                continue    # one dominates the other: the point checks cover their segment
            (xa, ya), (xb, yb) = sorted(((a1, b1), (a2, b2)))
            # the segment's points (xa + l (xb - xa), ya - l (ya - yb)), 0 <= l <= 1, below-left of (a, b)
            if max((ya - b) / (ya - yb), 0.0) <= min((a - xa) / (xb - xa), 1.0):
                return True
    return False
