"""Composing the layouts: one function turns a plain model, its task and a config into a training engine.

Order of application (each one a function of model and mesh; axis size 1 = off):
pipeline split on ``pp`` (stages, then virtual chunks) -> tensor/sequence parallelism on ``tp`` inside each
chunk -> the data-parallel strategy on ``dp`` (replicated — :class:`~podscale.parallel.data.SingleReplica`
over one data rank —, or ZeRO when ``zero.stage`` > 0; with expert
parallelism on ``dp`` x ``ep``, the experts on ``dp`` only) -> the
model-parallel wrapper that adds what tp and pp need on top (sequence-parallel gradient sums, the tied
embedding across first and last stage, the true global gradient norm, the pipeline schedule) -> with
``train.compile``, the task's repeated units compiled one by one, inside all of the above
(:mod:`podscale.train.compile`).

Every ZeRO stage composes with every (pp, tp, sp) layout.  With expert parallelism the pipeline and the
tensor-parallel wrapper get the same expert/dense split of the data-parallel strategy (a GPT-MoE: pp, tp
and sp in any combination, each with ep).  ZeRO sums the sequence-parallel gradients over
tp itself, unit by unit before each reduce-scatter; under a pipeline it accumulates the micro-batches'
gradients locally and reduce-scatters once per step from each chunk's last backward, the tied embedding's
unit after the first and last stage have added their copies (see :mod:`podscale.parallel.zero.strategy`).
"""
from __future__ import annotations

import torch.nn as nn

from podscale.optim import build_adamw
from podscale.parallel.data import DataParallel, SingleReplica
from podscale.parallel.model_protocols import MetaInitModel
from podscale.parallel.tensor import (TensorParallelStrategy, apply_recompute, apply_tensor_parallel,
                                      tensor_parallel_rng)


def _data_parallel(module: nn.Module, mesh, cfg, ep_sharded: list[nn.Parameter] = ()):
    """The data-parallel strategy over the data ranks (dp, and ep when > 1); ``ep_sharded``: the parameters
    each ep rank holds its own of (experts), replicated over dp only.  Replicated over one data rank there
    is nothing to reduce: :class:`SingleReplica`, with autograd's own gradients (no buckets, no hooks)."""
    t = cfg.train
    if cfg.zero.stage > 0:
        from podscale.parallel.zero import build_strategy  # ZeRO over dp (dp x ep for dense parameters)
        return build_strategy(module, mesh, t, cfg.zero, bucket_mb=cfg.parallel.bucket_mb, ep_sharded=ep_sharded)
    optimizer = build_adamw(module, t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay)
    if mesh.size(*mesh.data_axes) == 1:
        return SingleReplica(module, mesh, optimizer)
    return DataParallel(module, mesh, mesh.data_axes, bucket_mb=cfg.parallel.bucket_mb,
                        reduce_dtype=t.reduce_dtype, optimizer=optimizer, ep_sharded=ep_sharded)


def build_engine(model: nn.Module, mesh, cfg, task=None, measure_memory: bool = False):
    """Apply ``cfg``'s (pp, dp, ep, tp) layout to ``model`` and return an Engine that trains it with
    ``task``'s loss (a :class:`podscale.tasks.Task`; default: the task ``cfg``'s ``[model]`` names).  With
    ep > 1 ``model`` is this rank's (:meth:`~podscale.tasks.Task.build_model_on`: its own experts) and the
    data-parallel strategy reduces the task's :meth:`~podscale.tasks.Task.ep_sharded_parameters` over dp
    and every other parameter over dp x ep.

    ``model`` may be built on the meta device (``with torch.device("meta"): GPT(cfg)``): then each rank
    gives memory only to its own pipeline chunks and tensor-parallel shards, each parameter initialised to
    exactly its single-process value (a :class:`~podscale.parallel.model_protocols.MetaInitModel`, as
    :meth:`GPT.init_parameter`).  Tensor, sequence and pipeline
    parallelism need a task that supports them (the GPT's).

    ``measure_memory``: the pipeline schedule counts the bytes each micro-batch saves for backward.
    """
    from podscale.tasks import check_task_layout, task_for
    from podscale.tasks.base import check_task_compile
    from podscale.train.engine import Engine

    p = cfg.parallel
    task = task if task is not None else task_for(cfg)
    check_task_layout(type(task), mesh.size("tp"), p.sequence_parallel, mesh.size("pp"), mesh.size("ep"))
    if cfg.train.compile:
        check_task_compile(type(task), p.recompute)
    task.bind(model, mesh)  # state outside the parameters (sharded tables), before the strategy wraps the model
    loss_fn = task.loss_fn(cfg.train.precision, mesh.device)
    if mesh.size("pp") > 1:
        from podscale.parallel.pipeline.schedule import PipelineParallel
        def make_data_parallel(module, mesh, cfg):  # this rank's chunks; their experts (if any) over dp only
            return _data_parallel(module, mesh, cfg, task.ep_sharded_parameters(module))
        strategy = PipelineParallel.build(model, mesh, cfg, make_data_parallel, measure_memory)
        engine = Engine(strategy.module, mesh, cfg.train, strategy, loss_fn)
    else:
        apply_recompute(model, p.recompute, tensor_parallel_rng(mesh, p.sequence_parallel))
        if mesh.size("tp") == 1 and not p.sequence_parallel:
            if cfg.zero.stage == 0 and isinstance(model, MetaInitModel):
                model.materialize(mesh.device)  # (ZeRO materialises a meta-device model one unit at a time)
            # (after materialising: the parameters are the ones the strategy trains)
            strategy = _data_parallel(model, mesh, cfg, task.ep_sharded_parameters(model))
        else:
            apply_tensor_parallel(model, mesh, p.sequence_parallel)
            model.materialize(mesh.device)  # what tp did not shard, on a model built on the meta device
            strategy = TensorParallelStrategy(_data_parallel(model, mesh, cfg, task.ep_sharded_parameters(model)),
                                              model, mesh, cfg.train.precision, p.sequence_parallel)
        engine = Engine(model, mesh, cfg.train, strategy, loss_fn)
    if cfg.train.compile:
        # last, once every layout has shaped the units (tp's layers, ZeRO's parameters and hooks, pipeline
        # chunks, which share their blocks with ``model``): each unit's forward compiles at its first call
        from podscale.train.compile import compile_units
        compile_units(task.compile_units(model), cfg.train.compile_backend)
    return engine
