"""Validation and sampling on model-parallel layouts match one process: the forward-only pipeline (pp = 2,
1F1B stages and interleaved chunks) and vocab-parallel logits (tp = 2, with and without sequence
parallelism) give the single-process validation loss and, with the same seed, the same sampled bytes on
every rank."""
import math

import torch

from conftest import shakespeare
from podscale.models.gpt import GPT
from podscale.train.data import eval_batches, load_tokens, split_tokens
from podscale.tasks.gpt import gpt_config
from podscale.config import parse_config
from podscale.runtime.launcher import launch
from test_tensor_parallel import reference_run
from tp_workers import eval_and_sample, make_config

STEPS, GLOBAL_BATCH, EVAL_BATCH, N_EVAL, N_SAMPLE = 8, 8, 4, 3, 48
# 4 blocks: pp = 2 with 2 virtual stages has one block per chunk; block_size 32 (sequence parallel: 16 per rank)
MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 32}


def _cfg(nproc, micro, **parallel):
    return make_config(shakespeare(), STEPS, GLOBAL_BATCH, micro, nproc, model=MODEL, **parallel)


def _reference(d: dict) -> dict:
    """The single-process model after the same training: validation loss and sampled bytes."""
    ref = reference_run(d)
    cfg = parse_config(d)
    model = GPT(gpt_config(cfg))
    model.load_state_dict(ref["params"], strict=False)
    model.eval()
    _, val = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
    with torch.no_grad():
        losses = [float(model(x, y)[1]) for x, y in eval_batches(val, cfg.model.block_size, EVAL_BATCH, N_EVAL, 0, 1)]
    g = torch.Generator().manual_seed(cfg.run.seed)
    sample = model.generate(torch.tensor([[10]]), N_SAMPLE, temperature=0.8, top_k=50, generator=g)
    return {"val_loss": sum(losses) / len(losses), "sample": sample[0].tolist()}


def test_eval_and_sample_pp2_tp2_match_one_process():
    ref = _reference(_cfg(1, GLOBAL_BATCH))
    layouts = [("pp=2 1f1b", _cfg(2, 2, pp=2)),
               ("pp=2 interleaved v=2", _cfg(2, 2, pp=2, schedule="interleaved", virtual_stages=2)),
               ("tp=2", _cfg(2, 4, tp=2)),
               ("tp=2 sequence parallel", _cfg(2, 4, tp=2, sequence_parallel=True))]
    results = launch(eval_and_sample, ([d for _, d in layouts], EVAL_BATCH, N_EVAL, N_SAMPLE), nproc=2)
    for i, (label, _) in enumerate(layouts):
        ours = results[0][i]
        assert results[1][i] == ours, f"{label}: ranks disagree"
        # the layouts train to the single-process parameters within ~1e-6; the loss follows
        assert math.isclose(ours["val_loss"], ref["val_loss"], rel_tol=1e-5), \
            f"{label}: val loss {ours['val_loss']} vs {ref['val_loss']}"
        assert ours["sample"] == ref["sample"], f"{label}: sampled {ours['sample']} vs {ref['sample']}"
    # the model learned something: the samples are not the untrained model's
    assert ref["val_loss"] < math.log(256) - 0.5


def test_the_validation_set_is_the_same_windows_at_every_data_parallel_layout():
    # run.eval_batches global batches of windows, cut into each data rank's micro-batches: the union over the
    # ranks, in rank order, is one process's set whatever dp and micro_batch are
    from podscale.tasks.gpt import GPTTask

    def windows(nproc, micro):
        cfg = parse_config(_cfg(nproc, micro))
        task, n = GPTTask(cfg), cfg.run.eval_batches
        per_rank = [task.eval_data(r, nproc) for r in range(nproc)]
        assert all(x.shape[0] == micro for batches in per_rank for x, _ in batches)
        shares = len(per_rank[0]) // n            # eval batch b is every rank's b-th share, in rank order
        return torch.cat([x for b in range(n) for batches in per_rank for x, _ in batches[b * shares:(b + 1) * shares]])

    one = windows(1, GLOBAL_BATCH)
    assert one.shape[0] == parse_config(_cfg(1, GLOBAL_BATCH)).run.eval_batches * GLOBAL_BATCH
    for nproc, micro in ((1, 2), (2, 4), (2, 1), (4, 2)):
        assert torch.equal(windows(nproc, micro), one), (nproc, micro)
