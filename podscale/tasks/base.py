"""The task seam: what one model family brings to the trunk, declared in one place.

The trunk — :class:`~podscale.train.engine.Engine`, the training loop, checkpoints, the launcher,
progress, the metrics log, ``podscale report`` and ``podscale export`` — runs any :class:`Task` on any
layout and knows nothing of any one model.  A task is one typed record per model family (torchtitan's
``TrainSpec`` is the same idea): how to build the model, where its batches come from, how a batch moves to
the device, the loss, the evaluation metrics, what a unit of throughput is and what a sample costs in FLOPs,
and optional extras at the end of a run.  Batches are opaque to the trunk: only the task's own methods look
inside one.

Which task runs is the config's ``[model] kind``: ``gpt`` (:mod:`podscale.tasks.gpt`), or ``custom`` with
``task = "package.module:Class"`` naming a subclass in the user's own code.  There is no registry: the
config names the class, and every worker process builds the task from the config as ``TaskClass(cfg)``.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.nn as nn
from pydantic import BaseModel, ConfigDict

from podscale.parallel.strategy import LossFn  # fn(module, batch) -> scalar tensor
from podscale.train.precision import autocast

if TYPE_CHECKING:
    from podscale.config import Config
    from podscale.train.checkpoint import ModelWeights
    from podscale.train.engine import Engine


class WeightConversion(ABC):
    """A model's initial weights converted from another model's checkpoint (``train.init_from``; e.g. a
    GPT-MoE upcycled from a dense GPT), under the single-process names: the trunk asks for the names of this
    rank's tensors and writes each whole tensor's share into its layout
    (:func:`~podscale.parallel.sharded_state.fill_from_full`), so it works at any layout."""

    @abstractmethod
    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Whole single-process tensors for the ones of ``names`` the conversion provides; the others keep
        their initialisation.  May return views of one tensor under several names (every expert of a layer
        upcycled from the same MLP)."""

    @abstractmethod
    def describe(self) -> str:
        """One phrase for the run's first line (what was converted from what)."""



class DataSource(Protocol):
    """A task's training data for one data-parallel rank: deterministic (the same samples for the same
    seed and step), sharded by dp rank (each global batch is split over the ranks, so every layout sees the
    same global batch) and resumable (its whole position is :meth:`state_dict`, plain JSON that goes into
    the checkpoint's ``meta.json``)."""

    def next_step(self) -> list[Any]:
        """This rank's micro-batches for the next optimizer step (``cfg.grad_accum`` of them)."""
        ...

    def state_dict(self) -> dict:
        """The position in the data, as JSON-serialisable values."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position :meth:`state_dict` returned (raise ValueError when it does not fit)."""
        ...


class NoOptions(BaseModel):
    """A task without options of its own: ``[model]`` holds only ``kind`` (and ``task``)."""

    model_config = ConfigDict(extra="forbid")


class Task(ABC):
    """What a model family brings.  Built in every worker as ``TaskClass(cfg)`` from the whole
    :class:`~podscale.config.Config` (``cfg.model`` is the task's section, ``cfg.train`` the batch sizes,
    ``cfg.run`` the seed and evaluation sizes, ``cfg.data`` an optional data path)."""

    #: The options a ``kind = "custom"`` task reads from ``[model]`` (a pydantic model; unknown keys are
    #: config errors before workers start).  ``cfg.model.options`` is the validated instance.
    Options: ClassVar[type[BaseModel]] = NoOptions
    #: Whether the model runs under tensor (and sequence) parallelism; a config with tp > 1 is refused
    #: before workers start when it does not.
    supports_tensor_parallel: ClassVar[bool] = False
    #: Whether the model can be cut into pipeline stages (pp > 1).
    supports_pipeline: ClassVar[bool] = False
    #: Whether the model has parameters sharded over the mesh's ``ep`` axis (mixture-of-experts): ep > 1
    #: is refused before workers start when it does not.
    supports_expert_parallel: ClassVar[bool] = False
    #: Whether ``train.compile`` can compile the model's repeated units (:meth:`compile_units`); a config
    #: with ``train.compile = true`` is refused before workers start when it cannot.
    supports_compile: ClassVar[bool] = False
    #: What throughput counts, plural ("tokens", "samples", "edges"): the metrics log's
    #: ``<unit>_per_s`` key and the axis label of ``podscale report``.
    throughput_unit: ClassVar[str] = "samples"

    def __init__(self, cfg: Config):
        self.cfg = cfg

    # the model -----------------------------------------------------------------------------------------
    @abstractmethod
    def build_model(self) -> nn.Module:
        """The single-process model, with torch's global generator seeded by ``run.seed``.  It may be on
        the meta device when it can initialise its parameters itself (it then implements
        :class:`~podscale.parallel.model_protocols.MetaInitModel`, as the GPT does); otherwise on the CPU,
        and the strategy moves it.  It may name ZeRO-3's gather units
        (:class:`~podscale.parallel.model_protocols.GatherUnits`)."""

    def build_model_on(self, mesh) -> nn.Module:
        """This rank's model before the strategies apply, for a task whose model needs the mesh at build time
        (its experts sharded over ``ep``: only this rank's are built).  Default: :meth:`build_model`.  The
        parameters :meth:`ep_sharded_parameters` names must carry the same names at every ep size (global
        ids), so checkpoints load at another ep and ``podscale export`` writes :meth:`build_model`'s."""
        return self.build_model()

    def ep_sharded_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters of ``model`` that differ across the ``ep`` axis (each ep rank holds its own share,
        e.g. its experts): replicated and reduced over dp only, while every other parameter is replicated
        and reduced over dp x ep.  Default: none."""
        return []

    def after_step(self, model: nn.Module, mesh) -> None:
        """Update what the model keeps outside its parameters from the step just taken (e.g. the GPT-MoE's
        DeepSeek-V3 balance biases).  Collective: every rank calls it once after each step, before
        :meth:`step_metrics`.  ``model`` is the module the strategy trains.  Default: nothing."""

    def step_metrics(self, model: nn.Module, mesh) -> dict[str, float]:
        """Per-step figures of the model itself (e.g. routing statistics), as ``{"<series>/<name>": value}``:
        the metrics log keeps them under the step record's ``"task"`` key and ``podscale report`` plots every
        ``<name>`` over the steps, one line per ``<series>``.  Collective: every rank calls it once after
        each step.  ``model`` is the module the strategy trains.  Default: none."""
        return {}

    def compile_units(self, model: nn.Module) -> list[nn.Module]:
        """The repeated units of ``model`` (this rank's model, or the model a pipeline cut its chunks from) that
        ``train.compile`` compiles one by one, e.g. the transformer blocks: each unit's ``forward`` is compiled
        and units of one class share one compiled graph (:mod:`podscale.train.compile`), so the parallel
        wrappers, their hooks and the collectives between units run eagerly around them (as torchtitan
        compiles per block).  A unit's forward must be traceable: no data-dependent shapes or Python-side
        state that changes from call to call.  Default: none (``supports_compile`` is False)."""
        return []

    def convert_weights(self, source: "ModelWeights") -> WeightConversion | None:
        """How this model starts from checkpoint ``source`` of another model (``train.init_from``), checked
        against it (a one-line ValueError naming what does not fit); None when ``source`` must be this same
        model's (the default: the same task, tensor names and shapes, any layout: fine-tuning)."""
        return None

    @abstractmethod
    def model_config(self) -> dict:
        """The model's hyper-parameters as plain JSON: saved in checkpoints and in ``podscale export``'s
        file, so the exported weights can be loaded into a freshly built model."""

    def describe(self, model: nn.Module) -> str:
        """One phrase for the start-of-run line (default: the parameter count and the global batch)."""
        n = sum(p.numel() for p in model.parameters())
        per = "" if self.units_per_sample() == 1 else f" x {self.units_per_sample():g}"
        return f"{n / 1e6:.2f}M params, global batch {self.cfg.train.global_batch}{per} {self.throughput_unit}"

    # data -------------------------------------------------------------------------------------------------
    @abstractmethod
    def train_data(self, dp_rank: int, dp_size: int) -> DataSource:
        """This rank's training data (see :class:`DataSource`)."""

    @abstractmethod
    def eval_data(self, dp_rank: int, dp_size: int) -> list[Any]:
        """A fixed validation set: ``cfg.run.eval_batches`` batches, this rank's share of each."""

    @abstractmethod
    def to_device(self, batch: Any, device: torch.device) -> Any:
        """``batch`` with its tensors on ``device``."""

    # loss and metrics ----------------------------------------------------------------------------------
    @abstractmethod
    def loss(self, module: nn.Module, batch: Any) -> torch.Tensor:
        """The scalar training loss of ``batch`` (already on the device) through ``module`` (the model, or
        the model as a strategy wraps it), with its autograd graph."""

    def evaluate(self, engine: Engine, batches: list[Any]) -> dict[str, float]:
        """Validation metrics over this rank's ``batches``, averaged over data-parallel ranks; the loop
        logs them as ``val_<name>``.  Every rank calls it (forwards can be collective).  Default: the
        loss; a task adds its own with ``engine.evaluate(batches, self.on_device(metric))``."""
        return {"loss": engine.evaluate(batches)}

    # throughput and model FLOP/s utilisation ------------------------------------------------------------
    @abstractmethod
    def units_per_sample(self) -> float:
        """Throughput units in one sample (tokens per sequence for a language model; 1 for samples)."""

    @abstractmethod
    def flops_per_sample(self) -> float:
        """Model FLOPs of one sample's forward and backward (for MFU: Chowdhery et al. 2022, App. B)."""

    # extras ---------------------------------------------------------------------------------------------
    def finish(self, engine: Engine, rank: int, run_dir: Path, say: Callable[[str], None]) -> dict[str, Any]:
        """Called on every rank after the last step (collective, like evaluation): optional extras such as
        sampled text; ``say`` prints on rank 0.  Returns entries for the run's summary (default: none)."""
        return {}

    # model state outside the strategy (sharded tables): optional hooks, default nothing -------------------
    def bind(self, model: nn.Module, mesh) -> None:
        """Give ``model`` the state that lives on the mesh outside its parameters -- rows by key on their
        owner ranks, updated by a model-owned sparse optimizer inside backward (the DLRM's embedding tables)
        -- before the strategy wraps the model (``parallelize`` calls it once, on every rank).  The strategy
        then sees only the dense parameters.  Default: nothing."""

    def save_state(self, step_dir: Path, root: Path, step: int) -> None:
        """Collective: write what :meth:`bind` added (not in the strategy's tensors) into checkpoint ``step``,
        while the trunk writes ``step_dir`` (the unfinished folder, renamed into place after every rank
        returns).  State shared by several checkpoints (incremental saves) may go under ``root`` with files in
        ``step_dir`` naming it.  Default: nothing."""

    def load_state(self, step_dir: Path) -> None:
        """Collective: restore what :meth:`save_state` wrote into the finished checkpoint ``step_dir`` (written
        by any number of ranks).  Default: nothing."""

    def close(self) -> None:
        """Release what :meth:`bind` opened (files, threads); the loop calls it once at the end of a run,
        also a failed one.  Default: nothing."""

    # what the trunk builds from the above -----------------------------------------------------------------
    def on_device(self, fn: LossFn, precision: str, device: torch.device) -> LossFn:
        """``fn`` as the engine calls it: the batch moved to ``device`` by :meth:`to_device` and ``fn`` run
        under the precision's autocast."""
        return on_device(fn, self.to_device, precision, device)

    def loss_fn(self, precision: str, device: torch.device) -> LossFn:
        """The engine's ``loss_fn``: :meth:`loss` through :meth:`on_device`."""
        return self.on_device(self.loss, precision, device)


def on_device(fn: LossFn, to_device: Callable[[Any, torch.device], Any], precision: str,
              device: torch.device) -> LossFn:
    """``fn(module, batch)`` with ``batch`` first moved by ``to_device(batch, device)``, run under the autocast
    of ``precision`` ("fp32": none)."""
    def run(module: nn.Module, batch: Any) -> torch.Tensor:
        batch = to_device(batch, device)
        with autocast(precision, device):
            return fn(module, batch)
    return run


def import_task(path: str) -> type[Task]:
    """The :class:`Task` subclass named ``package.module:Class``; ValueError (one line) when the module
    cannot be imported or the name is not a Task subclass."""
    module_name, _, class_name = path.partition(":")
    if not (module_name and class_name.isidentifier()):
        raise ValueError(f"model.task={path!r} must name a class as 'package.module:Class', e.g. "
                         "'my_tasks:MyTask'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"model.task: cannot import '{module_name}' ({err}): install it or put its folder "
                         "on PYTHONPATH") from None
    cls = vars(module).get(class_name)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"model.task: '{path}' is not a podscale.tasks.Task subclass: name a class that "
                         "derives from podscale.tasks.Task")
    return cls


def task_for(cfg: Config) -> Task:
    """The task ``cfg``'s ``[model]`` section names, built from ``cfg``."""
    return cfg.model.task_class()(cfg)


def check_task_layout(task: type[Task], tp: int, sequence_parallel: bool, pp: int, ep: int = 1) -> None:
    """ValueError (one line naming the key and the fix) when the layout asks for a parallelism the task
    class does not support.  The config refuses such a layout before workers start; ``build_engine``
    checks again for the Python API."""
    name = f"{task.__module__}:{task.__qualname__}"
    if (tp > 1 or sequence_parallel) and not task.supports_tensor_parallel:
        raise ValueError(f"parallel.tp={tp}, parallel.sequence_parallel={str(sequence_parallel).lower()}: task "
                         f"{name} does not support tensor parallelism: set parallel.tp = 1 and "
                         "parallel.sequence_parallel = false")
    if pp > 1 and not task.supports_pipeline:
        raise ValueError(f"parallel.pp={pp}: task {name} does not support pipeline parallelism: "
                         "set parallel.pp = 1")
    if ep > 1 and not task.supports_expert_parallel:
        raise ValueError(f"parallel.ep={ep}: task {name} has no experts to shard over ep (expert parallelism "
                         "needs a mixture-of-experts model): set parallel.ep = 1 or model.kind = 'gpt-moe'")


def check_task_compile(task: type[Task], recompute: str) -> None:
    """ValueError (one line naming the key and the fix) when ``train.compile = true`` cannot work: the task
    has no units to compile, or activation recomputation also replaces the blocks' forward."""
    name = f"{task.__module__}:{task.__qualname__}"
    if not task.supports_compile:
        raise ValueError(f"train.compile = true: task {name} has no units that torch.compile can compile "
                         "(supports_compile is false): set train.compile = false")
    if recompute != "none":
        raise ValueError(f"train.compile = true with parallel.recompute='{recompute}': compiled blocks are not "
                         "built with activation recomputation: set parallel.recompute = 'none' or "
                         "train.compile = false")
