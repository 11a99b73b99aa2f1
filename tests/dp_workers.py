"""Worker functions for multi-process tests (a module of its own so spawned workers can import it)."""
from __future__ import annotations

import torch

from podscale.config import parse_config
from podscale.models.gpt import GPT
from podscale.runtime.mesh import Mesh
from podscale.runtime.process import init_process
from podscale.train.data import ShardedLoader, load_tokens, split_tokens
from podscale.optim import build_adamw
from podscale.parallel.data import DataParallel
from podscale.tasks.gpt import GPTTask, gpt_config
from podscale.train.engine import Engine

MODEL = {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64}


def make_config(data_path: str, steps: int, global_batch: int, micro_batch: int, precision: str,
                nproc: int, bucket_mb: float = 0.05) -> dict:
    return {"run": {"steps": steps, "seed": 7}, "model": MODEL, "data": {"path": data_path},
            "parallel": {"nproc": nproc, "bucket_mb": bucket_mb},
            "train": {"global_batch": global_batch, "micro_batch": micro_batch, "precision": precision,
                      "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 5, "grad_clip": 1.0}}


def gpt_engine(model, mesh, cfg, strategy=None) -> Engine:
    """An Engine training ``model`` (the GPT of ``cfg``) with the GPT task's loss and ``strategy``
    (default: the replicated DataParallel over dp with ``cfg``'s optimizer and buckets)."""
    if strategy is None:
        t = cfg.train
        model = model.to(mesh.device)
        strategy = DataParallel(model, mesh, ("dp",), bucket_mb=cfg.parallel.bucket_mb, reduce_dtype=t.reduce_dtype,
                                optimizer=build_adamw(model, t.lr, (t.beta1, t.beta2), t.eps, t.weight_decay))
    return Engine(model, mesh, cfg.train, strategy, GPTTask(cfg).loss_fn(cfg.train.precision, mesh.device))


def train_podscale(cfg_dicts: list[dict]) -> list[dict]:
    """Train each config on this process group with podscale's engine; losses and grad norms per step."""
    info = init_process()
    torch.set_num_threads(1)
    out = []
    for d in cfg_dicts:
        cfg = parse_config(d)
        cfg.check_layout(info.world_size)
        mesh = Mesh.build(info.device, **cfg.mesh_sizes())
        torch.manual_seed(cfg.run.seed)
        model = GPT(gpt_config(cfg))
        engine = gpt_engine(model, mesh, cfg)
        tokens, _ = split_tokens(load_tokens(cfg.data.path), cfg.data.val_fraction)
        loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch,
                               mesh.local_rank("dp"), mesh.size("dp"), seed=cfg.run.seed)
        losses, norms = [], []
        for _ in range(cfg.run.steps):
            r = engine.step(loader.next_step())
            losses.append(r.loss)
            norms.append(r.grad_norm)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append({"losses": losses, "grad_norms": norms, "params": params if info.rank == 0 else None,
                    "buckets": len(engine.strategy.buckets), "comm": mesh.stats.snapshot()})
    return out
