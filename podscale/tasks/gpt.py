"""The GPT task: a byte-level GPT language model (``[model] kind = "gpt"``, the default).

Everything the trunk needs to train :class:`~podscale.models.gpt.GPT`: the model built on the meta
device (each rank materialises only what it holds), the byte corpus (``data.path``, or the Python standard
library's own source) cut into windows by the deterministic, resumable :class:`ShardedLoader`, the
cross-entropy loss, throughput in tokens and FLOPs per token for MFU, and text sampled at the end of a run.
The GPT runs under every layout: tensor and sequence parallelism and pipeline stages included.
"""
from __future__ import annotations

from dataclasses import asdict
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from podscale.models.gpt import GPT, GPTConfig, sample
from podscale.parallel.strategy import LossFn
from podscale.tasks.base import Task, on_device
from podscale.train.compile import eager
from podscale.train.data import ShardedLoader, eval_batches, load_tokens, split_tokens


def gpt_config(cfg) -> GPTConfig:
    """The :class:`GPTConfig` of a config's ``[model]`` section (``kind = "gpt"``)."""
    m = cfg.model
    return GPTConfig(vocab_size=m.vocab_size, block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head,
                     n_embd=m.n_embd, dropout=m.dropout, bias=m.bias)


def batch_to(batch: tuple[torch.Tensor, torch.Tensor], device: torch.device):
    """A GPT batch, ``(inputs, targets)`` token ids of shape (micro_batch, block_size), on ``device``."""
    x, y = batch
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def gpt_loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy of a GPT batch (``module(x, y)`` returns ``(logits, loss)``)."""
    x, y = batch
    return module(x, y)[1]


def gpt_loss_fn(precision: str, device: torch.device) -> LossFn:
    """The GPT's loss as the engine calls it (batch moved, autocast), for code that builds an
    :class:`~podscale.train.engine.Engine` without a config (benchmarks)."""
    return on_device(gpt_loss, batch_to, precision, device)


@torch.no_grad()
def generate(engine, idx: torch.Tensor, max_new_tokens: int, block_size: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sample from the GPT that ``engine`` trains, as :meth:`GPT.generate` does, on any layout: every rank
    must call it (tp and pp forwards are collective) and every rank gets the same tokens for the same
    ``generator`` seed (the strategy gathers vocabulary shards and broadcasts the last stage's logits)."""
    engine.model.eval()
    with eager():  # the context grows one token at a time: compiled blocks (train.compile) would recompile
        return sample(engine.strategy.next_logits, idx.to(engine.device), max_new_tokens, block_size, temperature,
                      top_k, generator)


class GPTTask(Task):
    """The byte-level GPT: batches are ``(inputs, targets)`` pairs of (micro_batch, block_size) token ids."""

    supports_tensor_parallel = True
    supports_pipeline = True
    supports_compile = True
    throughput_unit = "tokens"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.gpt = gpt_config(cfg)

    @cached_property
    def _tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(training, validation) bytes of the corpus, read once."""
        return split_tokens(load_tokens(self.cfg.data.path), self.cfg.data.val_fraction)

    def build_model(self) -> nn.Module:
        # On the meta device: each rank gives memory only to the parameters (or shards) it holds, each
        # initialised to its single-process value, so the whole model never has to fit one process.
        with torch.device("meta"):
            return GPT(self.gpt)

    def model_config(self) -> dict:
        return asdict(self.gpt)

    def compile_units(self, model: nn.Module) -> list[nn.Module]:
        """The transformer blocks (a pipeline's chunks share them with ``model``); the embeddings, final norm
        and (vocab-parallel) head and loss run eagerly."""
        return list(model.blocks.values())

    def describe(self, model: nn.Module) -> str:
        return (f"{self.gpt.num_params() / 1e6:.2f}M params, global batch {self.cfg.train.global_batch} x "
                f"{self.gpt.block_size} tokens")

    def train_data(self, dp_rank: int, dp_size: int) -> ShardedLoader:
        t = self.cfg.train
        return ShardedLoader(self._tokens[0], self.gpt.block_size, t.global_batch, t.micro_batch, dp_rank, dp_size,
                             seed=self.cfg.run.seed)

    def eval_data(self, dp_rank: int, dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``run.eval_batches`` global batches of validation windows, this rank's share of each in micro-batches: the
        same windows at every layout (as Megatron-LM evaluates ``eval_iters`` global batches), so runs at different
        dp, ep and micro-batch sizes report the validation loss of one set."""
        t = self.cfg.train
        return eval_batches(self._tokens[1], self.gpt.block_size, t.global_batch, self.cfg.run.eval_batches, dp_rank,
                            dp_size, t.micro_batch)

    def to_device(self, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device):
        return batch_to(batch, device)

    def loss(self, module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return gpt_loss(module, batch)

    def units_per_sample(self) -> float:
        return self.gpt.block_size

    def flops_per_sample(self) -> float:
        return self.gpt.flops_per_token() * self.gpt.block_size

    def finish(self, engine, rank: int, run_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
        """``run.sample_tokens`` bytes of text from byte 10 (a newline), written to ``sample.txt``."""
        n = self.cfg.run.sample_tokens
        if not n:
            return {}
        # every rank samples (tp and pp forwards are collective) and draws the same bytes from the same seed
        g = torch.Generator(device=engine.device).manual_seed(self.cfg.run.seed)
        out = generate(engine, torch.tensor([[10]], device=engine.device), n, self.gpt.block_size,
                       temperature=0.8, top_k=50, generator=g)
        text = bytes(out[0, 1:].tolist()).decode("utf-8", errors="replace")
        if rank == 0:
            (run_dir / "sample.txt").write_text(text)
            say("sample:\n" + text)
        return {"sample": text}
