"""`podscale train` end to end: resume, worker kill with restart, crash during save, export, report.

The uninterrupted run is a ``python -m podscale train`` subprocess, as a user types it; the other runs and
commands call the same command's entry point (``podscale.cli.main``) in this process: the workers are
launched, killed, restarted and resumed the same way and print to this process's standard streams (which
``capfd`` reads), and each run saves an interpreter start and the fork server's imports.
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import shakespeare

STEPS = 20
CONFIG = """
[run]
name = "{name}"
out_dir = "{out}"
steps = {steps}
seed = 3
log_every = 5
eval_every = 10
eval_batches = 2
sample_tokens = 0

[model]
n_layer = 2
n_head = 2
n_embd = 64
block_size = 64

[data]
path = "{data}"

[parallel]
nproc = 2

[train]
global_batch = 8
micro_batch = 2
lr = 3e-3
warmup_steps = 4
decay_steps = 20
precision = "fp32"

[checkpoint]
every = 5
keep = 2
"""


def _train(tmp: Path, name: str, steps: int = STEPS, *extra: str, fault: str = "") -> subprocess.CompletedProcess:
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG.format(name=name, out=tmp / "runs", steps=steps, data=shakespeare()))
    env = dict(os.environ, PODSCALE_FAULT=fault)
    return subprocess.run([sys.executable, "-m", "podscale", "train", str(cfg), *extra], env=env,
                          capture_output=True, text=True, timeout=300)


def _train_here(capfd, monkeypatch, tmp: Path, name: str, steps: int = STEPS, *extra: str,
                fault: str = "") -> SimpleNamespace:
    """``podscale train`` through ``podscale.cli.main`` in this process: its exit code and the output of the
    command and its workers."""
    from podscale.cli import main
    cfg = tmp / f"{name}.toml"
    cfg.write_text(CONFIG.format(name=name, out=tmp / "runs", steps=steps, data=shakespeare()))
    monkeypatch.setenv("PODSCALE_FAULT", fault)
    capfd.readouterr()
    code = main(["train", str(cfg), *extra])
    out = capfd.readouterr()
    return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)


def _losses(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    full = _train(tmp, "full", STEPS, "--set", "run.tensorboard=true")
    assert full.returncode == 0, full.stderr[-3000:]
    return tmp


def test_uninterrupted_run_writes_metrics_checkpoints_and_plots(runs, capsys):
    run = runs / "runs" / "full"
    assert (run / ".podscale-run").is_file()  # created by podscale: --fresh may delete it
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5
    for key in ("tokens_per_s", "mfu", "comm_share", "tflops_per_rank", "lr", "grad_norm"):
        assert all(r[key] > 0 for r in rows), key
    assert "dp" in rows[0]["comm"] and rows[0]["comm"]["dp"]["bytes"] > 0
    mem = [r for r in rows if "peak_mem_bytes" in r]
    assert mem and all(len(r["peak_mem_bytes"]) == 2 and min(r["peak_mem_bytes"]) > 50e6 for r in mem)
    assert "val_loss" in rows[9] and "val_loss" in rows[19]
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_00000015", "step_00000020"]  # keep = 2

    from podscale.cli import main  # (test_custom_task.py runs `python -m podscale report` as a subprocess)
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    for png in ("loss.png", "throughput.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert len(acc.Scalars("comm/dp/bytes")) == STEPS and len(acc.Scalars("peak_mem_bytes/rank1")) == len(mem)


def test_resume_reproduces_the_uninterrupted_curve(runs, capfd, monkeypatch):
    first = _train_here(capfd, monkeypatch, runs, "resumed", 10)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _train_here(capfd, monkeypatch, runs, "resumed", STEPS)
    assert again.returncode == 2 and "--resume" in again.stderr  # refuses to overwrite silently
    second = _train_here(capfd, monkeypatch, runs, "resumed", STEPS, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step_00000010" in second.stdout
    full, resumed = _losses(runs / "runs" / "full"), _losses(runs / "runs" / "resumed")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == pytest.approx(full[step], abs=1e-6), step


def test_killed_worker_restarts_and_finishes_with_the_same_loss(runs, capfd, monkeypatch):
    out = _train_here(capfd, monkeypatch, runs, "killed", STEPS, "--max-restarts", "1", fault="kill@12:1")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from step_00000010" in out.stdout  # the restarted group picked up the last checkpoint
    full, killed = _losses(runs / "runs" / "killed"), _losses(runs / "runs" / "full")
    assert killed[STEPS] == pytest.approx(full[STEPS], abs=1e-6)


def test_crash_during_save_keeps_the_previous_checkpoint(runs, capfd, monkeypatch):
    from podscale.train import checkpoint
    out = _train_here(capfd, monkeypatch, runs, "crashed", STEPS, fault="crash-in-save@10")
    assert out.returncode == 1
    root = runs / "runs" / "crashed" / "checkpoints"
    assert (root / ".step_00000010.partial").is_dir()  # the interrupted save, never committed
    assert checkpoint.latest(root).name == "step_00000005"
    meta = checkpoint.read_meta(checkpoint.latest(root))
    assert meta["step"] == 5 and meta["loader"]["consumed"] == 5 * 8
    resumed = _train_here(capfd, monkeypatch, runs, "crashed", STEPS, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step_00000005" in resumed.stdout
    assert _losses(runs / "runs" / "crashed")[STEPS] == pytest.approx(_losses(runs / "runs" / "full")[STEPS], abs=1e-6)
    assert not (root / ".step_00000010.partial").exists()  # replaced by the completed save


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_consolidates_the_model(runs, tmp_path, fmt, capsys):
    from podscale.cli import main
    from podscale.models.gpt import GPT, GPTConfig
    from podscale.train.checkpoint import read_safetensors
    run = runs / "runs" / "full"
    name = "model.pt" if fmt == "torch" else "model.safetensors"
    assert main(["export", str(run), str(tmp_path / name)]) == 0, capsys.readouterr().err
    if fmt == "torch":
        blob = torch.load(tmp_path / name, weights_only=True)
        state, model_config, step = blob["model"], blob["model_config"], blob["step"]
    else:
        state, model_config, step = read_safetensors(tmp_path / name)
    assert step == STEPS
    model = GPT(GPTConfig(**model_config))
    model.load_state_dict(state)
    # the exported weights are the trained ones: validation loss matches the run's last measurement
    from podscale.train.data import eval_batches, load_tokens, split_tokens
    _, val = split_tokens(load_tokens(shakespeare()), 0.1)
    with torch.no_grad():
        losses = [model(x, y)[1].item() for x, y in eval_batches(val, 64, 8, 2, 0, 1)]   # global_batch 8
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses) / len(losses) == pytest.approx(rows[-1]["val_loss"], abs=1e-4)
