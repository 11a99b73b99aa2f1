"""``train.compile = true`` (issue 16, item 1): the GPT's transformer blocks compiled one by one with
``torch.compile`` (inductor, which generates C++ on this CPU) train like the eager model, in one process and
under dp=2, ZeRO-3 (its per-block parameter gathers and frees run around the compiled blocks), tp=2 with
sequence parallelism (the f/g collectives break the block's graph, the pieces between them are compiled) and
a 2-stage pipeline (1F1B).  Each is compared step by step with the plain eager single-process loop: losses
and gradient norms at every step, every gradient after step 1, every parameter after the last step.

Compile time is the cost: the model is tiny (2 blocks of width 32), every layout gives its blocks the same
micro-batch shape, and one inductor cache (a fresh folder) serves the whole module, so the single-process
run compiles the block's graph and the launched layouts with the same shapes load its kernels; all four
layouts run in one launch of 2 ranks.
"""
import pytest
import torch

import reference as single_process
from conftest import shakespeare
from podscale.config import ConfigError, parse_config
from podscale.runtime.launcher import launch
from reference import reference_run
from tp_workers import make_config, train_layouts

STEPS = 8
GLOBAL_BATCH = 4
MICRO = 2  # sequences per block forward in every layout (one process and tp, pp: 2 micro-batches of 2)
MODEL = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}
# compiled kernels fuse and reorder float32 sums (layer norm, softmax, GELU), so the compiled run differs from
# the eager one by rounding, which training carries from step to step
LOSS_TOL = 2e-5
GRAD_TOL = 1e-5
PARAM_TOL = 1e-4


def _base(micro: int, nproc: int, **parallel) -> dict:
    # a higher learning rate than the other layout tests' (2e-3): the loss falls by more than 0.5 in 8 steps
    d = make_config(shakespeare(), STEPS, GLOBAL_BATCH, micro, nproc, model=MODEL, **parallel)
    d["train"].update(lr=6e-3, min_lr=6e-4, warmup_steps=1)
    return d


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """One fresh inductor cache for this module (launched workers inherit the environment)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    yield
    mp.undo()


def _cfg(nproc: int, micro: int = MICRO, zero: dict | None = None, **parallel) -> dict:
    d = _base(micro, nproc, **parallel)
    d["train"]["compile"] = True
    if zero:
        d["zero"] = zero
    return d


@pytest.fixture(scope="module")
def reference():
    return reference_run(_base(GLOBAL_BATCH, 1))


def _compare(label, ours, ref, results=None, index=0, nproc=1):
    return single_process.compare(label, ours, ref, results or {0: [ours]}, index, nproc, LOSS_TOL, PARAM_TOL,
                                  GRAD_TOL)


def test_one_process_compiled_blocks_match_eager(reference, inductor_cache):
    # the plain loop of the reference, its blocks compiled as train.compile compiles them: one graph for both
    from torch._dynamo.utils import counters
    counters.clear()
    ours = reference_run(_base(GLOBAL_BATCH, 1), "inductor", micro_batches=GLOBAL_BATCH // MICRO)
    print(_compare("one process, compiled", ours, reference))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_compiled_dp_zero3_tp_sp_pp_match_eager(reference, inductor_cache):
    layouts = [
        ("dp=2", _cfg(2)),
        ("dp=2 ZeRO-3", _cfg(2, zero={"stage": 3, "reduce_bucket_mb": 0.01,
                                               "param_persistence_threshold": 1000})),
        ("tp=2 sp", _cfg(2, tp=2, dp=1, sequence_parallel=True)),
        ("pp=2 1f1b", _cfg(2, pp=2, dp=1)),
    ]
    results = launch(train_layouts, ([d for _, d in layouts],), nproc=2)
    for i, (label, _) in enumerate(layouts):
        print(label, _compare(label, results[0][i], reference, results, i, 2))


def test_compile_config_errors():
    base = _base(MICRO, 2)
    base["train"]["compile"] = True
    cases = [
        ({"model": {"kind": "gpt-moe", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32}},
         "train.compile = true: task podscale.tasks.gpt_moe:GPTMoETask has no units"),
        ({"parallel": {**base["parallel"], "recompute": "full"}}, "parallel.recompute = 'none'"),
        ({"model": {**MODEL, "dropout": 0.1}, "parallel": {**base["parallel"], "tp": 2}}, "model.dropout = 0"),
    ]
    for change, expected in cases:
        with pytest.raises(ConfigError) as err:
            parse_config({**base, **change}).check_layout(2)
        msg = str(err.value)
        assert expected in msg and "\n" not in msg, msg
