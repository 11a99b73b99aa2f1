"""ZeRO-Infinity NVMe offload: training matches one process, a model whose optimizer state on disk is 4x a
RAM budget trains with the process's peak memory growth under that budget, and bad offload setups fail
with a clear message before training (or at the failing step) and leave checkpoints alone."""
import errno
import math
import os
import subprocess
import sys

import pytest

from conftest import shakespeare
from podscale.config import ConfigError, parse_config
from podscale.runtime.launcher import launch
from reference import reference_run
from zero_workers import nvme_budget_run, train_zero, zero_config

STEPS = 20


def test_nvme_offload_matches_single_process(tmp_path):
    path = shakespeare()
    ref = reference_run(zero_config(path, STEPS, 16, 16, "fp32", 1, 0))
    nv = {"offload_optimizer": "nvme", "nvme_path": str(tmp_path), "nvme_block_mb": 0.1}
    cases = [(3, 1), (3, 2), (2, 1), (1, 2)]  # (stage, accumulation): chunks of 0.1 MB, several per step
    cfgs = [zero_config(path, STEPS, 16, 16 // (2 * a), "fp32", 2, st, **nv) for st, a in cases]
    cases.append((3, 1))  # and parameters on NVMe too (ZeRO-Infinity)
    cfgs.append(zero_config(path, STEPS, 16, 8, "fp32", 2, 3, offload_param="nvme", **nv))
    res = launch(train_zero, (cfgs,), nproc=2)
    for i, (st, a) in enumerate(cases):
        ours = res[0][i]
        for step, (x, y) in enumerate(zip(ours["losses"], ref["losses"])):
            assert math.isclose(x, y, rel_tol=2e-5), f"stage {st} accum {a} step {step + 1}: {x} vs {y}"
        for x, y in zip(ours["grad_norms"], ref["grad_norms"]):
            assert math.isclose(x, y, rel_tol=2e-4), (st, a, x, y)
        worst = max((ours["params"][n] - p).abs().max().item() for n, p in ref["params"].items())
        assert worst < 1e-4, (st, a, worst)
        sb = ours["state_bytes"]
        assert sb["optim"] == 0 and sb["on_disk"] > 0  # the optimizer state is not in memory
    assert not list(tmp_path.glob("*.swp"))  # swap files removed on close


def test_nvme_trains_model_4x_ram_budget(tmp_path, monkeypatch):
    """~85M parameters, stage 3, bf16, dp=2, optimizer state and parameters on NVMe: fp32 gradient, master,
    moments and the bf16 parameter shard on disk (18 bytes per shard element, ~730 MiB per rank) against a
    budget of a quarter of that for the growth of the worker's peak resident memory, which holds three swap
    chunks, prefetched parameter shards, the gathered blocks, gradient buckets and activations (measured:
    ~157 MiB of a 183 MiB budget, save and load included).
    The model is built on the meta device and materialised one unit at a time.  The run also saves a
    checkpoint (master and moments: 12 bytes a parameter, far above the budget), trains on, loads it back
    and trains the same steps again with identical losses, the peak still under the budget: saving and
    loading stream the state unit by unit."""
    path = shakespeare()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    d = zero_config(path, 3, 2, 1, "bf16", 2, 3, model={"n_layer": 48, "n_embd": 384, "n_head": 6,
                                                         "block_size": 16},
                    offload_optimizer="nvme", offload_param="nvme", nvme_path=str(tmp_path), nvme_block_mb=1.0,
                    param_persistence_threshold=10_000)
    d["train"]["warmup_steps"] = 0
    # 2 steps, the save, 1 step, the load, the same step again (each step streams ~730 MiB per rank in and out:
    # ~2.7 s here; the growth is flat from the second step on, measured 126 / 127 MiB after steps 2 / 3)
    res = launch(nvme_budget_run, (d, 2, str(tmp_path / "ckpt"), 1), nproc=2, start_method="spawn")
    for rank, r in res.items():
        budget = r["on_disk"] / 4
        print(f"rank {rank}: {r['params'] / 1e6:.1f}M params, on disk {r['on_disk'] / 2**20:.0f} MiB, "
              f"budget {budget / 2**20:.0f} MiB, peak growth {r['growth'] / 2**20:.0f} MiB (after the save "
              f"{r['save_peak'] / 2**20:.0f}, after the load {r['load_peak'] / 2**20:.0f}), checkpoint "
              f"{r['ckpt_bytes'] / 2**20:.0f} MiB, step {r['step_s']}, io {r['io']}, trace {r['trace']}")
        assert r["on_disk"] >= 4 * budget
        assert r["growth"] < budget, (rank, r["growth"], budget)  # training, saving and loading included
        assert all(math.isfinite(x) for x in r["losses"]) and r["losses"][-1] < r["losses"][0]
        # every step streamed the whole optimizer state in (4 steps, at least 3 times in all): 16 of the 18
        # bytes per shard element on disk (fp32 gradient, master, moments; the other 2 are the bf16 parameter
        # shard)
        assert r["io"]["read"] >= 3 * r["on_disk"] * 16 / 18
        # the checkpoint (both ranks' files) holds this model's master and both moments, 12 bytes a parameter:
        # far more than the two ranks' budgets, so it cannot have been put together in memory
        assert r["ckpt_bytes"] >= 12 * r["params"] * 0.99 > 2 * budget
        # reloaded, the run continues exactly as it did after the save
        assert r["losses_after_load"] == r["losses_after_save"], (r["losses_after_save"], r["losses_after_load"])


def test_bad_offload_configs_fail_before_training(tmp_path):
    base = {"zero": {"stage": 2, "offload_param": "nvme", "nvme_path": str(tmp_path)}}
    with pytest.raises(ConfigError, match="needs zero.stage=3"):
        parse_config(base)
    with pytest.raises(ConfigError, match="nvme_path is required"):
        parse_config({"zero": {"stage": 3, "offload_optimizer": "nvme"}})
    with pytest.raises(ConfigError, match="not an existing folder"):
        parse_config({"zero": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": str(tmp_path / "nope")}})
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # (root ignores permissions)
            with pytest.raises(ConfigError, match="not writable"):
                parse_config({"zero": {"stage": 1, "offload_optimizer": "nvme", "nvme_path": str(ro)}})
    finally:
        ro.chmod(0o700)


def test_disk_full_gives_clear_error_and_keeps_checkpoint(tmp_path):
    """A file-size limit makes the swap file's preallocation fail like a full disk: the error names the
    path and the space needed, and the checkpoint written before is untouched.  The limit is set in a
    process of its own, forked from podscale's fork server (torch already imported there, as in every
    launched worker) rather than a new interpreter importing torch."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from podscale.runtime import forkserver
    from zero_workers import disk_full_build

    ck = tmp_path / "ckpt"
    ck.mkdir()
    (ck / "meta.json").write_text('{"step": 5}')
    forkserver.start_server()
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver")) as pool:
        out = pool.submit(forkserver.run_with_parent_env, disk_full_build, dict(os.environ), None,
                          str(tmp_path)).result(timeout=120)
    assert out.startswith("CLEAR: "), out
    assert "disk full while swapping" in out and "GiB" in out
    assert (ck / "meta.json").read_text() == '{"step": 5}'
    assert not list(tmp_path.glob("*.swp"))


def _one_process(folder, precision: str, stage: int, **zero):
    """A 4-block GPT under ZeRO in one process, swap chunks of 0.05 MB: (config, strategy, engine)."""
    import torch

    from podscale.models.gpt import GPT
    from podscale.parallel.zero import build_strategy
    from podscale.runtime.mesh import Mesh
    from dp_workers import gpt_engine
    from podscale.tasks.gpt import gpt_config

    d = zero_config(shakespeare(), 3, 4, 4, precision, 1, stage, model={"n_layer": 4}, offload_optimizer="nvme",
                    nvme_path=str(folder), nvme_block_mb=0.05, **zero)
    cfg = parse_config(d)
    torch.manual_seed(0)
    st = build_strategy(GPT(gpt_config(cfg)), Mesh.build(), cfg.train, cfg.zero)
    return cfg, st, gpt_engine(st.module, st.mesh, cfg, st)


def _masters(st):
    """The fp32 master of every unit's shard, read unit by unit from the swap file (settles the step)."""
    import torch
    return torch.cat([st.state.read_unit("master", u).clone() for u in st.checkpoint_units()])


def test_nvme_reads_are_prefetched(tmp_path):
    """Stage 3 with parameters and optimizer state on NVMe, one process: every parameter read is issued
    before the gather that needs it (forward: block i+1's before block i computes), none is wasted, and
    the step reads optimizer chunk i+1 before it computes chunk i (double buffering, write-behind)."""
    from zero_workers import batches_for

    cfg, st, engine = _one_process(tmp_path, "fp32", 3, offload_param="nvme")
    events = []
    swap = st.state.swap  # (NVMe backend)
    read_param, file_read = swap.read_param, swap.file.read
    swap.read_param = lambda u, out: (events.append(("read", u.index)), read_param(u, out))[1]
    for u in st.layers:
        u.module.register_forward_pre_hook(lambda m, a, i=u.index: events.append(("fwd", i)))
    chunk_bytes = swap.C * 4
    swap.file.read = lambda off, t: (off < swap.S * 4 and events.append(("chunk", off // chunk_bytes)),
                                       file_read(off, t))[1]  # reads of the gradient array: the step's
    publish = st.state.on_stepped
    st.state.on_stepped = lambda u, lo, hi, m: (events.append(("step", (u.goff + lo) // swap.C)),
                                              publish(u, lo, hi, m))[1]
    try:
        for b in batches_for(cfg, 2):
            engine.step(b)
        n = len(st.layers)
        assert n == 4 and len(swap.chunks) >= 3
        assert st.state.param_demand_reads == 0 and st.state.param_dropped_reads == 0 and st.state.param_reads > 0
        first_fwd = events[: events.index(("fwd", n - 1)) + 1]
        for i in range(1, n):
            assert first_fwd.index(("read", i)) < first_fwd.index(("fwd", i - 1)), first_fwd
        steps = [e for e in events if e[0] in ("chunk", "step")]
        for i in range(len(swap.chunks) - 1):
            assert steps.index(("chunk", i + 1)) < steps.index(("step", i)), steps
    finally:
        st.close()


def test_nvme_fp16_overflow_skips_step(tmp_path):
    """fp16 with the optimizer state on NVMe: the engine unscales through ``scale_grads`` (deferred to
    the streamed step) and learns of an overflow through ``found_inf``; an overflowing step changes no
    weight and halves the loss scale, a clean step after it trains."""
    import torch

    from zero_workers import batches_for

    cfg, st, engine = _one_process(tmp_path, "fp16", 2)
    try:
        assert st.grads() == []  # the gradients are on disk: no in-memory tensor to hand out
        b = batches_for(cfg, 2)
        before = _masters(st)
        engine.scaler.scale = 3e38  # the scaled loss overflows
        r = engine.step(b[0])
        assert r.skipped and engine.scaler.scale == 1.5e38
        assert torch.equal(_masters(st), before) and st.state.step_count() == 0
        engine.scaler.scale = 1024.0
        r = engine.step(b[1])
        assert not r.skipped and math.isfinite(r.grad_norm) and st.state.step_count() == 1
        assert not torch.equal(_masters(st), before)
    finally:
        st.close()


def test_nvme_step_streams_under_next_forward(tmp_path):
    """Stage 3, optimizer and parameters on NVMe, one process: with ``nvme_overlap_step`` the step's chunks
    are stepped while the next forward runs (some after its first block has started, all before its last),
    the forward takes its new parameters from the step's buffers rather than reading back what was just
    written, and the weights after 3 steps equal those of stepping at once, bit for bit."""
    import torch

    from zero_workers import batches_for

    finals = {}
    for overlap in (True, False):
        folder = tmp_path / str(overlap)
        folder.mkdir()
        cfg, st, engine = _one_process(folder, "fp32", 3, offload_param="nvme", nvme_overlap_step=overlap)
        events = []
        for u in st.layers:
            u.module.register_forward_pre_hook(lambda m, a, i=u.index: events.append(("fwd", i)))
        publish = st.state.on_stepped
        st.state.on_stepped = lambda u, lo, hi, m: (events.append(("step", u.index)), publish(u, lo, hi, m))[1]
        try:
            evals = []
            for i, b in enumerate(batches_for(cfg, 3)):
                events.append(("begin", None))
                engine.step(b)
                if i == 1:  # a validation forward between steps catches up with the streamed step too
                    x, y = b[0]
                    evals.append(engine.evaluate([(x[:2], y[:2])]))
            st.complete_step()
            n = len(st.layers)
            second = events[events.index(("begin", None), 1) + 1:]
            second = second[: second.index(("fwd", 0), second.index(("fwd", n - 1)))]  # step 2's forward (..)
            first_fwd, last_fwd = second.index(("fwd", 0)), second.index(("fwd", n - 1))
            stepped_in_fwd = [e for e in second[first_fwd:last_fwd] if e[0] == "step"]
            if overlap:  # step 1's chunks of blocks 1.. are stepped after block 0's forward began
                assert stepped_in_fwd and second[:first_fwd].count(("step", n - 1)) == 0, second
                assert st.state.param_captured > 0 and st.state.param_demand_reads == 0
            else:
                assert not stepped_in_fwd and st.state.param_captured == 0, second
            finals[overlap] = (_masters(st), evals)
        finally:
            st.close()
    assert torch.equal(finals[True][0], finals[False][0]) and finals[True][1] == finals[False][1]


def test_stale_swap_files_of_dead_runs_are_removed(tmp_path):
    """A killed worker leaves its swap file; the next run on the host removes it (not a live process's,
    not another host's)."""
    import socket

    from podscale.parallel.zero.nvme import remove_stale_swap_files

    host = socket.gethostname().split(".")[0]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f"podscale-zero-{host}-rank00001-{dead}.swp"
    live = tmp_path / f"podscale-zero-{host}-rank00000-{os.getpid()}.swp"
    other = tmp_path / f"podscale-zero-otherhost-rank00000-{dead}.swp"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert remove_stale_swap_files(tmp_path, host) == [stale]
    assert not stale.exists() and live.exists() and other.exists()


def test_disk_full_during_a_streamed_step_is_a_clear_error(tmp_path, monkeypatch):
    """The disk fills while the optimizer step streams under the next forward: that step fails with the
    storage error naming the swap file and the fix, nothing is left half-done to continue from silently,
    and closing still removes the swap file."""
    from podscale.storage import aio
    from podscale.storage.aio import StorageFullError
    from zero_workers import batches_for

    cfg, st, engine = _one_process(tmp_path, "fp32", 3, offload_param="nvme")
    batches = batches_for(cfg, 3)
    try:
        engine.step(batches[0])
        real = os.pwritev

        def full(fd, buffers, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(aio.os, "pwritev", full)
        with pytest.raises(StorageFullError, match="disk full while swapping .* point zero.nvme_path"):
            engine.step(batches[1])  # the first step's writes behind the chunks, in this forward
        monkeypatch.setattr(aio.os, "pwritev", real)
    finally:
        st.close()
    assert not list(tmp_path.glob("*.swp"))
