"""A named-axis mesh of ranks, built on torch.distributed process groups.

Axes are ``pp, dp, ep, tp`` from outermost to innermost, so tensor-parallel ranks are neighbours (one NVLink
island) and pipeline stages are furthest apart.  Rank ``r`` has coordinates given by the row-major
decomposition ``r = ((pp_i * dp + dp_i) * ep + ep_i) * tp + tp_i``.  An axis of size 1 has no process
group and every collective on it is free.  The mesh is passed explicitly; nothing here is global.
"""
from __future__ import annotations

import itertools
import math
from datetime import timedelta
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from podscale.runtime import comm
from podscale.runtime.comm import CommStats, Ledger

if TYPE_CHECKING:
    from podscale.parallel.rng import RNGTracker

AXES = ("pp", "dp", "ep", "tp")
# Axis combinations that later parts need a group for, besides each single axis: dense parameters are
# data-parallel over dp x ep (experts are not), a mixture-of-experts layer folded over tp exchanges its
# tokens over ep x tp, and the world.
_COMBOS = (("dp", "ep"), ("dp", "tp"), ("ep", "tp"), AXES)


class MeshError(ValueError):
    """A mesh shape that cannot be built on this world."""


@dataclass(frozen=True)
class AxisGroup:
    """This rank's process group over a combination of axes, with what the collectives need to know of it,
    decided once when the group is created: its backend (``"gloo"``, ``"nccl"``, ...), which picks the
    gloo-only in-place path of :func:`podscale.runtime.comm.all_gather` / ``reduce_scatter``."""

    group: object
    backend: str


def check_shape(sizes: dict[str, int], world_size: int) -> None:
    """Raise MeshError with a one-line fix when the axis sizes do not multiply to ``world_size``."""
    for axis, n in sizes.items():
        if axis not in AXES:
            raise MeshError(f"unknown mesh axis '{axis}': use one of {', '.join(AXES)}")
        if not isinstance(n, int) or n < 1:
            raise MeshError(f"mesh axis {axis}={n!r} must be a positive integer")
    product = math.prod(sizes.get(a, 1) for a in AXES)
    if product != world_size:
        shape = " x ".join(f"{a}={sizes.get(a, 1)}" for a in AXES)
        raise MeshError(
            f"mesh {shape} has {product} ranks but the world has {world_size}: "
            f"make pp*dp*ep*tp equal the number of processes ({world_size})"
        )


@dataclass
class Mesh:
    """Ranks arranged on the named axes ``pp, dp, ep, tp`` with one process group per axis.

    Build it with :meth:`Mesh.build` after ``torch.distributed`` is initialised (or without it for one
    process).  ``stats`` records the bytes and time of every collective issued through
    :mod:`podscale.runtime.comm`, keyed by axis and operation; ``ledger`` what those collectives have
    reached (read by the hang watchdog, :mod:`podscale.runtime.watchdog`).  ``rng_tracker`` is this
    process's model-parallel dropout streams for the mesh, created on first use by
    :func:`podscale.parallel.rng.rng_tracker` (the one place that makes it).
    """

    sizes: dict[str, int]
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    stats: CommStats = field(default_factory=CommStats)
    ledger: Ledger = field(default_factory=Ledger, repr=False)
    _groups: dict[tuple[str, ...], AxisGroup] = field(default_factory=dict, repr=False)
    rng_tracker: RNGTracker | None = field(default=None, repr=False, compare=False)

    @classmethod
    def build(cls, device: torch.device | None = None, timeout_s: float | None = None, **sizes: int) -> "Mesh":
        """Create the mesh and its process groups; every rank must call this with the same sizes.

        ``timeout_s`` bounds how long a collective of these groups may wait (torch's process-group timeout;
        default: torch's, 30 minutes); ``new_group`` does not inherit the default group's."""
        if comm.strict_devices_requested():  # (the test suite: see comm.check_devices)
            comm.enable_strict_devices()
        initialized = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if initialized else 1
        rank = dist.get_rank() if initialized else 0
        full = {a: int(sizes.get(a, 1)) for a in AXES}
        check_shape(full, world)
        mesh = cls(sizes=full, rank=rank, device=device or torch.device("cpu"))
        if initialized and world > 1:
            timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
            for axes in [(a,) for a in AXES] + list(_COMBOS):
                mesh._create_groups(axes, timeout)
        return mesh

    # coordinates -------------------------------------------------------------------------------
    def coords(self, rank: int | None = None) -> dict[str, int]:
        """Coordinates of ``rank`` (default: this rank) on each axis."""
        r = self.rank if rank is None else rank
        out = {}
        for axis in reversed(AXES):
            out[axis] = r % self.sizes[axis]
            r //= self.sizes[axis]
        return {a: out[a] for a in AXES}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates; missing axes take this rank's coordinate."""
        c = self.coords() | coords
        r = 0
        for axis in AXES:
            r = r * self.sizes[axis] + c[axis]
        return r

    def size(self, *axes: str) -> int:
        """Number of ranks spanned by ``axes`` (all axes when none are given)."""
        return math.prod(self.sizes[a] for a in (axes or AXES))

    def local_rank(self, *axes: str) -> int:
        """This rank's index inside its group over ``axes`` (row-major over the named axes)."""
        c = self.coords()
        idx = 0
        for axis in AXES:
            if axis in axes:
                idx = idx * self.sizes[axis] + c[axis]
        return idx

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes over which ranks see different samples: ``dp``, and ``ep`` when it is > 1 (expert-parallel
        ranks split the batch too, GShard section 3).  Losses and metrics are averaged over these."""
        return ("dp", "ep") if self.sizes["ep"] > 1 else ("dp",)

    @property
    def world_size(self) -> int:
        return self.size()

    def group(self, *axes: str):
        """The process group of this rank over ``axes``, or None when those axes span one rank."""
        record = self.axis_group(*axes)
        return None if record is None else record.group

    def axis_group(self, *axes: str) -> AxisGroup | None:
        """The record of this rank's group over ``axes`` (group and backend), or None when those axes span
        one rank."""
        key = tuple(a for a in AXES if a in axes)
        if self.size(*key) == 1:
            return None
        if key not in self._groups:
            raise MeshError(
                f"no process group for axes {key}: groups exist for single axes and {_COMBOS}; "
                "add the combination to podscale.runtime.mesh._COMBOS"
            )
        return self._groups[key]

    def group_ranks(self, *axes: str) -> list[int]:
        """Global ranks of this rank's group over ``axes``, in group order."""
        key = tuple(a for a in AXES if a in axes)
        ranges = [range(self.sizes[a]) for a in key]
        return [self.rank_of(**dict(zip(key, idx))) for idx in itertools.product(*ranges)]

    def _create_groups(self, axes: tuple[str, ...], timeout: timedelta | None = None) -> None:
        key = tuple(a for a in AXES if a in axes)
        if key in self._groups or self.size(*key) == 1:
            return
        others = [a for a in AXES if a not in key]
        mine = None
        # Every rank creates every group, in the same order, as torch.distributed.new_group requires.
        for fixed in itertools.product(*[range(self.sizes[a]) for a in others]):
            base = dict(zip(others, fixed))
            ranks = [
                self.rank_of(**(base | dict(zip(key, idx))))
                for idx in itertools.product(*[range(self.sizes[a]) for a in key])
            ]
            g = dist.new_group(ranks, timeout=timeout)
            if self.rank in ranks:
                mine = g
        self._groups[key] = AxisGroup(mine, dist.get_backend(mine))

    def describe(self) -> str:
        return " ".join(f"{a}={self.sizes[a]}" for a in AXES)
