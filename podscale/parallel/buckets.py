"""Which parameters share a gradient bucket: decided in one place for every data-parallel strategy (the
replicated all-reduce of :mod:`podscale.parallel.data` and ZeRO-1/2's reduce-scatter units,
:mod:`podscale.parallel.zero.layout`)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def reverse_order_buckets(items: Sequence[T], cap_bytes: int, nbytes: Callable[[T], int]) -> list[list[T]]:
    """``items`` (parameters, in registration order) grouped into buckets of about ``cap_bytes``: filled in
    reverse registration order, which is roughly the order backward produces gradients (Li et al. 2020,
    "PyTorch Distributed", section 3.2.3), each closed as soon as its ``nbytes`` reach the cap."""
    buckets, current, size = [], [], 0
    for item in reversed(items):
        current.append(item)
        size += nbytes(item)
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets
