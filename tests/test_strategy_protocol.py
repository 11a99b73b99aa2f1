"""The strategy seam (podscale/parallel/strategy.py): every strategy implements the whole protocol
explicitly, nothing in the package forwards attributes with ``__getattr__``, the engine and the loop probe
no attributes, and an Engine drives each strategy built in one process through a step, a validation, the
checkpoint state and close."""
import ast
import inspect
import math
from pathlib import Path

import pytest
import torch

from podscale.config import parse_config
from podscale.models.gpt import GPT, GPTConfig
from podscale.parallel.data import DataParallel, SingleReplica
from podscale.parallel.pipeline.schedule import PipelineParallel
from podscale.parallel.strategy import DataParallelStrategy, Strategy
from podscale.parallel.tensor import TensorParallelStrategy
from podscale.parallel.zero import ZeroStrategy, build_strategy
from podscale.runtime.mesh import Mesh
from podscale.tasks.gpt import gpt_loss_fn
from podscale.train.engine import Engine

PACKAGE = Path(__file__).resolve().parent.parent / "podscale"


@pytest.mark.parametrize("cls", [DataParallel, SingleReplica, ZeroStrategy, TensorParallelStrategy,
                                 PipelineParallel])
def test_every_strategy_implements_the_protocol(cls):
    assert issubclass(cls, Strategy)
    missing = sorted(n for n in dir(cls) if getattr(getattr(cls, n), "__isabstractmethod__", False))
    assert not inspect.isabstract(cls) and not missing, f"{cls.__name__} leaves {missing} abstract"


@pytest.mark.parametrize("cls", [DataParallel, SingleReplica, ZeroStrategy])
def test_data_parallel_strategies_declare_how_they_compose(cls):
    assert issubclass(cls, DataParallelStrategy)
    assert isinstance(cls.reduce_commutes, bool) and isinstance(cls.sums_sequence_parallel, bool)
    # exactly one of them sums the sequence-parallel gradients: the replicated mean lets the wrapper do it
    assert cls.reduce_commutes != cls.sums_sequence_parallel


def _defines(tree: ast.AST, name: str) -> list[int]:
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]


def test_no_attribute_forwarding_in_the_package():
    found = []
    for f in PACKAGE.rglob("*.py"):
        found += [f"{f.relative_to(PACKAGE)}:{ln}" for ln in _defines(ast.parse(f.read_text()), "__getattr__")]
    assert not found, f"__getattr__ forwarding in {found}"


@pytest.mark.parametrize("module", ["train/engine.py", "train/loop.py", "tasks/base.py", "tasks/gpt.py"])
def test_the_trunk_probes_no_strategy_attributes(module):
    tree = ast.parse((PACKAGE / module).read_text())
    calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in ("getattr", "hasattr")]
    assert not calls, f"{module} probes attributes at lines {calls}"


def _config(stage: int):
    return parse_config({"model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16},
                         "train": {"global_batch": 4, "micro_batch": 2, "lr": 1e-2, "warmup_steps": 0},
                         "zero": {"stage": stage, "param_persistence_threshold": 0},
                         "parallel": {"nproc": 1}})


def _build(kind: str, stage: int):
    cfg = _config(stage)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    mesh = Mesh.build()
    inner = build_strategy(model, mesh, cfg.train, cfg.zero) if stage else SingleReplica(
        model, mesh, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    strategy = TensorParallelStrategy(inner, inner.module, mesh) if kind == "tp-wrapper" else inner
    return cfg, Engine(strategy.module, mesh, cfg.train, strategy, gpt_loss_fn(cfg.train.precision, mesh.device))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_engine_drives_each_strategy_through_the_protocol(stage):
    """Two steps, a validation, checkpoint state round trip and close, on every strategy, plain and inside
    the model-parallel wrapper (tp = 1): both give the same losses and global gradient norms."""
    results = []
    for kind in ("plain", "tp-wrapper"):
        cfg, engine = _build(kind, stage)
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
                   for _ in range(2)]
        first = engine.step(batches)
        second = engine.step(batches)
        assert math.isfinite(first.loss) and second.loss < first.loss
        assert math.isfinite(first.grad_norm) and first.grad_norm > 0
        val = engine.evaluate(batches[:1])
        assert math.isfinite(val)
        state, optim = engine.model_state(), engine.optim_state()
        assert set(state) >= {"wte.weight", "lm_head.weight"} and optim
        template = engine.optim_template()
        assert set(template) >= set(optim)
        engine.load_model_state(state)
        engine.load_optim_state(template | optim)
        assert engine.evaluate(batches[:1]) == pytest.approx(val, rel=1e-6)
        engine.close()
        engine.close()  # twice is safe
        results.append((first.loss, second.loss, first.grad_norm, second.grad_norm))
    assert results[0] == pytest.approx(results[1], rel=1e-5)
