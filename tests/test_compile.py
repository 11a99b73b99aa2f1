"""``train.compile = true`` (issue 16, item 1; the GPT-MoE, issue 12): the GPT's transformer blocks compiled one by one with
``torch.compile`` (inductor, which generates C++ on this CPU) train like the eager model, in one process and
under dp=2, ZeRO-3 (its per-block parameter gathers and frees run around the compiled blocks), tp=2 with
sequence parallelism (the f/g collectives break the block's graph, the pieces between them are compiled) and
a 2-stage pipeline (1F1B).  Each is compared step by step with the plain eager single-process loop: losses
and gradient norms at every step, every gradient after step 1, every parameter after the last step.

Compile time is the cost: the model is tiny (2 blocks of width 32), every layout but tp/sp gives its blocks
the same micro-batch shape, and everything runs in one launch of 2 ranks sharing one fresh inductor cache: rank
0 compiles the block's graph in the one-process run while rank 1 waits, then the layouts load its kernels
(tp/sp compiles its own pieces).
"""
import pytest

import reference as single_process
from conftest import shakespeare
from podscale.config import ConfigError, parse_config
from podscale.runtime.launcher import launch
from reference import reference_run
from tp_workers import compiled_one_process_then_layouts, make_config

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
def compile_env(tmp_path_factory):
    """The launched workers' environment: a fresh inductor cache shared by all of them, compiling in the
    process itself (a pool of compile workers, each importing torch, costs more than it saves for a handful
    of small kernels on 2 cores), and the suite's strict device check off: it records factory calls through
    a TorchFunctionMode that stays on for the whole process, and Dynamo runs frames eagerly under such a mode
    (the graph counts below would catch that)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
        mp.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")
        mp.setenv("PODSCALE_STRICT_DEVICE", "0")
        yield


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


LAYOUTS = [
    ("dp=2", _cfg(2)),
    ("dp=2 ZeRO-3", _cfg(2, zero={"stage": 3, "reduce_bucket_mb": 0.01, "param_persistence_threshold": 1000})),
    ("tp=2 sp", _cfg(2, tp=2, dp=1, sequence_parallel=True)),
    ("pp=2 1f1b", _cfg(2, pp=2, dp=1)),
]
MOE_STEPS = 6
# the GPT-MoE (tests/gpt_moe_workers.py: fp64, both blocks MoE), top-1 beside a shared expert, at ep = 2; and
# at tp = 2 with the experts' width (the shared expert's too) split over tp (parallel.expert_tensor_parallel)
MOE_JOB = dict(mode="shared", dp=1, ep=2, steps=MOE_STEPS, eval=True)
MOE_SPLIT_JOB = dict(MOE_JOB, ep=1, tp=2, etp=True)


@pytest.fixture(scope="module")
def launched(compile_env):
    """One launch of 2 ranks for every compiled run: rank 0 first trains the plain loop of the reference with
    its blocks compiled as train.compile compiles them (one process, micro-batches of MICRO), then both ranks
    train the GPT layouts, then the compiled GPT-MoE jobs (ep = 2; tp = 2 with split experts)."""
    moe = [dict(job, compile="aot_eager") for job in (MOE_JOB, MOE_SPLIT_JOB)]
    return launch(compiled_one_process_then_layouts, (_base(GLOBAL_BATCH, 1), GLOBAL_BATCH // MICRO, "inductor",
                                                      [d for _, d in LAYOUTS], moe), nproc=2)


def test_compiled_one_process_dp_zero3_tp_sp_pp_match_eager(reference, launched):
    layouts, results = LAYOUTS, launched
    one, one_graphs = results[0][:2]
    print("one process", _compare("one process, compiled", one, reference))
    assert one_graphs == 1, f"the two blocks should share one compiled graph, Dynamo traced {one_graphs}"
    runs = {r: results[r][2] for r in results}
    for i, (label, _) in enumerate(layouts):
        print(label, _compare(label, runs[0][i], reference, runs, i, 2))
    graphs = {label: [runs[r][i]["compiled_graphs"] for r in (0, 1)] for i, (label, _) in enumerate(layouts)}
    print("graphs traced per rank", graphs, "; CPU seconds per rank", [round(results[r][3], 1) for r in results])
    # dp=2 traces the block's graph once on each rank (a new torch.compile, so rank 0 does not reuse the
    # one-process run's trace; its kernels come from the cache); ZeRO-3 (parameters gathered into and freed from
    # flat buffers around each block) and the pipeline's chunks run that same graph (no new trace); under tp/sp
    # the collectives split a block into pieces, each again shared by both blocks
    assert graphs["dp=2"] == [1, 1] and graphs["dp=2 ZeRO-3"] == [0, 0] and graphs["pp=2 1f1b"] == [0, 0], graphs
    assert all(1 < g <= 10 for g in graphs["tp=2 sp"]), graphs


@pytest.fixture(scope="module")
def moe_reference():
    """The eager single-process run of the GPT-MoE job that every compiled MoE layout is compared with."""
    import gpt_moe_workers as W
    from podscale.runtime.mesh import Mesh
    return W.run_job(dict(MOE_JOB, ep=1), Mesh.build())


def test_compiled_gpt_moe_under_expert_parallelism_matches_eager_one_process(launched, moe_reference):
    """The GPT-MoE with its blocks compiled (``train.compile``; both blocks MoE, top-1 beside a shared expert)
    at ep = 2 against the eager single-process run: the same routing statistics, losses, gradient norms,
    step-0 gradients, parameters after the steps and evaluation loss (fp64, tests/gpt_moe_workers.py, with the
    tolerances of tests/test_gpt_moe_task.py).  Dynamo traces the MoE block's two pieces around its MoE layer
    (which runs eagerly: ``torch.compiler.disable``) once for training and once for evaluation, shared by both
    blocks.  The backend is ``aot_eager``: Dynamo's capture, the graph breaks at the MoE layer and AOTAutograd's
    forward/backward graphs are what is new here; inductor's code generation for the same attention and layer
    norm operations is what the test above checks on the GPT (and costs a minute of C++ compiles per dtype)."""
    from test_gpt_moe_task import _matches

    ref = moe_reference
    assert ref["compiled_graphs"] == 0
    for rank, res in launched.items():
        ours = res[4][0]
        _matches(ours, ref, f"compiled ep=2 rank {rank}")
        assert ours["eval"] == pytest.approx(ref["eval"], rel=1e-6), rank
        assert any(".moe.shared." in n for n in ours["grads"]), rank
        assert ours["compiled_graphs"] == 4, ours["compiled_graphs"]


def test_compiled_gpt_moe_with_split_experts_matches_eager_one_process(launched, moe_reference):
    """The same compiled GPT-MoE at tp = 2 with expert tensor parallelism (every expert's width and the shared
    expert's split over tp; attention tensor-parallel, whose collectives break the blocks' graphs, so Dynamo
    traces more pieces) against the eager single-process run, with the same tolerances: it trains (the loss
    falls) and matches step by step, gradients gathered from the tp parts."""
    from test_gpt_moe_task import _matches

    ref = moe_reference
    for rank, res in launched.items():
        ours = res[4][1]
        assert ours["losses"][-1] < ours["losses"][0], rank
        _matches(ours, ref, f"compiled tp=2 split experts rank {rank}", ep=1)
        assert ours["eval"] == pytest.approx(ref["eval"], rel=1e-6), rank
        assert any(".moe.shared." in n for n in ours["grads"]), rank
        assert any(".moe.experts." in n for n in ours["grads"]), rank
        assert ours["compiled_graphs"] > 0, rank


def test_compile_config_errors():
    base = _base(MICRO, 2)
    base["train"]["compile"] = True
    cases = [
        ({"model": {"kind": "dlrm"}, "data": {}},
         "train.compile = true: task podscale.tasks.dlrm:DLRMTask has no units"),
        ({"parallel": {**base["parallel"], "recompute": "full"}}, "parallel.recompute = 'none'"),
        ({"model": {**MODEL, "dropout": 0.1}, "parallel": {**base["parallel"], "tp": 2}}, "model.dropout = 0"),
    ]
    for change, expected in cases:
        with pytest.raises(ConfigError) as err:
            parse_config({**base, **change}).check_layout(2)
        msg = str(err.value)
        assert expected in msg and "\n" not in msg, msg
