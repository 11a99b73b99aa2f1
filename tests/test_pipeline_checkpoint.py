"""A checkpoint written at one (pp, dp, tp) layout loads at another, and in one process, and training
continues with the same losses; each rank writes only its own shards (nothing is gathered to save); it
exports to one plain file with the single-process names and shapes."""
import math
import re

import torch
from podscale.train.safe_reader import SafeFileSystemReader

from conftest import shakespeare
from podscale.models.gpt import GPT, GPTConfig
from podscale.runtime.launcher import launch
from podscale.train import checkpoint
from tp_workers import checkpoint_roundtrip, make_config, resume_one_process

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 32, "block_size": 32, "vocab_size": 258}
# different layouts sum in different orders: only rounding differs (measured: within 2e-6)
TOL = 2e-5
ZERO3 = {"stage": 3, "reduce_bucket_mb": 0.01, "param_persistence_threshold": 500}
# the parameters a tp rank holds a shard of (and their Adam states)
TP_SHARDED = re.compile(r"attn\.qkv\.|mlp\.fc\.|attn\.proj\.weight|mlp\.proj\.weight|wte\.weight|lm_head\.weight")


def _cfg(path, nproc=4, model=MODEL, zero=0, **parallel):
    d = make_config(path, 6, 8, 2, nproc, model=model, **parallel)
    return dict(d, zero={"stage": zero, "reduce_bucket_mb": 0.01}) if zero else d


def _check_resumed(layouts, results, nproc=4):
    """Every layout's losses after loading equal the writer's (which trained on without a reload)."""
    written = results[0][0]["losses"]
    for i, (label, _) in enumerate(layouts[1:], start=1):
        for r in range(nproc):
            got = results[r][i]["losses"]
            for a, b in zip(got, written):
                assert math.isclose(a, b, rel_tol=TOL, abs_tol=TOL), f"{label}: {got} vs {written}"
    return written


def _check_written_per_rank(ckpt, results, tp: int) -> None:
    """Saving moved no bytes between ranks, and every tp-sharded tensor is stored as pieces of at most one
    tp shard each, written by at least tp different ranks (DCP's file per rank)."""
    for r, res in results.items():
        assert res[0]["save_comm_bytes"] == 0, f"rank {r} sent {res[0]['save_comm_bytes']} bytes to save"
    md = SafeFileSystemReader(str(ckpt)).read_metadata()
    checked = 0
    for key, m in md.state_dict_metadata.items():
        if not TP_SHARDED.search(key) or len(getattr(m, "size", ())) == 0:
            continue
        whole = math.prod(m.size)
        biggest = max(math.prod(c.sizes) for c in m.chunks)
        files = {info.relative_path for i, info in md.storage_data.items() if i.fqn == key}
        assert sum(math.prod(c.sizes) for c in m.chunks) == whole, key
        assert biggest <= whole / tp + math.prod(m.size[1:]), f"{key}: a chunk of {biggest} of {whole} elements"
        assert len(files) >= tp, f"{key} written by {files}"
        checked += 1
    assert checked >= 2 * 3 * 6, checked  # model, exp_avg, exp_avg_sq of >= 6 sharded tensors


def test_checkpoint_reshards_across_layouts(tmp_path):
    path = shakespeare()
    # written at (pp, dp, tp) = (2, 1, 2); the vocabulary of 258 is padded to 260 at tp=4
    layouts = [("(2,1,2) 1f1b", _cfg(path, pp=2, tp=2)),
               ("(1,4,1) replicated", _cfg(path)),
               ("(1,1,4) tp=4 sequence parallel", _cfg(path, tp=4, sequence_parallel=True)),
               ("(4,1,1) gpipe", _cfg(path, pp=4, schedule="gpipe")),
               ("(1,2,2) ZeRO-1", _cfg(path, tp=2, zero=1)),
               ("(2,2,1) ZeRO-1", _cfg(path, pp=2, zero=1)),
               ("(2,2,1) ZeRO-2", _cfg(path, pp=2, zero=2)),
               ("(1,2,2) sp ZeRO-3", dict(_cfg(path, tp=2, sequence_parallel=True), zero=ZERO3))]
    results = launch(checkpoint_roundtrip, ([d for _, d in layouts], str(tmp_path), 3, 2), nproc=4)
    written = _check_resumed(layouts, results)
    ckpt = checkpoint.latest(tmp_path)
    _check_written_per_rank(ckpt, results, tp=2)
    one = resume_one_process(_cfg(path, nproc=1), str(tmp_path), 2)
    assert all(math.isclose(a, b, rel_tol=TOL, abs_tol=TOL) for a, b in zip(one, written)), (one, written)

    # one plain file with the single-process names and shapes, loadable into a plain GPT
    out = checkpoint.export(ckpt, tmp_path / "model.pt")
    state = torch.load(out, weights_only=True)["model"]
    model = GPT(GPTConfig(**MODEL))
    model.load_state_dict(state)
    assert state["wte.weight"].shape == (258, 32)
    assert torch.equal(state["wte.weight"], state["lm_head.weight"])


def test_checkpoint_from_pipeline_zero3(tmp_path):
    """Written by (pp, dp) = (2, 2) interleaved with ZeRO-3 (blocks kept gathered for the step), loaded by
    sequence-parallel ZeRO-2 and by the replicated (2, 1, 2) layout."""
    path = shakespeare()
    layouts = [("(2,2,1) interleaved ZeRO-3", dict(_cfg(path, pp=2, schedule="interleaved", virtual_stages=2),
                                                   zero={**ZERO3, "reshard_after_forward": False})),
               ("(1,2,2) sp ZeRO-2", _cfg(path, tp=2, sequence_parallel=True, zero=2)),
               ("(2,1,2) 1f1b", _cfg(path, pp=2, tp=2)),
               ("(1,2,2) sp ZeRO-3, optimizer and parameters on NVMe",
                dict(_cfg(path, tp=2, sequence_parallel=True), zero=_nvme(tmp_path)))]
    results = launch(checkpoint_roundtrip, ([d for _, d in layouts], str(tmp_path), 2, 2), nproc=4)
    _check_resumed(layouts, results)


def _nvme(tmp_path) -> dict:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    return {**ZERO3, "offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(swap),
            "nvme_block_mb": 0.05}


def test_checkpoint_from_tensor_parallel_nvme(tmp_path):
    """Written by (1, 2, 2) ZeRO-3 with the optimizer state and parameters on NVMe (each rank's pieces read
    from its swap file), loaded by the replicated (2, 1, 2) pipeline and by (2, 2, 1) ZeRO-3 on NVMe."""
    path = shakespeare()
    layouts = [("(1,2,2) ZeRO-3 on NVMe", dict(_cfg(path, tp=2), zero=_nvme(tmp_path))),
               ("(2,1,2) 1f1b", _cfg(path, pp=2, tp=2)),
               ("(2,2,1) 1f1b ZeRO-3 on NVMe", dict(_cfg(path, pp=2), zero=_nvme(tmp_path)))]
    results = launch(checkpoint_roundtrip, ([d for _, d in layouts], str(tmp_path), 2, 2), nproc=4)
    _check_resumed(layouts, results)


def test_zero1_tensor_parallel_checkpoint_writes_shards_and_reshards(tmp_path):
    path = shakespeare()
    model = dict(MODEL, vocab_size=257)  # padded to 258 at tp=2: the padded row must not reach the file
    layouts = [("(1,2,2) ZeRO-1 writes", _cfg(path, model=model, tp=2, zero=1)),
               ("(1,4,1) replicated", _cfg(path, model=model)),
               ("(2,2,1) 1f1b", _cfg(path, model=model, pp=2)),
               ("(2,1,2) ZeRO-1", _cfg(path, model=model, pp=2, tp=2, zero=1)),
               ("(1,2,2) ZeRO-3", _cfg(path, model=model, tp=2, zero=3))]
    results = launch(checkpoint_roundtrip, ([d for _, d in layouts], str(tmp_path), 3, 2), nproc=4)
    written = _check_resumed(layouts, results)
    ckpt = checkpoint.latest(tmp_path)
    _check_written_per_rank(ckpt, results, tp=2)
    one = resume_one_process(_cfg(path, nproc=1, model=model), str(tmp_path), 2)
    assert all(math.isclose(a, b, rel_tol=TOL, abs_tol=TOL) for a, b in zip(one, written)), (one, written)
    state = torch.load(checkpoint.export(ckpt, tmp_path / "model.pt"), weights_only=True)["model"]
    GPT(GPTConfig(**model)).load_state_dict(state)
    assert state["wte.weight"].shape == (257, 32)
