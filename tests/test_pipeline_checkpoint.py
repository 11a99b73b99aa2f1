"""A checkpoint written at one (pp, dp, tp) layout loads at another and training continues with the same
losses; it exports to one plain file with the single-process names and shapes."""
import math

import torch

from conftest import shakespeare
from podscale.models.gpt import GPT, GPTConfig
from podscale.runtime.launcher import launch
from podscale.train import checkpoint
from tp_workers import checkpoint_roundtrip, make_config

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 32, "vocab_size": 258}
# different layouts sum in different orders: only rounding differs (measured: within 2e-6)
TOL = 2e-5
ZERO3 = {"stage": 3, "reduce_bucket_mb": 0.01, "param_persistence_threshold": 500}


def test_checkpoint_reshards_across_layouts(tmp_path):
    path = shakespeare()

    def cfg(**parallel):
        return make_config(path, 6, 8, 2, 4, model=MODEL, **parallel)

    # written at (pp, dp, tp) = (2, 1, 2); the vocabulary of 258 is padded to 260 at tp=4
    layouts = [("(2,1,2) 1f1b", cfg(pp=2, tp=2)),
               ("(1,4,1) replicated", cfg()),
               ("(1,1,4) tp=4 sequence parallel", cfg(tp=4, sequence_parallel=True)),
               ("(4,1,1) gpipe", cfg(pp=4, schedule="gpipe")),
               ("(1,2,2) ZeRO-1", dict(cfg(tp=2), zero={"stage": 1, "reduce_bucket_mb": 0.01})),
               ("(2,2,1) ZeRO-1", dict(cfg(pp=2), zero={"stage": 1, "reduce_bucket_mb": 0.01})),
               ("(2,2,1) ZeRO-2", dict(cfg(pp=2), zero={"stage": 2, "reduce_bucket_mb": 0.01})),
               ("(1,2,2) sp ZeRO-3", dict(cfg(tp=2, sequence_parallel=True), zero=ZERO3))]
    results = launch(checkpoint_roundtrip, ([d for _, d in layouts], str(tmp_path), 3, 2), nproc=4)
    written = results[0][0]["losses"]
    for i, (label, _) in enumerate(layouts[1:], start=1):
        for r in range(4):
            got = results[r][i]["losses"]
            for a, b in zip(got, written):
                assert math.isclose(a, b, rel_tol=TOL, abs_tol=TOL), f"{label}: {got} vs {written}"
    print({label: max(abs(a - b) for a, b in zip(results[0][i]["losses"], written))
           for i, (label, _) in enumerate(layouts)})

    # one plain file with the single-process names and shapes, loadable into a plain GPT
    out = checkpoint.export(checkpoint.latest(tmp_path), tmp_path / "model.pt")
    state = torch.load(out, weights_only=True)["model"]
    model = GPT(GPTConfig(**MODEL))
    model.load_state_dict(state)
    assert state["wte.weight"].shape == (258, 32)
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])


def test_checkpoint_from_pipeline_zero3(tmp_path):
    """Written by (pp, dp) = (2, 2) interleaved with ZeRO-3 (blocks kept gathered for the step), loaded by
    sequence-parallel ZeRO-2 and by the replicated (2, 1, 2) layout."""
    path = shakespeare()

    def cfg(**parallel):
        return make_config(path, 4, 8, 2, 4, model=MODEL, **parallel)

    layouts = [("(2,2,1) interleaved ZeRO-3", dict(cfg(pp=2, schedule="interleaved", virtual_stages=2),
                                                   zero={**ZERO3, "reshard_after_forward": False})),
               ("(1,2,2) sp ZeRO-2", dict(cfg(tp=2, sequence_parallel=True),
                                          zero={"stage": 2, "reduce_bucket_mb": 0.01})),
               ("(2,1,2) 1f1b", cfg(pp=2, tp=2))]
    results = launch(checkpoint_roundtrip, ([d for _, d in layouts], str(tmp_path), 2, 2), nproc=4)
    written = results[0][0]["losses"]
    for i, (label, _) in enumerate(layouts[1:], start=1):
        for r in range(4):
            got = results[r][i]["losses"]
            for a, b in zip(got, written):
                assert math.isclose(a, b, rel_tol=TOL, abs_tol=TOL), f"{label}: {got} vs {written}"
