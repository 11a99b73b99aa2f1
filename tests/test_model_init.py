"""GPT's per-parameter initialisation: a model built on the meta device materialises, parameter by parameter
(or shard by shard), to exactly the weights of the same model built eagerly with the same seed."""
import torch

from podscale.models.gpt import GPT, GPTConfig

CFG = GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16)


def _eager_and_meta(seed: int) -> tuple[GPT, GPT]:
    """The same GPT built eagerly and on the meta device from the same global seed."""
    torch.manual_seed(seed)
    eager = GPT(CFG)
    torch.manual_seed(seed)
    with torch.device("meta"):
        meta = GPT(CFG)
    return eager, meta


def test_meta_model_materialises_to_the_eager_weights():
    eager, meta = _eager_and_meta(11)
    assert meta.init_seed == eager.init_seed
    params = dict(eager.named_parameters())
    assert all(p.is_meta for p in meta.parameters())
    for name, p in meta.named_parameters():
        t = torch.empty(p.shape)
        meta.init_parameter(name, t)
        assert torch.equal(t, params[name]), name
    # the initialisation follows GPT-2's recipe
    assert torch.equal(params["blocks.0.ln_1.weight"], torch.ones(32))
    assert torch.equal(params["blocks.0.attn.qkv.bias"], torch.zeros(96))
    assert abs(params["wte.weight"].std().item() - 0.02) < 0.002
    assert abs(params["blocks.2.mlp.proj.weight"].std().item() - 0.02 / (2 * 3) ** 0.5) < 0.001
    # parameters are independent draws, and another seed gives another model
    assert not torch.equal(params["blocks.0.mlp.fc.weight"][:32], params["blocks.1.mlp.fc.weight"][:32])
    torch.manual_seed(12)
    assert not torch.equal(GPT(CFG).wte.weight, eager.wte.weight)


def test_zero3_materialises_a_meta_model_to_the_eager_weights():
    from podscale.config import TrainSection, ZeroSection
    from podscale.parallel.zero import build_strategy
    from podscale.runtime.mesh import Mesh

    eager, meta = _eager_and_meta(5)
    build_strategy(meta, Mesh.build(), TrainSection(), ZeroSection(stage=3, param_persistence_threshold=0))
    with torch.no_grad():
        x = torch.randint(0, 256, (2, 16))
        assert torch.equal(meta(x)[0], eager(x)[0])
