"""A task that is not a GPT trains through the trunk: examples/teacher_mlp.py (an MLP learning a hidden
teacher on generated data) runs under `podscale train` at dp=2 with ZeRO-3, checkpoints, resumes with the
uninterrupted run's loss curve, and plots with `podscale report`, while nothing in podscale/train or
podscale/parallel names it.  Its config errors are one line, before any worker starts."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from podscale.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
CONFIG = EXAMPLES / "teacher-mlp.toml"
STEPS = 12


def _args(out: Path, name: str, steps: int) -> list[str]:
    return ["--steps", str(steps), "--name", name, "--out-dir", str(out), "--set", "parallel.nproc=2",
            "--set", "zero.stage=3", "--set", "run.eval_every=4", "--set", "run.log_every=4",
            "--set", "checkpoint.every=4", "--set", "train.warmup_steps=2", "--set", "train.lr=1e-2",
            "--set", f"train.decay_steps={STEPS}"]


def _train(out: Path, name: str, steps: int, *extra: str) -> subprocess.CompletedProcess:
    # the workers import the task by its module name: they inherit PYTHONPATH
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    args = _args(out, name, steps)
    return subprocess.run([sys.executable, "-m", "podscale", "train", str(CONFIG), *args, *extra], env=env,
                          capture_output=True, text=True, timeout=600)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("custom")
    full = _train(out, "full", STEPS)
    assert full.returncode == 0, full.stderr[-3000:]
    assert "mesh pp=1 dp=2" in full.stdout
    return out


def test_trains_with_its_own_metrics_and_throughput_unit(runs):
    rows = _rows(runs / "full")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.2
    assert all(r["throughput_unit"] == "samples" and r["samples_per_s"] == r["throughput"] > 0 for r in rows)
    assert all("tokens_per_s" not in r and r["mfu"] > 0 for r in rows)
    evals = [r for r in rows if "val_accuracy" in r]
    assert [r["step"] for r in evals] == [4, 8, 12]
    assert all(0.0 <= r["val_accuracy"] <= 1.0 and r["val_loss"] > 0 for r in evals)
    assert evals[-1]["val_accuracy"] > 1.5 / 8  # better than chance over 8 classes
    meta = json.loads((runs / "full" / "checkpoints" / f"step_{STEPS:08d}" / "meta.json").read_text())
    assert meta["task"] == "teacher_mlp:TeacherMLPTask" and meta["model_config"]["n_classes"] == 8
    assert meta["loader"] == {"consumed": STEPS * 64, "seed": 1337}


def _train_here(capfd, out: Path, name: str, steps: int, *extra: str) -> SimpleNamespace:
    """The same command through ``podscale.cli.main`` in this process (the module fixture ran it as a command
    line of its own): its exit code and the output of the command and its workers.  The caller puts the
    examples folder on this process's path, which the forked workers take over."""
    capfd.readouterr()
    code = main(["train", str(CONFIG), *_args(out, name, steps), *extra])
    got = capfd.readouterr()
    return SimpleNamespace(returncode=code, stdout=got.out, stderr=got.err)


def test_resume_reproduces_the_uninterrupted_curve(runs, capfd, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(EXAMPLES), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("PODSCALE_LOCAL_WORLD", "2")
    first = _train_here(capfd, runs, "resumed", STEPS // 2)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train_here(capfd, runs, "resumed", STEPS, "--resume")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from step_{STEPS // 2:08d}" in second.stdout
    full, resumed = _rows(runs / "full"), _rows(runs / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for a, b in zip(full, resumed):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), a["step"]
    assert resumed[-1]["val_accuracy"] == pytest.approx(full[-1]["val_accuracy"], abs=1e-6)


def test_report_plots_loss_throughput_and_accuracy(runs, capsys):
    run = runs / "full"
    code = main(["report", str(run)])  # (in this process: the fixture ran `python -m podscale` as a command)
    assert code == 0, capsys.readouterr().err
    for png in ("loss.png", "throughput.png", "metrics.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_the_trunk_does_not_know_the_task():
    """No file of the engine, loop, checkpoints, progress, report or the parallel strategies names the task or
    imports a model family."""
    for folder in ("podscale/train", "podscale/parallel"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            assert "teacher" not in text.lower(), path
    for name in ("engine", "loop", "checkpoint", "progress", "report"):
        tree = ast.parse((ROOT / "podscale" / "train" / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
                   {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in imported if m and (m.startswith("podscale.models") or m == "podscale.tasks.gpt")}, name


MODEL = '[model]\nkind = "custom"\ntask = "teacher_mlp:TeacherMLPTask"\n'


@pytest.mark.parametrize("model, extra, words", [
    (MODEL + "width = 3\n", "", ["unknown key 'model.width'", "hidden", "n_layer"]),
    (MODEL + "hidden = 0\n", "", ["model.hidden", "greater than or equal to 1"]),
    ('[model]\nkind = "custom"\ntask = "no_such_module:Task"\n', "", ["model.task", "no_such_module", "PYTHONPATH"]),
    ('[model]\nkind = "custom"\ntask = "teacher_mlp:MLP"\n', "", ["model.task", "not a podscale.tasks.Task"]),
    ('[model]\nkind = "custom"\ntask = "teacher_mlp"\n', "", ["model.task"]),
    (MODEL, "[parallel]\nnproc = 2\ntp = 2\n", ["parallel.tp=2", "does not support tensor parallelism",
                                               "parallel.tp = 1"]),
    (MODEL, "[parallel]\nnproc = 2\npp = 2\n", ["parallel.pp=2", "does not support pipeline", "parallel.pp = 1"]),
    ('[model]\nkind = "bert"\n', "", ["model.kind", "unknown model kind 'bert'", "known kinds are gpt", "custom (", "task ="]),
])
def test_task_config_errors_are_one_line(tmp_path, capsys, monkeypatch, model, extra, words):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[run]\nname = "bad"\nout_dir = "{tmp_path / "runs"}"\n' + model + extra)
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("podscale: error: "), err
    for w in words:
        assert w in err, (w, err)
    assert not (tmp_path / "runs").exists()
