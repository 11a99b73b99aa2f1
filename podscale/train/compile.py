"""``train.compile = true``: each of the task's repeated units compiled with ``torch.compile``.

As torchtitan does (``apply_compile`` compiles every transformer block on its own; Liang et al. 2024,
"TorchTitan"), podscale compiles the units the task names (:meth:`podscale.tasks.Task.compile_units`: the GPT's
transformer blocks), not the whole model: the parallel wrappers stay outside the compiled regions and run
eagerly around them --- ZeRO-3's forward pre-/post-hooks that gather and free a block's parameters (hooks
live in ``Module.__call__``, and only ``forward`` is compiled), the gradient hooks of data parallelism and
ZeRO, the pipeline schedule, the embeddings and the (vocab-parallel) head and loss.

Why per unit, not the whole model:

* *one graph for all blocks.*  Every unit of a class runs the same compiled function (``torch.compile`` of
  the class's ``forward``, bound to each unit), so Dynamo traces it once and each unit's parameters are
  inputs of that graph: compile time does not grow with the depth, and a pipeline stage or a ZeRO-3
  rank that holds some of the blocks runs the same graph;
* *collectives at the seams.*  Tensor and sequence parallelism keep their f/g collectives inside a block;
  they run through :mod:`podscale.runtime.comm` and are marked ``torch.compiler.disable`` in
  :mod:`podscale.parallel.tensor`, so Dynamo breaks the block's graph there and compiles the pieces between
  collectives (each piece, again, shared by all blocks);
* *data-dependent work stays eager.*  A GPT-MoE's MoE layer (its routing's shapes follow the data; its
  expert-parallel exchanges and routing statistics run from Python) is ``torch.compiler.disable``: Dynamo
  breaks an MoE block's graph at the layer and compiles the attention half before it and the residual add
  after it, shared by all MoE blocks (torchtitan likewise compiles an MoE model's blocks around a token
  dispatcher that stays outside the graph);
* *static shapes* (``dynamic=False``): a training step's shapes do not change; a forward with other shapes
  (sampling, which grows the context one token at a time) runs eagerly inside :func:`eager`.

Dynamo runs frames eagerly while a ``TorchFunctionMode`` is active (the test suite's strict device check,
:func:`podscale.runtime.comm.enable_strict_devices`, holds one for the whole process): the compile tests turn
that check off.  Dropout inside a compiled block draws from inductor's own random streams (the same
distribution, not eager's numbers); under tensor parallelism its per-rank streams are not traced, and the
config refuses ``train.compile`` with dropout there.

The backend is ``train.compile_backend``: ``inductor`` (C++/OpenMP kernels on a CPU, Triton on a GPU) or
``aot_eager`` (the same forward/backward tracing, run eagerly; for debugging).  Compiled kernels are cached on
disk by inductor (``TORCHINDUCTOR_CACHE_DIR``), so later runs and other ranks of the same shapes reuse them.
"""
from __future__ import annotations

import contextlib
import types
from collections.abc import Iterable

import torch
import torch.nn as nn


def compile_units(units: Iterable[nn.Module], backend: str = "inductor") -> int:
    """Replace each unit's ``forward`` by the compiled ``forward`` of its class (one compiled function per
    class, so all units of a class share one graph); compilation happens at the first call.  The units'
    parameters, names, hooks and state dicts are unchanged.  Returns the number of units compiled."""
    compiled: dict[type, object] = {}
    n = 0
    for unit in units:
        cls = type(unit)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, backend=backend, dynamic=False)
        unit.forward = types.MethodType(compiled[cls], unit)
        n += 1
    return n


def eager() -> contextlib.AbstractContextManager:
    """Context: compiled units run their eager code (for forwards whose shapes change from call to call,
    such as sampling a growing context, which would otherwise compile one graph per length)."""
    return torch.compiler.set_stance("force_eager")
