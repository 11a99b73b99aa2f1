"""Dropout under tensor parallelism (the model-parallel RNG tracker, Shoeybi et al. 2019 appendix B.2).

With tp-sharded dropout (attention probabilities of each rank's heads) the masks cannot equal one
process's: one process draws one mask over all heads from one stream, tp = 2 draws each half from its own
stream.  What is compared instead: the tp = 2 run is deterministic; activations replicated over tp (every
block's output) are bitwise equal on both tp ranks, so the replicas never diverge; the model-parallel
stream differs across tp ranks while the default one agrees; recomputation (selective and full) replays
the forward's masks, so it trains exactly as without recomputation; and training is sane: the loss falls
as far as one process's with the same dropout, within the noise that different masks make.
"""
import math
import statistics

import pytest
import torch

from conftest import shakespeare
from podscale.runtime.launcher import launch
from test_tensor_parallel import reference_run
from tp_workers import dropout_run, make_config

STEPS, GLOBAL_BATCH = 16, 8
MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 32, "dropout": 0.2}


def _cfg(nproc, micro, **parallel):
    return make_config(shakespeare(), STEPS, GLOBAL_BATCH, micro, nproc, model=MODEL, **parallel)


def test_tp2_dropout_deterministic_replicated_and_sane():
    layouts = [("tp=2", _cfg(2, 4, tp=2)), ("tp=2 again", _cfg(2, 4, tp=2)),
               ("tp=2 selective recompute", _cfg(2, 4, tp=2, recompute="selective")),
               ("tp=2 full recompute", _cfg(2, 4, tp=2, recompute="full")),
               ("tp=2 sequence parallel", _cfg(2, 4, tp=2, sequence_parallel=True))]
    results = launch(dropout_run, ([d for _, d in layouts],), nproc=2)
    runs = {label: results[0][i] for i, (label, _) in enumerate(layouts)}
    for i, (label, _) in enumerate(layouts):
        assert results[1][i]["losses"] == runs[label]["losses"], f"{label}: tp ranks report different losses"
        assert runs[label]["fork_spread"] > 0, f"{label}: tp ranks share the model-parallel stream"
        assert runs[label]["default_spread"] == 0, f"{label}: tp ranks' default generators differ"
    base = runs["tp=2"]["losses"]
    assert runs["tp=2 again"]["losses"] == base, "tp=2 with dropout is not deterministic"
    for label in ("tp=2", "tp=2 selective recompute", "tp=2 full recompute"):
        assert runs[label]["block_spread"] == 0, f"{label}: replicated activations differ across tp ranks"
    for label in ("tp=2 selective recompute", "tp=2 full recompute"):
        worst = max(abs(a - b) for a, b in zip(runs[label]["losses"], base))
        assert worst < 1e-5, f"{label}: recomputation changed training by {worst} (masks not replayed)"
    # sane: the loss falls, and ends where one process with the same dropout ends (other masks: noise)
    ref = reference_run(_cfg(1, GLOBAL_BATCH))["losses"]
    for label in ("tp=2", "tp=2 sequence parallel"):
        losses = runs[label]["losses"]
        assert losses[-1] < losses[0] - 0.5, f"{label}: did not train"
        tail, ref_tail = statistics.mean(losses[-4:]), statistics.mean(ref[-4:])
        assert math.isclose(tail, ref_tail, abs_tol=0.15), f"{label}: final loss {tail} vs one process {ref_tail}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_rng_tracker_fork_and_recompute(device):
    """One process: the tracker's stream leaves the default generator untouched and is reproducible, and
    a checkpointed region with dropout inside ``fork`` recomputes the forward's masks, so its gradients
    equal those of the same region without recomputation."""
    from torch.utils.checkpoint import checkpoint

    from podscale.parallel.rng import RNGTracker

    tracker = RNGTracker(device)
    torch.manual_seed(0)
    default_draw = torch.rand(8, device=device)
    torch.manual_seed(0)
    tracker.add("model-parallel", 123)
    with tracker.fork():
        forked = torch.rand(8, device=device)
    assert torch.equal(torch.rand(8, device=device), default_draw), "fork moved the default generator"
    tracker.add("model-parallel", 123)
    with tracker.fork():
        assert torch.equal(torch.rand(8, device=device), forked), "the stream is not reproducible"

    def region(x):
        h = torch.nn.functional.dropout(x, 0.5, True)  # replicated: the default generator
        with tracker.fork():
            return torch.nn.functional.dropout(h * 2, 0.5, True)  # split over tp: the tracker's stream

    grads = []
    for recompute in (False, True):
        torch.manual_seed(1)
        tracker.add("model-parallel", 7)
        x = torch.randn(64, 64, device=device, requires_grad=True)
        y = checkpoint(region, x, use_reentrant=False, context_fn=tracker.recompute_context) if recompute \
            else region(x)
        with tracker.fork():  # the stream moves on before backward recomputes
            torch.rand(1000, device=device)
        y.sum().backward()
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1]), "recomputation drew other dropout masks"
