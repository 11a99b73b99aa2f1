"""The run configuration: TOML validated by pydantic, with one-line errors that name the key and the fix.

Every check that can be made before workers start is made here: unknown keys, types and ranges, layouts
that do not fit the number of processes, batches that do not divide, data paths that do not exist.
``load_config`` raises :class:`ConfigError`; the CLI prints its one line and exits with code 2.
"""
from __future__ import annotations

import importlib.util
import math
import os
import tomllib
from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, ValidationError, \
    field_validator, model_validator

Precision = Literal["fp32", "bf16", "fp16"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line that names the key and the fix."""


class _Section(BaseModel):
    # no inf or nan in any float: TOML spells them, but the config reaches the workers as JSON, which writes
    # them as null, so an infinite value passed here would fail in every worker instead
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunSection(_Section):
    name: str = Field("gpt-small", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    out_dir: str = "runs"
    steps: int = Field(200, ge=1)
    seed: int = Field(1337, ge=0)
    log_every: int = Field(10, ge=1)
    eval_every: int = Field(0, ge=0, description="0 disables periodic validation")
    eval_batches: int = Field(4, ge=1, description="validation batches: for the GPT tasks this many global "
                              "batches of windows (the same set at every layout, each rank its share in "
                              "micro-batches); the DLRM task splits its validation samples into this many")
    sample_tokens: int = Field(0, ge=0, description="bytes of text the GPT samples at the end of the run")
    tensorboard: bool = Field(False, description="also write the metrics as TensorBoard event files "
                                                 "(runs/NAME/tensorboard; needs the tensorboard package)")
    collective_timeout_s: float = Field(
        300.0, gt=0, description="hang watchdog: a rank that waits this long in one collective makes every "
                                 "rank exit with a line naming the rank that did not arrive "
                                 "(podscale.runtime.watchdog); torch's process-group timeout is twice this, "
                                 "at least 120 s")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: one GPU per rank where CUDA is visible (NCCL), else the CPU (gloo)")

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # the run directory is out_dir/name, and --fresh deletes it: never '.', '..' (nor a path: the pattern)
        if name in (".", ".."):
            raise ValueError(f"'{name}' is not a run name (the run directory would be run.out_dir or its "
                             "parent): use letters, digits, '_', '-' and '.'")
        return name


def tensor_parallel_split_problem(n_head: int, n_embd: int, tp: int) -> str | None:
    """Why a GPT with ``n_head`` heads and hidden size ``n_embd`` cannot be split over ``tp`` ranks (Megatron's
    column- and row-parallel layers split the heads and the hidden features, Shoeybi et al. 2019, section 3),
    as one line that names the fix; None when it can.  The config check and
    :func:`podscale.parallel.tensor.check_tensor_parallel` both ask this."""
    if n_head % tp:
        return (f"model.n_head={n_head} is not divisible by parallel.tp={tp}: use a head count that is a "
                f"multiple of {tp} or a smaller tp")
    if n_embd % tp:
        return (f"model.n_embd={n_embd} is not divisible by parallel.tp={tp}: use a hidden size that is a "
                f"multiple of {tp} or a smaller tp")
    return None


def expert_width_split_problem(hidden: int, tp: int) -> str | None:
    """Why a mixture-of-experts layer whose experts are ``hidden`` wide cannot split each expert's hidden
    width over ``tp`` ranks (expert tensor parallelism, ``parallel.expert_tensor_parallel``: each tp rank
    holds ``hidden/tp`` columns of ``w_fc`` and rows of ``w_proj``, Shoeybi et al. 2019's column/row split),
    as one line that names the fix; None when it can.  The config check and
    :func:`podscale.parallel.moe.check_moe_args` both ask this."""
    if hidden % tp:
        return (f"model.expert_hidden={hidden} is not divisible by parallel.tp={tp} (parallel."
                f"expert_tensor_parallel splits each expert's hidden width over tp): make model.expert_hidden a "
                f"multiple of {tp} or set expert_tensor_parallel = false")
    return None


def expert_dispatch_problem(dispatch: str, width_split: bool) -> str | None:
    """Why a mixture-of-experts layer cannot exchange its tokens by ``dispatch`` (``parallel.expert_dispatch``)
    when ``width_split`` (``parallel.expert_tensor_parallel`` under tp > 1), as one line naming the fix; None
    when it can.  The config check and :func:`podscale.parallel.moe.layer.check_expert_dispatch` both ask this."""
    if dispatch != "choice" and width_split:
        return (f"parallel.expert_dispatch = {dispatch!r} combines a token's choices on the rank of its experts, "
                "which parallel.expert_tensor_parallel splits over tp: set expert_dispatch = 'choice' or "
                "expert_tensor_parallel = false")
    return None


class GPTModelSection(_Section):
    """``[model] kind = "gpt"`` (the default): the byte-level GPT of :mod:`podscale.tasks.gpt`."""

    kind: Literal["gpt"] = "gpt"
    n_layer: int = Field(4, ge=1)
    n_head: int = Field(4, ge=1)
    n_embd: int = Field(128, ge=1)
    block_size: int = Field(128, ge=2)
    vocab_size: int = Field(256, ge=2)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    bias: bool = True

    @model_validator(mode="after")
    def _heads_divide(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                             "choose n_embd as a multiple of n_head")
        return self

    def task_class(self) -> type:
        from podscale.tasks.gpt import GPTTask
        return GPTTask

    def check_data(self, path: Path, given: str, head: bytes) -> None:
        """The corpus at ``path`` (``head``: its first bytes) must be text and hold enough windows of
        ``block_size + 1`` bytes."""
        if b"\0" in head:
            raise ConfigError(f"data.path: '{given}' holds NUL bytes, so it is not a text corpus: point it at a "
                              "UTF-8 text file")
        if path.stat().st_size < 2 * (self.block_size + 1) * 10:
            raise ConfigError(f"data.path: '{given}' is too small for block_size "
                              f"{self.block_size}: use a larger corpus or a smaller model.block_size")

    def check_model(self) -> None:
        """The GPT reads its corpus as bytes (a file or the standard library's source): every one of the 256
        byte values is a token id, so a smaller vocabulary would fail inside the workers' embedding."""
        if self.vocab_size < 256:
            raise ConfigError(f"model.vocab_size={self.vocab_size} is smaller than the 256 byte values the "
                              "byte-level corpus holds: set model.vocab_size >= 256 (or remove it: 256)")

    def check_layout(self, cfg: "Config") -> None:
        """Tensor, sequence and pipeline parallelism: what the GPT and the batch must satisfy."""
        p, m, t = cfg.parallel, self, cfg.train
        problem = tensor_parallel_split_problem(m.n_head, m.n_embd, p.tp)
        if problem:
            raise ConfigError(problem)
        if p.sequence_parallel and m.block_size % p.tp:
            raise ConfigError(f"model.block_size={m.block_size} (the sequence length) is not divisible by "
                              f"parallel.tp={p.tp} with sequence parallelism: use a multiple of {p.tp} or set "
                              "parallel.sequence_parallel = false")
        chunks = p.pp * p.virtual_stages
        if p.pipeline_layers is not None:
            if len(p.pipeline_layers) != chunks or sum(p.pipeline_layers) != m.n_layer \
                    or min(p.pipeline_layers) < 1:
                raise ConfigError(f"parallel.pipeline_layers={p.pipeline_layers} must list {chunks} positive "
                                  f"block counts (pp * virtual_stages) that sum to model.n_layer={m.n_layer}")
        elif p.pp > 1 and m.n_layer < chunks:
            raise ConfigError(f"model.n_layer={m.n_layer} is fewer than the {chunks} pipeline stages "
                              f"(pp * virtual_stages): use at least {chunks} layers or fewer stages")
        if t.compile and m.dropout > 0 and (p.tp > 1 or p.sequence_parallel):
            raise ConfigError(f"train.compile = true with model.dropout={m.dropout} under parallel.tp={p.tp}: the "
                              "per-rank dropout streams of tensor parallelism are not traced by torch.compile: "
                              "set model.dropout = 0, train.compile = false, or parallel.tp = 1 without "
                              "sequence parallelism")
        if p.pp > 1:
            micro = cfg.grad_accum
            if p.schedule == "interleaved" and micro % p.pp:
                raise ConfigError(f"interleaved 1F1B needs the micro-batches per step (global_batch / (dp * "
                                  f"micro_batch) = {micro}) to be a multiple of parallel.pp={p.pp}: set "
                                  f"train.global_batch to a multiple of {p.pp * cfg.dp * t.micro_batch}")


class GPTMoEModelSection(GPTModelSection):
    """``[model] kind = "gpt-moe"``: the GPT with a GShard mixture-of-experts feed-forward in every
    ``moe_every``-th block (:mod:`podscale.tasks.gpt_moe`); its experts are sharded over ``parallel.ep``."""

    kind: Literal["gpt-moe"] = "gpt-moe"
    experts: int = Field(8, ge=1, description="experts per MoE layer (a multiple of parallel.ep)")
    top_k: int = Field(2, ge=1, description="experts per token: 1 (Switch) or 2 (GShard)")
    capacity_factor: float = Field(1.25, description="GShard's C = ceil(cf * k * S / E) slots per expert")
    eval_capacity_factor: float = Field(2.0, description="the capacity factor of evaluation forwards")
    dropless: bool = Field(False, description="no capacity: every choice is dispatched")
    dropless_peak_load: float = Field(2.0, ge=1.0, description="dropless only: the busiest ep rank's expert "
                                      "rows over its even share (tokens x top_k) that the planner prices memory "
                                      "and time at; training logs the measured peak_rank_load per MoE layer and "
                                      "says so at the end when it exceeded this")
    random_routing: bool = Field(True, description="GShard: keep the second choice with probability 2*g2")
    # podscale.parallel.moe.DROP_POLICIES (a test holds them equal)
    drop_policy: Literal["position", "priority", "probs"] = Field(
        "position", description="which choices keep an over-full expert's capacity slots: position, GShard's "
        "(every first choice before any second choice, each in token order); priority, V-MoE's Batch "
        "Prioritized Routing (Riquelme et al. 2021: first choices first, the tokens ranked by their top routing "
        "score, so the capacity drops the tokens the router is least sure of); probs, Megatron-core's "
        "moe_token_drop_policy (each expert keeps the choices with its highest scores, first or second)")
    aux_loss_coef: float = Field(1e-2, ge=0.0, description="weight of the load-balancing loss")
    # podscale.parallel.moe.AUX_LOSS_SCOPES (a test holds them equal)
    aux_loss_scope: Literal["group", "global", "global_step"] = Field(
        "group", description="the tokens the load-balancing loss counts each expert's first-choice share f_e "
        "over: group, each routing group's (a sequence: Switch, GShard); global, every token of the micro-batch "
        "on every data-, expert- and tensor-parallel rank (Qiu et al. 2025, 'Demons in the Detail'; Megatron-"
        "core's moe_router_load_balancing_type = 'global_aux_loss'), which balances the experts over the batch "
        "instead of inside every sequence so they can specialise; global_step, those of every micro-batch of the "
        "optimizer step so far (the paper's buffer for gradient accumulation: micro-batch m's f_e from "
        "micro-batches 1..m, reset each step); the router probabilities P_e stay each rank's, and the shares are "
        "summed by one all-reduce of experts + 1 integers per MoE layer and micro-batch")
    bias_balancing: bool = Field(False, description="DeepSeek-V3's auxiliary-loss-free balancing: a per-expert "
                                 "bias added to the router's scores for choosing experts only (gates stay the "
                                 "softmax's), after every step moved by bias_update_rate towards the experts "
                                 "the step's tokens asked for least; usually with aux_loss_coef small or 0")
    bias_update_rate: float = Field(1e-3, gt=0.0, description="bias_balancing's step per training step "
                                    "(DeepSeek-V3's gamma, 0.001 over its 14.8T tokens; a run of a few thousand "
                                    "steps balances better with about 0.01: BENCHMARKS.md)")
    z_loss_coef: float = Field(1e-3, ge=0.0, description="weight of the router z-loss (ST-MoE)")
    moe_every: int = Field(2, ge=1, description="an MoE feed-forward in every moe_every-th block")
    expert_hidden: int | None = Field(None, ge=1, description="expert hidden size; default 4 * n_embd")
    expert_recompute: bool = Field(False, description="keep only the experts' GELU input for the backward and "
                                   "evaluate the GELU again there: one tokens x top_k x expert_hidden tensor "
                                   "less per MoE layer (Megatron-core's recompute_modules moe_act)")
    shared_experts: int = Field(0, ge=0, description="shared experts of expert_hidden width in every MoE layer, "
                                "which every token passes through beside its top_k routed ones (DeepSeekMoE), "
                                "run as one dense feed-forward of shared_experts x expert_hidden")
    # podscale.parallel.moe.Gating.SCORES (a test holds them equal)
    router_score: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="the router's scores: softmax over the experts (GShard, Switch) or each expert's "
        "sigmoid affinity (DeepSeek-V3); the gate values are the chosen scores, normalised over the top_k "
        "choices when top_k > 1")
    router_groups: int = Field(1, ge=1, description="node-limited routing (DeepSeek-V3; Megatron-core's "
                               "moe_router_num_groups): the experts in this many equal groups of consecutive "
                               "experts, a token choosing only among its best router_group_top_k groups' "
                               "experts; 1: no limit")
    router_group_top_k: int = Field(1, ge=1, description="the groups a token may choose experts from "
                                    "(Megatron-core's moe_router_group_topk), ranked by the sum of their "
                                    "top_k // router_group_top_k best scores")
    router_scale: float = Field(1.0, gt=0.0, description="the gate values times this (DeepSeek-V3's routed "
                                "scaling factor, 2.5 there; Megatron-core's moe_router_topk_scaling_factor)")
    # podscale.parallel.moe.kernels.KERNEL_NAMES (a test holds them equal; this module does not import torch)
    expert_kernel: Literal["auto", "tiled", "segment", "grouped"] = Field(
        "auto", description="how the experts run: auto picks by device and dtype (CPU: tiled; bf16 on NVIDIA "
        "SM90/SM100: grouped; other GPUs: segment); tiled: cache-resident row tiles; segment: one matmul per "
        "expert segment; grouped: one grouped GEMM per matmul kind (Megatron-core's moe_grouped_gemm)")

    @model_validator(mode="after")
    def _moe_args(self):
        if self.moe_every > self.n_layer:  # block i is an MoE block when (i + 1) % moe_every == 0
            raise ValueError(f"model.moe_every={self.moe_every} exceeds model.n_layer={self.n_layer}, which leaves "
                             f"no MoE block: use a moe_every of at most {self.n_layer} (1: every block)")
        if self.top_k > self.experts:
            raise ValueError(f"model.top_k={self.top_k} exceeds model.experts={self.experts}: lower top_k "
                             "or add experts")
        for key in ("capacity_factor", "eval_capacity_factor"):
            if not getattr(self, key) > 0:
                raise ValueError(f"model.{key}={getattr(self, key)} must be > 0: use e.g. 1.25 (or "
                                 "model.dropless = true for no capacity)")
        if self.experts % self.router_groups:
            raise ValueError(f"model.router_groups={self.router_groups} does not divide model.experts="
                             f"{self.experts} into equal groups: use a divisor of model.experts (1: no group "
                             "limit)")
        if self.router_group_top_k > self.router_groups:
            raise ValueError(f"model.router_group_top_k={self.router_group_top_k} exceeds model.router_groups="
                             f"{self.router_groups}: lower router_group_top_k")
        reach = self.router_group_top_k * (self.experts // self.router_groups)
        if self.top_k > reach:
            raise ValueError(f"model.top_k={self.top_k} exceeds the {reach} experts of a token's "
                             f"model.router_group_top_k={self.router_group_top_k} groups: raise "
                             "router_group_top_k or lower top_k")
        if self.expert_kernel == "grouped":
            for key, width in (("n_embd", self.n_embd), ("expert_hidden", self.expert_hidden or 4 * self.n_embd)):
                if width % 8:
                    raise ValueError(f"model.expert_kernel='grouped' needs model.{key}={width} to be a multiple "
                                     "of 8 (the grouped GEMM's rows start on 16-byte boundaries): change it or "
                                     "set model.expert_kernel = 'auto'")
        return self

    def task_class(self) -> type:
        from podscale.tasks.gpt_moe import GPTMoETask
        return GPTMoETask

    def check_layout(self, cfg: "Config") -> None:
        """Experts divide over ep; the layouts the GPT-MoE runs under (every pipeline schedule; tensor and
        sequence parallelism, alone or inside pipeline stages, its MoE layers splitting the samples over tp,
        so a micro-batch's samples must divide over tp; pipeline stages balanced by parameters or by list)."""
        from podscale.tasks.base import check_task_layout
        p = cfg.parallel
        if p.tp > 1 and cfg.train.micro_batch % p.tp:
            raise ConfigError(f"train.micro_batch={cfg.train.micro_batch} is not divisible by parallel.tp={p.tp}: "
                              "the MoE layers split each micro-batch's sequences over tp; make train.micro_batch "
                              f"a multiple of {p.tp}")
        if p.pp > 1 and p.pipeline_layers is None and p.pipeline_balance == "time":
            raise ConfigError("parallel.pipeline_balance='time' is not built for model.kind='gpt-moe' (timing an "
                              "MoE block alone would skip its ep exchange): use pipeline_balance = 'params' "
                              "or list parallel.pipeline_layers")
        if self.experts % p.ep:
            raise ConfigError(f"model.experts={self.experts} is not divisible by parallel.ep={p.ep}: make "
                              f"model.experts a multiple of {p.ep} or choose an ep that divides it")
        if p.fold_tp_into_ep and self.experts % (p.ep * p.tp):
            raise ConfigError(f"model.experts={self.experts} is not divisible by parallel.ep*parallel.tp="
                              f"{p.ep * p.tp} (parallel.fold_tp_into_ep shards the experts over both): make "
                              f"model.experts a multiple of {p.ep * p.tp} or set fold_tp_into_ep = false")
        if p.expert_tensor_parallel:
            problem = expert_width_split_problem(self.expert_hidden or 4 * self.n_embd, p.tp)
            if problem:
                raise ConfigError(problem)
        try:
            check_task_layout(self.task_class(), p.tp, p.sequence_parallel, p.pp, p.ep)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        super().check_layout(cfg)


class CustomModelSection(BaseModel):
    """``[model] kind = "custom"``: a task from the user's own code.  ``task = "package.module:Class"`` names
    a :class:`podscale.tasks.Task` subclass that every worker can import (installed, or on ``PYTHONPATH``,
    which spawned workers inherit); every other key of the section is one of that task's options, validated
    by its ``Options`` model.  Nothing is registered anywhere: the config names the class."""

    model_config = ConfigDict(extra="allow", validate_assignment=True)

    kind: Literal["custom"]
    task: str = Field(description="package.module:Class of a podscale.tasks.Task subclass")
    _task_class: type | None = PrivateAttr(None)
    _options: BaseModel | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _load_task(self):
        from podscale.tasks.base import import_task
        cls = import_task(self.task)  # ValueError with one line when it cannot be imported
        try:
            self._options = cls.Options.model_validate(self.model_extra or {})
        except ValidationError as err:
            raise ValueError(_option_error(err, self.task, cls)) from None
        self._task_class = cls
        return self

    @property
    def options(self) -> BaseModel:
        """The task's options (its ``Options`` model) as given in this section."""
        return self._options

    def task_class(self) -> type:
        return self._task_class

    def check_data(self, path: Path, given: str, head: bytes) -> None:
        """The task reads ``data.path`` itself; the trunk only checks that the file exists and is readable."""

    def check_model(self) -> None:
        """The task's own options were validated by its options model."""

    def check_layout(self, cfg: "Config") -> None:
        """A task trains under tensor or pipeline parallelism only when its class says it can."""
        from podscale.tasks.base import check_task_layout
        p = cfg.parallel
        try:
            check_task_layout(self._task_class, p.tp, p.sequence_parallel, p.pp)
        except ValueError as err:
            raise ConfigError(str(err)) from None


class DLRMTableSection(_Section):
    """One sparse feature's table in ``[model] kind = "dlrm"`` (``tables = [{name = "C1", cardinality = 1000}]``)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    cardinality: int = Field(ge=1, description="distinct ids the generator draws (Zipf over ranks)")
    sharding: Literal["row", "table", "column"] | None = Field(None, description="default: model.sharding")


class DLRMModelSection(_Section):
    """``[model] kind = "dlrm"``: DLRM over sharded embedding tables (:mod:`podscale.tasks.dlrm`).

    The MLPs are dense parameters under the data-parallel strategy (replicated or ZeRO); the tables are a
    :class:`~podscale.table.ShardedEmbeddingBags` with its own sparse optimizer and, with ``dram_budget_mb``,
    a DRAM cache over an SSD tier under ``ssd_path`` (``ssd_engine``: podscale's log-structured store or
    RocksDB).  ``data_format`` picks the data: the
    Criteo-like generator (``generated``, no file), a Criteo TSV file (``criteo-tsv``: label, 13 integer and
    26 hex categorical columns) or MovieLens-100K's ``u.data`` (``movielens``; click = rating >= 4).
    """

    kind: Literal["dlrm"]
    data_format: Literal["generated", "criteo-tsv", "movielens"] = "generated"
    tables: list[DLRMTableSection] | None = Field(
        None, description="generated data: one table per sparse feature (default: Criteo's 26 cardinalities)")
    num_dense: int = Field(13, ge=1, description="generated data: dense features")
    embedding_dim: int = Field(16, ge=1)
    bottom_mlp: list[int] = Field([64, 32], description="hidden sizes of the bottom MLP (dense features)")
    top_mlp: list[int] = Field([64, 32], description="hidden sizes of the top MLP (to the click logit)")
    pooling: Literal["sum", "mean"] = "mean"
    sharding: Literal["row", "table", "column"] = "row"
    declare_range: bool = Field(False, description="generated data: ids are ranks in [0, cardinality) and "
                                                   "outside that range are errors (else hashed int64 ids)")
    alpha: float = Field(1.05, gt=0.0, description="generated data: Zipf exponent of id popularity")
    min_ids: int = Field(1, ge=1, description="generated data: ids per bag, at least")
    max_ids: int = Field(1, ge=1, description="generated data: ids per bag, at most")
    teacher_scale: float = Field(2.0, ge=0.0, description="generated data: strength of the hidden teacher")
    data_seed: int = Field(0, ge=0, description="generated data: seed of the ids and of the teacher")
    val_samples: int = Field(4096, ge=1, description="generated data: validation samples (AUC, log loss); "
                                                    "files hold out data.val_fraction")
    sparse_optimizer: Literal["adagrad", "sgd", "adam"] = "adagrad"
    sparse_lr: float = Field(0.05, gt=0.0)
    admit_after: int = Field(0, ge=0, description="occurrences before an id gets a row (reads zeros before)")
    ttl_steps: int | None = Field(None, ge=1, description="rows unused this many steps are dropped")
    dram_budget_mb: float | None = Field(None, gt=0.0, description="DRAM cache per table shard (MiB); rows "
                                                                   "beyond it live in the SSD tier")
    ssd_path: str | None = Field(None, description="folder of the SSD tier (needed with dram_budget_mb)")
    cache_policy: Literal["lru", "lfu"] = "lru"
    ssd_engine: Literal["log", "rocksdb"] = Field(
        "log", description="SSD tier engine: log (append-only row records, key index in DRAM, 34-136 B a key; "
                           "faster) or rocksdb (index on disk: for more keys than DRAM can index)")
    table_storage: Literal["keyed", "dense"] = Field(
        "keyed", description="keyed: arbitrary int64 ids, rows created as ids arrive (admission, TTL, SSD "
                             "tier); dense: ids in [0, cardinality), every row created up front and the id "
                             "is its slot (needs declare_range and table- or column-wise sharding)")
    prefetch: bool = Field(True, description="promote the next batch's rows while this batch trains")
    full_checkpoint_every: int = Field(4, ge=1, description="tables: every N-th checkpoint is full, the "
                                                            "others hold only the rows changed since the last")

    @model_validator(mode="after")
    def _consistent(self):
        if self.min_ids > self.max_ids:
            raise ValueError(f"model.min_ids={self.min_ids} exceeds model.max_ids={self.max_ids}: set "
                             "min_ids <= max_ids")
        if self.dram_budget_mb is not None and not self.ssd_path:
            raise ValueError("model.dram_budget_mb needs an SSD tier below the DRAM cache: set model.ssd_path "
                             "to a folder on a writable disk")
        if self.tables is not None:
            names = [t.name for t in self.tables]
            if not names or len(set(names)) != len(names):
                raise ValueError(f"model.tables names {names}: give at least one table, each its own name")
        if self.table_storage == "dense":
            from podscale.table.embedding import dense_store_rule_broken
            keyed = "or set model.table_storage = \"keyed\""
            rows = [t.name for t in (self.tables or []) if (t.sharding or self.sharding) == "row"]
            broken = dense_store_rule_broken(self.data_format == "generated" and self.declare_range,
                                             self.sharding == "row" and self.tables is None or bool(rows),
                                             self.admit_after > 1 or self.ttl_steps is not None
                                             or self.dram_budget_mb is not None)
            if broken == "range":
                raise ValueError("model.table_storage = \"dense\" needs declared id ranges: set "
                                 f"model.declare_range = true (generated data) {keyed}")
            if broken == "row-wise":
                raise ValueError(f"model.table_storage = \"dense\" needs table- or column-wise sharding "
                                 f"(row-wise: {rows or 'every table'}): set model.sharding {keyed}")
            if broken == "tiers":
                raise ValueError("model.table_storage = \"dense\" holds every row in memory from the start: "
                                 f"drop model.admit_after, model.ttl_steps and model.dram_budget_mb {keyed}")
        return self

    def task_class(self) -> type:
        from podscale.tasks.dlrm import DLRMTask
        return DLRMTask

    def check_data(self, path: Path, given: str, head: bytes) -> None:
        """``data.path`` must be a file of ``data_format`` (checked on its first line)."""
        from podscale.tasks.dlrm import check_data_file
        try:
            check_data_file(self.data_format, path, head)
        except ValueError as err:
            raise ConfigError(f"data.path: '{given}' {err}") from None

    def check_model(self) -> None:
        """The SSD folder must be writable and the generated data needs no file."""
        if self.ssd_path is not None:
            from podscale.storage.rows import unwritable_reason
            reason = unwritable_reason(Path(os.path.expanduser(self.ssd_path)))
            if reason is not None:
                raise ConfigError(f"model.ssd_path '{self.ssd_path}' is not writable ({reason}): point "
                                  "it at a folder on a writable disk")

    def check_layout(self, cfg: "Config") -> None:
        """The tables update on every backward: one micro-batch per step, no fp16 loss scaling."""
        from podscale.tasks.base import check_task_layout
        from podscale.tasks.dlrm import DLRMTask
        p = cfg.parallel
        try:
            check_task_layout(DLRMTask, p.tp, p.sequence_parallel, p.pp, p.ep)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        if cfg.grad_accum != 1:
            raise ConfigError(f"model.kind='dlrm' applies the sparse optimizer in each backward, so it needs one "
                              f"micro-batch per step (global_batch / (dp * micro_batch) = {cfg.grad_accum}): set "
                              f"train.micro_batch = {cfg.train.global_batch // cfg.dp}")
        if cfg.train.precision == "fp16":
            raise ConfigError("model.kind='dlrm' with train.precision='fp16': the loss scale would reach the "
                              "sparse optimizer's gradients: use 'fp32' or 'bf16'")
        if self.dram_budget_mb is not None:
            # One step's rows of a shard must fit its DRAM cache: at most every id of the global batch
            # (each bag's ids; a file's one id per feature -- MovieLens' genre bag: 6), capped by the
            # table's cardinality where the generator declares one.
            per_sample = {"generated": self.max_ids, "criteo-tsv": 1, "movielens": 6}[self.data_format]
            cards = [t.cardinality for t in self.tables] if self.tables and self.data_format == "generated" \
                else [None]
            state = {"adagrad": 1, "sgd": 0, "adam": 2 * self.embedding_dim}[self.sparse_optimizer]
            row = 4 * (self.embedding_dim + state + 1)
            need = max(min(cfg.train.global_batch * per_sample, c or cfg.train.global_batch * per_sample)
                       for c in cards)
            have = int(self.dram_budget_mb * 2 ** 20) // row
            if have < need:
                raise ConfigError(f"model.dram_budget_mb={self.dram_budget_mb} holds {have} rows of {row} B per "
                                  f"table shard, fewer than one batch's ids ({need}): raise it to at least "
                                  f"{need * row / 2 ** 20:.3g} or lower train.global_batch")
        if self.data_format != "generated" and cfg.data.path is None:
            raise ConfigError(f"model.data_format='{self.data_format}' reads a file: set data.path (or use "
                              "data_format='generated')")


class GraphModelSection(_Section):
    """``[model] kind = "graphsage"`` or ``"gcn"``: node classification with the GNN task of
    :mod:`podscale.tasks.graph` on a generated or loaded graph; ``fanouts = []`` trains on the full graph
    (one process), else mini-batches of sampled neighbourhoods, over ``partitions`` when dp > 1."""

    kind: Literal["graphsage", "gcn"]
    graph: Literal["sbm", "rmat", "planetoid", "ogb"] = Field(
        "sbm", description="generated sbm (planted communities) or rmat, a Planetoid .npz or an OGB-style folder")
    graph_path: str | None = Field(None, description="the .npz (planetoid) or folder (ogb)")
    graph_seed: int = Field(0, ge=0, description="seed of a generated graph")
    nodes: int = Field(2000, ge=2, description="nodes of the generated sbm")
    scale: int = Field(14, ge=1, le=32, description="log2 of the nodes of the generated rmat graph")
    features: int = Field(32, ge=0, description="feature width of a generated graph (0: none; then train "
                          "node embeddings)")
    classes: int = Field(8, ge=2, description="classes (communities) of a generated graph")
    hidden: int = Field(64, ge=1)
    layers: int = Field(2, ge=1)
    dropout: float = Field(0.5, ge=0.0, lt=1.0)
    fanouts: list[int] = Field([10, 5], description="sampled neighbours per layer, input layer first; [] = full graph")
    partitions: str | None = Field(None, description="folder of `podscale graph partition` (dp > 1)")
    feature_cache_rows: int = Field(0, ge=0, description="remote feature rows each rank caches")
    node_embedding_dim: int = Field(0, ge=0, description="learnable node embedding width, rows of the sharded "
                                    "table appended to the features (0: none)")
    node_embedding_optimizer: Literal["adagrad", "sgd", "adam"] = Field(
        "adagrad", description="sparse optimizer of the node embeddings, applied by each row's owner")
    node_embedding_lr: float = Field(0.05, gt=0.0, description="learning rate of the node embeddings")

    def task_class(self) -> type:
        from podscale.tasks.graph import GraphTask
        return GraphTask

    def check_data(self, path: Path, given: str, head: bytes) -> None:
        raise ConfigError(f"data.path: the GNN task reads its graph from model.graph and model.graph_path: remove "
                          f"data.path '{given}' and set model.graph_path")

    def check_model(self) -> None:
        if any(f <= 0 for f in self.fanouts):
            raise ConfigError(f"model.fanouts={self.fanouts}: every fan-out must be a positive neighbour count "
                              "(e.g. [10, 5]); [] trains on the full graph")
        if self.fanouts and len(self.fanouts) != self.layers:
            raise ConfigError(f"model.fanouts={self.fanouts} has {len(self.fanouts)} entries but model.layers="
                              f"{self.layers}: give one fan-out per layer")

    def check_layout(self, cfg: "Config") -> None:
        """Tensor and pipeline parallelism are refused; the graph, its partitions and the world must agree."""
        from podscale.graph.core import GraphError
        from podscale.tasks.base import check_task_layout
        from podscale.tasks.graph import GraphTask, check_config
        p = cfg.parallel
        try:
            check_task_layout(GraphTask, p.tp, p.sequence_parallel, p.pp, p.ep)
            check_config(cfg)
        except (GraphError, ValueError) as err:
            raise ConfigError(f"model: {err}" if isinstance(err, GraphError) else str(err)) from None


#: ``[model] kind`` -> its section (a fixed table: a user's own task is ``kind = "custom"`` with ``task``)
MODEL_KINDS: dict[str, type] = {"gpt": GPTModelSection, "gpt-moe": GPTMoEModelSection, "dlrm": DLRMModelSection,
                                "graphsage": GraphModelSection, "gcn": GraphModelSection, "custom": CustomModelSection}


def _model_kind(value) -> str:
    """The ``kind`` of a ``[model]`` section; ``gpt`` when it names none (configs from before kinds)."""
    if isinstance(value, dict):
        return value.get("kind", "gpt")
    return value.kind


ModelSection = Annotated[
    Union[Annotated[GPTModelSection, Tag("gpt")], Annotated[GPTMoEModelSection, Tag("gpt-moe")],
          Annotated[DLRMModelSection, Tag("dlrm")], Annotated[GraphModelSection, Tag("graphsage")],
          Annotated[GraphModelSection, Tag("gcn")], Annotated[CustomModelSection, Tag("custom")]],
    Discriminator(_model_kind, custom_error_type="unknown_model_kind", custom_error_message="unknown model kind"),
]


def _option_error(err: ValidationError, task: str, cls: type) -> str:
    e = err.errors()[0]
    key = "model." + ".".join(str(x) for x in e["loc"])
    if e["type"] == "extra_forbidden":
        valid = ", ".join(["kind", "task", *cls.Options.model_fields])
        return f"unknown key '{key}' for task {task}: valid keys in [model] are {valid}"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{key}: {msg}" + (f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else "")


class DataSection(_Section):
    path: str | None = Field(None, description="UTF-8/bytes corpus; none = the Python standard library's source")
    val_fraction: float = Field(0.1, gt=0.0, lt=0.5)


class ParallelSection(_Section):
    nproc: int = Field(2, ge=1, le=4096, description="local worker processes spawned by `podscale train`")
    bind_cores: bool = Field(
        False, description="CPU runs: pin each local worker to its own equal share of the cores it may use, one "
        "thread per core (DeepSpeed's --bind_cores_to_rank); off by default because two bound jobs on one machine "
        "would share the same cores; no effect with more workers than cores or on GPUs")
    dp: int | None = Field(None, ge=1, description="data-parallel size; default: what pp, ep and tp leave")
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    bucket_mb: float = Field(25.0, gt=0.0)
    sequence_parallel: bool = False
    fold_tp_into_ep: bool = Field(
        False, description="mixture-of-experts models under tp > 1: shard the experts over ep x tp and exchange "
        "tokens over those ranks, instead of every tp rank holding the ep rank's experts (MoE parallel folding: "
        "tp times less expert memory, no tp sum of their gradients; model.experts a multiple of ep * tp)")
    expert_tensor_parallel: bool = Field(
        False, description="mixture-of-experts models under tp > 1: split each expert's hidden width over tp "
        "(Megatron-core's expert_tensor_parallel_size = tp): every tp rank holds 1/tp of each of its ep rank's "
        "experts and of the shared experts and runs every tp rank's tokens through it, for few large experts "
        "(model.expert_hidden a multiple of tp; not with fold_tp_into_ep)")
    # podscale.parallel.moe.EXPERT_DISPATCHES (a test holds them equal)
    expert_dispatch: Literal["choice", "rank", "node"] = Field(
        "choice", description="mixture-of-experts models under ep > 1: 'choice' exchanges one row per kept "
        "(token, expert) choice and combines the outputs on the token's rank; 'rank' sends a token once to each "
        "rank holding any of its choices and combines its choices' outputs there (DeepEP's dispatch and "
        "combine: fewer bytes for top_k > 1, plus 16 bytes a choice); 'node' sends it once to each node, "
        "to the rank with the sender's index there, which forwards it per rank inside the node (DeepEP's "
        "internode dispatch; 'rank' when the expert group is inside one node); not with expert_tensor_parallel")
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    virtual_stages: int = Field(1, ge=1, description="model chunks per pipeline rank (interleaved 1F1B)")
    recompute: Literal["none", "selective", "full"] = "none"
    pipeline_balance: Literal["params", "time"] = Field(
        "params", description="split blocks into stages by parameter count or by measured time")
    pipeline_layers: list[int] | None = Field(
        None, description="blocks per model chunk (pp * virtual_stages counts), overriding the balance")


class ZeroSection(_Section):
    stage: Literal[0, 1, 2, 3] = 0
    offload_optimizer: Literal["none", "cpu", "nvme"] = "none"
    offload_param: Literal["none", "cpu", "nvme"] = "none"
    nvme_path: str | None = None
    reduce_bucket_mb: float = Field(25.0, gt=0.0)
    param_persistence_threshold: int = Field(10_000, ge=0,
                                             description="parameters with fewer elements stay whole (stage 3)")
    nvme_block_mb: float = Field(8.0, gt=0.0, description="size of one NVMe read/write request")
    nvme_overlap_step: bool = Field(
        True, description="stage 3 with offload_optimizer=nvme (AdamW): stream the optimizer step while the next "
        "forward runs, each block waiting only for its own update (false: step at once after backward)")
    reshard_after_forward: bool = Field(
        True, description="stage 3: free a block's gathered parameters after its forward (gather again for "
        "backward); false keeps it gathered until its gradients are reduced (fewer all-gathers, more memory)")
    host_mmap_threshold_mb: float | None = Field(
        None, ge=0.0, description="stage 3 on a CPU device: glibc serves allocations of at least this size "
                                  "with mmap, so released block buffers leave the process (default: 32 MiB, "
                                  "glibc's cap; 0: leave malloc alone)")
    grad_accum_dtype: Literal["fp32"] | None = Field(
        None, description="gradient shard dtype (stages 1-3): default the reduce dtype (ZeRO's 2 bytes per "
                          "parameter in mixed precision); fp32 accumulates micro-batches without 16-bit rounding")
    optimizer: Literal["adamw", "lamb", "lars"] = Field(
        "adamw", description="optimizer over the flat shards (stages 1-3); lamb/lars use per-tensor trust ratios")

    @model_validator(mode="after")
    def _offload_fits_stage(self):
        # ZeRO-Offload moves partitioned state; ZeRO-Infinity's parameter offload needs partitioned params
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"zero.offload_param={self.offload_param} needs zero.stage=3 (only stage 3 "
                             f"partitions parameters): set zero.stage=3 or zero.offload_param='none'")
        if not self.reshard_after_forward and self.stage != 3:
            raise ValueError(f"zero.reshard_after_forward=false needs zero.stage=3 (only stage 3 gathers and "
                             f"frees parameters; got stage {self.stage}): set zero.stage=3 or remove the key")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("zero.offload_optimizer needs zero.stage >= 1 (stage 0 does not partition the "
                             "optimizer state): set zero.stage=1, 2 or 3")
        if self.optimizer != "adamw" and self.stage == 0:
            raise ValueError(f"zero.optimizer={self.optimizer} runs on ZeRO's flat shards: set zero.stage=1, 2 or 3")
        if self.offload_param == "nvme" and self.offload_optimizer != "nvme":
            raise ValueError(f"zero.offload_param='nvme' needs zero.offload_optimizer='nvme' (ZeRO-Infinity keeps "
                             f"the parameter shards in the optimizer's swap file; got offload_optimizer="
                             f"'{self.offload_optimizer}'): set offload_optimizer='nvme'")
        if self.offload_param == "cpu" and self.offload_optimizer == "nvme":
            raise ValueError("zero.offload_param='cpu' with zero.offload_optimizer='nvme' is not supported (the "
                             "parameters would stay on the device): set offload_param='nvme' or 'none', or "
                             "offload_optimizer='cpu'")
        if "nvme" in (self.offload_optimizer, self.offload_param):
            if not self.nvme_path:
                raise ValueError("zero.nvme_path is required for nvme offload: point it at a folder on a fast disk")
            path = Path(os.path.expanduser(self.nvme_path))
            if not path.is_dir():
                raise ValueError(f"zero.nvme_path '{self.nvme_path}' is not an existing folder: create it "
                                 "or point at one")
            if not os.access(path, os.W_OK | os.X_OK):
                raise ValueError(f"zero.nvme_path '{self.nvme_path}' is not writable: choose a folder you "
                                 "can write")
        return self


class TrainSection(_Section):
    global_batch: int = Field(16, ge=1, description="sequences per optimizer step, over all dp ranks")
    micro_batch: int = Field(8, ge=1, description="sequences per forward/backward on one rank")
    lr: float = Field(1e-3, gt=0.0, lt=1.0)
    min_lr: float = Field(1e-4, ge=0.0)
    warmup_steps: int = Field(10, ge=0)
    decay_steps: int | None = Field(None, ge=1, description="cosine decay length; default run.steps")
    weight_decay: float = Field(0.1, ge=0.0)
    beta1: float = Field(0.9, ge=0.0, lt=1.0)
    beta2: float = Field(0.95, ge=0.0, lt=1.0)
    eps: float = Field(1e-8, gt=0.0)
    grad_clip: float = Field(1.0, ge=0.0, description="global-norm clipping; 0 disables")
    precision: Precision = "fp32"
    reduce_dtype: Literal["fp32", "bf16", "fp16"] | None = None
    loss_scale_init: float = Field(2.0**16, gt=0.0)
    loss_scale_window: int = Field(1000, ge=1)
    compile: bool = Field(
        False, description="compile each of the task's repeated units (the GPT's and GPT-MoE's transformer blocks) with "
                           "torch.compile, one graph shared by all of them; parallel wrappers, hooks and "
                           "collectives stay outside the compiled regions (podscale.train.compile)")
    init_from: str | None = Field(
        None, description="start from the model weights of this checkpoint (a run directory: its newest complete "
                          "one; or a step_XXXXXXXX folder), written at any layout, with a fresh optimizer, data "
                          "position and step: the same model's weights (fine-tuning), or for a GPT-MoE a dense "
                          "GPT's of the same trunk, upcycled (every expert a copy of its block's MLP; Komatsuzaki "
                          "et al. 2023); ignored when the run resumes its own checkpoint")
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor", description="torch.compile backend: inductor generates C++ (CPU) or Triton (GPU) kernels; "
                                "aot_eager traces forward and backward the same way but runs them eagerly "
                                "(no code generation: for debugging a compiled run)")

    @model_validator(mode="after")
    def _lr_range(self):
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} exceeds train.lr={self.lr}: set min_lr <= lr")
        return self


class CheckpointSection(_Section):
    every: int = Field(0, ge=0, description="save every N steps; 0 = only at the end")
    keep: int = Field(3, ge=1)
    at_end: bool = True


class Config(_Section):
    run: RunSection = RunSection()
    model: ModelSection = GPTModelSection()
    data: DataSection = DataSection()
    parallel: ParallelSection = ParallelSection()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    zero: ZeroSection = ZeroSection()

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    @property
    def dp(self) -> int:
        p = self.parallel
        return p.dp if p.dp is not None else p.nproc // (p.pp * p.ep * p.tp)

    @property
    def data_ranks(self) -> int:
        """Ranks that see different samples: dp x ep (expert-parallel ranks also split the batch, GShard)."""
        return self.dp * self.parallel.ep

    @property
    def grad_accum(self) -> int:
        return self.train.global_batch // (self.data_ranks * self.train.micro_batch)

    def mesh_sizes(self) -> dict[str, int]:
        p = self.parallel
        return {"pp": p.pp, "dp": self.dp, "ep": p.ep, "tp": p.tp}

    def check_layout(self, world_size: int) -> None:
        """Raise ConfigError unless the layout and batch fit ``world_size`` processes."""
        p, t = self.parallel, self.train
        inner = p.pp * p.ep * p.tp
        if world_size % p.ep:
            raise ConfigError(f"parallel.ep={p.ep} does not divide the {world_size} processes: use an ep that "
                              f"divides {world_size} or a process count that is a multiple of {p.ep}")
        if p.dp is None and world_size % inner:
            raise ConfigError(f"parallel: pp*ep*tp={inner} does not divide {world_size} processes: "
                              f"use a process count that is a multiple of {inner}")
        if math.prod(self.mesh_sizes().values()) != world_size:
            raise ConfigError(f"parallel: pp*dp*ep*tp={math.prod(self.mesh_sizes().values())} but there are "
                              f"{world_size} processes: set parallel.dp={world_size // inner} or "
                              f"parallel.nproc={math.prod(self.mesh_sizes().values())}")
        n = self.data_ranks
        if t.global_batch % (n * t.micro_batch):
            what = "dp*micro_batch" if p.ep == 1 else "dp*ep*micro_batch"
            got = f"{self.dp}*{t.micro_batch}" if p.ep == 1 else f"{self.dp}*{p.ep}*{t.micro_batch}"
            raise ConfigError(f"train.global_batch={t.global_batch} is not divisible by {what}="
                              f"{got}: make global_batch a multiple of {n * t.micro_batch}")
        if p.ep > 1:  # what the task says of experts (a model without experts has nothing to shard over ep)
            from podscale.tasks.base import check_task_layout
            try:
                check_task_layout(self.model.task_class(), 1, False, 1, p.ep)
            except ValueError as err:
                raise ConfigError(str(err)) from None
        # the two ways of giving the tp ranks the experts (MoE parallel folding; expert tensor parallelism)
        for key, on, what, how in (
                ("fold_tp_into_ep", p.fold_tp_into_ep, "shards", "it folds the tp ranks into the experts' group"),
                ("expert_tensor_parallel", p.expert_tensor_parallel, "splits",
                 "it splits each expert's hidden width over the tp ranks")):
            if on and p.tp == 1:
                raise ConfigError(f"parallel.{key} needs parallel.tp > 1 ({how}): set parallel.tp or {key} = false")
            if on and not self.model.task_class().supports_expert_parallel:
                raise ConfigError(f"parallel.{key} {what} a mixture-of-experts model's experts, and "
                                  f"model.kind={self.model.kind!r} has none: set {key} = false")
        problem = expert_dispatch_problem(p.expert_dispatch, p.expert_tensor_parallel and p.tp > 1)
        if problem:
            raise ConfigError(problem)
        if p.expert_tensor_parallel and p.fold_tp_into_ep:
            raise ConfigError("parallel.expert_tensor_parallel and parallel.fold_tp_into_ep both use the tp "
                              "ranks for the experts (splitting each expert, or sharding whole experts over "
                              "ep x tp): set one of them to false")
        if p.virtual_stages > 1 and p.schedule != "interleaved":
            raise ConfigError(f"parallel.virtual_stages={p.virtual_stages} needs parallel.schedule = "
                              "'interleaved': set the schedule or virtual_stages = 1")
        if p.pp > 1 and p.schedule == "interleaved" and p.virtual_stages < 2:
            raise ConfigError("parallel.schedule = 'interleaved' needs parallel.virtual_stages >= 2 (model "
                              "chunks per pipeline rank): set it, or use schedule = '1f1b'")
        self.model.check_layout(self)  # what the model family needs of tp, sp and pp
        if self.train.compile:
            from podscale.tasks.base import check_task_compile
            try:
                check_task_compile(self.model.task_class(), p.recompute)
            except ValueError as err:
                raise ConfigError(str(err)) from None


def _where(loc: tuple) -> str:
    return ".".join(str(x) for x in _untagged(loc) if not str(x).startswith("function-after"))


def _untagged(loc: tuple) -> tuple:
    """``loc`` without the ``[model]`` union's tag (``("model", "gpt", "n_head")`` -> ``("model", "n_head")``)."""
    if len(loc) >= 2 and loc[0] == "model" and loc[1] in MODEL_KINDS:
        return loc[:1] + loc[2:]
    return loc


def _one_line(err: ValidationError) -> str:
    e = err.errors()[0]
    key = _where(e["loc"])
    if e["type"] == "unknown_model_kind":
        kind = e["input"].get("kind") if isinstance(e["input"], dict) else e["input"]
        return (f"model.kind: unknown model kind {kind!r}: known kinds are {', '.join(MODEL_KINDS)} (a task of "
                "your own: kind = 'custom' with task = 'package.module:Class')")
    if e["type"] == "extra_forbidden":
        section = ".".join(str(x) for x in _untagged(e["loc"][:-1]))
        valid = _known_keys(e["loc"][:-1])
        return f"unknown key '{key}': valid keys{' in [' + section + ']' if section else ''} are {valid}"
    msg = e["msg"].removeprefix("Value error, ")
    if key and (msg.startswith(key) or msg.startswith("unknown key '")):  # the message names the key itself
        return msg
    if key:
        return f"{key}: {msg} (got {e.get('input')!r})" if "input" in e and not isinstance(
            e.get("input"), dict) else f"{key}: {msg}"
    return msg


def _known_keys(loc: tuple) -> str:
    """The keys of the section at ``loc`` (a validation error's location, the model union's tag included)."""
    model = Config
    parts = [str(x) for x in loc]
    while parts:
        part = parts.pop(0)
        if model is Config and part == "model":
            model = MODEL_KINDS[parts.pop(0)] if parts and parts[0] in MODEL_KINDS else GPTModelSection
        elif part.isdigit():  # an item of a list of sections (model.tables.0): its model is already unwrapped
            continue
        else:
            model = _section_of(model.model_fields[part].annotation)
    return ", ".join(model.model_fields)


def _section_of(annotation):
    """The section model inside ``annotation`` (``list[X] | None`` -> ``X``), or ``annotation`` itself."""
    import typing
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _section_of(arg)
        if isinstance(found, type) and issubclass(found, BaseModel):
            return found
    return annotation


def parse_config(data: dict, base_dir: Path | None = None) -> Config:
    """Validate a config mapping; relative data paths resolve against ``base_dir``."""
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_one_line(err)) from None
    if cfg.data.path is not None:
        path = Path(os.path.expanduser(cfg.data.path))
        if not path.is_absolute() and base_dir is not None and not path.exists():
            path = base_dir / path
        if path.is_dir():
            raise ConfigError(f"data.path: '{cfg.data.path}' is a folder, not a file: point it at a text corpus "
                              "file, or remove data.path to train on the Python standard library's source")
        if not path.is_file():
            raise ConfigError(f"data.path: file '{cfg.data.path}' does not exist: point it at a text corpus, "
                              "or remove data.path to train on the Python standard library's source")
        try:
            with open(path, "rb") as f:
                head = f.read(1 << 16)
        except OSError as err:
            raise ConfigError(f"data.path: '{cfg.data.path}' cannot be read ({err.strerror}): fix its "
                              "permissions or point data.path at a readable file") from None
        cfg.model.check_data(path, cfg.data.path, head)
        cfg.data.path = str(path.resolve())
    if cfg.train.init_from is not None:
        src = Path(os.path.expanduser(cfg.train.init_from))
        if not src.is_absolute() and base_dir is not None and not src.exists():
            src = base_dir / src
        if not src.is_dir():
            raise ConfigError(f"train.init_from: '{cfg.train.init_from}' is not a folder: give a run directory or "
                              "a step_XXXXXXXX checkpoint folder, or remove train.init_from")
        cfg.train.init_from = str(src.resolve())
    cfg.model.check_model()
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("run.tensorboard = true needs the tensorboard package: pip install tensorboard "
                          "(or podscale[tensorboard]), or set run.tensorboard = false")
    if cfg.train.decay_steps is None:
        cfg.train.decay_steps = cfg.run.steps
    return cfg


def load_config(path: str | os.PathLike | None, overrides: list[str] = ()) -> Config:
    """Read and validate a TOML config (``None``: the bundled example), then apply ``key=value`` overrides."""
    if path is None:
        from importlib import resources
        text = resources.files("podscale").joinpath("examples/gpt-small.toml").read_text()
        data, base = tomllib.loads(text), None
    else:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist: give the path of a TOML config "
                              "(see examples/gpt-small.toml)")
        try:
            data = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file '{path}' is not valid TOML ({err}): fix the syntax") from None
        base = p.parent
    for item in overrides:
        apply_override(data, item)
    return parse_config(data, base)


def apply_override(data: dict, item: str) -> None:
    """Apply ``section.key=value`` (value parsed as TOML, else taken as a string) to ``data`` in place."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' must look like section.key=value, e.g. train.lr=3e-4")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"override key '{key}' must be section.key, e.g. run.steps=50")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    section = data.setdefault(parts[0], {})
    if not isinstance(section, dict):
        raise ConfigError(f"override '{item}': '{parts[0]}' is not a section")
    section[parts[1]] = value
