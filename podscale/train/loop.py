"""The training run a worker executes: build mesh, task, model, data and engine; train; validate;
checkpoint; the task's extras at the end.  ``podscale train`` runs ``run_worker`` in every worker process.

The loop knows no model family: everything specific to one comes from the :class:`~podscale.tasks.Task`
that the config's ``[model]`` section names (batches, loss, metrics, throughput unit, FLOPs per sample).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

from podscale import parallelize
from podscale.config import Config
from podscale.parallel.rng import rng_tracker, seed_model_parallel
from podscale.parallel.sharded_state import fill_from_full
from podscale.runtime import comm, watchdog
from podscale.runtime.mesh import AXES, Mesh
from podscale.runtime.metrics import MetricsLog, matmul_peak, peak_memory_bytes
from podscale.runtime.process import bind_this_worker, device_kind, init_process, local_slot
from podscale.tasks import task_for
from podscale.train import checkpoint, faults
from podscale.train.progress import Progress


def _bind_cores(device: str) -> list[int] | None:
    """``parallel.bind_cores``: pin this worker to its own share of the cores (:func:`bind_this_worker`) when it
    will run on the CPU, before the process group starts its communication threads, so they are bound too.
    Returns the cores (None: not bound)."""
    return bind_this_worker() if device_kind(device, local_slot()[1]) == "cpu" else None


def _set_cpu_threads(device: torch.device, cores: list[int] | None) -> None:
    """Local workers on a CPU share its cores instead of each spawning a thread per core (a bound worker already
    runs one per bound core; OMP_NUM_THREADS, when set, decides)."""
    if device.type != "cpu" or cores or "OMP_NUM_THREADS" in os.environ:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_slot()[1])))


def _gather_per_rank(value: float, mesh: Mesh) -> list[float]:
    """``value`` of every rank (world order), for per-rank memory reporting."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=mesh.device)
    out = torch.empty(mesh.world_size, dtype=torch.float64, device=mesh.device)
    comm.all_gather(out, t, mesh, AXES)
    return out.tolist()


def _init_weights(path: Path, engine, task, expected: checkpoint.Expected) -> str:
    """``train.init_from``: this rank's share of the model's weights from checkpoint ``path`` (collective),
    loaded by DCP when it is this model's own, else converted by the task (e.g. a GPT-MoE upcycled from a
    dense GPT) and written into the layout; the optimizer, data and step start afresh.  Returns what was
    done, for the run's first line."""
    source, conversion = checkpoint.initial_weights(path, task, expected.shapes)
    template = engine.model_state()
    if conversion is None:
        checkpoint.load_model(source.path, template)
        how = f"the weights of {source.path}"
    else:
        fill_from_full(template, conversion.tensors(list(template)))
        how = f"weights {conversion.describe()}"
    engine.load_model_state(template)
    return how


def run_worker(cfg: Config, resume: bool = False) -> dict:
    """Train as one rank of the job described by ``cfg``; returns a summary (rank 0's is complete)."""
    # torch's process-group timeout is the backstop of the hang watchdog (see podscale.runtime.watchdog)
    backstop = watchdog.backstop_s(cfg.run.collective_timeout_s)
    cores = _bind_cores(cfg.run.device) if cfg.parallel.bind_cores else None
    info = init_process(timeout_s=backstop, device=cfg.run.device)
    _set_cpu_threads(info.device, cores)
    cfg.check_layout(info.world_size)
    mesh = Mesh.build(info.device, timeout_s=backstop, **cfg.mesh_sizes())
    dog = watchdog.start(mesh, cfg.run.collective_timeout_s)
    # data ranks: dp, and ep when > 1 (expert-parallel ranks split the batch too)
    rank, dp_rank, dp = info.rank, mesh.local_rank(*mesh.data_axes), mesh.size(*mesh.data_axes)
    run_dir = cfg.run_dir
    ckpt_root = run_dir / "checkpoints"

    task = task_for(cfg)
    torch.manual_seed(cfg.run.seed)
    model = task.build_model_on(mesh)
    # what a checkpoint must hold to resume: the single-process names and shapes (under expert parallelism this
    # rank's model holds only its experts, as with experts folded over tp or split over tp, so the one-process
    # model is built on the meta device to compare)
    if mesh.size("ep") == 1 and not cfg.parallel.fold_tp_into_ep and not cfg.parallel.expert_tensor_parallel:
        single = model
    else:
        with torch.device("meta"):
            single = task.build_model()
    expected = checkpoint.expected_of(task, single)
    engine = parallelize(model, mesh, cfg, task)
    try:
        loader = task.train_data(dp_rank, dp)
        val = task.eval_data(dp_rank, dp)
        # Dropout masks differ per sample, as in one process: per dp and pp rank, and per tp rank where
        # activations are split over tp (the model-parallel RNG tracker).
        seed_model_parallel(cfg.run.seed, mesh)
        tracker = rng_tracker(mesh)

        start_step = 0
        restored = None
        if resume or info.restart_count > 0:  # the newest checkpoint that is complete and fits this model
            restored, skipped = checkpoint.latest_usable(ckpt_root, expected)
            if skipped and rank == 0:
                print(checkpoint.fallback_note(skipped, restored), flush=True)
        initialised = None
        if restored is None and cfg.train.init_from is not None:
            initialised = _init_weights(Path(cfg.train.init_from), engine, task, expected)
        if restored is not None:
            template = {"model": engine.model_state(), "optim": engine.optim_template()}
            meta, rank_state = checkpoint.load(restored, template, rank)
            engine.load_model_state(template["model"])
            engine.load_optim_state(template["optim"])
            task.load_state(restored)
            engine.step_count = start_step = int(meta["step"])
            loader.load_state_dict(meta["loader"])
            if engine.scaler is not None and meta.get("scaler"):
                engine.scaler.load_state_dict(meta["scaler"])
            if rank_state is not None and meta.get("world_size") == info.world_size:
                torch.set_rng_state(rank_state["torch_rng"])
                streams = {k.removeprefix("rng."): v for k, v in rank_state.items() if k.startswith("rng.")}
                if streams:  # (checkpoints from before the tracker have none)
                    tracker.set_states(streams)

        samples_per_step = cfg.train.global_batch
        units_per_step = samples_per_step * task.units_per_sample()
        flops_per_step = task.flops_per_sample() * samples_per_step
        unit = task.throughput_unit
        peak = matmul_peak(info.device, "fp32" if cfg.train.precision == "fp32" else cfg.train.precision)
        log = MetricsLog(run_dir / "metrics.jsonl", truncate_from_step=start_step,
                         tensorboard=cfg.run.tensorboard) if rank == 0 else None
        progress = Progress(cfg.run.steps, start_step, enabled=rank == 0)
        if rank == 0:
            progress.print(f"podscale: {cfg.run.name}: {task.describe(model)}, mesh {mesh.describe()}, "
                           f"accumulation {cfg.grad_accum}, {cfg.train.precision}, device {info.device}"
                           + (f", local ranks bound to {len(cores)} core(s) each" if cores else "")
                           + (f", resumed from {restored.name}" if restored is not None else "")
                           + (f", initialised with {initialised}" if initialised is not None else ""))

        def save(step: int) -> None:
            meta = {"step": step, "loader": loader.state_dict(), "world_size": info.world_size,
                    "mesh": mesh.sizes, "task": checkpoint.task_name(task),
                    "model_config": task.model_config(),
                    "scaler": engine.scaler.state_dict() if engine.scaler else None, "time": time.time()}
            rng = {"torch_rng": torch.get_rng_state(), **{f"rng.{k}": v for k, v in tracker.get_states().items()}}
            checkpoint.save(ckpt_root, step, {"model": engine.model_state(), "optim": engine.optim_state()},
                            meta, rng, rank, cfg.checkpoint.keep,
                            extra=lambda partial: task.save_state(partial, ckpt_root, step))

        last = {}
        mesh.stats.reset()
        for step in range(start_step, cfg.run.steps):
            mesh.ledger.step = step + 1  # (as logged; the watchdog names it)
            faults.maybe_kill(step, rank)
            faults.maybe_stall(step, rank)
            res = engine.step(loader.next_step())
            comm_totals, comm_axes = mesh.stats.totals(), mesh.stats.per_axis()
            mesh.stats.reset()
            task.after_step(engine.model, mesh)   # (collective, like step_metrics; not the step's traffic)
            task_metrics = task.step_metrics(engine.model, mesh)  # (collective; its traffic is not the step's)
            s = res.step
            record = {
                "step": s, "loss": res.loss, "lr": res.lr, "grad_norm": res.grad_norm, "skipped": res.skipped,
                "step_time_s": res.step_time_s,
                # throughput in the task's unit, under a generic key and under "<unit>_per_s" (tokens_per_s)
                "throughput": units_per_step / res.step_time_s, "throughput_unit": unit,
                f"{unit}_per_s": units_per_step / res.step_time_s,
                "tflops_per_rank": flops_per_step / res.step_time_s / info.world_size / 1e12,
                "mfu": flops_per_step / res.step_time_s / info.world_size / peak,
                "comm_share": comm_totals["exposed_s"] / res.step_time_s,
                "comm": {a: {k: round(v, 6) for k, v in d.items()} for a, d in comm_axes.items()},
            }
            if res.loss_scale is not None:
                record["loss_scale"] = res.loss_scale
            if task_metrics:
                record["task"] = task_metrics
            if cfg.run.eval_every and (s % cfg.run.eval_every == 0 or s == cfg.run.steps):
                record.update({f"val_{k}": v for k, v in task.evaluate(engine, val).items()})
            if s % cfg.run.log_every == 0 or s == cfg.run.steps:
                record["peak_mem_bytes"] = _gather_per_rank(peak_memory_bytes(info.device), mesh)
            mesh.stats.reset()
            if log is not None:
                log.write(record)
            progress.update(record)
            last = record
            if cfg.checkpoint.every and s % cfg.checkpoint.every == 0 and s < cfg.run.steps:
                save(s)
        if cfg.checkpoint.at_end and cfg.run.steps > start_step:
            save(cfg.run.steps)
        progress.close()

        summary = {"rank": rank, "steps": cfg.run.steps, "final_loss": last.get("loss"),
                   "val_loss": last.get("val_loss"), "run_dir": str(run_dir)}
        summary.update(task.finish(engine, rank, run_dir, progress.print))
        if log is not None:
            log.close()
        sys.stdout.flush()
        return summary
    finally:
        try:
            engine.close()  # the strategy's scratch state (swap files), also when the run failed
        finally:
            task.close()
            if dog is not None:
                dog.stop()
