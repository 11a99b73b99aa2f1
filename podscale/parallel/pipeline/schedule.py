"""Pipeline schedules and the executor that runs them with point-to-point sends on the ``pp`` axis.

A schedule is, for each pipeline rank, the ordered list of ``("F" | "B", virtual stage, micro-batch)``
actions it runs in one optimizer step:

* **GPipe** (Huang et al. 2019): all forwards, then all backwards.  Bubble ``(p - 1) / m`` of the ideal
  time, and every rank holds the activations of all ``m`` micro-batches until its backwards start.
* **1F1B** (Narayanan et al. 2021, section 2.2, Figure 4 top; PipeDream-Flush): rank ``i`` runs
  ``p - i - 1`` warm-up forwards, then alternates one forward and one backward, then drains.  Same bubble as
  GPipe, but at most ``p - i`` micro-batches are in flight on rank ``i``: at most ``p`` instead of ``m``.
* **Interleaved 1F1B** (Narayanan et al. 2021, section 2.2, Figure 4 bottom): each rank holds ``v`` model
  chunks (virtual stages ``i, i + p, ...``); micro-batches go through the chunks in groups of ``p``, which
  divides the bubble by ``v``: ``(p - 1) / (v m)``, for ``v`` times more point-to-point messages.
  Needs ``m`` to be a multiple of ``p``.

The executor posts receives a few actions ahead, waits for an activation (or gradient) right before the
action that needs it and sends results asynchronously, so a rank waits exactly when the schedule makes it
wait; that waiting time is the measured bubble.  Messages carry a tag made of (micro-batch, stage, direction), so
sends and receives between two ranks pair up whatever order two schedules issue them in.
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from podscale.models.gpt import GPT
from podscale.parallel.model_protocols import GatherUnits
from podscale.parallel.pipeline.partition import PipelineError, layer_costs, split_chunk, stage_layers
from podscale.parallel.sharded_state import ShardedCheckpointState, persistent_buffers
from podscale.parallel.tensor import (WrapsDataParallel, apply_recompute, apply_tensor_parallel, gather_vocab_logits,
                                      pad_to_shards, sync_sequence_parallel_grads, tensor_parallel_rng)
from podscale.runtime import comm
from podscale.runtime.mesh import AXES
from podscale.train.precision import autocast

SCHEDULES = ("gpipe", "1f1b", "interleaved")


# ------------------------------------------------------------------------------------------------------
# schedules


def check_schedule(schedule: str, p: int, m: int, v: int = 1) -> None:
    if schedule not in SCHEDULES:
        raise PipelineError(f"unknown pipeline schedule '{schedule}': use one of {', '.join(SCHEDULES)}")
    if schedule != "interleaved" and v != 1:
        raise PipelineError(f"parallel.virtual_stages={v} needs parallel.schedule='interleaved' "
                            "(or set virtual_stages = 1)")
    if m < 1:
        raise PipelineError("a pipeline step needs at least one micro-batch")
    if schedule == "interleaved" and m % p:
        raise PipelineError(f"interleaved 1F1B needs the number of micro-batches per step ({m}) to be a "
                            f"multiple of parallel.pp={p}: set train.global_batch / (dp * micro_batch) "
                            f"to a multiple of {p}")


def schedule_actions(schedule: str, p: int, m: int, v: int = 1) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, the ordered ``(kind, virtual chunk, micro-batch)`` actions of one step."""
    check_schedule(schedule, p, m, v)
    out = []
    for rank in range(p):
        if schedule == "gpipe":
            acts = [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
        elif schedule == "1f1b":
            warm = min(p - rank - 1, m)
            acts = [("F", 0, i) for i in range(warm)]
            for i in range(m - warm):
                acts += [("F", 0, warm + i), ("B", 0, i)]
            acts += [("B", 0, i) for i in range(m - warm, m)]
        else:
            total = m * v

            def unit(k: int, forward: bool) -> tuple[int, int]:
                chunk = (k // p) % v
                return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

            warm = min((p - rank - 1) * 2 + (v - 1) * p, total)
            acts = [("F",) + unit(k, True) for k in range(warm)]
            for k in range(total - warm):
                acts += [("F",) + unit(warm + k, True), ("B",) + unit(k, False)]
            acts += [("B",) + unit(k, False) for k in range(total - warm, total)]
        out.append(acts)
    return out


def simulate(actions: list[list[tuple[str, int, int]]], v: int, t_f: float = 1.0, t_b: float = 2.0,
             t_msg: float = 0.0) -> dict:
    """Run the schedule on an ideal machine (blocking receives; each message arrives ``t_msg`` after the action
    that sends it ends, while its sender goes on: the executor's asynchronous sends); raises on a deadlock.

    Returns the makespan, the bubble ``(makespan - m (t_f + t_b) v) / (m (t_f + t_b) v)`` and the largest
    number of micro-batches in flight on each rank.
    """
    return _run(_compile(actions, v), t_f, t_b, t_msg)


def simulate_schedule(schedule: str, p: int, m: int, v: int = 1, t_f: float = 1.0, t_b: float = 2.0,
                      t_msg: float = 0.0) -> dict:
    """:func:`simulate` of ``schedule_actions(schedule, p, m, v)``, the schedule compiled once for all the
    stage and message times it is run with (the planner runs one schedule with many)."""
    return _run(_compiled_schedule(schedule, p, m, v), t_f, t_b, t_msg)


@functools.lru_cache(maxsize=256)
def _compiled_schedule(schedule: str, p: int, m: int, v: int) -> tuple:
    return _compile(schedule_actions(schedule, p, m, v), v)


def _compile(actions: list[list[tuple[str, int, int]]], v: int) -> tuple:
    """The actions as (event it finishes, event it waits for or -1, +1 forward / -1 backward), an event of
    (kind, stage, micro-batch) numbered ``(2 stage + backward) mbs + micro-batch``, so that :func:`_run` does
    no hashing."""
    p = len(actions)
    last = p * v - 1
    mbs = 1 + max((a[2] for acts in actions for a in acts), default=0)
    plans = []
    for r, acts in enumerate(actions):
        plan = []
        for kind, c, mb in acts:
            s = c * p + r
            if kind == "F":
                plan.append((2 * s * mbs + mb, (2 * s - 2) * mbs + mb if s > 0 else -1, 1))
            else:
                plan.append(((2 * s + 1) * mbs + mb, (2 * s + 3) * mbs + mb if s < last else -1, -1))
        plans.append(plan)
    m = sum(1 for a in actions[0] if a[0] == "F") // v
    return actions, plans, 2 * (last + 1) * mbs, m * v


def _run(compiled: tuple, t_f: float, t_b: float, t_msg: float) -> dict:
    actions, plans, events, work = compiled
    p = len(plans)
    done: list = [None] * events  # event -> finish time
    pos, clock = [0] * p, [0.0] * p
    live, peak = [0] * p, [0] * p
    remaining = sum(len(a) for a in plans)
    while remaining:
        progressed = False
        for r in range(p):
            plan, i, t, n_live, n_peak = plans[r], pos[r], clock[r], live[r], peak[r]
            n = len(plan)
            while i < n:
                ev, dep, sign = plan[i]
                if dep >= 0:
                    arrive = done[dep]
                    if arrive is None:
                        break
                    arrive += t_msg
                    if arrive > t:
                        t = arrive
                t += t_f if sign > 0 else t_b
                done[ev] = t
                n_live += sign
                if n_live > n_peak:
                    n_peak = n_live
                i += 1
            if i != pos[r]:
                remaining -= i - pos[r]
                pos[r], clock[r], live[r], peak[r] = i, t, n_live, n_peak
                progressed = True
        if not progressed:
            raise PipelineError(f"pipeline schedule deadlocks at {[a[i] if i < len(a) else None for a, i in zip(actions, pos)]}")
    ideal = work * (t_f + t_b)
    makespan = max(clock)
    return {"makespan": makespan, "bubble": (makespan - ideal) / ideal, "peak_in_flight": peak}


# ------------------------------------------------------------------------------------------------------
# point-to-point messages


def _tag(mb: int, stage: int, backward: bool, stages: int) -> int:
    return (mb * stages + stage) * 2 + int(backward)


def _send(t: torch.Tensor, dst: int, mesh, tag: int) -> comm.Handle:
    # Interleaved schedules exchange several chunks' messages between the same two ranks: tags pair them.
    return comm.send(t, dst, mesh, "pp", async_op=True, tag=tag)


def _recv(t: torch.Tensor, src: int, mesh, tag: int) -> comm.Handle:
    return comm.recv(t, src, mesh, "pp", async_op=True, tag=tag)


def _completed(h: comm.Handle) -> bool:
    if not h.is_completed():
        return False
    h.wait()  # books the (zero) exposed time and marks it done
    return True


# ------------------------------------------------------------------------------------------------------
# the strategy


class _Chunks(nn.ModuleList, GatherUnits):
    """The model chunks of this pipeline rank (the schedule calls the chunks themselves, and starts the
    data-parallel strategy's per-step work through :meth:`DataParallelStrategy.begin_forward`)."""

    def gather_units(self) -> list[nn.Module]:
        """ZeRO-3's gather units: every block of every chunk, in this rank's forward order (the embeddings
        and the head form the root unit, gathered for the whole step)."""
        return [b for c in self for b in c.blocks.values()]


@dataclass(frozen=True)
class ChunkPlacement:
    """Where one of this rank's model chunks sits in the pipeline: its stage (0 .. pp x virtual stages - 1,
    in forward order) and the layers of the single-process model (block indices) it holds."""

    stage: int
    layers: list[int]


@dataclass
class StepStats:
    """Measured on this rank during the last ``forward_backward``."""

    compute_s: float = 0.0          # time in forward and backward of model chunks
    wait_s: float = 0.0             # time blocked receiving activations or gradients (the bubble)
    total_s: float = 0.0
    peak_in_flight: int = 0         # micro-batches whose forward ran and backward has not
    peak_activation_bytes: int = 0  # bytes saved for backward by those micro-batches (parameters excluded)
    actions: list = field(default_factory=list)
    timeline: list = field(default_factory=list)  # (kind, chunk, micro-batch, start, end) from step start


class PipelineParallel(ShardedCheckpointState, WrapsDataParallel):
    """Pipeline-parallel training strategy: model chunks on this pp rank, a schedule, and a data-parallel
    strategy over dp for the chunks' parameters (replicated or ZeRO).  Provides ``forward_backward``.
    ``placement``: where each chunk sits (:meth:`build` fills it in; reported, not used by the schedule)."""

    def __init__(self, chunks: list[GPT], mesh, inner, schedule: str = "1f1b", precision: str = "fp32",
                 activation_shape: tuple[int, ...] | None = None, measure_memory: bool = False,
                 seq_shards: int = 1, recv_ahead: int = 4, placement: Sequence[ChunkPlacement] = ()):
        self.chunks, self.mesh, self.inner, self.schedule = chunks, mesh, inner, schedule
        self.placement = list(placement)
        self.module = chunks if isinstance(chunks, _Chunks) else _Chunks(chunks)
        self.p, self.v = mesh.size("pp"), len(chunks)
        self.stage_rank = mesh.local_rank("pp")
        self.ranks = mesh.group_ranks("pp")
        self.precision = precision
        self.activation_shape = activation_shape
        self.measure_memory = measure_memory
        self.seq_shards = seq_shards  # tp under sequence parallelism: activations hold T / tp positions
        # Receives are posted for the next `recv_ahead` actions: a message whose receive is not yet posted
        # is held by gloo and copied when it is; posting 4 ahead instead of 1 took ~10 % less CPU per step
        # in bench/pipeline.py (interleaved, p = 4), at the cost of up to 4 activation-sized buffers.
        self.recv_ahead = recv_ahead
        self.params = [q for c in chunks for q in c.parameters() if q.requires_grad]
        self.stats = StepStats()
        # ZeRO: gradients accumulate over the micro-batches and each chunk's last backward reduce-scatters
        # them; the tied embedding's copies wait for their sum across first and last stage
        inner.accumulate_locally(deferred=self._tied_copy())

    def _tied_copy(self) -> list[nn.Parameter]:
        """This rank's copy of the embedding tied between the first and the last stage (none in between)."""
        if self.p == 1:
            return []
        if self.mesh.rank == self.ranks[0]:
            return [self.chunks[0].wte.weight]
        if self.mesh.rank == self.ranks[-1]:
            return [self.chunks[-1].lm_head.weight]
        return []

    # construction -------------------------------------------------------------------------------------
    @classmethod
    def build(cls, model: GPT, mesh, cfg, make_data_parallel, measure_memory: bool = False):
        """Split ``model`` for this pp rank, apply tp/sp to each chunk, wrap the dp strategy."""
        p = cfg.parallel
        pp, v = mesh.size("pp"), p.virtual_stages
        m = cfg.grad_accum
        check_schedule(p.schedule, pp, m, v)
        costs = None
        if p.pipeline_layers is None and p.pipeline_balance == "time":
            # timings differ from rank to rank: all ranks split by the average, so they agree
            t = torch.tensor(layer_costs(model, "time"), dtype=torch.float64, device=mesh.device)
            comm.all_reduce(t, mesh, AXES)
            costs = (t / mesh.world_size).tolist()
        groups = stage_layers(model, pp * v, p.pipeline_balance, p.pipeline_layers, costs)
        rank = mesh.local_rank("pp")
        chunks, placement = [], []
        for c in range(v):
            k = c * pp + rank
            chunk = split_chunk(model, groups[k], first=k == 0, last=k == pp * v - 1)
            apply_tensor_parallel(chunk, mesh, p.sequence_parallel)
            chunk.materialize(mesh.device)  # a meta-device model: only this chunk's layers get memory
            apply_recompute(chunk, p.recompute, tensor_parallel_rng(mesh, p.sequence_parallel))
            chunks.append(chunk)
            placement.append(ChunkPlacement(k, groups[k]))
        tp = mesh.size("tp")
        T = cfg.model.block_size // tp if p.sequence_parallel else cfg.model.block_size
        module = _Chunks(chunks)
        return cls(module, mesh, make_data_parallel(module, mesh, cfg), p.schedule, cfg.train.precision,
                   (cfg.train.micro_batch, T, cfg.model.n_embd), measure_memory,
                   tp if p.sequence_parallel else 1, placement=placement)

    # the strategy interface ---------------------------------------------------------------------------
    def named_parameters(self, remove_duplicate: bool = True):
        """(name in the single-process GPT, parameter) for the chunks on this rank."""
        for c in self.chunks:
            yield from c.named_parameters(remove_duplicate=remove_duplicate)

    def named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """(name in the single-process model, persistent buffer) for the chunks on this rank."""
        return [nb for c in self.chunks for nb in persistent_buffers(c)]

    def finish_grad_sync(self) -> None:
        # Each chunk's last backward started its dp reduction.  Replicated dp: the tp and pp sums commute
        # with its all-reduce and follow.  ZeRO: it summed the sequence-parallel gradients over tp before
        # each reduce-scatter and kept the tied embedding's back: the pp sum first, then its reduce-scatter.
        overlap = self.inner.reduce_commutes
        if overlap:
            self.inner.finish_grad_sync()
        if not self.inner.sums_sequence_parallel:
            sync_sequence_parallel_grads(self.params, self.mesh)
        self._sync_tied_embedding()
        if not overlap:
            self.inner.finish_grad_sync()

    def _sync_tied_embedding(self) -> None:
        """Sum the gradients of the input embedding (first stage) and its copy in the output layer (last
        stage), so both copies take the same step."""
        if self.p == 1:
            return
        first, last = self.ranks[0], self.ranks[-1]
        if self.mesh.rank == first:
            mine, peer = self.chunks[0].wte.weight.grad, last
        elif self.mesh.rank == last:
            mine, peer = self.chunks[-1].lm_head.weight.grad, first
        else:
            return
        theirs = torch.empty_like(mine)
        h = _send(mine.contiguous(), peer, self.mesh, tag=1 << 30)
        _recv(theirs, peer, self.mesh, tag=1 << 30).wait()
        h.wait()
        mine.add_(theirs)

    # forward only: validation and sampling ------------------------------------------------------------
    def _forward_pipeline(self, inputs, last) -> tuple[list, torch.Tensor]:
        """Forward ``inputs`` (a list of ``(x, y)``, same shapes on every rank) through the pipeline without
        autograd: each micro-batch through this rank's chunks in stage order, receiving blocking right
        before a chunk needs its input and sending asynchronously, so micro-batches flow through the stages
        as in GPipe's forward phase.  Returns ``last(output, loss)`` of each micro-batch on the last stage
        (an empty list elsewhere) and the sum of the losses the other stages' chunks return (a GPT-MoE
        stage's auxiliary losses; zero for a GPT).  Every rank's order sorts by (micro-batch, stage), which
        is also the order of the dependencies, so it cannot deadlock."""
        p, stages, dev = self.p, self.p * self.v, self.mesh.device
        dtype = next(self.module.parameters()).dtype
        sends, out = [], []
        stage_loss = torch.zeros((), device=dev)
        with torch.no_grad():
            self.inner.begin_forward()
            for mb, (x, y) in enumerate(inputs):
                shape = (x.shape[0], x.shape[1] // self.seq_shards, self.activation_shape[-1])
                for c, chunk in enumerate(self.chunks):
                    s = c * p + self.stage_rank
                    if s == 0:
                        inp = x.to(dev)
                    else:
                        inp = torch.empty(shape, device=dev, dtype=dtype)
                        _recv(inp, self.ranks[(s - 1) % p], self.mesh, _tag(mb, s, False, stages)).wait()
                    with autocast(self.precision, dev):
                        h, loss = chunk(inp, None if y is None or s < stages - 1 else y.to(dev), tokens=x.to(dev))
                    if s == stages - 1:
                        out.append(last(h, loss))
                    else:
                        if loss is not None:
                            stage_loss += loss.float()
                        sends.append(_send(h.contiguous(), self.ranks[(s + 1) % p], self.mesh,
                                           _tag(mb, s + 1, False, stages)))
            self.inner.end_forward()
        for h in sends:
            h.wait()
        return out, stage_loss

    def forward_only(self, batches, loss_fn=None) -> torch.Tensor:
        """The sum of the losses of ``batches`` (evaluation) on every rank: the last stage's plus the other
        stages' auxiliary losses (a GPT-MoE's), summed over pp.  The chunks compute the loss themselves:
        ``loss_fn`` is not called (only the GPT tasks run under a pipeline)."""
        losses, total = self._forward_pipeline(batches, lambda h, loss: loss.float())
        if losses:
            total = total + torch.stack(losses).sum()
        comm.all_reduce(total, self.mesh, "pp")
        return total

    def next_logits(self, idx: torch.Tensor) -> torch.Tensor:
        """The (B, vocab) logits of the last position of ``idx`` on every rank (sampling): the last stage
        gathers the vocab shards over tp and broadcasts them over pp."""
        T, vocab = idx.shape[1], self.chunks[0].cfg.vocab_size
        padded = pad_to_shards(idx, self.mesh, self.seq_shards > 1)
        out, _ = self._forward_pipeline([(padded, None)], lambda h, _: h[:, T - 1, :])
        if out:  # the last stage
            logits = gather_vocab_logits(out[0], self.mesh, vocab)
        else:
            logits = torch.empty(idx.shape[0], vocab, device=self.mesh.device, dtype=torch.float32)
        logits = logits.float().contiguous()
        comm.broadcast(logits, self.p - 1, self.mesh, "pp")
        return logits

    # the schedule -------------------------------------------------------------------------------------
    def forward_backward(self, micro_batches, loss_scale: float | None, loss_fn=None) -> torch.Tensor:
        """Run the schedule over ``micro_batches`` (``(x, y)`` token pairs); the last stage's GPT chunk
        computes the loss, so ``loss_fn`` is not called (only the GPT tasks run under a pipeline).

        A chunk before the last may return a loss of its own beside its activations (a GPT-MoE stage: its
        MoE layers' weighted aux and z losses).  Its backward then starts from both, ``(activations,
        loss / m * loss_scale)`` with gradients ``(received gradient, 1)``, so the auxiliary losses of every
        stage reach the gradients with the scale the last stage's loss has; its value is added to the
        step's loss (summed over pp).  Megatron-core gets the same gradient by attaching the aux loss to the
        activations with an identity autograd function whose backward adds the scaled loss gradient
        (``MoEAuxLossAutoScaler``); here the schedule owns the scale, so it passes both roots to backward."""
        m = len(micro_batches)
        self.inner.begin_forward()  # the dp strategy's per-step work (ZeRO waits for its parameter all-gather)
        actions = schedule_actions(self.schedule, self.p, m, self.v)[self.stage_rank]
        stages, p, dev = self.p * self.v, self.p, self.mesh.device
        stash: dict[tuple[int, int], tuple] = {}
        live_bytes: dict[tuple[int, int], int] = {}
        sends = []
        loss_sum = torch.zeros((), device=dev)
        st = StepStats(actions=actions)
        t_start = time.perf_counter()
        params = {q.data_ptr() for q in self.params} if self.measure_memory else set()
        # each chunk's last backward launches its dp reduction (all-reduce, or ZeRO's reduce-scatter of the
        # gradients accumulated over the micro-batches), overlapped with the rest of the schedule
        last_b = {c: i for i, (k, c, _) in enumerate(actions) if k == "B"}

        posted: dict[int, tuple[torch.Tensor, comm.Handle]] = {}
        # the residual stream has the dtype the parameters compute in (fp32 under autocast, 16-bit with
        # ZeRO's 16-bit compute copies)
        act = dict(size=self.activation_shape, device=dev, dtype=next(self.module.parameters()).dtype)

        def post(i: int) -> None:
            """Post the receive action ``i`` needs (ahead of time, so it arrives during compute)."""
            if i >= len(actions) or i in posted:
                return
            kind, c, mb = actions[i]
            s = c * p + self.stage_rank
            if kind == "F" and s > 0:
                buf, src, tag = torch.empty(**act), s - 1, _tag(mb, s, False, stages)
            elif kind == "B" and s < stages - 1:
                buf, src, tag = torch.empty(**act), s + 1, _tag(mb, s, True, stages)
            else:
                return
            posted[i] = (buf, _recv(buf, self.ranks[src % p], self.mesh, tag))

        def received(i: int) -> torch.Tensor:
            buf, h = posted.pop(i)
            t0 = time.perf_counter()
            h.wait()
            st.wait_s += time.perf_counter() - t0
            return buf

        for i, (kind, c, mb) in enumerate(actions):
            a_start = time.perf_counter() - t_start
            for j in range(i, i + 1 + self.recv_ahead):
                post(j)
            s = c * p + self.stage_rank
            chunk = self.chunks[c]
            x, y = micro_batches[mb]
            if kind == "F":
                inp = x.to(dev) if s == 0 else received(i).requires_grad_()
                t0 = time.perf_counter()
                saved = [0]

                def pack(t, saved=saved):
                    if t.data_ptr() not in params:
                        saved[0] += t.numel() * t.element_size()
                    return t

                hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if self.measure_memory \
                    else contextlib.nullcontext()
                with hooks, autocast(self.precision, dev):
                    out, loss = chunk(inp, y.to(dev) if s == stages - 1 else None, tokens=x.to(dev))
                st.compute_s += time.perf_counter() - t0
                scale = (loss_scale if loss_scale is not None else 1.0) / m
                aux = None
                if s == stages - 1:
                    loss_sum += loss.detach().float()
                    out = loss * scale
                else:
                    sends.append(_send(out.detach().contiguous(), self.ranks[(s + 1) % p], self.mesh,
                                       _tag(mb, s + 1, False, stages)))
                    if loss is not None:  # this stage's own loss (a GPT-MoE stage's aux and z losses)
                        loss_sum += loss.detach().float()
                        aux = loss * scale
                stash[(c, mb)] = (inp, out, aux)
                live_bytes[(c, mb)] = saved[0]
                st.peak_in_flight = max(st.peak_in_flight, len(stash))
                st.peak_activation_bytes = max(st.peak_activation_bytes, sum(live_bytes.values()))
            else:
                inp, out, aux = stash.pop((c, mb))
                live_bytes.pop((c, mb))
                grad = received(i) if s < stages - 1 else None
                roots, grads = (out,), (grad,)
                if aux is not None:
                    roots, grads = (out, aux), (grad, torch.ones_like(aux))
                t0 = time.perf_counter()
                with contextlib.nullcontext() if last_b.get(c) == i else self.inner.no_sync():
                    torch.autograd.backward(roots, grads)
                st.compute_s += time.perf_counter() - t0
                if s > 0:
                    sends.append(_send(inp.grad, self.ranks[(s - 1) % p], self.mesh, _tag(mb, s - 1, True, stages)))
                del inp, out, aux, roots
            sends = [h for h in sends if not _completed(h)]  # release what has been delivered
            st.timeline.append((kind, c, mb, a_start, time.perf_counter() - t_start))
        t0 = time.perf_counter()
        for h in sends:
            h.wait()
        st.wait_s += time.perf_counter() - t0
        # the loss lives on the last stage (and a GPT-MoE's aux losses on every stage); every rank reports it
        comm.all_reduce(loss_sum, self.mesh, "pp")
        st.total_s = time.perf_counter() - t_start
        self.stats = st
        return loss_sum

