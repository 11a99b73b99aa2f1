"""GPT-MoE: the GPT of :mod:`podscale.models.gpt` with a mixture-of-experts feed-forward in every
``moe_every``-th block (GShard, Lepikhin et al. 2020, section 2: every other feed-forward layer of the
Transformer becomes an MoE layer; Switch, Fedus et al. 2021, likewise).

Block ``i`` is an MoE block when ``(i + 1) % moe_every == 0`` (``moe_every = 2``: blocks 1, 3, ...).  The
loss is the language-model cross-entropy plus, for every MoE layer, ``aux_loss_coef`` times its
load-balancing loss (its first-choice shares counted per sequence or, with ``aux_loss_scope = "global"``, over
the global batch: Qiu et al. 2025; ``"global_step"``, over the micro-batches of the step so far, the paper's
buffer for gradient accumulation) and ``z_loss_coef`` times its router z-loss.  Initialisation is the GPT's, per
parameter from (``init_seed``, name); expert parameters are named by global expert id, so a rank that holds
experts ``[first, first + El)`` of an expert-parallel layout materialises exactly their single-process
values, and the names (hence checkpoints) are the same at every ep size.

Per-step metrics: every training forward adds its layers' :class:`~podscale.parallel.moe.MoEStats` to
:attr:`GPTMoE.moe_metrics`; the task reads and clears them once per step with
:meth:`MoEMetrics.pop` (dropped-token share, per-expert load min/max/entropy, aux and z losses per layer).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from podscale.models.gpt import GPT, CausalSelfAttention, GPTConfig
from podscale.parallel.moe import Gating, MoELayer, MoEStats, check_moe_args, sequence_token_keys
from podscale.parallel.moe.kernels import kernel_named


@dataclass
class GPTMoEConfig(GPTConfig):
    experts: int = 8
    top_k: int = 2
    moe_every: int = 2
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    dropless: bool = False
    random_routing: bool = True
    drop_policy: str = "position"      # or "priority" (V-MoE's BPR), "probs" (Megatron-core): gate.DROP_POLICIES
    aux_loss_coef: float = 1e-2
    aux_loss_scope: str = "group"      # "global"/"global_step": f_e over the batch/step (Qiu et al. 2025), MoELayer
    z_loss_coef: float = 1e-3
    bias_balancing: bool = False       # DeepSeek-V3's auxiliary-loss-free selection bias, stepped after each step
    bias_update_rate: float = 1e-3
    expert_hidden: int | None = None   # default 4 * n_embd, the dense MLP's width
    expert_recompute: bool = False     # keep the experts' pre-activation only; the GELU again in the backward
    expert_kernel: str = "auto"        # podscale.parallel.moe.kernels.KERNEL_NAMES; auto: by device and dtype
    shared_experts: int = 0            # DeepSeekMoE's shared experts: one dense FFN of shared_experts x hidden
    router_score: str = "softmax"      # or "sigmoid" (DeepSeek-V3's affinities): podscale.parallel.moe.Gating
    router_groups: int = 1             # node-limited routing: experts in this many groups (1: no limit)
    router_group_top_k: int = 1        # ... a token's experts chosen from its best this-many groups
    router_scale: float = 1.0          # gate values times this (DeepSeek-V3's routed scaling factor)

    def is_moe(self, layer: int) -> bool:
        return (layer + 1) % self.moe_every == 0

    @property
    def hidden(self) -> int:
        return self.expert_hidden or 4 * self.n_embd

    @property
    def gating(self) -> Gating:
        return Gating(self.router_score, self.router_groups, self.router_group_top_k, self.router_scale)


class MoEBlock(nn.Module):
    """``x + attn(ln(x))`` then ``x + moe(ln(x))``; the MoE's extra loss and statistics are returned."""

    def __init__(self, cfg: GPTMoEConfig, layer: int, mesh=None, sequence_parallel: bool = False,
                 fold_tp: bool = False, expert_tensor_parallel: bool = False, expert_dispatch: str = "choice"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.moe = MoELayer(cfg.n_embd, cfg.hidden, cfg.experts, cfg.top_k, cfg.capacity_factor,
                            cfg.eval_capacity_factor, cfg.dropless, cfg.random_routing, cfg.aux_loss_coef,
                            cfg.z_loss_coef, cfg.bias_balancing, cfg.bias_update_rate, mesh=mesh,
                            seed=zlib.crc32(f"moe{layer}".encode()), bias=cfg.bias,
                            sequence_parallel=sequence_parallel, recompute_activation=cfg.expert_recompute,
                            kernel=kernel_named(cfg.expert_kernel, cfg.expert_recompute),
                            shared_hidden=cfg.shared_experts * cfg.hidden, fold_tp=fold_tp,
                            expert_tensor_parallel=expert_tensor_parallel, gating=cfg.gating,
                            aux_loss_scope=cfg.aux_loss_scope, expert_dispatch=expert_dispatch,
                            drop_policy=cfg.drop_policy)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None):
        x = x + self.attn(self.ln_1(x))
        y, out = self.moe(self.ln_2(x), keys)
        return x + y, out


@dataclass
class MoEMetrics:
    """Routing statistics of the forwards since the last :meth:`pop`, per MoE block (by layer name)."""

    layers: dict[str, MoEStats] = field(default_factory=dict)

    def add(self, name: str, stats: MoEStats) -> None:
        self.layers[name] = self.layers[name] + stats if name in self.layers else stats

    def take(self, other: "MoEMetrics") -> None:
        """Move ``other``'s statistics into this one (a pipeline rank's chunks hold other layers)."""
        for name, s in other.layers.items():
            self.add(name, s)
        other.layers.clear()

    def pop(self, mesh=None, groups=(("dp", "ep"),)) -> dict[str, dict[str, float]]:
        """Summaries per layer (``{"blocks.1": {"dropped_share": ..., "load_min": ...}}``), the counts summed
        over each axis group of ``groups`` in turn on ``mesh`` when given (collective), and clear."""
        out = {}
        for name, s in sorted(self.layers.items()):
            out[name] = s.all_reduce_groups(mesh, groups).summary()
        self.layers.clear()
        return out


class GPTMoE(GPT):
    """The GPT with MoE blocks; ``mesh`` (optional) gives the ep axis its experts are sharded over and the
    tp axis its MoE layers split their samples over; ``sequence_parallel``: the model will be sharded with
    sequence parallelism (:func:`~podscale.parallel.tensor.apply_tensor_parallel`), so its MoE layers
    receive sequence shards (see :meth:`podscale.parallel.moe.MoELayer.forward`); ``fold_tp``: their experts
    are sharded over ep x tp (MoE parallel folding) instead of held by every tp rank;
    ``expert_tensor_parallel``: each expert's hidden width is split over tp instead (Megatron-core's expert
    tensor parallelism, :class:`~podscale.parallel.moe.WidthSplit`); ``expert_dispatch``: how their tokens are
    exchanged under expert parallelism (``"choice"``, ``"rank"`` or ``"node"``: :class:`~podscale.parallel.moe.MoELayer`)."""

    def __init__(self, cfg: GPTMoEConfig, mesh=None, sequence_parallel: bool = False, fold_tp: bool = False,
                 expert_tensor_parallel: bool = False, expert_dispatch: str = "choice"):
        ep = mesh.sizes["ep"] if mesh is not None else 1
        tp = mesh.sizes["tp"] if mesh is not None else 1
        check_moe_args(cfg.experts, cfg.top_k, cfg.capacity_factor, cfg.eval_capacity_factor, ep,
                       tp if fold_tp else 1, tp if expert_tensor_parallel else 1, cfg.hidden)
        cfg.gating.check(cfg.experts, cfg.top_k)
        if cfg.moe_every < 1:
            raise ValueError(f"model.moe_every={cfg.moe_every} must be >= 1: 1 makes every block MoE, 2 every other")
        super().__init__(cfg)
        for i in range(cfg.n_layer):
            if cfg.is_moe(i):
                self.blocks[str(i)] = MoEBlock(cfg, i, mesh, sequence_parallel, fold_tp, expert_tensor_parallel,
                                               expert_dispatch)
        self.moe_metrics = MoEMetrics()
        moe_blocks = tuple(f"blocks.{i}." for i in range(cfg.n_layer) if cfg.is_moe(i))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.startswith(moe_blocks) and not p.is_meta:
                    self.init_parameter(name, p)

    def init_parameter(self, name: str, t: torch.Tensor) -> None:
        """The GPT's rule for every parameter, expert weights included: each expert's tensors are named by
        their global expert id (``blocks.1.moe.experts.5.w_fc``), so the (seed, name) generator gives a rank
        of any ep layout the single-process values of its experts.  ``w_fc`` and the router N(0, 0.02);
        ``w_proj``, a residual projection, N(0, 0.02 / sqrt(2 * n_layer)); biases 0; the shared expert
        (``blocks.1.moe.shared.w_fc``) like the routed ones.  A routed expert whose width is split over tp
        (expert tensor parallelism) draws its whole one-process tensor and keeps its own part of it."""
        module, _, leaf = name.rpartition(".")
        if ".moe.experts." not in name and ".moe.shared." not in name:
            return super().init_parameter(name, t)
        if leaf.startswith("b_"):
            t.zero_()
            return
        expert = self.get_submodule(module)
        std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if leaf == "w_proj" else 0.02
        g = torch.Generator().manual_seed((self.init_seed + zlib.crc32(name.encode())) % 2**63)
        full = torch.empty(expert.single_process_shape(leaf), dtype=t.dtype).normal_(0.0, std, generator=g)
        t.copy_(expert.own_part(leaf, full))

    def empty_chunk(self) -> "GPTMoE":
        """A pipeline stage's module: a GPTMoE with its own routing statistics (see :meth:`GPT.empty_chunk`)."""
        chunk = super().empty_chunk()
        chunk.moe_metrics = MoEMetrics()
        return chunk

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, tokens: torch.Tensor | None = None):
        """Logits and, with targets, the cross-entropy plus every MoE layer's weighted aux and z losses.

        A pipeline stage before the last (no ``lm_head``) returns its activations and the weighted aux and
        z losses of its own MoE layers (None when it has none): the schedule adds their gradient to the
        activations' in the stage's backward and their value to the step's loss, since the loss computed on
        the last stage cannot reach them.  ``tokens``: the micro-batch's token ids, for random routing on a
        stage past the first (whose ``idx`` are activations)."""
        out, lm_loss, moe_loss, stats = self.forward_detailed(idx, targets, tokens)
        if self.training:
            for name, s in stats.items():
                self.moe_metrics.add(name, s)
        if self.lm_head is None:
            return out, moe_loss
        if lm_loss is None:
            return out, None
        return out, lm_loss if moe_loss is None else lm_loss + moe_loss.to(lm_loss.dtype)

    def forward_detailed(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                         tokens: torch.Tensor | None = None):
        """(logits — a stage's activations when it has no head —, cross-entropy or None, summed MoE losses
        or None when there is no MoE layer, {block name: MoEStats})."""
        if self.wte is not None:
            T = idx.shape[1]
            if T > self.cfg.block_size:
                raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
            tokens = idx
            pos = torch.arange(T, device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
        else:
            x = idx
        keys = None
        if self.cfg.random_routing and self.training:
            if tokens is None:
                raise ValueError("a GPT-MoE stage past the first needs the micro-batch's token ids for random "
                                 "routing: pass tokens=")
            keys = sequence_token_keys(tokens)
        moe_loss = None
        stats = {}
        for name, block in self.blocks.items():
            if isinstance(block, MoEBlock):
                x, out = block(x, keys)
                moe_loss = out.loss if moe_loss is None else moe_loss + out.loss
                stats[f"blocks.{name}"] = out.stats
            else:
                x = block(x)
        if self.lm_head is None:
            return x, None, moe_loss, stats
        logits = self.lm_head(self.ln_f(x))
        lm_loss = None if targets is None else self.loss_fn(logits, targets)
        return logits, lm_loss, moe_loss, stats

    def update_balance_bias(self, mesh=None, groups=(("dp", "ep"),)) -> None:
        """DeepSeek-V3's bias step for every MoE layer built with ``bias_balancing``, from the per-expert
        demand (the choices that asked each expert for a slot, dropped ones included: what the router chose,
        which the bias steers) accumulated in :attr:`moe_metrics` since its last ``pop``, summed over each
        axis group of ``groups`` on ``mesh`` when given (collective, so every rank's biases stay equal).
        Call after the optimizer step and before ``moe_metrics.pop``."""
        for name, layer in self.moe_layers().items():
            stats = self.moe_metrics.layers.get(name.removesuffix(".moe"))
            if layer.router.selection_bias is None or stats is None:
                continue
            layer.update_balance_bias(stats.all_reduce_groups(mesh, groups).wanted)

    def moe_layers(self) -> dict[str, MoELayer]:
        return {f"blocks.{n}.moe": b.moe for n, b in self.blocks.items() if isinstance(b, MoEBlock)}

    def active_params_per_token(self) -> int:
        """Parameters a token passes through (the k chosen experts instead of all E)."""
        dense = self.cfg.num_params(include_embeddings=False)
        h, H = self.cfg.n_embd, self.cfg.hidden

        def ffn(width: int) -> int:   # a GELU feed-forward h -> width -> h (0 wide: none)
            return 2 * h * width + (width + h if self.cfg.bias else 0) if width else 0

        n_moe = sum(self.cfg.is_moe(i) for i in range(self.cfg.n_layer))
        routed = self.cfg.top_k * ffn(H) + ffn(self.cfg.shared_experts * H) + self.cfg.experts * h  # + router
        return dense - n_moe * ffn(4 * h) + n_moe * routed
