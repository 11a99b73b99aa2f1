"""Collective communication time on hierarchical networks.

A communication group is described by its size ``n`` and its ``stride``: the distance, in global
ranks, between consecutive members. With the mesh order ``pp, dp, ep, tp`` (outermost to innermost)
a tp group has stride 1, an ep group stride tp, a dp group stride ep*tp and pipeline neighbours are
dp*ep*tp ranks apart. Ranks fill a node before the next one, so the stride decides which members share
a node (switched fabrics) or a torus ring (TPU).

The network is reduced to *levels* ``[(k_1, link_1), (k_2, link_2), ...]``: the group is a product of
sub-groups of k_i members that talk over link class i. A bandwidth-optimal hierarchical all-reduce
reduce-scatters inside level 1, all-reduces the 1/k_1 shard across level 2, and so on, then
all-gathers back, so (Thakur et al., "Optimization of collective communication operations in MPICH",
2005; the 2-D torus all-reduce of Ying et al., "Image classification at supercomputer scale", 2018):

    T_allreduce = sum_i [ 2 (k_i - 1)/k_i * S / (prod_{j<i} k_j) / B_i  +  2 (k_i - 1) * alpha_i ]

reduce-scatter and all-gather are half of it each (at a link's own measured bandwidth for them where it
has one: ``plan calibrate`` on gloo, whose podscale reduce-scatter is one reduce per rank). All-to-all
sends (n-1)/n of the buffer, and the bottleneck is the slowest level it crosses. Point-to-point is S / B + alpha.
On a calibrated CPU every collective and message also pays, once, the measured wait of one issued between
compute kernels (``System.collective_wait``: the ranks' late arrivals and gloo's thread hand-offs), whatever its
kind: an all-gather or an all-to-all waits for the last rank as an all-reduce does.
"""
from __future__ import annotations

from .hardware import Link, System

Level = tuple  # (members, bandwidth bytes/s, latency s)


def node_members(system: System, n: int, stride: int = 1) -> int:
    """Members of a group of ``n`` ranks ``stride`` apart that share one node (ranks fill a node before the next
    one): on switched systems those behind one NVLink/NVSwitch domain, the rest reached over the NICs; n // this
    is the number of nodes the group spans. A torus or a weight-streaming system has no such split: the whole
    group counts as one node."""
    if system.topology not in ("switch", "fat-tree", "host"):
        return max(1, n)
    per_node = system.devices_per_node
    return max(1, min(n, per_node // stride)) if stride < per_node else 1


def _switch_levels(system: System, n: int, stride: int, collective: str = "all_reduce") -> list[Level]:
    """Members per node first (NVLink/NVSwitch), then nodes over the per-device NIC share."""
    inside = node_members(system, n, stride)
    levels = []
    if inside > 1:
        levels.append((inside, system.intra.effective_for(collective), system.intra.latency))
    if n // inside > 1:
        levels.append((n // inside, system.inter.effective_for(collective), system.inter.latency))
    return levels


def _torus_levels(system: System, n: int, stride: int) -> list[Level]:
    """Map the group onto torus dimensions, fastest first; a ring in one dimension uses both
    directions of its links (2 x link bandwidth), shared by the ``hop`` interleaved groups that
    use the same ring when members are ``hop`` chips apart. A group that does not align with the
    torus (sizes or strides that do not divide its dimensions) is costed as one ring over routes
    that share links: a single link's one-way bandwidth."""
    levels = []
    link = system.ici
    size, hop = n, stride
    for dim in system.torus:
        if size == 1:
            break
        if hop >= dim:
            if hop % dim:
                break
            hop //= dim
            continue
        if dim % hop:
            break
        members = min(size, dim // hop)
        if size % members:
            break
        levels.append((members, 2 * link.effective / hop, link.latency * hop))
        size //= members
        hop = 1
    if size == 1:
        return levels
    total = 1
    for dim in system.torus:
        total *= dim
    if n * stride > total:
        raise ValueError("communication group larger than the torus")
    return [(n, link.effective, link.latency * max(1, stride))]


def levels(system: System, n: int, stride: int = 1, collective: str = "all_reduce") -> list[Level]:
    """The group's levels; ``collective`` picks a link's own measured bandwidth for a reduce-scatter or an
    all-gather where it has one (a calibrated CPU's gloo: not the ring halves of its all-reduce)."""
    if n <= 1:
        return []
    if system.topology in ("switch", "fat-tree", "host"):
        return _switch_levels(system, n, stride, collective)
    if system.topology == "torus":
        return _torus_levels(system, n, stride)
    if system.topology == "weight-streaming":
        # SwarmX is a broadcast/reduce tree between MemoryX and the wafers: every wafer uses its own I/O.
        return [(n, system.stream.effective, system.stream.latency)]
    raise ValueError(f"unknown topology {system.topology}")


def all_reduce_time(system: System, nbytes: float, n: int, stride: int = 1) -> float:
    """Hierarchical ring all-reduce (module docstring)."""
    t, shard = 0.0, float(nbytes)
    for k, bw, lat in levels(system, n, stride):
        t += 2 * (k - 1) / k * shard / bw + 2 * (k - 1) * lat
        shard /= k
    return t + _wait(system, n)


def _wait(system: System, n: int) -> float:
    """The once-per-collective wait (module docstring) of a group of ``n`` ranks: none alone."""
    return system.collective_wait if n > 1 else 0.0


def _half_ring(system: System, nbytes: float, n: int, stride: int, collective: str) -> float:
    t, shard = 0.0, float(nbytes)
    for k, bw, lat in levels(system, n, stride, collective):
        t += (k - 1) / k * shard / bw + (k - 1) * lat
        shard /= k
    return t + _wait(system, n)


def reduce_scatter_time(system: System, nbytes: float, n: int, stride: int = 1) -> float:
    """Half of an all-reduce: ``nbytes`` is the full (unsharded) buffer."""
    return _half_ring(system, nbytes, n, stride, "reduce_scatter")


def all_gather_time(system: System, nbytes: float, n: int, stride: int = 1) -> float:
    """Same volume as the reduce-scatter, reversed direction; ``nbytes`` is the gathered size."""
    return _half_ring(system, nbytes, n, stride, "all_gather")


def all_to_all_time(system: System, nbytes: float, n: int, stride: int = 1) -> float:
    """Each member sends (n-1)/n of its ``nbytes``; traffic leaving the innermost level goes over the
    slower link, so the time is set by the fraction that crosses each level at that level's bandwidth."""
    t, inner = 0.0, 1
    lv = levels(system, n, stride)
    if not lv:
        return 0.0
    for k, bw, lat in lv:
        inner_new = inner * k
        # Share of destinations reachable only by crossing this level.
        frac = (inner_new - inner) / n
        t = max(t, frac * nbytes / bw)
        inner = inner_new
    return t + sum((k - 1) * lat for k, _, lat in lv) + _wait(system, n)


def p2p_time(system: System, nbytes: float, stride: int) -> float:
    """Send ``nbytes`` to the rank ``stride`` away (pipeline neighbour)."""
    if nbytes <= 0:
        return 0.0
    link: Link
    if system.topology == "torus":
        link = system.ici
        return nbytes / link.effective + link.latency
    if system.topology == "weight-streaming":
        return nbytes / system.stream.effective + system.stream.latency
    link = system.intra if stride < system.devices_per_node else system.inter
    return nbytes / link.effective + link.latency + system.collective_wait
