"""End to end through `podscale train`: a checkpoint written at (tp=2, dp=2, ZeRO-2) resumes at
(dp=4, ZeRO-3) and the loss curve continues exactly as the uninterrupted run; `podscale export` turns the
tp-sharded checkpoint and the one written at dp=4 into the same plain single-process file.

The commands run through their entry point (``podscale.cli.main``) in this process, which launches the
workers as ``python -m podscale train`` does and saves an interpreter start per command (test_train_cli.py
runs the command line itself as a subprocess); ``capfd`` reads what the workers print."""
import json

import pytest
import torch

from conftest import shakespeare
from podscale.cli import main
from podscale.models.gpt import GPT, GPTConfig

CONFIG = """
[run]
name = "{name}"
out_dir = "{out}"
steps = {steps}
eval_every = 0
sample_tokens = 0
[model]
n_layer = 2
n_head = 4
n_embd = 64
block_size = 64
[data]
path = "{data}"
[parallel]
nproc = 4
tp = 2
[train]
global_batch = 8
micro_batch = 2
decay_steps = 6
[zero]
stage = 2
[checkpoint]
every = 3
"""


def _train(capfd, tmp, name, steps, *extra):
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG.format(name=name, out=tmp / "runs", steps=steps, data=shakespeare()))
    capfd.readouterr()
    code = main(["train", str(cfg), *extra])
    out = capfd.readouterr()
    assert code == 0, out.err[-3000:]
    return out.out


def _losses(tmp, name):
    return [json.loads(line)["loss"] for line in (tmp / "runs" / name / "metrics.jsonl").read_text().splitlines()]


def test_resume_on_another_layout_and_zero_stage(tmp_path, capfd):
    _train(capfd, tmp_path, "full", 6)
    _train(capfd, tmp_path, "moved", 3)
    out = _train(capfd, tmp_path, "moved", 6, "--resume", "--set", "parallel.tp=1", "--set", "zero.stage=3")
    assert "mesh pp=1 dp=4 ep=1 tp=1" in out and "resumed from step_00000003" in out
    full, moved = _losses(tmp_path, "full"), _losses(tmp_path, "moved")
    assert len(full) == len(moved) == 6
    assert moved == pytest.approx(full, abs=1e-5)
    assert full[-1] < full[0]

    # both runs' step-6 checkpoints (tp=2 ZeRO-2 shards; dp=4 ZeRO-3) export to the same single-process model
    exported = {}
    for name in ("full", "moved"):
        assert main(["export", str(tmp_path / "runs" / name), str(tmp_path / f"{name}.pt")]) == 0, \
            capfd.readouterr().err[-3000:]
        exported[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)
    assert exported["full"]["step"] == exported["moved"]["step"] == 6
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=64, block_size=64))
    model.load_state_dict(exported["full"]["model"])  # single-process names and shapes, no padded rows
    for k, v in exported["full"]["model"].items():
        assert torch.allclose(v, exported["moved"]["model"][k], atol=1e-5), k
