"""Random numbers for dropout under tensor parallelism: a model-parallel RNG tracker (Shoeybi et al. 2019,
appendix B.2; Megatron-LM's ``CudaRNGStatesTracker``).

Dropout draws its mask from torch's default generator of the device.  Under tensor parallelism two kinds of
activations meet dropout:

* activations *replicated* over tp (the embedding output, the output of the row-parallel projections): every
  tp rank must drop the same elements, or the replicas diverge; they draw from the default generator, which
  :func:`seed_model_parallel` seeds identically on the ranks of a tp group (and differently across dp and pp);
* activations *split* over tp (attention probabilities of this rank's heads; with sequence parallelism also
  the replicated regions, which then hold this rank's part of the sequence): each rank must draw its own
  independent mask, as one process draws a different mask for each head; they draw from the tracker's
  ``model-parallel`` stream, seeded differently on every rank, inside ``tracker.fork()``.

``fork`` swaps the stream's state into the default generator and back, so the same dropout code serves both.
Activation recomputation replays a forward in backward: torch's checkpoint restores the default generator,
and :meth:`RNGTracker.recompute_context` restores the tracker's streams to their state at the forward, so
the recomputed masks are the forward's (as Megatron's ``CheckpointFunction`` does).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

MODEL_PARALLEL = "model-parallel"
_TRACKER_SEED_OFFSET = 2718  # Megatron's offset between the default and the model-parallel seeds


class RNGTracker:
    """Named generator states for one device, swapped into the device's default generator by ``fork``."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def add(self, name: str, seed: int) -> None:
        """(Re)start stream ``name`` from ``seed``; the default generator is left as it was."""
        self.states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL):
        """Draw from stream ``name`` inside the block (the default generator is untouched)."""
        if name not in self.states:
            raise RuntimeError(f"RNG stream '{name}' was never seeded: call seed_model_parallel(seed, mesh)")
        saved = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def recompute_context(self):
        """For ``torch.utils.checkpoint(..., context_fn=...)``: called at the forward, it returns (forward
        context, recompute context); the second runs the recomputation with the streams as they were at the
        forward and afterwards puts back their current state."""
        at_forward = self.get_states()

        @contextlib.contextmanager
        def replay():
            now = self.get_states()
            self.set_states(at_forward)
            try:
                yield
            finally:
                self.set_states(now)

        return contextlib.nullcontext(), replay()


def rng_tracker(mesh) -> RNGTracker:
    """The tracker of this process for ``mesh`` (one per mesh, created on first use; until
    :func:`seed_model_parallel` seeds it, its stream starts from torch's initial seed and the global rank).
    It lives in the mesh's declared ``rng_tracker`` field, which only this function fills."""
    tracker = mesh.rng_tracker
    if tracker is None:
        tracker = mesh.rng_tracker = RNGTracker(mesh.device)
        tracker.add(MODEL_PARALLEL, torch.initial_seed() + _TRACKER_SEED_OFFSET + mesh.rank)
    return tracker


def seed_model_parallel(seed: int, mesh) -> None:
    """Seed dropout for this rank (Megatron's ``model_parallel_cuda_manual_seed``): the default generator
    from ``seed`` and this rank's coordinates on every axis but tp (tp is the innermost axis, so that is
    ``rank // tp``): the same on a tp group, different across dp, pp and ep; the model-parallel stream from
    ``seed`` and the global rank: different on every rank."""
    torch.manual_seed(seed + 1 + mesh.rank // mesh.size("tp"))
    rng_tracker(mesh).add(MODEL_PARALLEL, seed + _TRACKER_SEED_OFFSET + mesh.rank)


class ForkedDropout(nn.Dropout):
    """Dropout whose mask comes from the tracker's model-parallel stream: for activations split over tp
    (sequence parallelism's sequence shards)."""

    def __init__(self, p: float, tracker: RNGTracker):
        super().__init__(p)
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with self.tracker.fork():
            return F.dropout(x, self.p, True)
