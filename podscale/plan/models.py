"""Model descriptions for the planner: dense and MoE GPT by dimensions, DLRM by tables and MLPs.

Parameter counts follow Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC'21), Sec. 5.1: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) for a
GPT with ffn = 4h; with a general ffn the per-layer weight count is 4h^2 + 2 h ffn (+ biases and
layer norms, 9h + ffn).
"""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from podscale.parallel.moe.gate import AUX_LOSS_SCOPES, DROP_POLICIES


class ModelError(ValueError):
    pass


def non_bool_field(obj) -> str | None:
    """The first ``bool`` field of dataclass ``obj`` that does not hold a bool (JSON's "false" or 0 would
    otherwise switch it by its truth), or None: the planner's models and layouts both check theirs."""
    return next((f.name for f in fields(obj) if f.type == "bool" and not isinstance(getattr(obj, f.name), bool)),
                None)


def _finite(x) -> bool:
    """``x`` is a finite real number (a JSON model's "1.5" string or 1e400, read as inf, is not)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class GPT:
    """Decoder-only transformer. ``experts > 1`` makes every ``moe_every``-th MLP a GShard MoE layer
    (Lepikhin et al. 2020) with ``top_k`` routing and ``capacity_factor`` (or, ``dropless``, no capacity:
    the busiest ep rank priced at ``dropless_peak_load`` times the mean rows, see :meth:`expert_load`);
    ``expert_recompute``: its experts keep only the GELU's input for the backward and evaluate the GELU
    again there. ``shared_experts`` = s > 0: every MoE layer also has one dense GELU MLP of width
    s x ``ffn`` that every token passes through, unrouted, its output added to the routed experts' (DeepSeekMoE's
    shared expert isolation, Dai et al. 2024; DeepSpeed-MoE's residual MoE, Rajbhandari et al. 2022).
    ``aux_loss_scope``: ``"global"`` (Qiu et al. 2025; Megatron-core's ``global_aux_loss``; podscale's
    ``model.aux_loss_scope``) and ``"global_step"`` (the same counts added up over the step's micro-batches)
    add to every MoE layer's forward an all-reduce of its experts + 1 first-choice counts over the ranks that
    route other tokens (dp x ep, then tp); ``"group"`` needs none. ``drop_policy`` (podscale's
    ``model.drop_policy``: which choices keep an over-full expert's slots) ``"priority"`` and ``"probs"`` add their
    listing's sort to the routing (``gpt_cost.drop_policy_bytes``); ``"position"`` sorts nothing more."""

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0                  # 0 -> 4 * hidden
    experts: int = 1
    top_k: int = 1
    shared_experts: int = 0
    capacity_factor: float = 1.0
    dropless: bool = False
    dropless_peak_load: float = 2.0
    moe_every: int = 1
    expert_recompute: bool = False
    aux_loss_scope: str = "group"
    drop_policy: str = "position"
    name: str = "custom"
    kind: str = "gpt"

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "seq", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ModelError(f"model field {f!r} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ModelError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        for f, low in (("ffn", 0), ("experts", 1), ("top_k", 1), ("moe_every", 1)):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ModelError(f"model field {f!r} must be an integer >= {low}"
                                 f"{' (0: 4 x hidden)' if f == 'ffn' else ''}, got {v!r}")
        if (name := non_bool_field(self)) is not None:
            raise ModelError(f"model field {name!r} must be true or false, got {getattr(self, name)!r}")
        if self.experts > 1 and self.top_k > self.experts:  # a dense model (experts 1) reads neither key
            raise ModelError(f"top_k {self.top_k} exceeds experts {self.experts}: lower top_k or add experts")
        if self.experts > 1 and self.moe_every > self.layers:  # layer i is MoE when (i + 1) % moe_every == 0
            raise ModelError(f"moe_every {self.moe_every} exceeds layers {self.layers}, which leaves no MoE layer: "
                             f"use a moe_every of at most {self.layers}")
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if not isinstance(self.shared_experts, int) or isinstance(self.shared_experts, bool) or self.shared_experts < 0:
            raise ModelError(f"model field 'shared_experts' must be an integer >= 0 (0: none), got "
                             f"{self.shared_experts!r}")
        if self.shared_experts and self.experts < 2:
            raise ModelError(f"model field 'shared_experts'={self.shared_experts} needs an MoE model: set experts "
                             f"> 1, or shared_experts: 0")
        if not _finite(self.capacity_factor) or not self.capacity_factor > 0:
            raise ModelError(f"capacity_factor must be a finite number > 0, got {self.capacity_factor!r} (or "
                             "dropless: true)")
        if self.aux_loss_scope not in AUX_LOSS_SCOPES:
            raise ModelError(f"aux_loss_scope {self.aux_loss_scope!r} must be one of {', '.join(AUX_LOSS_SCOPES)}")
        if self.drop_policy not in DROP_POLICIES:
            raise ModelError(f"drop_policy {self.drop_policy!r} must be one of {', '.join(DROP_POLICIES)}")
        if not _finite(self.dropless_peak_load) or not self.dropless_peak_load >= 1:
            raise ModelError(f"dropless_peak_load must be a finite number >= 1 (the busiest rank's rows over its even "
                             f"share), got {self.dropless_peak_load!r}")

    def expert_load(self, ep: int) -> float:
        """Rows the busiest of ``ep`` ranks' experts run in a forward per routed choice of a rank (``top_k``
        x its tokens): what an MoE layer's expert GEMMs, activations and all-to-all volume on that rank
        scale with.  A capacity bounds each expert's slots, so a rank's rows by ``capacity_factor``; with no
        capacity (``dropless``) nothing does but the stated ``dropless_peak_load``, which a training run
        measures (its ``peak_rank_load`` metric).  Either way a rank cannot run more than every choice of
        its ep group: ``ep`` (at ep = 1 a rank runs its kept choices, at most all of them)."""
        return min(self.dropless_peak_load if self.dropless else self.capacity_factor, ep)

    @property
    def moe_layers(self) -> int:
        return self.layers // self.moe_every if self.experts > 1 else 0

    @property
    def attention_params(self) -> int:
        """QKV and output projection with biases, and the block's two layer norms: what a dense and an MoE
        block share (tensor-parallel over tp in both)."""
        h = self.hidden
        return 4 * h * h + 4 * h + 4 * h

    def mlp_params(self, width: int | None = None) -> int:
        """A GELU MLP h -> ``width`` -> h with biases (default width ``ffn``: the dense MLP, or one expert)."""
        w, h = self.ffn if width is None else width, self.hidden
        return 2 * h * w + w + h

    @property
    def shared_ffn(self) -> int:
        """Width of an MoE layer's shared-expert MLP (0: none)."""
        return self.shared_experts * self.ffn

    @property
    def moe_dense_params(self) -> int:
        """An MoE layer's parameters that are not experts: its router (h x experts, no bias:
        podscale.parallel.moe.gate.Router) and its shared-expert MLP; every ep rank holds them."""
        return self.hidden * self.experts + (self.mlp_params(self.shared_ffn) if self.shared_experts else 0)

    def active_ffn(self, moe: bool = False) -> int:
        """MLP width a token passes through in a block: its top_k experts and the shared experts in an MoE
        block, the dense MLP otherwise (4 h x this is the block's MLP FLOPs per token, forward)."""
        return self.top_k * self.ffn + self.shared_ffn if moe else self.ffn

    def layer_params(self, moe: bool = False) -> int:
        if moe:
            return self.attention_params + self.moe_dense_params + self.experts * self.mlp_params()
        return self.attention_params + self.mlp_params()

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.seq * self.hidden   # tied output layer

    @property
    def params(self) -> int:
        dense_layers = self.layers - self.moe_layers
        return (dense_layers * self.layer_params() + self.moe_layers * self.layer_params(moe=True)
                + self.embedding_params + 2 * self.hidden)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DLRM:
    """Deep Learning Recommendation Model (Naumov et al. 2019): sparse features looked up in embedding
    tables (rows x dim), a bottom MLP on dense features, pairwise dot interactions, a top MLP."""

    tables: tuple                 # ((rows, dim), ...)
    bottom_mlp: tuple             # layer widths, first = number of dense features
    top_mlp: tuple                # layer widths after the interaction, last = 1
    lookups_per_table: float = 1  # pooling factor (mean ids per sample per table)
    name: str = "dlrm"
    kind: str = "dlrm"
    # How podscale's tables run it (podscale/table, [model] of kind "dlrm"): the tables' sharding, their
    # store (keyed: int64 keys through a key index; dense: the key is the slot), the DRAM budget per table
    # shard over an SSD tier (None: every row in DRAM), its cache policy, the Zipf exponent of the ids
    # (how many a step's deduplication leaves and how many the cache holds) and the sparse optimizer.
    sharding: str = "row"
    storage: str = "keyed"
    dram_budget_mb: float | None = None
    cache_policy: str = "lru"
    alpha: float = 1.05
    sparse_optimizer: str = "adagrad"
    # The training step the prediction is for: a keyed store creates a row for each id no earlier step
    # drew, and under Zipf ids such keys keep arriving for many steps.  None: steady state (every key seen).
    step: int | None = None

    def __post_init__(self):
        checks = [
            (self.sharding in ("row", "table", "column"), f"sharding '{self.sharding}' must be row, table or column"),
            (self.storage in ("keyed", "dense"), f"storage '{self.storage}' must be keyed or dense"),
            (self.storage == "keyed" or self.sharding != "row",
             "storage 'dense' needs table- or column-wise sharding: set sharding or storage='keyed'"),
            (self.dram_budget_mb is None or (self.dram_budget_mb > 0 and self.storage == "keyed"),
             f"dram_budget_mb={self.dram_budget_mb} must be positive, with storage='keyed' (or None: all in DRAM)"),
            (self.cache_policy in ("lru", "lfu"), f"cache_policy '{self.cache_policy}' must be lru or lfu"),
            (self.alpha > 0, f"alpha={self.alpha} (Zipf exponent of the ids) must be positive"),
            (self.lookups_per_table >= 1, f"lookups_per_table={self.lookups_per_table} must be >= 1"),
            (self.sparse_optimizer in ("adagrad", "sgd", "adam"),
             f"sparse_optimizer '{self.sparse_optimizer}' must be adagrad, sgd or adam"),
            (self.step is None or self.step >= 1, f"step={self.step} must be >= 1 (or None: steady state)"),
            (len(self.tables) > 0 and all(r >= 1 and d >= 1 for r, d in self.tables),
             "tables must be a non-empty list of (rows, dim) with positive rows and dim"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ModelError(f"DLRM {self.name}: {msg}")

    @property
    def embedding_params(self) -> int:
        return sum(r * d for r, d in self.tables)

    @property
    def mlp_params(self) -> int:
        total = 0
        for widths in (self.bottom_mlp, self.interaction_mlp_widths):
            total += sum(a * b + b for a, b in zip(widths[:-1], widths[1:]))
        return total

    @property
    def interaction_mlp_widths(self) -> tuple:
        dim = self.bottom_mlp[-1]
        f = len(self.tables) + 1
        return (dim + f * (f - 1) // 2,) + tuple(self.top_mlp)

    @property
    def params(self) -> int:
        return self.embedding_params + self.mlp_params

    def to_dict(self) -> dict:
        return asdict(self)


def _gpt(name, layers, hidden, heads, seq=2048, vocab=51200, **kw) -> GPT:
    return GPT(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, name=name, **kw)


# Narayanan et al. SC'21 Table 1 (seq 2048, vocab 51,200): name -> (heads, hidden, layers).
MEGATRON_TABLE1 = {
    "megatron-1.7b": (24, 2304, 24), "megatron-3.6b": (32, 3072, 30), "megatron-7.5b": (32, 4096, 36),
    "megatron-18b": (48, 6144, 40), "megatron-39b": (64, 8192, 48), "megatron-76b": (80, 10240, 60),
    "megatron-146b": (96, 12288, 80), "megatron-310b": (128, 16384, 96),
    "megatron-530b": (128, 20480, 105), "megatron-1t": (160, 25600, 128),
}

PRESETS: dict = {name: _gpt(name, l, h, a) for name, (a, h, l) in MEGATRON_TABLE1.items()}
PRESETS.update({
    # GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, context 2048;
    # Megatron trains it with the padded 51,200-token GPT-2 vocabulary (50,257 real tokens).
    "gpt-175b": _gpt("gpt-175b", 96, 12288, 96),
    "gpt-13b": _gpt("gpt-13b", 40, 5120, 40),
    "gpt-1.3b": _gpt("gpt-1.3b", 24, 2048, 16),
    # LLaMA (Touvron et al. 2023): SwiGLU MLP has 3 matrices of h x ffn; ffn = 3/2 * listed size gives
    # the same weights and FLOPs in our 2-matrix form (7B: 11008 -> 16512; 70B: 28672 -> 43008).
    # Attention is counted as full multi-head: LLaMA-2 70B's grouped-query attention has ~10% fewer
    # weights, so the 70B preset over-counts slightly (78B).
    "llama-7b": _gpt("llama-7b", 32, 4096, 32, seq=4096, vocab=32000, ffn=16512),
    "llama-13b": _gpt("llama-13b", 40, 5120, 40, seq=4096, vocab=32000, ffn=20736),
    "llama-70b": _gpt("llama-70b", 80, 8192, 64, seq=4096, vocab=32000, ffn=43008),
    # GShard-style MoE: a 1.3B dense trunk with 64 experts in every other layer, top-2, capacity 1.25.
    "moe-1.3b-64e": _gpt("moe-1.3b-64e", 24, 2048, 16, experts=64, top_k=2, capacity_factor=1.25,
                         moe_every=2),
    # DLRM as in the MLPerf Training recommendation benchmark (Criteo 1TB): 26 tables of dim 128,
    # bottom MLP 13-512-256-128, top MLP 1024-1024-512-256-1. Row counts are the MLPerf (capped at
    # 40M) table sizes, rounded.
    "dlrm-mlperf": DLRM(
        tables=tuple((r, 128) for r in (
            39884406, 39043, 17289, 7420, 20263, 3, 7120, 1543, 63, 38532951, 2953546, 403346, 10,
            2208, 11938, 155, 4, 976, 14, 39979771, 25641295, 39664984, 585935, 12972, 108, 36)),
        bottom_mlp=(13, 512, 256, 128), top_mlp=(1024, 1024, 512, 256, 1), name="dlrm-mlperf"),
})


def model_from_dict(data: dict, name: str = "custom"):
    """Build a model from a JSON/TOML mapping; ``kind`` selects gpt (default) or dlrm."""
    data = dict(data)
    kind = data.pop("kind", "gpt")
    data.setdefault("name", name)
    cls = {"gpt": GPT, "dlrm": DLRM}.get(kind)
    if cls is None:
        raise ModelError(f"model kind must be 'gpt' or 'dlrm', got {kind!r}")
    known = {f.name for f in fields(cls)} - {"kind"}
    unknown = set(data) - known
    if unknown:
        raise ModelError(f"unknown model keys {sorted(unknown)}; allowed: {sorted(known)}")
    if cls is GPT:
        missing = {"layers", "hidden", "heads", "seq", "vocab"} - set(data)
        if missing:
            raise ModelError(f"model lacks keys {sorted(missing)} (need layers, hidden, heads, seq, vocab)")
    else:
        data["tables"] = tuple(tuple(t) for t in data["tables"])
        data["bottom_mlp"], data["top_mlp"] = tuple(data["bottom_mlp"]), tuple(data["top_mlp"])
    try:
        return cls(**data)
    except TypeError as e:
        raise ModelError(str(e)) from None


def as_model(model):
    """``model`` itself (a GPT or DLRM), or the model a preset name / JSON / file (:func:`get_model`) or a
    mapping (:func:`model_from_dict`) describes."""
    if isinstance(model, str):
        return get_model(model)
    if isinstance(model, dict):
        return model_from_dict(model)
    return model


def get_model(spec: str):
    """A preset name, a JSON object literal, or a path to a .json/.toml model file."""
    spec = spec.strip()
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.startswith("{"):
        try:
            return model_from_dict(json.loads(spec))
        except json.JSONDecodeError as e:
            raise ModelError(f"--model is not valid JSON: {e}") from None
    path = Path(spec)
    if path.suffix in (".json", ".toml") and path.exists():
        data = json.loads(path.read_text()) if path.suffix == ".json" else tomllib.loads(path.read_text())
        return model_from_dict(data.get("model", data), path.stem)
    raise ModelError(f"unknown model {spec!r}; presets: {', '.join(PRESETS)} "
                     "(or a JSON object / .json / .toml file with layers, hidden, heads, seq, vocab)")
