"""Parallelisms, each a function or wrapper applied to a plain model and a mesh."""
from podscale.parallel.data import DataParallel

__all__ = ["DataParallel"]
