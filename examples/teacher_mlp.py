"""A task of one's own: an MLP classifier that learns a hidden teacher network, on generated data.

It shows everything a model family brings to podscale (see ``podscale/tasks/base.py``) in one small file,
and it is the trunk's test that nothing in the engine, loop, checkpoints, progress, report or export
is specific to the GPT.  Train it with::

    PYTHONPATH=examples podscale train examples/teacher-mlp.toml

``[model] kind = "custom"`` with ``task = "teacher_mlp:TeacherMLPTask"`` names this class; the other keys
of ``[model]`` are its :class:`TeacherMLPTask.Options`.  The workers import the module by that name, so its
folder must be on ``PYTHONPATH`` (which they inherit) or the module installed.

The data: inputs ``x ~ N(0, I)`` of ``in_dim`` features, drawn once from ``data_seed``; labels
``argmax(teacher(x))`` for a fixed random two-layer teacher, so a student that learns it reaches high
accuracy and the loss means something.  Batches are ``(x, y)`` pairs; throughput counts samples.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from podscale.parallel.model_protocols import GatherUnits
from podscale.tasks import Task
from podscale.train.data import SampleOrder, rank_micro_batches


class MLP(nn.Module, GatherUnits):
    """``n_layer`` hidden layers of width ``hidden`` (Linear + GELU), then a linear head.  It declares its
    hidden layers as ZeRO-3's gather units (:class:`~podscale.parallel.model_protocols.GatherUnits`), so
    ZeRO-3 gathers and frees them one at a time (without it: the direct children holding parameters)."""

    def __init__(self, in_dim: int, hidden: int, n_layer: int, n_classes: int):
        super().__init__()
        dims = [in_dim] + [hidden] * n_layer
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(hidden, n_classes)

    def gather_units(self) -> list[nn.Module]:
        return list(self.layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def teacher_data(n: int, in_dim: int, n_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs and the labels a fixed random teacher (seeded by ``seed``) gives them."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(in_dim, 4 * n_classes, generator=g) / in_dim ** 0.5
    w2 = torch.randn(4 * n_classes, n_classes, generator=g) / (4 * n_classes) ** 0.5
    x = torch.randn(n, in_dim, generator=g)
    return x, (torch.tanh(x @ w1) @ w2).argmax(dim=1)


class TeacherLoader:
    """Micro-batches of ``(x, y)`` for one dp rank, in podscale's global sample order (the same global
    batch on every layout); its whole state is the number of samples consumed."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, global_batch: int, micro_batch: int, dp_rank: int,
                 dp_size: int, seed: int):
        self.x, self.y = x, y
        self.global_batch, self.micro_batch, self.dp_rank, self.dp_size = global_batch, micro_batch, dp_rank, dp_size
        self.seed, self.consumed = seed, 0
        self.order = SampleOrder(len(x), seed)

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for samples in rank_micro_batches(self.consumed, self.global_batch, self.micro_batch, self.dp_rank,
                                          self.dp_size):
            idx = torch.tensor([self.order(s) for s in samples])
            out.append((self.x[idx], self.y[idx]))
        self.consumed += self.global_batch
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint's data has seed {state['seed']} but this run has {self.seed}: resume "
                             "with the same run.seed")
        self.consumed = int(state["consumed"])


def accuracy(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The share of ``batch`` whose most likely class is the teacher's."""
    x, y = batch
    return (module(x).argmax(dim=1) == y).float().mean()


class TeacherMLPTask(Task):
    """Classify generated inputs as the hidden teacher does."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        in_dim: int = Field(32, ge=1)
        hidden: int = Field(128, ge=1)
        n_layer: int = Field(3, ge=1)
        n_classes: int = Field(8, ge=2)
        n_train: int = Field(8192, ge=1, description="generated training samples")
        n_val: int = Field(512, ge=1, description="generated validation samples")
        data_seed: int = Field(0, ge=0, description="seed of the inputs and of the teacher")

    throughput_unit = "samples"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.opt = cfg.model.options
        o = self.opt
        x, y = teacher_data(o.n_train + o.n_val, o.in_dim, o.n_classes, o.data_seed)
        self.train_xy, self.val_xy = (x[:o.n_train], y[:o.n_train]), (x[o.n_train:], y[o.n_train:])

    def build_model(self) -> nn.Module:
        o = self.opt
        return MLP(o.in_dim, o.hidden, o.n_layer, o.n_classes)  # on the CPU; the strategy moves it

    def model_config(self) -> dict:
        return self.opt.model_dump()

    def train_data(self, dp_rank: int, dp_size: int) -> TeacherLoader:
        t = self.cfg.train
        return TeacherLoader(*self.train_xy, t.global_batch, t.micro_batch, dp_rank, dp_size, self.cfg.run.seed)

    def eval_data(self, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        x, y = self.val_xy
        per = max(1, len(x) // (self.cfg.run.eval_batches * dp_size))
        out = []
        for b in range(self.cfg.run.eval_batches):
            lo = (b * dp_size + dp_rank) * per
            out.append((x[lo:lo + per], y[lo:lo + per]))
        return out

    def to_device(self, batch, device: torch.device):
        x, y = batch
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True)

    def loss(self, module: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(module(x).float(), y)

    def evaluate(self, engine, batches) -> dict[str, float]:
        acc = self.on_device(accuracy, self.cfg.train.precision, engine.device)
        return {"loss": engine.evaluate(batches), "accuracy": engine.evaluate(batches, acc)}

    def units_per_sample(self) -> float:
        return 1

    def flops_per_sample(self) -> float:
        o = self.opt
        weights = o.in_dim * o.hidden + (o.n_layer - 1) * o.hidden ** 2 + o.hidden * o.n_classes
        return 6 * weights  # forward 2 FLOPs per weight, backward 4
