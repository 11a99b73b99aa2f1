"""A GPT language model (Radford et al. 2019), written to read top to bottom like nanoGPT.

Pre-norm transformer blocks: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``, causal self-attention through
``scaled_dot_product_attention``, GELU MLP of width ``4 * n_embd``, input and output embeddings tied
(Press & Wolf 2017).  Initialisation follows GPT-2: N(0, 0.02), residual projections scaled by
``1/sqrt(2 * n_layer)``.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from podscale.parallel.model_protocols import GatherUnits, MetaInitModel


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count: 12·L·h² + 13·L·h for the blocks (with biases), plus embeddings and final norm."""
        h, L = self.n_embd, self.n_layer
        per_block = 12 * h * h + (13 * h if self.bias else 4 * h)
        n = L * per_block + (2 * h if self.bias else h)
        if include_embeddings:
            n += self.vocab_size * h + self.block_size * h
        return n

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6·N for the matmuls plus 12·L·h·s for attention (PaLM, Appendix B)."""
        return 6 * self.num_params(include_embeddings=False) + 6 * self.vocab_size * self.n_embd \
            + 12 * self.n_layer * self.n_embd * self.block_size


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout
        # where dropout on the attention probabilities draws from: tensor parallelism, which leaves each
        # rank some of the heads, swaps in a stream of this rank's own (podscale.parallel.rng)
        self.heads_rng = contextlib.nullcontext
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The number of heads follows from the projection's width, so a tensor-parallel projection
        # holding n_head / tp heads runs this same code; the sequence length follows from its output, so a
        # sequence-parallel input (T / tp positions, gathered inside the projection) does too.
        qkv = self.qkv(x)
        B, T, _ = qkv.shape
        q, k, v = qkv.chunk(3, dim=2)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = self.core(q, k, v).transpose(1, 2).reshape(B, T, -1)
        return self.resid_drop(self.proj(y))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v with a causal mask and dropout on the attention probabilities (what
        selective recomputation recomputes)."""
        p = self.dropout if self.training else 0.0
        with self.heads_rng() if p > 0 else contextlib.nullcontext():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CrossEntropy(nn.Module):
    """Mean cross-entropy over all tokens (tensor parallelism swaps in a vocab-parallel one)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


class GPT(nn.Module, MetaInitModel, GatherUnits):
    """The model; it can be built on the meta device and materialise itself (:class:`MetaInitModel`), and its
    blocks are ZeRO-3's gather units (:class:`GatherUnits`)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # One base seed from torch's global generator, drawn before the layers' own (discarded) default init
        # consumes it; each parameter is then drawn from its own generator seeded by (base seed, name), so any
        # rank can materialise any parameter, or its shard of one, from a model built on the meta device
        # without building the rest (what ZeRO-3 and tp/pp need at scale).
        self.init_seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        # Keyed by layer number, so a pipeline stage that keeps some of them keeps their names.
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.loss_fn = CrossEntropy()
        with torch.no_grad():
            for name, p in self.named_parameters():
                if not p.is_meta:
                    self.init_parameter(name, p)

    def init_parameter(self, name: str, t: torch.Tensor) -> None:
        """Fill ``t`` with the initial value of parameter ``name`` (GPT-2: weights N(0, 0.02), residual
        projections N(0, 0.02 / sqrt(2 * n_layer)), biases 0, layer-norm gains 1); the same values every
        time for the same ``init_seed``, whichever rank or device asks."""
        if name == "lm_head.weight":  # tied to the input embedding: a pipeline's last stage holds a copy
            name = "wte.weight"
        if name.endswith(".bias"):
            t.zero_()
        elif name.startswith("ln_f.") or ".ln_" in name:
            t.fill_(1.0)
        else:
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith("proj.weight") else 0.02
            # drawn on the CPU whatever ``t``'s device: CUDA's generator gives other numbers for the same seed
            g = torch.Generator().manual_seed((self.init_seed + zlib.crc32(name.encode())) % 2**63)
            if t.device.type == "cpu":
                t.normal_(0.0, std, generator=g)
            else:
                t.copy_(torch.empty(t.shape, dtype=t.dtype).normal_(0.0, std, generator=g))

    def materialize(self, device: torch.device | str = "cpu") -> "GPT":
        """Give every parameter still on the meta device its initial value on ``device``, in place; a buffer
        still on the meta device starts at zero there (the only buffers of the GPT family are the MoE
        routers' balance biases, which start at zero)."""
        for mod_name, mod in self.named_modules():
            for b_name, b in list(mod.named_buffers(recurse=False)):
                if b.is_meta:
                    setattr(mod, b_name, torch.zeros(b.shape, dtype=b.dtype, device=device))  # (stays a buffer)
            for p_name, p in list(mod.named_parameters(recurse=False)):
                if p.is_meta:
                    t = torch.empty(p.shape, dtype=p.dtype, device=device)
                    with torch.no_grad():
                        self.init_parameter(f"{mod_name}.{p_name}" if mod_name else p_name, t)
                    new = nn.Parameter(t, requires_grad=p.requires_grad)
                    new.__dict__.update(p.__dict__)  # keep the tags set by parallel wrappers (param_tags)
                    setattr(mod, p_name, new)
        if self.lm_head is not None and self.wte is not None:
            self.lm_head.weight = self.wte.weight  # re-tie after materialising
        return self

    def gather_units(self) -> list[nn.Module]:
        """ZeRO-3's gather units: the transformer blocks, in forward order."""
        return list(self.blocks.values())

    def empty_chunk(self) -> "GPT":
        """A module of this model's class holding nothing yet but the configuration and the init seed: the
        pipeline fills in a stage's layers (:func:`podscale.parallel.pipeline.partition.split_chunk`).  A
        subclass with state beside its modules adds it here."""
        chunk = type(self).__new__(type(self))
        nn.Module.__init__(chunk)
        chunk.cfg, chunk.init_seed = self.cfg, self.init_seed
        return chunk

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, tokens: torch.Tensor | None = None):
        """Logits for ``idx`` (B, T); with ``targets``, also the mean cross-entropy over all tokens.

        A pipeline stage (``podscale.parallel.pipeline``) keeps only some layers: without ``wte`` it takes
        the previous stage's activations as ``idx``, without ``lm_head`` it returns its activations.
        ``tokens``: the micro-batch's token ids, which a pipeline gives every stage (the GPT does not use
        them; a GPT-MoE's random routing draws from them on stages past the first).
        """
        if self.wte is not None:
            T = idx.shape[1]
            if T > self.cfg.block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
            pos = torch.arange(T, device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
        else:
            x = idx
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is None:
            return x, None
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, self.loss_fn(logits, targets)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens autoregressively (temperature and top-k sampling)."""
        return sample(lambda ctx: self(ctx)[0][:, -1, :], idx, max_new_tokens, self.cfg.block_size,
                      temperature, top_k, generator)


@torch.no_grad()
def sample(next_logits, idx: torch.Tensor, max_new_tokens: int, block_size: int, temperature: float = 1.0,
           top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Extend ``idx`` (B, T) by ``max_new_tokens`` tokens drawn from ``next_logits(context)``, the (B, vocab)
    logits of the context's last position: one process's forward, or a parallel layout's distributed one
    (which gives every rank the same logits, so every rank draws the same tokens from the same seed)."""
    for _ in range(max_new_tokens):
        logits = next_logits(idx[:, -block_size:]).float() / max(temperature, 1e-6)
        if top_k is not None:
            v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
            logits[logits < v[:, [-1]]] = -float("inf")
        probs = F.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat((idx, nxt), dim=1)
    return idx
