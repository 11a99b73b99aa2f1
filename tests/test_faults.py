"""Faults (issue 11, items 8 and 9): a stalled rank, a killed rank on each layout, damaged checkpoints.

Every run is ``podscale train`` (its ``main``, in this process, so torch is imported once) on a tiny GPT for
a few steps.  A restarted run must end on the final loss of the same layout's uninterrupted run, bit for
bit up to float printing (the resumed state, data position and RNG streams are the saved ones).
"""
import json
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from conftest import shakespeare
from podscale.cli import main
from podscale.runtime.watchdog import diagnose

STEPS = 6
CONFIG = """
[run]
name = "{name}"
out_dir = "{out}"
steps = {steps}
seed = 5
log_every = 3
sample_tokens = 0

[model]
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32

[data]
path = "{data}"

[train]
global_batch = 4
micro_batch = 1
lr = 3e-3
warmup_steps = 2
decay_steps = 6
precision = "fp32"

[checkpoint]
every = 2
keep = 3
"""

# layout -> (processes, config overrides); the fault matrix of issue 11
LAYOUTS = {
    "dp2": (2, []),
    "zero3-nvme": (2, ["zero.stage=3", "zero.offload_optimizer='nvme'", "zero.offload_param='nvme'",
                       "zero.nvme_path='{nvme}'"]),
    "pp2-1f1b": (2, ["parallel.pp=2", "parallel.schedule='1f1b'"]),
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "pp2-dp2-tp2-zero1": (8, ["parallel.pp=2", "parallel.tp=2", "zero.stage=1"]),
}
# pp x dp x tp each of size 2 needs 8 ranks: with workers forked from the preloaded server (no import per
# worker) the 8-rank case costs about 20 s here.
MATRIX = list(LAYOUTS)


class Runs:
    """Runs of ``podscale train`` under one folder; the uninterrupted run of each layout is made once."""

    def __init__(self, root: Path):
        self.root = root
        self._full: dict[str, dict[int, float]] = {}

    def train(self, capfd, monkeypatch, layout: str, name: str, *extra: str, fault: str = "",
              steps: int = STEPS) -> tuple[int, str]:
        nproc, sets = LAYOUTS[layout]
        cfg = self.root / f"{name}.toml"
        cfg.write_text(CONFIG.format(name=name, out=self.root / "runs", steps=steps, data=shakespeare()))
        nvme = self.root / "nvme" / name
        nvme.mkdir(parents=True, exist_ok=True)
        argv = ["train", str(cfg), "--set", f"parallel.nproc={nproc}"]
        for item in sets:
            argv += ["--set", item.format(nvme=nvme)]
        monkeypatch.setenv("PODSCALE_FAULT", fault)
        monkeypatch.setenv("PODSCALE_LOCAL_WORLD", str(nproc))
        capfd.readouterr()
        code = main(argv + list(extra))
        out = capfd.readouterr()
        return code, out.out + out.err

    def losses(self, name: str) -> dict[int, float]:
        rows = [json.loads(line) for line in (self.root / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows}

    def full(self, capfd, monkeypatch, layout: str) -> dict[int, float]:
        if layout not in self._full:
            code, out = self.train(capfd, monkeypatch, layout, f"full-{layout}")
            assert code == 0, out[-3000:]
            self._full[layout] = self.losses(f"full-{layout}")
        return self._full[layout]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("faults"))


# -- the hang watchdog ----------------------------------------------------------------------------------
def _rec(step, entered, blocked=None, age=0.1):
    return {"step": step, "entered": entered, "blocked": blocked, "age": age}


def test_diagnosis_follows_the_chain_of_waits_to_the_stalled_rank():
    # pp: rank 3 waits to receive from rank 1 (the stage before it), which waits in a dp all-reduce for
    # rank 0, which is in no collective: rank 0 is named, with the collective it did not enter.
    records = {
        0: _rec(7, {"dp:0,1": 11, "pp:0>2": 20}),
        1: _rec(7, {"dp:0,1": 12, "pp:1>3": 20}, ["dp:0,1", 12, "all_reduce", "dp", 4.0]),
        2: _rec(7, {"dp:2,3": 11, "pp:0>2": 20}, ["dp:2,3", 12, "all_reduce", "dp", 3.0]),
        3: _rec(7, {"dp:2,3": 12, "pp:1>3": 21}, ["pp:1>3", 21, "recv", "pp", 5.0]),
    }
    line = diagnose(records, 3, 5.0, 2.0)
    assert line.startswith("rank 0 stalled in step 7: it did not enter all_reduce #12 on axis dp (ranks 0,1)")
    assert "rank 1 waited 4.0 s" in line and "no collective" in line
    # rank 2's chain: its dp peer 3 entered the all-reduce, so... rank 3 waits for rank 1 -> rank 0
    records[3]["entered"]["dp:2,3"] = 11
    assert diagnose(records, 2, 5.0, 2.0).startswith("rank 0 stalled")
    # a frozen process (its heartbeat stopped) is named as such
    records[0]["age"] = 30.0
    assert "stopped responding 30 s ago" in diagnose(records, 1, 5.0, 2.0)
    # two ranks that wait for each other
    dead = {0: _rec(2, {"dp:0,1": 3, "tp:0,1": 1}, ["dp:0,1", 3, "all_reduce", "dp", 6.0]),
            1: _rec(2, {"dp:0,1": 2, "tp:0,1": 2}, ["tp:0,1", 2, "all_gather", "tp", 6.0])}
    assert diagnose(dead, 0, 5.0, 2.0).startswith("ranks 0, 1 wait for each other (deadlock)")


def test_stalled_rank_makes_every_rank_exit_then_the_restart_resumes(runs, capfd, monkeypatch):
    full = runs.full(capfd, monkeypatch, "dp2")
    # rank 1 sleeps before step 5's collectives (after 4 steps: the checkpoint of step 4 exists)
    code, out = runs.train(capfd, monkeypatch, "dp2", "stalled", "--max-restarts", "1",
                           "--set", "run.collective_timeout_s=4", fault="stall@4:1")
    assert code == 0, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("podscale: watchdog:")]
    assert sorted(line.split()[3] for line in lines) == ["0", "1"], out[-3000:]  # one line per rank
    for line in lines:
        assert "rank 1 stalled in step 5: it did not enter all_reduce" in line and "axis dp" in line, line
    assert "resumed from step_00000004" in out
    assert runs.losses("stalled")[STEPS] == pytest.approx(full[STEPS], abs=1e-6)


# -- the fault matrix: SIGKILL of a rank drawn at random, on each layout ---------------------------------
@pytest.mark.parametrize("layout", MATRIX)
def test_killed_rank_restarts_and_ends_on_the_uninterrupted_loss(runs, capfd, monkeypatch, layout):
    nproc = LAYOUTS[layout][0]
    draw = random.Random(f"podscale-fault-matrix-{layout}")
    rank, step = draw.randrange(nproc), draw.randrange(2, STEPS)  # (after the first checkpoint)
    full = runs.full(capfd, monkeypatch, layout)
    code, out = runs.train(capfd, monkeypatch, layout, f"killed-{layout}", "--max-restarts", "1",
                           fault=f"kill@{step}:{rank}")
    assert code == 0, out[-3000:]
    # checkpoints every 2 steps: the restart resumes from the last one before the kill
    assert f"resumed from step_{step // 2 * 2:08d}" in out, out[-3000:]
    assert "warning" not in out
    killed = runs.losses(f"killed-{layout}")
    assert sorted(killed) == list(range(1, STEPS + 1))
    assert killed[STEPS] == pytest.approx(full[STEPS], abs=1e-6), (layout, rank, step)


# -- damaged checkpoints --------------------------------------------------------------------------------
def _damage_truncated_shard(step: Path) -> Path:
    shard = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard


def _damage_missing_file(step: Path) -> Path:
    gone = step / "rank_00001.pt"
    gone.unlink()
    return gone


def _damage_other_model(step: Path) -> Path:
    """``.metadata`` of another model (a wider GPT) over this checkpoint's files."""
    import torch.distributed.checkpoint as dcp
    from podscale.models.gpt import GPT, GPTConfig
    other = step.parent / "other"
    state = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=48)).state_dict()
    dcp.save({"model": state}, checkpoint_id=str(other), no_dist=True)
    shutil.copy(other / ".metadata", step / ".metadata")
    shutil.rmtree(other)
    return step / ".metadata"


DAMAGE = {"truncated shard": _damage_truncated_shard, "missing file": _damage_missing_file,
          "metadata of another model": _damage_other_model}


def test_damaged_checkpoints_are_named_and_resume_falls_back(runs, capfd, monkeypatch):
    from podscale.tasks import task_for
    from podscale.config import load_config
    from podscale.train import checkpoint
    runs.full(capfd, monkeypatch, "dp2")
    src = runs.root / "runs" / "full-dp2"
    cfg = load_config(str(runs.root / "full-dp2.toml"), [])
    task = task_for(cfg)
    expected = checkpoint.expected_of(task, task.build_model())
    for what, damage in DAMAGE.items():
        copy = runs.root / "damaged" / what.replace(" ", "-")
        shutil.copytree(src, copy)
        newest = checkpoint.latest(copy / "checkpoints")
        bad = damage(newest)
        found, skipped = checkpoint.latest_usable(copy / "checkpoints", expected)
        assert found is not None and found.name == "step_00000004", what
        assert len(skipped) == 1 and "\n" not in skipped[0] and f"'{bad}'" in skipped[0], (what, skipped)
        assert ("--fresh" in skipped[0]) and (("another model" in skipped[0]) == (what == "metadata of another model"))
    # and end to end: --resume says which checkpoint it passes over, resumes from the one before and ends on
    # the uninterrupted loss (the damaged step 6 is written again)
    shutil.copytree(runs.root / "damaged" / "truncated-shard", runs.root / "runs" / "fallback")
    code, out = runs.train(capfd, monkeypatch, "dp2", "fallback", "--resume")
    assert code == 0, out[-3000:]
    note = [line for line in out.splitlines() if line.startswith("podscale: warning:")]
    assert len(note) == 1 and "truncated" in note[0] and "resuming from step_00000004" in note[0], out[-3000:]
    assert "resumed from step_00000004" in out
    assert runs.losses("fallback")[STEPS] == pytest.approx(runs.full(capfd, monkeypatch, "dp2")[STEPS], abs=1e-6)
    # every checkpoint damaged: one line, exit 2, nothing started
    for step in checkpoint.completed(runs.root / "runs" / "fallback" / "checkpoints"):
        (step / "rank_00000.pt").unlink()
    code, out = runs.train(capfd, monkeypatch, "dp2", "fallback", "--resume")
    assert code == 2 and "can be resumed" in out and "rank_00000.pt' is missing" in out, out[-3000:]
