"""Worker functions for the ZeRO multi-process tests (importable by spawned workers)."""
from __future__ import annotations

import os

import torch

from dp_workers import gpt_engine, make_config
from podscale.config import parse_config
from podscale.models.gpt import GPT
from podscale.parallel.zero import build_strategy
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process
from podscale.storage.lazy import resident
from podscale.train import checkpoint
from podscale.train.data import ShardedLoader, load_tokens, split_tokens
from podscale.tasks.gpt import gpt_config


def zero_config(path: str, steps: int, global_batch: int, micro_batch: int, precision: str, nproc: int,
                stage: int, model: dict | None = None, **zero) -> dict:
    d = make_config(path, steps, global_batch, micro_batch, precision, nproc)
    if model:
        d["model"] = dict(d["model"], **model)
    # small buckets and threshold so the tiny test model has several units per stage
    d["zero"] = {"stage": stage, "reduce_bucket_mb": 0.05, "param_persistence_threshold": 1000} | zero
    return d


def _build(d: dict, info):
    cfg = parse_config(d)
    cfg.check_layout(info.world_size)
    mesh = Mesh.build(info.device, **cfg.mesh_sizes())
    torch.manual_seed(cfg.run.seed)
    model = GPT(gpt_config(cfg))
    strategy = build_strategy(model, mesh, cfg.train, cfg.zero)
    engine = gpt_engine(model, mesh, cfg, strategy)
    tokens, _ = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
    loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch,
                           mesh.local_rank("dp"), mesh.size("dp"), seed=cfg.run.seed)
    return cfg, mesh, model, engine, loader


def _full_params(engine, model) -> dict:
    """Every parameter as a plain fp32 tensor (gathered from the fp32 masters when sharded)."""
    from podscale.parallel.zero import ZeroStrategy
    from podscale.runtime import comm
    if isinstance(engine.strategy, ZeroStrategy):
        st = engine.strategy
        out = {}
        for u in st.checkpoint_units():
            full = torch.zeros(u.padded, dtype=torch.float32, device=st.mesh.device)
            # (read from the swap file under NVMe offload)
            comm.all_gather(full, st.state.read_unit("master", u).detach().float().clone().to(st.mesh.device),
                            st.mesh, "dp")
            for n, o, k, s in zip(u.names, u.offsets, u.numels, u.shapes):
                out[n] = full[o:o + k].view(s).clone()
        return out
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def train_zero(cfg_dicts: list[dict]) -> list[dict]:
    """Train each config with the ZeRO strategy; losses, grad norms, final parameters, memory."""
    info = init_process()
    torch.set_num_threads(1)
    out = []
    for d in cfg_dicts:
        cfg, mesh, model, engine, loader = _build(d, info)
        losses, norms, skipped = [], [], []
        for _ in range(cfg.run.steps):
            r = engine.step(loader.next_step())
            losses.append(r.loss)
            norms.append(r.grad_norm)
            skipped.append(r.skipped)
        params = _full_params(engine, model)
        st = engine.strategy
        out.append({"losses": losses, "grad_norms": norms, "skipped": skipped,
                    "params": params if info.rank == 0 else None,
                    "comm": mesh.stats.snapshot(),
                    "state_bytes": st.state_bytes(), "units": len(st.units)})
        st.close()
    return out


def train_zero_gloo_inplace(cfg_dicts: list[dict]) -> list[dict]:
    """:func:`train_zero` with every gloo collective on podscale's in-place path (per-rank reduces and
    broadcasts in the caller's buffer), which the tiny test models' units are otherwise too small to take."""
    from podscale.runtime import comm
    comm.GLOO_INPLACE_MIN_BYTES = 0
    return train_zero(cfg_dicts)


def checkpoint_chain(d: dict, root: str, first: int, then: int) -> dict:
    """Train ``first`` steps, save, then train ``then`` more: losses of all steps (the continuous run)."""
    info = init_process()
    torch.set_num_threads(1)
    cfg, mesh, model, engine, loader = _build(d, info)
    losses = [engine.step(loader.next_step()).loss for _ in range(first)]
    meta = {"step": engine.step_count, "loader": loader.state_dict(), "world_size": info.world_size}
    checkpoint.save(root, engine.step_count, {"model": engine.model_state(), "optim": engine.optim_state()},
                    meta, {"torch_rng": torch.get_rng_state()}, info.rank, keep=10)
    losses += [engine.step(loader.next_step()).loss for _ in range(then)]
    return {"losses": losses}


def resume_and_step(d: dict, ckpt: str, steps: int, save_root: str | None = None) -> dict:
    """Load ``ckpt`` into a fresh engine of config ``d``, train ``steps`` steps; optionally save again."""
    info = init_process()
    torch.set_num_threads(1)
    cfg, mesh, model, engine, loader = _build(d, info)
    template = {"model": engine.model_state(), "optim": engine.optim_template()}
    meta, _ = checkpoint.load(ckpt, template, info.rank)
    engine.load_model_state(template["model"])
    engine.load_optim_state(template["optim"])
    engine.step_count = int(meta["step"])
    loader.load_state_dict(meta["loader"])
    loaded = None
    if info.world_size == 1:
        with resident(template["model"].values()):  # (NVMe offload: read from the swap file)
            loaded = {k: v.detach().clone() for k, v in template["model"].items()}
    losses = [engine.step(loader.next_step()).loss for _ in range(steps)]
    saved = None
    if save_root:
        m = {"step": engine.step_count, "loader": loader.state_dict(), "world_size": info.world_size}
        saved = str(checkpoint.save(save_root, engine.step_count,
                                    {"model": engine.model_state(), "optim": engine.optim_state()},
                                    m, {"torch_rng": torch.get_rng_state()}, info.rank, keep=10))
    return {"losses": losses, "saved": saved, "loaded": loaded}


def current_rss_bytes() -> int:
    import psutil
    return psutil.Process(os.getpid()).memory_info().rss


def measure_states(cfg_dicts: list[dict]) -> list[dict]:
    """Resident memory growth of building and training each config (model states once a step is over:
    activations, gathered blocks and gradient buckets are gone).  Run with MALLOC_MMAP_THRESHOLD_ set so
    large tensors are mmapped and freeing them returns memory to the OS."""
    import gc
    info = init_process()
    torch.set_num_threads(1)
    cfg0 = parse_config(cfg_dicts[0])
    tokens, _ = split_tokens(load_tokens(cfg0.data.path), cfg0.data.val_fraction)
    mesh = Mesh.build(info.device, **cfg0.mesh_sizes())
    # Everything alive now (torch's and podscale's modules, the data: ~260k objects) moves to the collector's
    # permanent generation, so the collections below traverse only what each config creates: a full
    # collection over the imported modules costs 0.25-0.5 s, and each config runs three (measured: 6 of the
    # 24 s of a 4-config run).  What a config frees is collected as before.
    gc.collect()
    gc.freeze()
    out = []
    # warm-up runs, not measured: the first config of each precision.  One-time library costs (thread
    # pools, gloo buffers, oneDNN's JIT kernels and primitive cache for the bf16 matmul shapes: ~11 MiB)
    # are paid there and not charged to whichever measured config happens to run first
    warm = {d["train"]["precision"]: d for d in reversed(cfg_dicts)}
    for d in list(warm.values()) + cfg_dicts:
        cfg = parse_config(d)
        loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch,
                               mesh.local_rank("dp"), mesh.size("dp"), seed=cfg.run.seed)
        batches = [loader.next_step() for _ in range(cfg.run.steps)]
        gc.collect()
        before = current_rss_bytes()
        reset_peak_rss()
        torch.manual_seed(cfg.run.seed)
        model = GPT(gpt_config(cfg))
        n_params = sum(p.numel() for p in model.parameters())
        small = sum(p.numel() for p in model.parameters() if p.numel() < cfg.zero.param_persistence_threshold)
        layer = max(sum(p.numel() for p in b.parameters() if p.numel() >= cfg.zero.param_persistence_threshold)
                    for b in model.blocks.values())
        in_blocks = {id(p) for p in model.blocks.parameters()}
        root = sum(p.numel() for p in model.parameters()
                   if id(p) not in in_blocks and p.numel() >= cfg.zero.param_persistence_threshold)
        strategy = build_strategy(model, mesh, cfg.train, cfg.zero)
        engine = gpt_engine(model, mesh, cfg, strategy)
        built = current_rss_bytes()
        reset_peak_rss()
        for b in batches:
            engine.step(b)
        if strategy is not None:
            strategy.wait_params()  # the post-step parameter all-gather is in flight until next forward
        peak = hwm_rss_bytes()
        gc.collect()
        after = current_rss_bytes()
        sb = strategy.state_bytes() if strategy is not None else None
        out.append({"delta": after - before, "peak": peak - built, "built": built - before, "params": n_params,
                    "persistent": small, "layer": layer, "root": root, "state_bytes": sb})
        if strategy is not None:
            strategy.remove_hooks()
        del engine, strategy, model
        gc.collect()
    return out[len(warm):]


def reset_peak_rss() -> None:
    """Reset the kernel's resident high-water mark (VmHWM) of this process (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def hwm_rss_bytes() -> int:
    """Peak resident memory since the last :func:`reset_peak_rss` (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def nvme_budget_run(d: dict, steps: int, ckpt_root: str | None = None, then: int = 0) -> dict:
    """Stage 3 + NVMe optimizer offload of a model built on the meta device; the process's peak resident
    memory growth over the baseline (taken after imports, data and process group) and the bytes on disk.

    With ``ckpt_root``: after ``steps`` steps a checkpoint is saved, ``then`` more steps are trained, the
    checkpoint is loaded back into the same engine (its state on disk is overwritten) and the same ``then``
    steps are trained again: ``losses_after_save`` and ``losses_after_load`` must be equal, and the peak
    growth covers the save and the load."""
    import gc
    if os.environ.get("NO_MKLDNN"):
        torch.backends.mkldnn.enabled = False
    info = init_process()
    torch.set_num_threads(1)
    cfg = parse_config(d)
    mesh = Mesh.build(info.device, **cfg.mesh_sizes())
    tokens, _ = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
    loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch,
                           mesh.local_rank("dp"), mesh.size("dp"), seed=cfg.run.seed)
    batches = [loader.next_step() for _ in range(steps + then)]
    del tokens
    gc.collect()
    base = current_rss_bytes()
    reset_peak_rss()  # ru_maxrss would carry the launching process's peak across exec
    torch.manual_seed(cfg.run.seed)
    with torch.device("meta"):
        model = GPT(gpt_config(cfg))
    strategy = build_strategy(model, mesh, cfg.train, cfg.zero)  # materialised by GPT.init_parameter
    engine = gpt_engine(model, mesh, cfg, strategy)
    trace = [("built", current_rss_bytes() - base, hwm_rss_bytes() - base)]
    losses, times = [], []
    for b in batches[:steps]:
        r = engine.step(b)
        losses.append(r.loss)
        times.append(r.step_time_s)
        trace.append(("step", current_rss_bytes() - base, hwm_rss_bytes() - base))
    out = {}
    if ckpt_root is not None:
        meta = {"step": engine.step_count, "world_size": info.world_size}
        saved = checkpoint.save(ckpt_root, engine.step_count, {"model": engine.model_state(),
                                                               "optim": engine.optim_state()},
                                meta, {"torch_rng": torch.get_rng_state()}, info.rank, keep=1)
        trace.append(("save", current_rss_bytes() - base, hwm_rss_bytes() - base))
        out["save_peak"] = hwm_rss_bytes() - base
        out["losses_after_save"] = [engine.step(b).loss for b in batches[steps:]]
        trace.append(("steps", current_rss_bytes() - base, hwm_rss_bytes() - base))
        template = {"model": engine.model_state(), "optim": engine.optim_template()}
        meta, _ = checkpoint.load(saved, template, info.rank)
        engine.load_model_state(template["model"])
        engine.load_optim_state(template["optim"])
        engine.step_count = int(meta["step"])
        del template
        trace.append(("load", current_rss_bytes() - base, hwm_rss_bytes() - base))
        out["load_peak"] = hwm_rss_bytes() - base
        out["losses_after_load"] = [engine.step(b).loss for b in batches[steps:]]
        trace.append(("steps", current_rss_bytes() - base, hwm_rss_bytes() - base))
        out["ckpt_bytes"] = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    strategy.complete_step()  # the last step streams during the next forward: none comes, finish it
    sb = strategy.state_bytes()
    f = strategy.state.swap.file
    io = {"read": f.bytes_read, "written": f.bytes_written, "read_s": f.read_s, "write_s": f.write_s}
    out.update({"growth": hwm_rss_bytes() - base, "base": base, "on_disk": sb["on_disk"], "state_bytes": sb,
                "losses": losses, "step_s": times, "io": io,
                "params": sum(p.numel() for p in model.parameters()),
                "trace": [(k, round(a / 2**20), round(b / 2**20)) for k, a, b in trace]})
    strategy.close()
    return out


def disk_full_build(nvme_path: str) -> str:
    """In a process of its own (the file-size limit stays with it): with files limited to 1 MiB, build a
    ZeRO-3 strategy whose optimizer state is swapped to ``nvme_path``; ``"CLEAR: "`` and the storage error
    it raises, or what happened instead."""
    import resource
    import signal

    from podscale.config import parse_config
    from podscale.models.gpt import GPTConfig
    from podscale.storage.aio import StorageFullError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    cfg = parse_config({"zero": {"stage": 3, "offload_optimizer": "nvme", "nvme_path": nvme_path}})
    try:
        build_strategy(GPT(GPTConfig(n_layer=2, n_embd=128)), Mesh.build(), cfg.train, cfg.zero)
    except StorageFullError as e:
        return f"CLEAR: {e}"
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        return f"another error: {type(e).__name__}: {e}"
    return "no error"


def batches_for(cfg, steps: int) -> list:
    """The first ``steps`` optimizer steps' micro-batches of ``cfg``'s data on this rank (one process)."""
    tokens, _ = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
    loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch,
                           seed=cfg.run.seed)
    return [loader.next_step() for _ in range(steps)]
