"""The model seams (podscale.parallel.model_protocols, podscale.parallel.param_tags) are declared, not probed:
which models declare what, ZeRO-3's units with and without a declaration, the tags' one home, and no
attribute probing left in the modules that use them.  One process, no process group."""
import ast
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import podscale
from podscale.models.gpt import GPT, GPTConfig
from podscale.models.gpt_moe import GPTMoE, GPTMoEConfig
from podscale.parallel.model_protocols import GatherUnits, MetaInitModel
from podscale.parallel.param_tags import ParamTags, tag, tags
from podscale.parallel.pipeline.schedule import _Chunks
from podscale.parallel.zero.layout import wrap_modules

PACKAGE = Path(podscale.__file__).parent
CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def test_podscale_models_declare_meta_init_and_gather_units():
    moe = GPTMoE(GPTMoEConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, experts=2))
    for m in (GPT(CFG), moe, GPT(CFG).empty_chunk()):
        assert isinstance(m, MetaInitModel) and isinstance(m, GatherUnits)
    assert issubclass(_Chunks, GatherUnits) and not issubclass(_Chunks, MetaInitModel)
    # declared by inheritance only: a module with methods of the same names is not one (no structural probe)

    class Lookalike(nn.Module):
        def gather_units(self):
            return []

        def init_parameter(self, name, t):
            pass

        def materialize(self, device="cpu"):
            return self
    assert not isinstance(Lookalike(), GatherUnits) and not isinstance(Lookalike(), MetaInitModel)


def test_zero3_units_are_the_declared_ones_else_the_children_holding_parameters():
    gpt = GPT(CFG)
    assert wrap_modules(gpt) == list(gpt.blocks.values())
    chunks = _Chunks([gpt])
    assert wrap_modules(chunks) == list(gpt.blocks.values())

    class Plain(nn.Module):  # a user's model that declares nothing: even its ``blocks`` are not looked for
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
            self.act = nn.GELU()
            self.head = nn.Linear(4, 2)
    plain = Plain()
    assert wrap_modules(plain) == [plain.blocks, plain.head]


def test_param_tags_have_one_home_and_travel_with_the_parameter():
    p = nn.Parameter(torch.zeros(3))
    assert tags(p) == ParamTags()
    assert tag(p, tensor_parallel=True) is p
    tag(p, tp_layout=("vocab", 10))
    assert tags(p) == ParamTags(tensor_parallel=True, tp_layout=("vocab", 10))
    with pytest.raises(TypeError):
        tag(p, tensor_paralel=True)  # a misspelt tag is an error, not a new attribute
    # a meta-device GPT keeps its parameters' tags when it materialises
    with torch.device("meta"):
        meta = GPT(CFG)
    tag(meta.blocks["0"].ln_1.weight, sequence_parallel=True)
    meta.materialize()
    assert not meta.blocks["0"].ln_1.weight.is_meta and tags(meta.blocks["0"].ln_1.weight).sequence_parallel


@pytest.mark.parametrize("module", ["parallel/tensor.py", "parallel/compose.py", "parallel/rng.py",
                                    "parallel/sharded_state.py", "parallel/zero/__init__.py",
                                    "parallel/zero/layout.py", "parallel/zero/strategy.py",
                                    "parallel/pipeline/schedule.py", "parallel/pipeline/partition.py",
                                    "parallel/moe/layer.py", "plan/auto.py", "models/gpt.py"])
def test_the_model_seams_probe_no_attributes(module):
    tree = ast.parse((PACKAGE / module).read_text())
    calls = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id in ("getattr", "hasattr")]
    assert not calls, f"{module} probes attributes at lines {calls}"
