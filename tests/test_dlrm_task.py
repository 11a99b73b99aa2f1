"""DLRM as a task (``[model] kind = "dlrm"``): its config errors (one line, before workers), its data readers
(generated Criteo TSV and MovieLens files of the real formats; the real MovieLens is never read here), and
`podscale train` at 2 ranks with the tables' SSD tier: the loss falls, the tiers report, and the same run
under ZeRO-3, killed by SIGKILL, resumes from its last (incremental) checkpoint to the first run's losses."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from podscale.config import ConfigError, parse_config
from podscale.storage import SSD_ENGINES
from podscale.table import TableSpec
from podscale.tasks.dlrm import ClickArrays, auc_score, read_criteo_tsv, read_movielens

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8


def _cfg(tmp_path, **model):
    data = {"run": {"name": "d", "out_dir": str(tmp_path)},
            "model": {"kind": "dlrm", "tables": [{"name": "a", "cardinality": 1000}], **model},
            "train": {"global_batch": 64, "micro_batch": 32}, "parallel": {"nproc": 2}}
    return data


def _layout_error(data) -> str:
    with pytest.raises(ConfigError) as e:
        parse_config(data).check_layout(2)
    return str(e.value)


def test_config_errors_are_one_line_before_workers(tmp_path):
    cfg = parse_config(_cfg(tmp_path))
    cfg.check_layout(2)
    assert cfg.model.task_class().__name__ == "DLRMTask"
    d = _cfg(tmp_path)
    d["train"]["micro_batch"] = 16
    assert "one micro-batch per step" in _layout_error(d) and "train.micro_batch = 32" in _layout_error(d)
    d = _cfg(tmp_path)
    d["train"]["precision"] = "fp16"
    assert "fp16" in _layout_error(d)
    with pytest.raises(ConfigError, match="set model.ssd_path"):
        parse_config(_cfg(tmp_path, dram_budget_mb=1.0))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="model.ssd_path .* is not writable"):
        parse_config(_cfg(tmp_path, dram_budget_mb=1.0, ssd_path=str(blocker / "sub")))
    with pytest.raises(ConfigError, match="model.ssd_engine") as e:
        parse_config(_cfg(tmp_path, dram_budget_mb=1.0, ssd_path=str(tmp_path / "ssd"), ssd_engine="leveldb"))
    assert "\n" not in str(e.value) and "'log'" in str(e.value) and "'rocksdb'" in str(e.value)
    assert parse_config(_cfg(tmp_path, dram_budget_mb=1.0, ssd_path=str(tmp_path / "ssd"),
                             ssd_engine="rocksdb")).model.ssd_engine == "rocksdb"
    # a budget below one batch's working set: 64 ids of 4 * (16 + 1 + 1) B = 72 B > 0.004 MiB
    msg = _layout_error(_cfg(tmp_path, dram_budget_mb=0.004, ssd_path=str(tmp_path / "ssd")))
    assert "fewer than one batch's ids (64)" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="data.path"):
        parse_config(_cfg(tmp_path, data_format="criteo-tsv")).check_layout(2)
    bad = tmp_path / "bad.tsv"
    bad.write_text("1\t2\t3\n")
    d = _cfg(tmp_path, data_format="criteo-tsv")
    d["data"] = {"path": str(bad)}
    with pytest.raises(ConfigError, match="not a Criteo TSV file"):
        parse_config(d)
    with pytest.raises(ConfigError, match="unknown key 'model.bogus'"):
        parse_config(_cfg(tmp_path, bogus=1))
    with pytest.raises(ConfigError, match=r"unknown key 'model.tables.0.size': valid keys in \[model.tables.0\] are "
                                          "name, cardinality, sharding"):
        parse_config(_cfg(tmp_path, tables=[{"name": "a", "cardinality": 3, "size": 3}]))


def write_criteo_tsv(path: Path, n: int, seed: int = 0) -> None:
    """``n`` records of Criteo's format: label, 13 integers (some empty), 26 hex categories (some empty)."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            ints = ["" if rng.random() < 0.1 else str(int(rng.integers(0, 50))) for _ in range(13)]
            cats = ["" if rng.random() < 0.05 else f"{int(rng.integers(0, 2 ** 32)):08x}" for _ in range(26)]
            f.write("\t".join([str(int(rng.random() < 0.25))] + ints + cats) + "\n")


def write_movielens(folder: Path, users: int = 30, items: int = 40, ratings: int = 600, seed: int = 0) -> Path:
    """MovieLens-100K's u.data, u.user and u.item formats with made-up content."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "u.data", "w") as f:
        for _ in range(ratings):
            f.write(f"{rng.integers(1, users + 1)}\t{rng.integers(1, items + 1)}\t{rng.integers(1, 6)}\t"
                    f"{rng.integers(874724710, 893286638)}\n")
    with open(folder / "u.user", "w") as f:
        for u in range(1, users + 1):
            f.write(f"{u}|{rng.integers(10, 70)}|{'MF'[u % 2]}|{['writer', 'student', 'other'][u % 3]}|{55105 + u}\n")
    with open(folder / "u.item", "w", encoding="latin-1") as f:
        for i in range(1, items + 1):
            genres = "|".join(str(int(rng.random() < 0.2)) for _ in range(19))
            f.write(f"{i}|Movie {i} (1995)|01-Jan-{1990 + i % 9}||http://x|{genres}\n")
    return folder / "u.data"


def write_movielens_recbole(folder: Path, users: int = 30, items: int = 40, ratings: int = 600, seed: int = 0) -> Path:
    """The RecBole atomic-file layout (typed headers) of the MovieLens-100K copy benchmarks read, made-up content."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "ml.inter", "w") as f:
        f.write("user_id:token\titem_id:token\trating:float\ttimestamp:float\n")
        for _ in range(ratings):
            f.write(f"{rng.integers(1, users + 1)}\t{rng.integers(1, items + 1)}\t{rng.integers(1, 6)}\t"
                    f"{rng.integers(874724710, 893286638)}\n")
    with open(folder / "ml.user", "w") as f:
        f.write("user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n")
        for u in range(1, users + 1):
            f.write(f"{u}\t{rng.integers(10, 70)}\t{'MF'[u % 2]}\twriter\t{55105 + u}\n")
    with open(folder / "ml.item", "w") as f:
        f.write("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n")
        for i in range(1, items + 1):
            f.write(f"{i}\tMovie {i}\t{1990 + i % 9}\t{'Comedy Drama' if i % 2 else 'Film-Noir'}\n")
    return folder / "ml.inter"


def test_readers_of_criteo_tsv_and_movielens(tmp_path):
    tsv = tmp_path / "day.tsv"
    write_criteo_tsv(tsv, 50)
    c = read_criteo_tsv(tsv)
    lines = tsv.read_text().splitlines()
    assert len(c) == 50 and c.dense.shape == (50, 13) and len(c.names) == 26
    f0 = lines[0].split("\t")
    assert c.labels[0] == float(f0[0])
    assert c.dense[0, 0] == pytest.approx(np.log1p(int(f0[1]) if f0[1] else 0))
    # a missing category is an empty bag; a present one is its hex value
    v, o = c.sparse["C1"]
    present = [x.split("\t")[14] for x in lines]
    assert len(v) == sum(1 for p in present if p) and int(v[0]) == int(next(p for p in present if p), 16)
    d, s, y = c.take(torch.tensor([3, 0]))
    assert torch.equal(y, c.labels[[3, 0]]) and len(s["C1"][1]) == 2
    bad = tmp_path / "neg.tsv"
    bad.write_text(lines[0].rsplit("\t", 1)[0] + "\t-5\n")
    with pytest.raises(ValueError, match="line 1"):
        read_criteo_tsv(bad)

    ml = read_movielens(write_movielens(tmp_path / "ml"))
    raw = np.loadtxt(tmp_path / "ml" / "u.data", dtype=np.int64)
    assert len(ml) == 600 and torch.equal(ml.labels, torch.from_numpy((raw[:, 2] >= 4).astype(np.float32)))
    assert torch.equal(ml.sparse["user"][0], torch.from_numpy(raw[:, 0]))
    train, val = ml.split(0.2, seed=1)
    assert len(train) + len(val) == 600 and len(val) == 120
    # jagged genre bags survive the gather: every sample's bag is its item's genres
    _, s, _ = ml.take(torch.arange(600))
    assert torch.equal(s["genre"][0], ml.sparse["genre"][0])
    rb = read_movielens(write_movielens_recbole(tmp_path / "rb"))
    raw = np.loadtxt(tmp_path / "rb" / "ml.inter", dtype=np.int64, skiprows=1)
    assert len(rb) == 600 and torch.equal(rb.labels, torch.from_numpy((raw[:, 2] >= 4).astype(np.float32)))
    lens = torch.diff(torch.cat([rb.sparse["genre"][1], torch.tensor([len(rb.sparse["genre"][0])])]))
    assert torch.equal(lens, torch.from_numpy(np.where(raw[:, 1] % 2 == 1, 2, 1)))  # genres per item
    d = _cfg(tmp_path, data_format="movielens")
    d["data"] = {"path": str(tmp_path / "rb" / "ml.inter")}
    parse_config(d).check_layout(2)  # the RecBole header passes the format check


def test_auc_matches_pairwise_definition():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 5, (200,), generator=g).float()  # many ties
    y = (torch.rand(200, generator=g) < 0.4).float()
    pos, neg = s[y > 0.5], s[y < 0.5]
    pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    assert auc_score(s, y) == pytest.approx(pairs.mean().item(), abs=1e-9)


# -- podscale train at 2 ranks, with the SSD tier ---------------------------------------------------------
def _args(out: Path, name: str, steps: int) -> list[str]:
    return ["--steps", str(steps), "--name", name, "--out-dir", str(out),
            "--set", "run.eval_every=4", "--set", "run.log_every=4", "--set", "checkpoint.every=2",
            "--set", "train.global_batch=64", "--set", "train.micro_batch=32", "--set", "train.lr=1e-2",
            "--set", "train.warmup_steps=0", "--set", "model.dram_budget_mb=0.02",
            "--set", f"model.ssd_path='{out / 'ssd'}'", "--set", "model.full_checkpoint_every=2",
            "--set", "model.sparse_lr=0.1", "--set", "model.teacher_scale=4.0",
            "--set", "model.val_samples=1024"]


def _start(out: Path, name: str, steps: int, *extra: str, env=None) -> subprocess.Popen:
    args = _args(out, name, steps)
    e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {}))
    return subprocess.Popen([sys.executable, "-m", "podscale", "train", str(ROOT / "examples" / "dlrm-small.toml"),
                             *args, *extra], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=600)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _main_here(capfd, argv: list[str]) -> subprocess.CompletedProcess:
    """``podscale`` with ``argv`` through ``podscale.cli.main`` in this process (what ``python -m podscale``
    calls and exits with): its exit code and the output of the command and its forked workers."""
    from podscale.cli import main
    capfd.readouterr()
    code = main(argv)
    out = capfd.readouterr()
    return subprocess.CompletedProcess(["podscale", *argv], code, out.out, out.err)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_train_two_ranks_ssd_tier_kill_and_resume(tmp_path, capfd):
    # the uninterrupted run and the run to be killed (below) start together: their start-ups overlap
    z3 = ("--set", "zero.stage=3")
    running = _start(tmp_path, "full", STEPS)
    to_kill = _start(tmp_path, "res", STEPS, *z3, env={"PODSCALE_FAULT": "kill@5:1"})
    full, killed = _finish(running), _finish(to_kill)
    assert full.returncode == 0, full.stderr[-3000:]
    rows = _rows(tmp_path / "full")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert np.mean([r["loss"] for r in rows[-2:]]) < np.mean([r["loss"] for r in rows[:2]]) - 0.02
    assert all(r["samples_per_s"] > 0 and {"bytes/tier0", "bytes/tier1"} <= set(r["task"]) for r in rows)
    assert sum(r["task"]["tables/ssd_reads_per_step"] for r in rows) > 0
    assert all(0 <= r["task"]["tables/dram_hit_rate"] <= 1 for r in rows)
    evals = [r for r in rows if "val_auc" in r]
    assert [r["step"] for r in evals] == [4, 8] and all(0 < r["val_loss"] and 0 <= r["val_auc"] <= 1 for r in evals)
    manifest = json.loads((tmp_path / "full" / "checkpoints" / f"step_{STEPS:08d}" / "tables.json").read_text())
    assert [c["full"] for c in manifest["chain"]] == [True, False]  # full every 2nd save: step 6 full, 8 delta

    # the same under ZeRO-3 (the dense part's parameters, gradients and Adam state sharded), killed (SIGKILL)
    # at the start of step 6 on rank 1, mid-run with the SSD tier written every step, and resumed
    assert killed.returncode != 0
    # (resumed through the command's entry point in this process: the two runs above were command lines)
    resumed = _main_here(capfd, ["train", str(ROOT / "examples" / "dlrm-small.toml"),
                                 *_args(tmp_path, "res", STEPS), "--resume", *z3])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step_00000004" in resumed.stdout
    again = _rows(tmp_path / "res")
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    for a, b in zip(rows, again):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), a["step"]
    assert again[-1]["val_auc"] == pytest.approx(rows[-1]["val_auc"], abs=1e-6)


# the log store merges its file at every put here (no size floor: each put leaves as many dead records as
# live ones), so the kill also lands in merges: a merge cut short must leave the old log or the new one
ENGINE_ARGS = {"rocksdb": {}, "log": {"compact_min_bytes": 0}}


@pytest.mark.parametrize("engine", list(SSD_ENGINES))
def test_ssd_store_reopens_consistent_after_sigkill_mid_write(tmp_path, engine):
    """A process overwriting 2000 rows per atomic write batch is killed at an arbitrary moment: the store
    reopens with every row present and all rows from the same batch (no torn batch, no torn row) -- for
    each SSD engine.  The writer is forked from podscale's fork server (torch imported there once) rather
    than started as a new interpreter."""
    import multiprocessing

    from podscale.runtime import forkserver
    from table_workers import ssd_overwriter

    store = SSD_ENGINES[engine]
    path = tmp_path / "db"
    forkserver.start_server()
    ctx = multiprocessing.get_context("forkserver")
    ready = ctx.Event()
    p = ctx.Process(target=forkserver.run_with_parent_env,
                    args=(ssd_overwriter, dict(os.environ), None, str(path), engine, ENGINE_ARGS[engine], ready))
    p.start()
    assert ready.wait(120), f"the writer did not write 3 batches (exit code {p.exitcode})"
    time.sleep(0.3)
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert p.exitcode == -signal.SIGKILL  # killed mid-write, not ended by itself
    s = store(path, 64)
    keys, rows = zip(*s.scan())
    keys, rows = torch.cat(keys), torch.cat(rows)
    assert torch.equal(torch.sort(keys).values, torch.arange(2000))
    assert rows.min() == rows.max() >= 3  # one generation everywhere
    s.close()


def test_a_data_file_damaged_past_its_first_line_is_one_line_from_every_rank(tmp_path, capfd):
    """Bad input found inside the workers (the config check reads only the first line): each rank prints the
    line, the command prints it once, no traceback, exit status 1 (podscale.runtime.errors)."""
    data = tmp_path / "c.tsv"
    write_criteo_tsv(data, 300)
    lines = data.read_text().splitlines()
    lines[200] = "garbage\tline"
    data.write_text("\n".join(lines) + "\n")
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nname = "bad"\nsteps = 2\n[model]\nkind = "dlrm"\nembedding_dim = 8\n'
                   f'data_format = "criteo-tsv"\n[data]\npath = "{data}"\n[parallel]\nnproc = 2\n'
                   "[train]\nglobal_batch = 64\nmicro_batch = 32\n")
    # through the command's entry point in this process (the exit status is main()'s return value, which
    # `python -m podscale` exits with; the ranks' and the command's lines reach this process's stderr)
    p = _main_here(capfd, ["train", str(cfg), "--out-dir", str(tmp_path / "runs")])
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(f"podscale: error: data.path '{data}': line 201 has 2 tab-separated fields")
    assert "fix or remove that record" in last
    ranks = [ln for ln in p.stderr.splitlines() if ln.startswith("podscale: rank ")]
    assert ranks and all("line 201" in ln for ln in ranks)


# -- a table 10x its DRAM budget under `podscale train` ------------------------------------------------------
# One table of near-uniform ids (Zipf(0.01) over 10^9 keys: almost every id is new, so the table grows by
# about one step's ids every step) of dim 64 with row-wise Adagrad: 264 B a row.  The DRAM budget holds one
# global batch's ids (512 x 40 = 20480 rows, 5.2 MiB; about the least the config accepts); each rank's shard gets
# about half of each step's ids, so after 30 steps a shard holds ~15x what its cache may.  Peak RSS growth
# is counted from step 1's peak (torch, gloo, the data and the tables' setup are all there by then).
# Overhead allowed above the budget, per rank: the SSD engine's own DRAM as it states it (the default log
# store: its key index over every key of the shard, ~300k keys here, at its largest and while rebuilt;
# RocksDB: its two 4 MiB memtables and 4 MiB block cache), and RSS_OTHER_MB for the rest: the engine's own
# state (RocksDB's compaction buffers; the log store's mapped read windows, released after each), the
# write-back queue (at most half the budget), the I/O thread's malloc arena, the record of changed keys for
# incremental checkpoints and the step's temporaries.  Measured (machine loaded), RocksDB: tiered 66-69 MiB
# of which 12 MiB its buffers; the same table in memory 249-252 MiB (its slab doubles as keys arrive, to
# 138 MiB past 262144 rows a shard, with the old slab alive during the copy).
RSS_STEPS = 30
RSS_BUDGET_MB = 5.3
RSS_OTHER_MB = 76

_RSS_TOML = """
[run]
name = "{name}"
out_dir = "{out}"
steps = {steps}
log_every = 1
eval_every = 0

[model]
kind = "dlrm"
embedding_dim = 64
bottom_mlp = [32, 64]
top_mlp = [32]
sparse_optimizer = "adagrad"
sparse_lr = 0.05
tables = [{{name = "big", cardinality = 1000000000}}]
alpha = 0.01
min_ids = 40
max_ids = 40
val_samples = 512
{tier}

[parallel]
nproc = 2

[train]
global_batch = 512
micro_batch = 256
lr = 1e-2
warmup_steps = 0

[checkpoint]
every = 0
at_end = false
"""


def test_dlrm_table_ten_times_its_dram_budget_trains_like_in_memory(tmp_path):
    """`podscale train` of a DLRM whose table outgrows its DRAM budget 10x: the same losses as the run that
    keeps the table in memory, and each rank's peak RSS grows by at most the budget plus a stated overhead
    (the in-memory run grows by more than that: the bound can fail)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = {}
    for name, tier in [("mem", ""), ("ssd", f"dram_budget_mb = {RSS_BUDGET_MB}\nssd_path = '{tmp_path / 'ssd'}'")]:
        cfg = tmp_path / f"{name}.toml"
        cfg.write_text(_RSS_TOML.format(name=name, out=tmp_path, steps=RSS_STEPS, tier=tier))
        procs[name] = subprocess.Popen([sys.executable, "-m", "podscale", "train", str(cfg)], env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, p in procs.items():  # (both at once: RSS is per process, and the start-up costs overlap)
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    mem, ssd = _rows(tmp_path / "mem"), _rows(tmp_path / "ssd")
    assert [r["loss"] for r in ssd] == [r["loss"] for r in mem], "the tiered table trained differently"
    budget = int(RSS_BUDGET_MB * 2 ** 20) // (4 * (64 + 1 + 1)) * 4 * (64 + 1 + 1)  # the cache's bytes
    table = mem[-1]["task"]["bytes/tier0"]  # every row, summed over the ranks
    assert table / 2 >= 10 * budget, f"the table is {table / 2 / budget:.1f}x a rank's DRAM budget"
    assert ssd[-1]["task"]["bytes/tier0"] <= 2 * budget  # the DRAM tiers kept to their budget
    assert ssd[-1]["task"]["bytes/tier1"] >= 8 * budget  # the rest went to the SSD tier
    keys = math.ceil(table / 2 / (4 * (64 + 1 + 1)))  # a rank's shard (the ids hash evenly over the ranks)
    overhead = RSS_OTHER_MB + SSD_ENGINES[TableSpec.ssd_engine].dram_bytes(int(keys * 1.05)) / 2 ** 20
    for r in range(2):
        grow = lambda rows: (rows[-1]["peak_mem_bytes"][r] - rows[0]["peak_mem_bytes"][r]) / 2 ** 20
        assert grow(ssd) < RSS_BUDGET_MB + overhead, (
            f"rank {r}: peak RSS grew {grow(ssd):.1f} MiB, budget {RSS_BUDGET_MB} + {overhead:.1f}")
        assert grow(mem) > RSS_BUDGET_MB + overhead, f"rank {r}: in memory grew only {grow(mem):.1f} MiB"
        print(f"rank {r}: peak RSS growth tiered {grow(ssd):.1f} MiB (allowed {RSS_BUDGET_MB + overhead:.1f}), "
              f"in memory {grow(mem):.1f} MiB; table {table / 2 / budget:.1f}x the budget")
