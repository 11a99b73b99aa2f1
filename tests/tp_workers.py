"""Worker functions for tensor/sequence/pipeline-parallel tests (spawned workers import this module)."""
from __future__ import annotations

import contextlib

import torch
from torch._dynamo.utils import counters

from podscale.config import parse_config
from podscale.models.gpt import GPT
from podscale.parallel.compose import build_engine
from podscale.parallel.param_tags import tags
from podscale.parallel.tensor import unshard
from podscale.parallel.zero import ZeroStrategy
from podscale.runtime import comm
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process
from podscale.train.data import ShardedLoader, load_tokens, split_tokens
from podscale.tasks.gpt import generate, gpt_config

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 64, "block_size": 64}


def make_config(data_path: str, steps: int, global_batch: int, micro_batch: int, nproc: int,
                model: dict | None = None, **parallel) -> dict:
    # lr 2e-3: at 3e-3 this model hits a loss spike near step 20, where any rounding difference between
    # layouts (a different order of sums) is amplified chaotically; layouts are compared in a stable regime.
    return {"run": {"steps": steps, "seed": 7}, "model": dict(model or MODEL), "data": {"path": data_path},
            "parallel": {"nproc": nproc, "bucket_mb": 0.05, **parallel},
            "train": {"global_batch": global_batch, "micro_batch": micro_batch, "precision": "fp32",
                      "lr": 2e-3, "min_lr": 2e-4, "warmup_steps": 5, "grad_clip": 1.0}}


def _own_parts(t):
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    if isinstance(t, ShardedTensor):
        parts = [(tuple(s.metadata.shard_offsets), s.tensor.detach().cpu().clone()) for s in t.local_shards()]
    else:
        parts = [((0,) * t.dim(), t.detach().cpu().clone())]
    return (tuple(t.size()), t.dtype, parts)


def assemble(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole tensors of a checkpoint state dict (ShardedTensors of every rank's own pieces, or plain
    tensors), put together on every rank from what each rank holds (test helper: an object all-gather)."""
    import torch.distributed as dist

    from podscale.storage.lazy import resident

    mine = {}
    with resident(state.values()):  # (ZeRO-Infinity: the state's buffers are read from its swap file)
        for name, t in state.items():
            mine[name] = _own_parts(t)
    every = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather_object(every, mine)
    out = {}
    for rank_state in every:
        for name, (size, dtype, parts) in rank_state.items():
            full = out.setdefault(name, torch.zeros(size, dtype=dtype))
            for off, part in parts:
                full[tuple(slice(o, o + n) for o, n in zip(off, part.shape))] = part
    return out


def full_named(engine, mesh, what: str = "param") -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of the single-process model, reassembled from tp shards and pp
    stages; complete on global rank 0."""
    local = {}
    zero_grads = {}
    inner = getattr(engine.strategy, "inner", engine.strategy)
    if what == "grad" and isinstance(inner, ZeroStrategy):
        # ZeRO holds this rank's slice of the reduced gradient: put the slices together over dp
        for u in inner.units:
            for p in u.params:
                zero_grads[id(p)] = torch.zeros(p.numel(), device=mesh.device)
        scale = inner.pending_grad_scale()  # (clipping a 16-bit or on-disk shard defers)
        for u in inner.units:
            grad = inner.state.read_unit("grad", u)  # (read from the swap file under NVMe offload)
            for (i, lo, hi), (_i, a, b) in zip(u.owned(), u.shard_ranges()):
                zero_grads[id(u.params[i])][lo:hi] = grad[a:b].float() * scale
        for g in zero_grads.values():
            comm.all_reduce(g, mesh, "dp")
    named = engine.strategy.named_parameters() if hasattr(engine.strategy, "named_parameters") \
        else engine.model.named_parameters()
    if what == "param" and hasattr(type(engine.strategy), "model_state"):
        # the checkpoint view: single-process names and shapes, each rank holding its own pieces
        return assemble(engine.strategy.model_state())
    else:
        for name, p in named:
            t = p.detach() if what == "param" else \
                zero_grads[id(p)].view_as(p) if id(p) in zero_grads else p.grad.detach()
            layout = tags(p).tp_layout
            local[name] = unshard(t, layout, mesh) if layout is not None and mesh.size("tp") > 1 else t.clone()
    # stages send theirs to pp rank 0 (one tensor each, names agreed through an object gather)
    if mesh.size("pp") > 1:
        import torch.distributed as dist
        names = [None] * mesh.size("pp")
        group = mesh.group("pp")
        shapes = {n: (tuple(t.shape), t.dtype) for n, t in local.items()}
        dist.all_gather_object(names, shapes, group=group)
        first = mesh.rank_of(pp=0)
        for stage in range(1, mesh.size("pp")):
            src = mesh.rank_of(pp=stage)
            for n, (shape, dtype) in names[stage].items():
                if mesh.rank == src:
                    comm.send(local[n].contiguous(), first, mesh, "pp")
                elif mesh.rank == first:
                    buf = torch.empty(shape, dtype=dtype, device=mesh.device)
                    comm.recv(buf, src, mesh, "pp")
                    local.setdefault(n, buf)
    return local


def train_layouts(cfg_dicts: list[dict]) -> list[dict]:
    """Train each config with podscale's composed engine; losses, grad norms per step, parameters after
    the last step and gradients of step 1 (both reassembled to the single-process shapes, on rank 0)."""
    info = init_process()
    torch.set_num_threads(1)
    out = []
    for d in cfg_dicts:
        d = dict(d)
        meta = d.pop("meta", False)
        cfg = parse_config(d)
        cfg.check_layout(info.world_size)
        mesh = Mesh.build(info.device, **cfg.mesh_sizes())
        torch.manual_seed(cfg.run.seed)
        # "meta": build the model on the meta device; each rank materialises only what it holds
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = GPT(gpt_config(cfg))
        engine = build_engine(model, mesh, cfg, measure_memory=True)
        graphs = counters["stats"]["unique_graphs"]  # (train.compile: graphs Dynamo traces while this trains)
        out_meta = {"meta_left": any(p.is_meta for p in engine.strategy.module.parameters())}
        tokens, _ = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
        loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch,
                               mesh.local_rank("dp"), mesh.size("dp"), seed=cfg.run.seed)
        losses, norms, skipped, grads1 = [], [], [], None
        for step in range(cfg.run.steps):
            if step == 0:  # step 1 also keeps its reduced gradients, read just before the optimizer step
                r, grads1 = _first_step(engine, loader, mesh)
            else:
                r = engine.step(loader.next_step())
            losses.append(r.loss)
            norms.append(r.grad_norm)
            skipped.append(r.skipped)
        params = full_named(engine, mesh)
        inner = getattr(engine.strategy, "inner", engine.strategy)
        out_meta["zero_units"] = [len(getattr(inner, "units", [])), len(getattr(inner, "layers", []))]
        out_meta["compiled_graphs"] = counters["stats"]["unique_graphs"] - graphs
        out.append({**out_meta, "losses": losses, "grad_norms": norms, "skipped": skipped,
                    "params": params if info.rank == 0 else None,
                    "grads1": grads1 if info.rank == 0 else None,
                    "comm": mesh.stats.snapshot(), "pipeline": _pipeline_stats(engine)})
    return out


def compiled_one_process_then_layouts(single: dict, micro_batches: int, backend: str, cfg_dicts: list[dict],
                                      moe_jobs: list[dict] = ()):
    """Rank 0 first trains ``single`` in one process with its blocks compiled (:func:`reference.reference_run`
    with ``backend``, ``micro_batches`` forwards per step) while the other ranks wait, so that its compiled
    kernels are in the inductor cache before every rank trains ``cfg_dicts`` (:func:`train_layouts`), then
    the GPT-MoE ``moe_jobs`` (:func:`gpt_moe_workers.run_jobs`).
    Returns (that run or None, the graphs Dynamo traced for it, the layouts' results, the CPU seconds this
    worker and the C++ compilers it ran used: inductor compiles in the worker itself, the MoE jobs' results)."""
    import resource

    import torch.distributed as dist

    from reference import reference_run
    info = init_process()
    graphs = counters["stats"]["unique_graphs"]
    one = reference_run(single, backend, micro_batches) if info.rank == 0 else None
    graphs = counters["stats"]["unique_graphs"] - graphs
    dist.barrier()
    out = train_layouts(cfg_dicts)
    cpu = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                               resource.getrusage(resource.RUSAGE_CHILDREN)))  # (+ the C++ compiler)
    import gpt_moe_workers
    return one, graphs, out, cpu, gpt_moe_workers.run_jobs(list(moe_jobs))


def _first_step(engine, loader, mesh):
    """Engine.step, with the gradients captured between the reduction and the optimizer step."""
    captured = {}
    strategy = engine.strategy
    orig = strategy.step

    def step_and_capture(lr):
        captured.update(full_named(engine, mesh, "grad"))
        return orig(lr)

    strategy.step = step_and_capture
    try:
        r = engine.step(loader.next_step())
    finally:
        del strategy.step
    return r, captured


def _pipeline_stats(engine) -> dict | None:
    st = getattr(engine.strategy, "stats", None)
    if st is None or not hasattr(st, "peak_in_flight"):
        return None
    return {"peak_in_flight": st.peak_in_flight, "peak_activation_bytes": st.peak_activation_bytes,
            "wait_s": st.wait_s, "compute_s": st.compute_s, "total_s": st.total_s,
            "chunks": [{"stage": c.stage, "layers": c.layers} for c in engine.strategy.placement]}


def _layouts(cfg_dicts: list[dict]):
    """Join the process group once, then (config, mesh) of each layout in turn."""
    info = init_process()
    torch.set_num_threads(1)
    for d in cfg_dicts:
        cfg = parse_config(d)
        cfg.check_layout(info.world_size)
        yield cfg, Mesh.build(info.device, **cfg.mesh_sizes())


def _engine_and_loader(cfg, mesh, seed: int):
    torch.manual_seed(seed)
    engine = build_engine(GPT(gpt_config(cfg)), mesh, cfg)
    tokens, _ = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
    loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch,
                           mesh.local_rank("dp"), mesh.size("dp"), seed=cfg.run.seed)
    return engine, loader


def _resume(engine, loader, root: str, rank: int) -> None:
    from pathlib import Path

    from podscale.train import checkpoint
    template = {"model": engine.model_state(), "optim": engine.optim_template()}
    meta, _ = checkpoint.load(checkpoint.latest(Path(root)), template, rank)
    engine.load_model_state(template["model"])
    engine.load_optim_state(template["optim"])
    engine.step_count = int(meta["step"])
    loader.load_state_dict(meta["loader"])


def checkpoint_roundtrip(cfg_dicts: list[dict], root: str, steps_before: int, steps_after: int) -> list[dict]:
    """Train ``cfg_dicts[0]`` for ``steps_before`` steps, checkpoint, train ``steps_after`` more; then for
    every other layout start from a model built with another seed, load the checkpoint and train the same
    ``steps_after`` steps.  Returns each layout's losses after the checkpoint; the writer's entry also has
    the bytes podscale's collectives moved while the checkpoint state was built and saved."""
    from pathlib import Path

    from podscale.train import checkpoint

    info = init_process()
    torch.set_num_threads(1)
    out = []
    for k, d in enumerate(cfg_dicts):
        cfg = parse_config(d)
        cfg.check_layout(info.world_size)
        mesh = Mesh.build(info.device, **cfg.mesh_sizes())
        engine, loader = _engine_and_loader(cfg, mesh, cfg.run.seed + (0 if k == 0 else 1000))  # loading must matter
        entry = {}
        if k == 0:
            for _ in range(steps_before):
                engine.step(loader.next_step())
            meta = {"step": steps_before, "loader": loader.state_dict(), "mesh": mesh.sizes,
                    "model_config": {}}
            mesh.stats.reset()
            checkpoint.save(Path(root), steps_before, {"model": engine.model_state(),
                                                       "optim": engine.optim_state()},
                            meta, {"torch_rng": torch.get_rng_state()}, info.rank, keep=1)
            entry["save_comm_bytes"] = mesh.stats.totals()["bytes"]
        else:
            _resume(engine, loader, root, info.rank)
        entry["losses"] = [engine.step(loader.next_step()).loss for _ in range(steps_after)]
        out.append(entry)
    return out


def resume_one_process(cfg_dict: dict, root: str, steps: int) -> list[float]:
    """In this (non-distributed) process: the plain single-process engine loads the latest checkpoint under
    ``root`` and trains ``steps`` steps; returns their losses."""
    cfg = parse_config(cfg_dict)
    cfg.check_layout(1)
    mesh = Mesh.build(torch.device("cpu"))
    engine, loader = _engine_and_loader(cfg, mesh, cfg.run.seed + 1000)
    _resume(engine, loader, root, 0)
    return [engine.step(loader.next_step()).loss for _ in range(steps)]


def layer_equivalence() -> dict:
    """A column-parallel then row-parallel pair (the Megatron MLP without its activation) against the same
    two full layers on this process: outputs and all gradients, with f/g and with sequence-parallel g/ḡ,
    the column layer fused (overlapped backward) or not.  Returns the worst relative differences."""
    import torch.nn.functional as F

    from podscale.parallel.tensor import ColumnParallelLinear, RowParallelLinear, shard

    info = init_process()
    mesh = Mesh.build(info.device, tp=info.world_size)
    torch.manual_seed(0)
    w1, b1, w2, b2 = torch.randn(16, 8), torch.randn(16), torch.randn(8, 16), torch.randn(8)
    x = torch.randn(2, 4 * info.world_size, 8)
    xf = x.clone().requires_grad_()
    w1f, b1f, w2f, b2f = (t.clone().requires_grad_() for t in (w1, b1, w2, b2))
    ref = F.linear(F.linear(xf, w1f, b1f), w2f, b2f)
    ref.pow(2).sum().backward()
    worst = {}
    for sp in (False, True):
        for overlap in (False, True):
            col = ColumnParallelLinear(shard(w1, "rows", mesh), shard(b1, "rows", mesh), mesh, sp, overlap)
            row = RowParallelLinear(shard(w2, "cols", mesh), b2.clone(), mesh, sp)
            xi = (x.chunk(info.world_size, dim=1)[info.rank] if sp else x).clone().requires_grad_()
            y = row(col(xi))
            y.pow(2).sum().backward()
            yr = ref.chunk(info.world_size, dim=1)[info.rank] if sp else ref
            gx = xf.grad.chunk(info.world_size, dim=1)[info.rank] if sp else xf.grad
            gb2 = row.bias.grad.clone()
            if sp:  # each rank saw its sequence shard only: the bias gradient is partial
                comm.all_reduce(gb2, mesh, "tp")
            pairs = [(y.detach(), yr.detach()), (xi.grad, gx), (col.weight.grad, shard(w1f.grad, "rows", mesh)),
                     (col.bias.grad, shard(b1f.grad, "rows", mesh)),
                     (row.weight.grad, shard(w2f.grad, "cols", mesh)), (gb2, b2f.grad)]
            # relative to the largest entry: fp32 rounding of sums in another order
            worst[f"sp={sp} overlap={overlap}"] = max(float((a - b).abs().max() / b.abs().max()) for a, b in pairs)
    return worst


def eval_and_sample(cfg_dicts: list[dict], eval_batch: int, n_eval: int, n_sample: int) -> list[dict]:
    """Train each config for its steps, then the validation loss (``Engine.evaluate``) over ``n_eval``
    batches of ``eval_batch`` sequences and ``n_sample`` bytes sampled with the run's seed
    (``podscale.tasks.gpt.generate``, as ``podscale train`` samples)."""
    from podscale.train.data import eval_batches

    out = []
    for cfg, mesh in _layouts(cfg_dicts):
        engine, loader = _engine_and_loader(cfg, mesh, cfg.run.seed)
        _, val = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
        for _ in range(cfg.run.steps):
            engine.step(loader.next_step())
        batches = eval_batches(val, cfg.model.block_size, eval_batch, n_eval, mesh.local_rank("dp"), mesh.size("dp"))
        val_loss = engine.evaluate(batches)
        g = torch.Generator().manual_seed(cfg.run.seed)
        sampled = generate(engine, torch.tensor([[10]]), n_sample, cfg.model.block_size, temperature=0.8, top_k=50,
                           generator=g)
        out.append({"val_loss": val_loss, "sample": sampled[0].tolist()})
    return out


def dropout_run(cfg_dicts: list[dict]) -> list[dict]:
    """Train each config (dropout > 0) with dropout seeded as ``podscale train`` seeds it; per layout: the
    losses, the largest difference across tp ranks of every block's output at the first forward (the
    residual stream, replicated over tp without sequence parallelism), and whether a draw inside and
    outside the model-parallel stream differs across tp ranks."""
    from podscale.parallel.rng import rng_tracker, seed_model_parallel

    out = []
    for cfg, mesh in _layouts(cfg_dicts):
        engine, loader = _engine_and_loader(cfg, mesh, cfg.run.seed)
        seed_model_parallel(cfg.run.seed, mesh)
        seen = []
        hooks = [b.register_forward_hook(lambda mod, args, y: seen.append(y.detach().clone()) if len(seen) < 4
                                         else None) for b in engine.model.blocks.values()]
        losses = [engine.step(loader.next_step()).loss for _ in range(cfg.run.steps)]
        for h in hooks:
            h.remove()

        def spread(t: torch.Tensor) -> float:
            """max |t on this rank - t on the other tp ranks|"""
            parts = torch.empty((mesh.size("tp") * t.shape[0],) + tuple(t.shape[1:]), device=mesh.device)
            comm.all_gather(parts, t.contiguous(), mesh, "tp")
            return float((parts.view((-1,) + tuple(t.shape)) - t).abs().max())

        with rng_tracker(mesh).fork():
            inside = spread(torch.rand(64, device=mesh.device))
        outside = spread(torch.rand(64, device=mesh.device))
        out.append({"losses": losses, "block_spread": max(spread(t) for t in seen[:4]),
                    "fork_spread": inside, "default_spread": outside})
    return out
