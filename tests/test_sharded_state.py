"""The map from a tp rank's shard (or a ZeRO box of it) to single-process coordinates that sharded
checkpoints are written with: every piece equals the same elements of the full tensor, and over all tp
ranks the pieces cover the full tensor exactly once (padded vocabulary rows never appear)."""
import itertools

import pytest
import torch

from podscale.parallel.sharded_state import global_shape, to_global
from podscale.parallel.tensor import shard
from podscale.parallel.zero.layout import flat_range_boxes
from podscale.runtime.mesh import Mesh

CASES = [("qkv", (24, 4)), ("qkv", (24,)), ("rows", (16, 4)), ("rows", (16,)), ("cols", (4, 16)),
         (("vocab", 10), (10, 4)), (("vocab", 9), (9, 4)), (None, (6, 4))]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layout,full_shape", CASES)
def test_pieces_are_the_full_tensors_elements_exactly_once(layout, full_shape, tp):
    full = torch.arange(float(torch.Size(full_shape).numel())).view(full_shape)
    covered = torch.zeros(full_shape, dtype=torch.int64)
    kind, vocab = (layout, None) if layout is None or isinstance(layout, str) else layout
    for t in range(tp):
        mesh = Mesh(sizes={"pp": 1, "dp": 1, "ep": 1, "tp": tp}, rank=t)
        local = full.clone() if kind is None else shard(full, kind, mesh, vocab)
        assert global_shape(layout, tuple(local.shape), tp) == full_shape
        # the whole shard, and a ZeRO-like cut of it into flat ranges of awkward lengths
        cuts = [((0,) * local.dim(), tuple(local.shape))]
        n = local.numel()
        for lo, hi in itertools.pairwise([0, 3, n // 2 + 1, n]):
            cuts += flat_range_boxes(lo, hi, tuple(local.shape))
        for k, (off, size) in enumerate(cuts):
            for loff, lsize, goff in to_global(layout, tuple(local.shape), t, tp, off, size):
                mine = local[tuple(slice(o, o + s) for o, s in zip(loff, lsize))]
                theirs = full[tuple(slice(o, o + s) for o, s in zip(goff, lsize))]
                assert torch.equal(mine, theirs), (layout, tp, t, off, size)
                assert mine.is_contiguous() or not mine.numel()
                if k == 0 and (kind is not None or t == 0):
                    covered[tuple(slice(o, o + s) for o, s in zip(goff, lsize))] += 1
    assert torch.equal(covered, torch.ones_like(covered)), (layout, tp)
