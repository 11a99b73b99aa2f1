"""A Python-API script as a user writes it (issue 11, item 3): init, parallelize, a few steps, then
``dist.destroy_process_group()``; run by tests/test_api_exit.py under ``podscale launch -n 2``.

    python api_exit_script.py STAGE MODE     MODE: forget (no close), with (context manager), close
"""
import sys

import torch
import torch.distributed as dist

import podscale
from podscale.models import GPT, GPTConfig

stage, mode = int(sys.argv[1]), sys.argv[2]
cfg = podscale.load_config(None, [f"zero.stage={stage}", "model.n_layer=2", "model.n_embd=64", "model.n_head=2",
                                  "model.block_size=32", "train.global_batch=4", "train.micro_batch=2",
                                  "parallel.nproc=2", "zero.param_persistence_threshold=100"])
mesh = podscale.init(cfg)
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=32))


def train(engine):
    for _ in range(3):
        x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
        result = engine.step([(x, y)])
    print(f"rank {dist.get_rank()} loss {result.loss:.4f}", flush=True)


if mode == "with":
    with podscale.parallelize(model, mesh, cfg) as engine:
        train(engine)
    assert engine.closed
elif mode == "close":
    engine = podscale.parallelize(model, mesh, cfg)
    train(engine)
    engine.close()
    engine.close()  # twice is fine
else:  # the user forgets: the engine is drained at interpreter exit, after the process group is gone
    engine = podscale.parallelize(model, mesh, cfg)
    train(engine)
dist.destroy_process_group()
