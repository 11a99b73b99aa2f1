"""Mixture-of-experts: the fast path equals GShard's einsum form, the capacity rules hold on constructed
routings, expert parallelism (ep = 2, 4, with dp) reproduces one process step for step on real text, and
lopsided routings (one expert takes everything, a rank with nothing for remote experts, an empty rank)
finish with the right gradients.

Multi-process runs are fp64 end to end (the GPT's fp32 cast of the loss is swapped for an fp64 one), so
rounding differences between layouts (~1e-16) cannot flip a routing decision: routing counts are compared
exactly, losses and gradients to 1e-9 relative (measured: within ~1e-13).
"""
import contextlib
import dataclasses
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import moe_workers as W
from podscale.models.gpt_moe import GPTMoE, GPTMoEConfig
from podscale.parallel.moe import layer as moe_layer
from podscale.parallel.moe.kernels import (CacheTiledKernel, GroupedGemmKernel, SegmentKernel, has_fast_grouped_gemm,
                                           kernel_for)
from podscale.parallel.moe import Gating, MoELayer, expert_capacity, route, routing_uniform, sequence_token_keys
from podscale.parallel.param_tags import tags
from podscale.runtime.launcher import launch
from podscale.runtime.mesh import Mesh


def _grads(layer, x, keys=None, reference=False):
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    y, out = (layer.forward_reference if reference else layer.forward)(x, keys)
    (y.square().sum() + out.loss).backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}, out


KERNELS = {"cpu-default": None, "tiled-5": CacheTiledKernel(row_tile=5), "segment": SegmentKernel(),
           "tiled-5-recompute": CacheTiledKernel(row_tile=5, recompute=True),
           "segment-recompute": SegmentKernel(recompute=True)}


#: DeepSeek-V3's gating on 6 experts: sigmoid affinities, 3 groups of 2, a token's experts from its best 2
V3 = Gating("sigmoid", groups=3, group_top_k=2, scale=2.5)


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("top_k,dropless,random_routing,training,gating,drop_policy", [
    (1, False, False, True, Gating(), "position"), (2, False, True, True, Gating(), "position"),
    (2, False, False, False, Gating(), "position"), (2, True, False, True, Gating(), "position"),
    (1, True, False, True, Gating(), "position"), (3, False, False, True, Gating(), "position"),
    (3, False, False, True, V3, "position"), (1, True, False, True, V3, "position"),
    (1, False, False, True, Gating(), "priority"), (2, False, True, True, Gating(), "priority"),
    (2, False, True, True, Gating(), "probs"), (3, False, False, True, V3, "probs")])
def test_fast_path_equals_einsum_reference(top_k, dropless, random_routing, training, gating, drop_policy, kernel):
    """``kernel``: the experts' kernel (the CPU's default, whose 256-row tile is larger than every segment
    here; the CPU's with 5-row tiles, every segment split into several tiles, the last partial; the
    accelerators', run on the CPU; the last two again keeping only the pre-activation, the GELU evaluated
    again in the backward); ``gating``: GShard's softmax, or DeepSeek-V3's sigmoid with a group limit."""
    torch.manual_seed(0)
    layer = MoELayer(16, 24, 6, top_k=top_k, capacity_factor=0.8, eval_capacity_factor=1.1, dropless=dropless,
                     random_routing=random_routing, z_loss_coef=0.01, kernel=KERNELS[kernel],
                     gating=gating, drop_policy=drop_policy).double().train(training)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        for name, p in layer.experts.named_parameters():
            if ".b_" in name:
                p.normal_()
    x = torch.randn(4, 20, 16, dtype=torch.float64)
    keys = sequence_token_keys(torch.randint(0, 256, (4, 20)))
    y, gx, gp, out = _grads(layer, x, keys)
    y_ref, gx_ref, gp_ref, out_ref = _grads(layer, x, keys, reference=True)
    assert torch.equal(out.routing.keep, out_ref.routing.keep)
    if not dropless and training:
        assert 0 < out.stats.dropped  # the capacity is binding in this case
    if dropless:
        assert out.stats.dropped == 0
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    for n in gp:
        torch.testing.assert_close(gp[n], gp_ref[n], rtol=1e-12, atol=1e-12, msg=n)
    assert gp["router.weight"].abs().sum() > 0  # the gate values carry the router's gradient


@pytest.mark.parametrize("kernel", ["cpu-default", "tiled-5", "segment", "tiled-5-recompute"])
@pytest.mark.parametrize("top_k,dropless", [(1, False), (2, True)])
def test_shared_expert_adds_a_dense_feed_forward_of_every_token(top_k, dropless, kernel):
    """A layer with a shared expert (DeepSeekMoE): output and every gradient equal the einsum reference, whose
    shared expert runs in plain autograd operations; the output is the same layer's routed output plus the
    shared feed-forward of every token; the shared parameters are dense (not tagged ``expert_parallel``, not
    among :func:`expert_parameters`) and every one gets a gradient."""
    torch.manual_seed(1)
    layer = MoELayer(16, 24, 6, top_k=top_k, capacity_factor=0.8, dropless=dropless, z_loss_coef=0.01,
                     kernel=KERNELS[kernel], shared_hidden=40).double()
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        for p in (layer.shared.b_fc, layer.shared.b_proj):
            p.normal_()
    x = torch.randn(4, 20, 16, dtype=torch.float64)
    y, gx, gp, out = _grads(layer, x)
    y_ref, gx_ref, gp_ref, _ = _grads(layer, x, reference=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-12, atol=1e-12)
    for n in gp:
        torch.testing.assert_close(gp[n], gp_ref[n], rtol=1e-12, atol=1e-12, msg=n)
    for n in ("shared.w_fc", "shared.w_proj", "shared.b_fc", "shared.b_proj"):
        assert gp[n].abs().sum() > 0, n
    if not dropless:
        assert 0 < out.stats.dropped  # a dropped token still gets the shared expert's output
    shared = {id(p) for p in layer.shared.parameters()}
    assert not shared & {id(p) for p in moe_layer.expert_parameters(layer)}
    assert shared <= {id(p) for p in moe_layer.dense_parameters(layer)}
    assert not any(tags(p).expert_parallel for p in layer.shared.parameters())
    shared_module, layer.shared = layer.shared, None
    with torch.no_grad():
        routed, _ = layer(x)
        torch.testing.assert_close(y, routed + shared_module.reference(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kernel", ["tiled-7", "segment"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_grouped_experts_equal_the_autograd_experts_over_the_whole_gelu_range(dtype, tol, kernel, recompute):
    """The grouped feed-forward against the experts run by autograd with PyTorch's GELU, on pre-activations
    from -20 to 20 (both tails of the sigmoid) and with an expert that gets no rows: the CPU kernel (GELU
    and its derivative from one sigmoid, 7-row tiles packing several experts' rows, the weight gradients
    per segment) and the accelerators' (PyTorch's fused GELU over the buffer, its backward in place); each
    also keeping only the pre-activation (``recompute``)."""
    torch.manual_seed(3)
    experts = moe_layer.Experts(6, 10, 4, kernel=CacheTiledKernel(row_tile=7, recompute=recompute)
                                if kernel == "tiled-7" else SegmentKernel(recompute=recompute)).to(dtype)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 3.0)
    R = 5                                        # rows per expert; expert 2 gets none
    x = torch.randn(4, R, 6, dtype=dtype)
    x[2] = 0
    g = torch.randn(4, R, 6, dtype=dtype)
    grads = []
    for fast in (True, False):
        experts.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        if fast:
            keep = torch.tensor([0, 1, 3])
            y = torch.zeros_like(x).index_copy(0, keep, experts(xi[keep].reshape(-1, 6), [(0, R), (1, R), (2, 0), (3, R)]).view(3, R, 6))
        else:
            y = experts.forward_padded(xi) * (torch.arange(4) != 2).to(dtype)[:, None, None]
        (y * g).sum().backward()
        grads.append([y.detach(), xi.grad] + [p.grad for p in experts.parameters()])
    pre = torch.einsum("erm,emh->erh", x, torch.stack([e.w_fc for e in experts.values()]))
    assert pre.min() < -15 and pre.max() > 15
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert all(float(p.grad.abs().sum()) == 0 for p in experts["2"].parameters())


@pytest.mark.parametrize("recompute", [False, True])
def test_grouped_gemm_kernel_equals_the_autograd_experts(recompute):
    """The grouped-GEMM kernel (run here by PyTorch's CPU implementation of ``grouped_mm``, fp32; fp64 is
    refused by it) against the experts run by autograd, over the GELU's whole range, on segments that
    repeat an expert, skip one and come out of order, as the overlapped exchange's parts hand them; an
    expert without rows gets zero gradients."""
    torch.manual_seed(3)
    experts = moe_layer.Experts(8, 16, 4, kernel=GroupedGemmKernel(recompute=recompute))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 3.0)
    segments = [(1, 4), (0, 3), (2, 0), (1, 5), (3, 2), (0, 0)]
    rows = sum(n for _, n in segments)
    x, g = torch.randn(rows, 8), torch.randn(rows, 8)
    grads = []
    for fast in (True, False):
        experts.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        if fast:
            y = experts(xi, segments)
        else:
            parts, start = [], 0
            for j, n in segments:
                e = experts[str(j)]
                h = F.gelu(xi[start:start + n] @ e.w_fc + e.b_fc, approximate="tanh")
                parts.append(h @ e.w_proj + e.b_proj)
                start += n
            y = torch.cat(parts)
        (y * g).sum().backward()
        grads.append([y.detach(), xi.grad] + [torch.zeros_like(p) if p.grad is None else p.grad
                                              for p in experts.parameters()])
    pre = torch.cat([x[:4] @ experts["1"].w_fc, x[4:7] @ experts["0"].w_fc])
    assert pre.min() < -15 and pre.max() > 15
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * float(b.abs().max()))
    assert all(float(p.grad.abs().sum()) == 0 for p in experts["2"].parameters())


def test_the_grouped_gemm_kernel_is_picked_only_where_it_is_fused():
    """:func:`kernel_for`: the CPU kernel on a CPU whatever the dtype; the grouped GEMM only for bf16 on a
    CUDA device of compute capability 9.x or 10.x with 16-byte-aligned widths (checked when a GPU is present)."""
    cpu = torch.device("cpu")
    for dt in (torch.float32, torch.bfloat16):
        assert isinstance(kernel_for(cpu, dt, 1024, 4096), CacheTiledKernel)
        assert not has_fast_grouped_gemm(cpu, dt, 1024, 4096)
    assert kernel_for(cpu, torch.float32, 64, 128, recompute=True).recompute
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        hopper = torch.version.hip is None and torch.cuda.get_device_capability(gpu)[0] in (9, 10)
        assert isinstance(kernel_for(gpu, torch.bfloat16, 1024, 4096), GroupedGemmKernel if hopper else SegmentKernel)
        for dt, d, h in ((torch.float32, 1024, 4096), (torch.bfloat16, 1020, 4096), (torch.bfloat16, 1024, 4092)):
            assert isinstance(kernel_for(gpu, dt, d, h), SegmentKernel)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("kernel", [CacheTiledKernel, SegmentKernel, GroupedGemmKernel])
def test_grouped_experts_in_bfloat16_follow_fp32_and_refuse_a_second_backward(kernel, recompute):
    torch.manual_seed(4)
    experts = moe_layer.Experts(8, 16, 2, kernel=kernel(recompute=recompute))
    x = torch.randn(12, 8)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        experts.zero_grad(set_to_none=True)
        xi = x.to(dt).detach().requires_grad_(True)
        y = experts.to(dt)(xi, [(0, 5), (1, 7)])
        y.float().square().sum().backward(retain_graph=True)
        out[dt] = (y.detach().float(), xi.grad.float(), experts["0"].w_fc.grad.float())
        with pytest.raises(RuntimeError, match="backward ran twice"):
            y.float().square().sum().backward()
    for a, b in zip(out[torch.float32], out[torch.bfloat16]):
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05 * float(a.abs().max()))


def test_expert_gradients_are_views_of_one_buffer():
    """The CPU kernel's weight gradients are written into one buffer for all the layer's experts, and the biases'
    into one block a kind, so a step's fresh gradients fault in per 2 MiB huge page, not each matrix page by page
    (:class:`~podscale.parallel.moe.kernels.WeightGrads`); autograd keeps them as the ``.grad`` (views, not
    copies); an expert without rows gets zeros in its place."""
    torch.manual_seed(5)
    El, d, h = 4, 128, 1024                          # 4 x 2 x 512 KiB: over two huge pages
    experts = moe_layer.Experts(d, h, El)
    x = torch.randn(9, d, requires_grad=True)
    experts(x, [(0, 4), (1, 0), (2, 3), (3, 2)]).square().sum().backward()
    weights = [p for n, p in experts.named_parameters() if ".w_" in n]
    for group in (weights, [e.b_fc for e in experts.values()], [e.b_proj for e in experts.values()]):
        assert len({p.grad.untyped_storage().data_ptr() for p in group}) == 1
    assert all(float(p.grad.abs().sum()) == 0 for p in experts["1"].parameters())
    assert all(float(p.grad.abs().sum()) > 0 for j in ("0", "2", "3") for p in experts[j].parameters())


class _DtypeSpy:
    """An :class:`~podscale.parallel.moe.kernels.ExpertKernel` that records the dtypes it is handed and
    runs the CPU kernel."""

    def __init__(self):
        self.inner, self.seen = CacheTiledKernel(), []

    def forward(self, x, bounds, weights, El, bias, out):
        self.seen.append(("forward", x.dtype, weights[0].dtype, out.dtype))
        return self.inner.forward(x, bounds, weights, El, bias, out)

    def backward(self, grad, x, saved, bounds, weights, El, acc, g_x):
        self.seen.append(("backward", grad.dtype, x.dtype, *(t.dtype for t in saved)))
        self.inner.backward(grad, x, saved, bounds, weights, El, acc, g_x)


def test_experts_compute_in_the_autocast_dtype_and_the_router_in_fp32():
    """Under ``torch.autocast`` (``train.precision = "bf16"``) the experts run in bf16, as ``nn.Linear``
    experts would: the kernel gets bf16 tokens and weights and keeps bf16 activations, while the router
    stays fp32 (the same routing as without autocast), the parameters' gradients and the input's gradient
    stay fp32, and the result follows the fp32 layer to bf16's precision."""
    torch.manual_seed(3)
    spy = _DtypeSpy()
    layer = MoELayer(32, 64, 4, top_k=2, capacity_factor=1.0, kernel=spy)
    x = torch.randn(2, 24, 32)
    runs = {}
    for name, ctx in (("fp32", contextlib.nullcontext), ("bf16", lambda: torch.autocast("cpu", torch.bfloat16))):
        spy.seen.clear()
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        with ctx():
            y, out = layer(xi)
            loss = y.float().square().sum() + out.loss
        loss.backward()
        runs[name] = (y.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()}, out, list(spy.seen))
    y, gx, grads, out, seen = runs["bf16"]
    y32, gx32, grads32, out32, seen32 = runs["fp32"]
    assert seen == [("forward",) + (torch.bfloat16,) * 3, ("backward",) + (torch.bfloat16,) * 4]
    assert seen32 == [("forward",) + (torch.float32,) * 3, ("backward",) + (torch.float32,) * 4]
    assert torch.equal(out.routing.keep, out32.routing.keep) and torch.equal(out.routing.expert, out32.routing.expert)
    assert y.dtype == torch.bfloat16 and gx.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in grads.values())
    torch.testing.assert_close(y.float(), y32, rtol=0.02, atol=0.02 * float(y32.abs().max()))
    torch.testing.assert_close(gx, gx32, rtol=0.03, atol=0.03 * float(gx32.abs().max()))
    for n, g in grads.items():
        torch.testing.assert_close(g, grads32[n], rtol=0.03, atol=0.03 * float(grads32[n].abs().max()), msg=n)


def test_expert_parallel_under_autocast_and_with_the_grouped_gemm_kernel():
    """At ep = 2, with the CPU's kernel and the grouped-GEMM kernel, every row exchanged or the own rows
    overlapped, under each expert dispatch: in fp32 the one-process layer's outputs and gradients; under bf16
    autocast the tokens travel in bf16 (per choice half the exchanged bytes of fp32, beside the count exchange's
    int64s; per rank and per node fewer, the choices' float64 metadata unchanged) and the result is the
    one-process layer's under the same autocast."""
    res = launch(W.autocast_worker, (None,), nproc=2)
    counts = 2 * 2 * 8 // 2                          # ep x local experts int64 counts, (n-1)/n of them sent
    for name in ("fp32", "bf16"):
        ref = W.build_layer(2, False).float()
        ctx = torch.autocast("cpu", torch.bfloat16) if name == "bf16" else contextlib.nullcontext()
        xs, ys = [], []
        for rank in (0, 1):
            xs.append(W.layer_inputs("one_expert", rank).float().requires_grad_(True))
            with ctx:
                y, _ = ref(xs[-1])
            (y.float() * torch.linspace(-1, 1, W.D)).sum().backward()
            ys.append(y.detach())
        tol = 1e-5 if name == "fp32" else 0.01
        for (kernel, rows, dispatch, got), rank in itertools.product(res[0], (0, 1)):
            if got != name:
                continue
            ours = res[rank][kernel, rows, dispatch, name]
            label = f"{kernel} kernel, MIN_SEGMENT_ROWS {rows}, {dispatch} dispatch, {name}, rank {rank}"
            assert ours["y"].dtype == ys[rank].dtype and ours["x_grad"].dtype == torch.float32, label
            torch.testing.assert_close(ours["y"], ys[rank], rtol=tol, atol=tol * float(ys[rank].abs().max()), msg=label)
            torch.testing.assert_close(ours["x_grad"], xs[rank].grad, rtol=tol,
                                       atol=tol * float(xs[rank].grad.abs().max()), msg=label)
            for n, g in ours["grads"].items():     # summed over the ranks, as the two-rank loss is
                r = ref.experts.get_parameter(n).grad
                torch.testing.assert_close(g * 2, r, rtol=tol, atol=tol * float(r.abs().max()), msg=f"{label} {n}")
            if name == "bf16":
                fp32 = res[rank][kernel, rows, dispatch, "fp32"]
                if dispatch == "choice":
                    assert 0 < ours["bytes"] - counts == (fp32["bytes"] - counts) // 2, label
                else:
                    assert 0 < ours["bytes"] < fp32["bytes"], label


@pytest.mark.parametrize("kernel", [CacheTiledKernel, SegmentKernel])
def test_recomputing_the_expert_activation_keeps_one_rows_by_hidden_tensor_less(kernel):
    """``recompute_activation`` (``model.expert_recompute``): the layer keeps exactly one (dispatched rows x
    hidden) tensor less for its backward, and its outputs and gradients are the same."""
    def run(recompute):
        torch.manual_seed(6)
        layer = MoELayer(16, 40, 4, top_k=2, capacity_factor=1.0, kernel=kernel(recompute=recompute)).double()
        x = torch.randn(3, 24, 16, dtype=torch.float64, requires_grad=True)
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        kept = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params:
                kept.setdefault(ptr, t.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, out = layer(x)
        (y.square().sum() + out.loss).backward()
        return sum(kept.values()), int(out.stats.kept.sum()), [y.detach(), x.grad] + [p.grad for p in layer.parameters()]

    (full, rows, ref), (less, rows_again, got) = run(False), run(True)
    assert rows == rows_again > 0
    assert full - less == rows * 40 * 8
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["segment", "grouped", "tiled"])
def test_gpt_moe_expert_recompute_and_kernel_reach_every_layer_and_train_the_same(kernel):
    """``model.expert_recompute`` and ``model.expert_kernel`` reach every MoE layer of the GPT-MoE and change
    no number beyond fp32 rounding (the reference: the example config, auto kernel, no recompute)."""
    from podscale.config import load_config
    from podscale.tasks.gpt_moe import gpt_moe_config
    settings = [("false", "auto"), ("true", "auto"), ("false", kernel), ("true", kernel)]
    cfgs = [gpt_moe_config(load_config("examples/gpt-moe.toml", [f"model.expert_recompute={r}",
                                                                  f"model.expert_kernel={k}", "model.n_layer=2"]))
            for r, k in settings]
    assert [(c.expert_recompute, c.expert_kernel) for c in cfgs] == [(r == "true", k) for r, k in settings]
    cls = {"segment": SegmentKernel, "grouped": GroupedGemmKernel, "tiled": CacheTiledKernel}[kernel]
    results = []
    for cfg in cfgs:
        torch.manual_seed(0)
        model = GPTMoE(cfg)
        layers = [b.moe.experts for b in model.modules() if hasattr(b, "moe")]
        assert layers and all(e.recompute_activation == cfg.expert_recompute for e in layers)
        if cfg.expert_kernel == "auto":
            assert all(e.kernel is None for e in layers)
        else:
            assert all(type(e.kernel) is cls and e.kernel.recompute == cfg.expert_recompute for e in layers)
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(1))
        out = model(idx, idx)
        loss = out[1] if isinstance(out, tuple) else out
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None])
    for other in results[1:]:
        assert len(other) == len(results[0])
        for a, b in zip(other, results[0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize("overrides,match", [
    (["model.expert_kernel=grouped", "model.n_embd=36", "model.n_head=4"],
     r"^model.expert_kernel='grouped' needs model.n_embd=36 to be a multiple of 8 .*set model.expert_kernel = 'auto'$"),
    (["model.expert_kernel=grouped", "model.expert_hidden=100"], r"^model.expert_kernel='grouped' needs "
     r"model.expert_hidden=100 to be a multiple of 8"),
    (["model.expert_kernel=fast"], r"^model.expert_kernel: Input should be 'auto', 'tiled', 'segment' or 'grouped'"),
])
def test_a_bad_expert_kernel_is_one_line_naming_the_key(overrides, match):
    """The config's choices are the kernels' names (config.py stays free of torch, so it lists them)."""
    import typing

    from podscale.config import GPTMoEModelSection, load_config
    from podscale.parallel.moe.kernels import KERNEL_NAMES
    assert typing.get_args(GPTMoEModelSection.model_fields["expert_kernel"].annotation) == KERNEL_NAMES
    with pytest.raises(ValueError, match=match) as e:
        load_config("examples/gpt-moe.toml", overrides)
    assert "\n" not in str(e.value)


def _onehot_logits(first: list[int], second: list[int], E: int) -> torch.Tensor:
    """Logits whose top choice is ``first[s]`` and second ``second[s]`` (one group)."""
    logits = torch.zeros(1, len(first), E)
    for s, (a, b) in enumerate(zip(first, second)):
        logits[0, s, a] = 4.0
        logits[0, s, b] = 2.0
    return logits


@pytest.mark.parametrize("S,E,k,cf", [(8, 4, 1, 1.0), (16, 4, 2, 1.0), (10, 3, 2, 0.5), (7, 5, 1, 2.0)])
def test_everyone_to_one_expert_keeps_exactly_the_capacity(S, E, k, cf):
    C = expert_capacity(cf, k, S, E)
    assert C == math.ceil(cf * k * S / E)
    r, _ = route(_onehot_logits([0] * S, [1] * S, E), k, C)
    kept = r.keep.sum(0).tolist()
    assert kept[0] == min(S, C)                       # first choices of the first C tokens
    assert r.keep[:, 0].tolist() == [s < C for s in range(S)]
    if k == 2:
        assert kept[1] == min(S, C)                   # expert 1 has its own C slots for second choices
    assert int((~r.keep).sum()) == k * S - k * min(S, C)


def test_tied_scores_choose_the_lowest_expert_ids_in_order():
    # exact ties: all equal, two tied leaders, and a tie for second place behind a clear first
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 3.0], [5.0, 1.0, 1.0, 0.0]]])
    r1, _ = route(logits, 1, None)
    assert r1.expert[:, 0].tolist() == [0, 1, 0]
    r3, _ = route(logits, 3, None)
    assert r3.expert.tolist() == [[0, 1, 2], [1, 3, 0], [0, 1, 2]]


def test_first_choices_take_slots_before_second_choices():
    # even tokens: first choice expert 1, second expert 0; odd tokens: first choice 0, second 1.
    S, E = 8, 4
    first = [1 if s % 2 == 0 else 0 for s in range(S)]
    second = [0 if s % 2 == 0 else 1 for s in range(S)]
    C = expert_capacity(0.5, 2, S, E)                 # = 2
    r, _ = route(_onehot_logits(first, second, E), 2, C)
    # expert 0: odd tokens' first choices fill both slots (tokens 1, 3) though token 0 asked earlier as a
    # second choice; expert 1: even tokens 0, 2 likewise
    assert r.keep[:, 0].tolist() == [s < 4 for s in range(S)]
    assert not r.keep[:, 1].any()
    assert r.position[:4, 0].tolist() == [0, 0, 1, 1]


def _logits_of(probs: list[list[float]]) -> torch.Tensor:
    """One group's logits whose softmax is ``probs`` (a row per token)."""
    return torch.tensor(probs, dtype=torch.float64).log().unsqueeze(0)


def test_drop_policies_choose_which_choices_keep_the_slots():
    """Four tokens all for expert 0, ever more sure of it, one slot (top-1): GShard's order keeps the first
    token, Batch Prioritized Routing and the per-expert probabilities the surest.  Two tokens on three experts,
    top-2, one slot each: A's first choice and B's second both want expert 2 (0.40 and 0.45); first choices come
    first under "position" and "priority", so A keeps it, while "probs" gives it to the higher score, B's."""
    sure = _logits_of([[0.4, 0.2, 0.2, 0.2], [0.5, 0.2, 0.2, 0.1], [0.6, 0.2, 0.1, 0.1], [0.7, 0.1, 0.1, 0.1]])
    for policy, kept in (("position", 0), ("priority", 3), ("probs", 3)):
        r, _ = route(sure, 1, 1, drop_policy=policy)
        assert r.keep[:, 0].tolist() == [s == kept for s in range(4)], policy
        assert r.position[kept, 0] == 0 and r.counts.tolist() == [1, 0, 0, 0]
    two = _logits_of([[0.25, 0.35, 0.40], [0.50, 0.05, 0.45]])
    for policy, keep in (("position", [[True, True], [True, False]]), ("priority", [[True, True], [True, False]]),
                         ("probs", [[False, True], [True, True]])):
        r, _ = route(two, 2, 1, drop_policy=policy)
        assert r.expert.tolist() == [[2, 1], [0, 2]]
        assert r.keep.tolist() == keep, policy
        assert r.demand.tolist() == [1, 1, 2] and r.counts.tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="^model.drop_policy='fifo' is not one of position, priority, probs$"):
        MoELayer(8, 8, 4, drop_policy="fifo")
    import typing

    from podscale.config import GPTMoEModelSection
    from podscale.parallel.moe import DROP_POLICIES, EXPERT_DISPATCHES
    assert typing.get_args(GPTMoEModelSection.model_fields["drop_policy"].annotation) == DROP_POLICIES
    from podscale.config import ParallelSection
    assert typing.get_args(ParallelSection.model_fields["expert_dispatch"].annotation) == EXPERT_DISPATCHES


def test_random_routing_keeps_second_with_probability_two_g2_and_any_split_agrees():
    torch.manual_seed(1)
    G, S, E = 64, 32, 4
    logits = torch.randn(G, S, E)
    keys = sequence_token_keys(torch.randint(0, 256, (G, S)))
    u = routing_uniform(keys, seed=123)
    r, _ = route(logits, 2, None, u)
    share = r.wanted[:, 1].double().mean()
    expected = (2 * r.weight[:, 1]).clamp(max=1).double().mean()
    assert abs(share - expected) < 0.03 and 0.05 < share < 0.95
    # a rank that gets only the second half of the groups draws the same numbers for them
    half, _ = route(logits[G // 2:], 2, None, routing_uniform(keys[G // 2:], seed=123))
    assert torch.equal(half.wanted, r.wanted.view(G, S, 2)[G // 2:].reshape(-1, 2))
    assert not torch.equal(routing_uniform(keys, seed=124), u)


def test_aux_and_z_losses():
    layer = MoELayer(8, 8, 4, top_k=2, capacity_factor=2.0)
    with torch.no_grad():
        layer.router.weight.zero_()           # uniform router: E * sum_e f_e * P_e = 1, z = log(E)^2
    _, out = layer(torch.randn(3, 5, 8))
    assert abs(float(out.aux_loss.detach()) - 1.0) < 1e-6
    assert abs(float(out.z_loss.detach()) - math.log(4) ** 2) < 1e-6
    assert abs(float(out.loss.detach()) - (layer.aux_loss_coef + layer.z_loss_coef * math.log(4) ** 2)) < 1e-6
    with torch.no_grad():
        layer.router.weight[0, 0] = 50.0      # everything to expert 0: aux -> E * 1 * ~1
    layer.capacity_factor = 1.0               # C = ceil(1 * 2 * 5 / 4) = 3 of 5 first choices kept
    _, out = layer(torch.ones(3, 5, 8))
    assert float(out.aux_loss.detach()) > 3.9
    s = out.stats.summary()
    assert s["load_min"] == 0.0 and s["load_max"] == 0.5 and s["load_entropy"] == pytest.approx(0.5)
    assert s["dropped_share"] == pytest.approx(4 / 10)   # 2 of 5 first and 2 of 5 second choices
    assert s["peak_rank_load"] == pytest.approx(6 / 10)  # one rank: its experts ran its kept choices


def test_routing_statistics_stay_on_the_routing_device():
    """MoEStats concatenates its tensors for one all-reduce, which NCCL runs on the GPU: none of them may sit
    on the CPU when the routing does not (the token count did, so a GPU run failed in its step metrics);
    checked on the meta device, the CPU's stand-in for another device."""
    from dataclasses import replace

    from podscale.parallel.moe.gate import MoEStats
    layer = MoELayer(8, 8, 4, top_k=2)
    _, out = layer(torch.randn(2, 5, 8))
    r = out.routing
    meta = replace(r, expert=r.expert.to("meta"), demand=r.demand.to("meta"), counts=r.counts.to("meta"))
    s = MoEStats.of(meta, out.aux_loss.to("meta"), out.z_loss.to("meta"), rows=20)
    assert {t.device.type for t in (s.tokens, s.wanted, s.kept, s.aux_loss, s.z_loss)} == {"meta"}
    assert (int(out.stats.tokens), out.stats.top_k, out.stats.peak_rows) == (10, 2, int(r.counts.sum()))


def test_bias_balancing_selects_with_the_bias_and_moves_it_towards_balance():
    layer = MoELayer(8, 8, 4, top_k=1, capacity_factor=4.0, bias_balancing=True, bias_update_rate=0.1)
    x = torch.randn(2, 6, 8)
    _, before = layer(x)
    layer.router.selection_bias[3] = 10.0
    _, out = layer(x)
    assert (out.routing.expert == 3).all()
    # gate values come from the unbiased probabilities
    probs = torch.softmax(layer.router(x.reshape(-1, 8)).float(), -1)
    torch.testing.assert_close(out.routing.weight[:, 0], probs[:, 3])
    layer.update_balance_bias(out.stats.kept)
    assert layer.router.selection_bias.tolist() == pytest.approx([0.1, 0.1, 0.1, 9.9])
    # the model's step: from the loads its training forwards accumulated
    cfg = GPTMoEConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, experts=4, moe_every=2, top_k=1,
                       bias_balancing=True, bias_update_rate=0.01, random_routing=False)
    model = GPTMoE(cfg)
    model(torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8)))
    # the demand (dropped choices included: what the router chose), not the dispatched load
    wanted = model.moe_metrics.layers["blocks.1"].wanted.double()
    model.update_balance_bias()
    assert model.blocks["1"].moe.router.selection_bias.tolist() == pytest.approx(
        (0.01 * torch.sign(wanted.mean() - wanted)).tolist())
    with pytest.raises(ValueError, match="bias_balancing"):
        MoELayer(8, 8, 4).update_balance_bias(out.stats.kept)


def test_sigmoid_scores_and_node_limited_routing_follow_deepseek_v3():
    """DeepSeek-V3 eq. 13-16 and section 2.2 on hand-made logits: 8 experts in 4 groups of two (0-1, 2-3,
    4-5, 6-7); the gates are the chosen sigmoids normalised over the choices, times the scale; a group is
    ranked by the sum of its top_k // group_top_k best scores (sigmoid is monotone: the logits' order)."""
    logits = torch.tensor([[[5.0, 4.0, 2.5, -1.0, 0.0, 0.0, -2.0, 3.0],
                            [1.5, 0.0, -3.0, 2.0, 1.8, 1.9, 4.0, 1.95]]])
    s = torch.sigmoid(logits[0])
    # top-2 from the best 2 groups, each ranked by its best score: token 1's groups are 3 (4.0) and 1 (2.0)
    v3 = Gating("sigmoid", groups=4, group_top_k=2, scale=2.5)
    r, probs = route(logits, 2, None, gating=v3)
    assert r.expert.tolist() == [[0, 1], [6, 3]]
    for n, (a, b) in enumerate(r.expert.tolist()):
        torch.testing.assert_close(r.weight[n], 2.5 * torch.stack([s[n, a], s[n, b]]) / (s[n, a] + s[n, b]))
    torch.testing.assert_close(probs[0], s / s.sum(-1, keepdim=True))   # the aux loss's s' (eq. 20)
    # from the best group alone, token 1 must take 7 (group 3) where it would take 3 unlimited
    one, _ = route(logits, 2, None, gating=Gating("sigmoid", groups=4, group_top_k=1))
    assert one.expert.tolist() == [[0, 1], [6, 7]]
    free, _ = route(logits, 2, None, gating=Gating("sigmoid"))
    assert free.expert.tolist() == [[0, 1], [6, 3]]
    # top-4 from 2 groups ranked by the sum of their 2 best: token 1's groups 3 (s(4) + s(1.95)) and 2
    # (s(1.9) + s(1.8)) beat group 0 (s(1.5) + s(0)) and group 1 (s(2) + s(-3)), though group 1 holds its
    # second-best expert: 3 is out
    four, _ = route(logits, 4, None, gating=Gating("sigmoid", groups=4, group_top_k=2))
    assert four.expert[1].tolist() == [6, 7, 5, 4]
    assert route(logits, 4, None, gating=Gating("sigmoid"))[0].expert[1].tolist() == [6, 3, 7, 5]
    # the selection bias ranks the groups too (DeepSeek-V3 selects by the biased affinities)
    bias = torch.zeros(8).index_fill(0, torch.tensor([4]), 5.0)
    biased, _ = route(logits, 2, None, selection_bias=bias, gating=v3)
    assert biased.expert.tolist() == [[4, 0], [4, 6]]
    # softmax gates with a scale: GShard's normalisation, times the scale
    g, _ = route(logits, 2, None, gating=Gating(scale=2.0))
    p = torch.softmax(logits[0], -1)
    torch.testing.assert_close(g.weight[0], 2.0 * p[0, :2] / p[0, :2].sum())


def test_gating_names_match_the_config_and_bad_gating_is_one_line():
    import typing

    from podscale.config import GPTMoEModelSection, load_config
    assert typing.get_args(GPTMoEModelSection.model_fields["router_score"].annotation) == Gating.SCORES
    for gating, match in [(Gating("tanh"), r"router score 'tanh' is not one of softmax, sigmoid"),
                          (Gating(groups=3), r"router groups=3 must divide the 8 experts"),
                          (Gating(groups=4, group_top_k=5), r"router group_top_k=5 must be between 1 and the 4"),
                          (Gating(groups=4, group_top_k=1), r"top_k=4 exceeds the 2 experts of a token's 1 groups"),
                          (Gating(scale=0.0), r"router scale=0.0 must be > 0")]:
        with pytest.raises(ValueError, match=match) as e:
            MoELayer(8, 8, 8, top_k=4, gating=gating)
        assert "\n" not in str(e.value)
    for overrides, match in [
            (["model.router_groups=3"], r"model.router_groups=3 does not divide model.experts=8"),
            (["model.router_groups=4", "model.router_group_top_k=5"], r"model.router_group_top_k=5 exceeds"),
            (["model.router_groups=4", "model.router_group_top_k=1", "model.top_k=4"],
             r"model.top_k=4 exceeds the 2 experts of a token's model.router_group_top_k=1 groups"),
            (["model.router_score=tanh"], r"model.router_score: Input should be 'softmax' or 'sigmoid'"),
            (["model.router_scale=0"], r"model.router_scale")]:
        with pytest.raises(ValueError, match=match) as e:
            load_config("examples/gpt-moe.toml", overrides)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("kwargs,match", [
    (dict(experts=6, ep=4), r"model.experts=6 is not divisible by parallel.ep=4: make model.experts a multiple"),
    (dict(top_k=5, experts=4), r"model.top_k=5 must be between 1 and model.experts=4"),
    (dict(capacity_factor=0.0), r"model.capacity_factor=0.0 must be a finite number > 0"),
    (dict(eval_capacity_factor=-1.0), r"model.eval_capacity_factor=-1.0 must be a finite number > 0"),
    (dict(capacity_factor=float("inf")), r"model.capacity_factor=inf must be a finite number > 0"),
    (dict(eval_capacity_factor=float("nan")), r"model.eval_capacity_factor=nan must be a finite number > 0"),
    (dict(shared_hidden=-8), r"shared_hidden=-8 must be >= 0"),
    (dict(shared_hidden=10, tp=4, etp=True), r"shared_hidden=10 is not divisible by tp=4 \(expert_tensor_parallel "
                                             r"splits the shared expert's width over tp too\): make it a multiple"),
])
def test_bad_input_is_one_line_naming_the_key(kwargs, match):
    ep, tp = kwargs.pop("ep", 1), kwargs.pop("tp", 1)
    args = dict(experts=4, top_k=2, capacity_factor=1.0) | kwargs
    mesh = Mesh(sizes={"pp": 1, "dp": 1, "ep": ep, "tp": tp}) if ep * tp > 1 else None
    with pytest.raises(ValueError, match=match) as e:
        MoELayer(8, 8, args["experts"], top_k=args["top_k"], capacity_factor=args["capacity_factor"],
                 eval_capacity_factor=args.get("eval_capacity_factor", 2.0), mesh=mesh,
                 shared_hidden=args.get("shared_hidden", 0), expert_tensor_parallel=args.get("etp", False))
    assert "\n" not in str(e.value)


def test_gpt_moe_expert_shards_materialise_their_single_process_values():
    """Every rank of an ep = 2 layout, built directly or on the meta device and materialised, holds its own
    experts and the dense parameters (the shared expert's among them) at their single-process values."""
    cfg = GPTMoEConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, experts=4, moe_every=2, shared_experts=1)
    torch.manual_seed(3)
    full = GPTMoE(cfg)
    for rank in (0, 1):
        mesh = Mesh(sizes={"pp": 1, "dp": 1, "ep": 2, "tp": 1}, rank=rank)
        torch.manual_seed(3)
        part = GPTMoE(cfg, mesh)
        with torch.device("meta"):
            torch.manual_seed(3)
            meta = GPTMoE(cfg, mesh)
        meta.materialize()
        fp = dict(full.named_parameters())
        held = {n for n in dict(part.named_parameters()) if ".experts." in n}
        assert held == {f"blocks.1.moe.experts.{e}.{w}" for e in (2 * rank, 2 * rank + 1)
                        for w in ("w_fc", "w_proj", "b_fc", "b_proj")}
        for model in (part, meta):
            for name, p in model.named_parameters():
                assert torch.equal(p, fp[name]), name
                assert ("experts" in name) == tags(p).expert_parallel
    assert list(full.moe_layers()) == ["blocks.1.moe"]
    assert full.active_params_per_token() < sum(p.numel() for p in full.parameters())
    # a token passes through the shared expert: it adds its parameters, counted off the module, to the active ones
    with torch.device("meta"):
        plain = GPTMoE(dataclasses.replace(cfg, shared_experts=0))
    shared = sum(p.numel() for n, p in full.named_parameters() if ".moe.shared." in n)
    assert shared == 2 * 16 * 64 + 64 + 16
    assert full.active_params_per_token() - plain.active_params_per_token() == shared


def test_split_experts_and_shared_expert_materialise_their_part_of_the_single_process_values():
    """Expert tensor parallelism at tp = 2 (the trainer's build: the meta device, then ``materialize``): each tp
    rank holds, of every routed expert and of the shared expert, the part of the one-process tensor that its tp
    coordinate names (``w_fc``'s columns, ``b_fc``, ``w_proj``'s rows: h/2 each; ``Expert.own_part``) and
    ``b_proj`` whole.  The parts are tagged ``tensor_parallel`` with their layout (the norm sums them over tp,
    checkpoints store the one-process tensor), ``b_proj`` ``sequence_parallel`` (its gradient summed over tp);
    the shared expert's tensors are dense (not ``expert_parallel``), the routed ones' are."""
    cfg = GPTMoEConfig(n_layer=2, n_head=2, n_embd=16, block_size=8, experts=4, moe_every=2, shared_experts=1)
    torch.manual_seed(3)
    full = dict(GPTMoE(cfg).named_parameters())
    dims = {"w_fc": 1, "b_fc": 0, "w_proj": 0}
    for t in (0, 1):
        with torch.device("meta"):
            torch.manual_seed(3)
            meta = GPTMoE(cfg, Mesh(sizes={"pp": 1, "dp": 1, "ep": 1, "tp": 2}, rank=t), expert_tensor_parallel=True)
        meta.materialize()
        parts = {n: p for n, p in meta.named_parameters() if ".moe.shared." in n or ".moe.experts." in n}
        assert {n for n in parts if ".moe.shared." in n} == {f"blocks.1.moe.shared.{w}" for w in dims} | \
            {"blocks.1.moe.shared.b_proj"}
        for name, p in parts.items():
            leaf = name.rpartition(".")[2]
            want = full[name].chunk(2, dim=dims[leaf])[t] if leaf in dims else full[name]
            assert p.shape[dims[leaf]] == 64 // 2 if leaf in dims else p.shape == full[name].shape, name
            assert torch.equal(p, want), name
            tg = tags(p)
            assert (tg.tp_layout, tg.tensor_parallel, tg.sequence_parallel) == \
                ((moe_layer.WIDTH_LAYOUTS[leaf], True, False) if leaf in dims else (None, False, True)), name
            assert tg.expert_parallel == (".moe.experts." in name), name


# ---------------------------------------------------------------------------------------------------
# expert parallelism


STEPS = 20


@pytest.fixture(scope="module")
def single_process():
    return dict(zip(W.MODES, W.train_gpt_moe(list(W.MODES), STEPS, 1, 1, mesh=Mesh.build())))


def _close(a: torch.Tensor, b: torch.Tensor, rel: float, what: str):
    scale = max(float(b.abs().max()), 1e-12)
    assert float((a - b).abs().max()) <= rel * scale, f"{what}: {float((a - b).abs().max())} vs scale {scale}"


# min_segment_rows 0: every rank keeps its own rows out of the exchange and runs them while it is in flight
# (at ep = 4 the middle ranks' own rows sit between remote ones, and three sources are regrouped); 10**9:
# own rows travel with the rest, two sources regrouped
# expert_dispatch "rank": a token sent once to each rank holding any of its choices (at ep = 4 a top-2 token's
# choices share a rank about a third of the time), the choices combined there; "node": the 4 ranks as 2 nodes of
# 2, a token sent once to each node holding any of its choices, then once to each rank there
@pytest.mark.parametrize("dp,ep,min_segment_rows,dispatch", [(1, 2, 0, "choice"), (2, 2, 10**9, "choice"),
                                                             (1, 4, 0, "choice"), (1, 4, 0, "rank"),
                                                             (1, 4, 0, "node")])
def test_expert_parallel_matches_single_process(dp, ep, min_segment_rows, dispatch, single_process):
    nodes = 2 if dispatch == "node" else None
    results = launch(W.train_gpt_moe, (list(W.MODES), STEPS, dp, ep, None, min_segment_rows, dispatch, nodes),
                     nproc=dp * ep)
    for i, mode in enumerate(W.MODES):
        ref = single_process[mode]
        for rank, res in results.items():
            ours = res[i]
            label = f"dp={dp} ep={ep} {mode} rank {rank}"
            # identical routing: per step and layer, every expert's wanted and kept counts
            assert ours["counts"] == ref["counts"], label
            assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-9, abs=0), label
            assert ours["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-9, abs=0), label
            for name, g in ours["grads1"].items():
                _close(g, ref["grads1"][name], 1e-9, f"{label} grad {name}")
            for name, p in ours["params"].items():
                _close(p, ref["params"][name], 1e-8, f"{label} param {name}")
            # 2 MoE layers x (3 exchanges forward + 2 backward) per step, per choice and per rank; per node 6 + 4
            assert ours["comm"]["ep/all_to_all"]["calls"] == STEPS * 2 * {"choice": 5, "rank": 5, "node": 10}[dispatch]
        dropped = sum(sum(w) - sum(k) for c in ref["counts"] for w, k in c.values())
        assert (dropped == 0) == (mode == "dropless"), (mode, dropped)
    # the expert tensors of all ranks together are every global expert
    held = set().union(*(r[0]["params"] for r in results.values()))
    assert held == set(single_process["top1"]["params"])


NO_HANG = [("one_expert", 1, False), ("one_expert", 2, False), ("no_remote", 2, False), ("no_remote", 1, True),
           ("empty_rank", 2, False), ("empty_rank", 2, True)]


@pytest.fixture(scope="module")
def no_hang():
    return launch(W.no_hang_worker, (NO_HANG,), nproc=2)


def test_split_experts_row_collectives_with_empty_and_uneven_ranks(no_hang):
    """Expert tensor parallelism's all-gather of every tp rank's rows and reduce-scatter of the partial
    outputs (uneven pieces through all_to_all_single), a rank with no rows and both without included:
    every rank gets every rank's rows in rank order, the sum of both ranks' partials of its own rows, and
    in the backward the gradient of its rows summed over both ranks' partials (here 1 + 2 times the
    output's gradient)."""
    c = torch.linspace(-1, 1, W.D, dtype=torch.float64)
    for i, sizes in enumerate(W.SPLIT_ROWS):
        xs = [W.split_rows_input(sizes, r) for r in (0, 1)]
        for rank in (0, 1):
            ours = no_hang[rank][-1][i]
            assert ours["rows"].shape == (sum(sizes), W.D), sizes
            torch.testing.assert_close(ours["rows"], torch.cat(xs), rtol=0, atol=0)
            torch.testing.assert_close(ours["y"], 3 * xs[rank], rtol=1e-15, atol=0)
            torch.testing.assert_close(ours["x_grad"], 3 * c.expand(sizes[rank], W.D), rtol=1e-15, atol=0)


def test_the_global_aux_loss_sums_both_ranks_counts_whatever_the_routing(no_hang):
    """ep = 2 with ``aux_loss_scope = "global"`` (Qiu et al. 2025) on lopsided inputs, a rank without tokens
    included (empty_rank): every rank's forward enters exactly one all-reduce, of the first-choice counts over
    dp x ep; a rank's aux loss is ``E * sum_e f_e * P_e`` with ``f`` the shares of both ranks' tokens and ``P``
    its own groups' mean probabilities (0 without tokens), and the router's gradient is that of the mean of
    the ranks' losses, all computed here on one process from the router's logits."""
    c = torch.linspace(-1, 1, W.D, dtype=torch.float64)
    for i, case in enumerate(W.GLOBAL_CASES):
        ref = W.build_layer(2, False)
        xs = [W.layer_inputs(case, r) for r in (0, 1)]
        logits = [x.reshape(-1, W.D) @ ref.router.weight.t() for x in xs]
        first = torch.cat([lg.detach().argmax(-1) for lg in logits])              # both ranks' first choices
        f = torch.bincount(first, minlength=W.E).double() / first.numel()
        if case == "no_remote":  # rank 0's own shares are not the batch's (half its tokens prefer expert 1)
            assert not torch.equal(torch.bincount(logits[0].detach().argmax(-1), minlength=W.E).double() / (2 * W.S), f)
        losses = []
        for rank, (x, lg) in enumerate(zip(xs, logits)):
            G = x.shape[0]
            aux = (W.E * (f * torch.softmax(lg, -1).view(G, W.S, W.E).mean(1)).sum(-1)).mean() if G else lg.sum()
            ours = no_hang[rank][-2][i]
            torch.testing.assert_close(ours["aux"], aux.detach(), rtol=1e-12, atol=0, msg=f"{case} rank {rank}")
            assert ours["reduces"] == {"dp+ep/all_reduce": 1}, (case, rank, ours["reduces"])
            y, out = ref(x)
            losses.append((y * c).sum() + out.loss + ref.aux_loss_coef * (aux - out.aux_loss))
        (sum(losses) / 2).backward()
        for rank in (0, 1):
            torch.testing.assert_close(no_hang[rank][-2][i]["router_grad"], ref.router.weight.grad, rtol=1e-10,
                                       atol=1e-12, msg=f"{case} rank {rank}")


def test_lopsided_routing_finishes_with_the_right_gradients(no_hang):
    results = no_hang
    for i, ((case, top_k, dropless), (rows, kernel, dispatch)) in enumerate(itertools.product(NO_HANG, W.RUNS)):
        label = (f"{case} top_k={top_k} dropless={dropless} MIN_SEGMENT_ROWS of the ranks {rows}, {kernel} kernel, "
                 f"{dispatch} dispatch")
        ref = W.build_layer(top_k, dropless)
        losses, ys, xs = [], [], []
        for rank in (0, 1):
            xs.append(W.layer_inputs(case, rank))
            loss, y, _ = W.layer_loss(ref, xs[-1])
            losses.append(loss)
            ys.append(y.detach())
        (sum(losses) / 2).backward()
        kept = results[0][i]["kept"] + results[1][i]["kept"]
        for rank in (0, 1):
            ours = results[rank][i]
            torch.testing.assert_close(ours["y"], ys[rank], rtol=1e-12, atol=1e-12, msg=label)
            # a rank's input gradient is that of its own loss; the reference differentiated the mean of two
            torch.testing.assert_close(ours["x_grad"], 2 * xs[rank].grad, rtol=1e-10, atol=1e-12, msg=label)
            first = ours["first"]
            ref_grads = {n: p.grad for n, p in ref.named_parameters()}
            assert len(ours["grads"]) == 1 + 2 * 4   # the router and this rank's two experts
            for name, g in ours["grads"].items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-10, atol=1e-12, msg=f"{label} {name}")
                if name.startswith("experts."):
                    e = int(name.split(".")[1])
                    assert first <= e < first + 2
                    if ".w_" in name:  # zero exactly where nothing was routed
                        assert (kept[e] == 0) == bool((g == 0).all()), (label, name)
            # (the per-rank dispatch's choices travel with its rows, their gate gradients with the input
            # gradients; the per-node one's first stage runs around it)
            # (a top-1 layer's per-rank dispatch is the per-choice one: make_dispatch)
            runs = "choice" if dispatch == "rank" and top_k == 1 else dispatch
            exchanges = {"choice": 5, "rank": 5, "node": 10}[runs]
            assert ours["calls"]["ep/all_to_all"] == exchanges, label
            # an input without a gradient: the same parameter gradients; per choice one exchange less in the
            # backward (the per-rank dispatch still returns the gate gradients)
            assert ours["no_input_grad"]["calls"] == exchanges - (runs == "choice"), label
            for name, g in ours["no_input_grad"]["grads"].items():
                torch.testing.assert_close(g, ours["grads"][name], rtol=1e-12, atol=1e-14, msg=f"{label} {name}")
        # the rows each rank's experts ran (its own and the other's for them), the busiest over the mean
        # (the ranks' tokens x k over 2; rank 1 of empty_rank routes none but runs rows)
        rows = [int(kept[2 * r:2 * r + 2].sum()) for r in (0, 1)]
        tokens = sum(W.layer_inputs(case, r).shape[0] * W.S for r in (0, 1))
        for rank in (0, 1):
            assert results[rank][i]["peak"] == (rows[rank], pytest.approx(max(rows) / (tokens * top_k / 2))), label
        if case in ("one_expert", "no_remote"):
            assert kept[2:].sum() == 0          # experts 2 and 3 got nothing on every rank
            if dropless:
                assert results[0][i]["peak"][1] == 2.0   # rank 0 ran every choice: twice the mean
        if case == "no_remote":
            assert results[0][i]["kept"][2:].sum() == 0   # rank 0 sent nothing to rank 1's experts


def test_the_rank_dispatch_sends_a_token_once_to_the_rank_of_both_its_choices(no_hang):
    """one_expert, top-2 at capacity factor 1: both choices of every token are experts 0 and 1, both on rank 0,
    and each expert keeps the first 3 tokens of each group of 6, so each rank keeps 12 choices of 6 tokens, all
    for rank 0.  The per-choice dispatch sends 12 rows a rank and rank 0 returns 24 in each pass; the per-rank
    dispatch sends 6 and returns 12, plus each choice's row index and gate value (two float64s) forward and
    its gate gradient (one float64 here) back: the bytes of every all-to-all, as the mesh records them
    ((ep - 1)/ep of a rank's input), exactly."""
    # (the runs whose own rows travel with the others')
    run = W.RUNS.index((W.OVERLAP[1], "tiled", "choice")), W.RUNS.index((W.OVERLAP[1], "tiled", "rank"))
    base = NO_HANG.index(("one_expert", 2, False)) * len(W.RUNS)
    row, tokens, choices = W.D * 8, 6, 12                  # an fp64 row's bytes; a rank's kept tokens, choices
    for rank in (0, 1):
        got_rows, got_choices = (2 * tokens, 2 * choices) if rank == 0 else (0, 0)   # rank 0 receives both's
        sent = {"choice": 2 * 2 * 8 // 2 + 2 * (choices * row // 2) + 2 * (got_choices * row // 2),
                "rank": 2 * 3 * 8 // 2 + 2 * (tokens * row // 2) + 2 * (got_rows * row // 2)
                + choices * 16 // 2 + got_choices * 8 // 2}
        for dispatch, i in zip(("choice", "rank"), run):
            ours = no_hang[rank][base + i]
            assert int(ours["kept"].sum()) == choices and ours["kept"][:2].tolist() == [6, 6]
            assert ours["bytes"] == sent[dispatch], (dispatch, rank)
        assert sent["rank"] < 0.65 * sent["choice"]


def test_the_node_dispatch_groups_the_expert_ranks_by_node():
    """Ranks numbered node by node (torchrun's order): ep = 4 on nodes of 2 ranks is 2 nodes, rank 3 the second
    of its node; under tp = 2 the ep group's ranks are 2 apart, so nodes of 4 ranks hold 2 of them each.  An
    uneven split is one line naming the key; a group inside one node takes the per-rank dispatch, and a top-1
    layer's per-rank dispatch is the per-choice one (a token's one choice is on one rank)."""
    from podscale.parallel.moe.layer import NodeDispatch, NodeGroups, RankDispatch, make_dispatch
    sizes = {"pp": 1, "dp": 1, "ep": 4, "tp": 1}
    assert NodeGroups.of(Mesh(sizes=sizes, rank=3), ("ep",), 2) == NodeGroups(nodes=2, per_node=2, index=1)
    assert NodeGroups.of(Mesh(sizes=dict(sizes, tp=2), rank=5), ("ep",), 4) == NodeGroups(2, 2, 0)
    assert NodeGroups.of(Mesh(sizes=dict(sizes, tp=2), rank=5), ("ep", "tp"), 4) == NodeGroups(2, 4, 1)
    with pytest.raises(ValueError, match=r"^parallel.expert_dispatch = 'node' needs every node .* \[3, 1\]: use "
                                         r"expert_dispatch = 'rank'$"):
        NodeGroups.of(Mesh(sizes=sizes, rank=0), ("ep",), 3)
    assert isinstance(make_dispatch("node", Mesh(sizes=sizes, rank=0), ("ep",), 2), NodeDispatch)
    assert isinstance(make_dispatch("node", Mesh(sizes=sizes, rank=0), ("ep",), 8), RankDispatch)
    assert isinstance(make_dispatch("node", None, ("ep",)), RankDispatch)
    from podscale.parallel.moe.layer import ChoiceDispatch
    assert isinstance(make_dispatch("rank", Mesh(sizes=sizes, rank=0), ("ep",), top_k=1), ChoiceDispatch)


def test_the_dispatches_agree_under_tensor_parallelism_folded_or_not():
    """tp = 2 x ep = 2 on nodes of 2 ranks: unfolded, each tp rank's ep group is one rank on each node (the
    per-node dispatch's stage 2 stays on the rank); folded, the expert group is all 4 ranks, 2 a node.  Every
    dispatch gives the per-choice one's outputs and gradients (fp64, to rounding)."""
    res = launch(W.dispatch_under_tp_worker, (None,), nproc=4)
    for rank, runs in res.items():
        for fold in (False, True):
            by = {r["dispatch"]: r for r in runs if r["fold"] == fold}
            assert (by["rank"]["kind"], by["node"]["kind"]) == ("RankDispatch", "NodeDispatch")
            for dispatch in ("rank", "node"):
                label = f"rank {rank}, {'folded' if fold else 'tp'}, {dispatch}"
                torch.testing.assert_close(by[dispatch]["y"], by["choice"]["y"], rtol=1e-12, atol=1e-14, msg=label)
                torch.testing.assert_close(by[dispatch]["x_grad"], by["choice"]["x_grad"], rtol=1e-12, atol=1e-14,
                                           msg=label)
                for n, g in by[dispatch]["grads"].items():
                    torch.testing.assert_close(g, by["choice"]["grads"][n], rtol=1e-12, atol=1e-14, msg=f"{label} {n}")


# ---------------------------------------------------------------------------------------------------
# global-batch load balancing (model.aux_loss_scope; Qiu et al. 2025; Megatron-core's "global_aux_loss")


def _scoped_layers(E: int = 8):
    """Two layers with the same weights, the load-balancing loss counted per group and over the batch."""
    torch.manual_seed(5)
    group = MoELayer(16, 24, E, top_k=2, capacity_factor=1.25, aux_loss_scope="group").double()
    glob = MoELayer(16, 24, E, top_k=2, capacity_factor=1.25, aux_loss_scope="global").double()
    glob.load_state_dict(group.state_dict())
    return group, glob


def test_global_aux_loss_with_one_group_is_the_group_loss():
    """One group of tokens: the batch's first-choice shares are the group's, so the two scopes agree."""
    group, glob = _scoped_layers()
    x = torch.randn(1, 40, 16, dtype=torch.float64)
    a, b = group(x)[1], glob(x)[1]
    assert b.aux_loss == a.aux_loss
    assert torch.equal(b.routing.expert, a.routing.expert)


def test_global_aux_loss_counts_the_shares_over_every_group():
    """Several groups, each leaning to its own expert: the global loss is ``E * sum_e f_e * P_{g,e}`` averaged
    over the groups g with ``f`` the whole batch's first-choice shares (computed here from the softmax of the
    router's logits) and ``P_g`` each group's mean probabilities; its router gradient is that expression's
    (``f`` carries none); the group loss, whose shares are each group's own, differs."""
    E, G, S = 8, 4, 30
    group, glob = _scoped_layers(E)
    w = glob.router.weight.detach()
    x = torch.randn(G, S, 16, dtype=torch.float64)
    x = x + 2.0 * (w[:G] / w[:G].norm(dim=1, keepdim=True)).view(G, 1, 16)   # group g leans to expert g
    out = glob(x)[1]
    probs = torch.softmax(x.reshape(-1, 16) @ glob.router.weight.t(), -1).view(G, S, E)
    f_all = F.one_hot(probs.detach().argmax(-1).reshape(-1), E).double().mean(0)           # (E,): all G*S tokens
    by_hand = (E * (f_all * probs.mean(1)).sum(-1)).mean()
    torch.testing.assert_close(out.aux_loss, by_hand, rtol=1e-12, atol=0)
    f_own = F.one_hot(probs.detach().argmax(-1), E).double().mean(1)                      # (G, E): per group
    assert not torch.allclose(f_own, f_all.expand(G, E))                                 # the groups differ
    assert abs(group(x)[1].aux_loss.item() - out.aux_loss.item()) > 1e-3
    got, = torch.autograd.grad(out.aux_loss, glob.router.weight)
    want, = torch.autograd.grad(by_hand, glob.router.weight)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_an_unknown_aux_loss_scope_is_one_line_naming_the_key_and_the_choices():
    import typing

    from podscale.config import GPTMoEModelSection
    from podscale.parallel.moe import AUX_LOSS_SCOPES
    assert typing.get_args(GPTMoEModelSection.model_fields["aux_loss_scope"].annotation) == AUX_LOSS_SCOPES
    with pytest.raises(ValueError, match=r"^model.aux_loss_scope='batch' is not one of group, global, global_step$"):
        MoELayer(8, 8, 8, aux_loss_scope="batch")


# the global batch of a step of several micro-batches (model.aux_loss_scope = "global_step"; Qiu et al. 2025's
# buffer for gradient accumulation)


def _step_layer(E: int = 8) -> MoELayer:
    torch.manual_seed(5)
    return MoELayer(16, 24, E, top_k=2, capacity_factor=1.25, aux_loss_scope="global_step").double()


def _leaning_batches(layer: MoELayer, lean: list[int], S: int = 30) -> list[torch.Tensor]:
    """One single-sequence micro-batch per entry of ``lean``, its tokens leaning to that expert."""
    w = layer.router.weight.detach()
    torch.manual_seed(11)
    return [torch.randn(1, S, 16, dtype=torch.float64) + 2.0 * w[e] / w[e].norm() for e in lean]


def _by_hand(layer: MoELayer, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` of one single-group micro-batch with ``f`` from ``counts`` (E,)."""
    probs = torch.softmax(x.reshape(-1, 16) @ layer.router.weight.t(), -1)
    return layer.num_experts * (counts / counts.sum() * probs.mean(0)).sum()


def _first_counts(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(x.reshape(-1, 16) @ layer.router.weight.t(), -1).detach()
    return torch.bincount(probs.argmax(-1), minlength=layer.num_experts).double()


def test_step_scope_counts_micro_batch_two_over_micro_batches_one_and_two():
    """Micro-batch 2's ``f_e`` is the first-choice counts of micro-batches 1 and 2 over their tokens (not its
    own: the two micro-batches lean to different experts), micro-batch 1's its own; the engine's
    :meth:`MoELayer.start_step` empties the sum, so the next step's first micro-batch counts only itself, and
    a forward without autograd (evaluation) neither reads nor adds to it."""
    layer = _step_layer()
    first, second, third = _leaning_batches(layer, [0, 3, 5])
    c1, c2, c3 = (_first_counts(layer, x) for x in (first, second, third))
    assert not torch.equal(c1, c2)
    layer.start_step()
    a1 = layer(first)[1].aux_loss
    with torch.no_grad():   # evaluation between micro-batches: its own counts, the step's sum untouched
        torch.testing.assert_close(layer(third)[1].aux_loss, _by_hand(layer, third, c3), rtol=1e-12, atol=0)
    a2 = layer(second)[1].aux_loss
    torch.testing.assert_close(a1, _by_hand(layer, first, c1), rtol=1e-12, atol=0)
    torch.testing.assert_close(a2, _by_hand(layer, second, c1 + c2), rtol=1e-12, atol=0)
    assert abs(a2.item() - _by_hand(layer, second, c2).item()) > 1e-3   # not micro-batch 2's own shares
    assert torch.equal(layer.step_counts.total, torch.cat([c1 + c2, c1.new_tensor([60])]).long())
    layer.start_step()
    torch.testing.assert_close(layer(third)[1].aux_loss, _by_hand(layer, third, c3), rtol=1e-12, atol=0)


def _accumulated_grads(layer: MoELayer, batches: list[torch.Tensor], recompute: bool) -> dict[str, torch.Tensor]:
    """The gradients of one step of gradient accumulation over ``batches`` (each loss / M), with every forward
    run again in its backward (``torch.utils.checkpoint``, as ``parallel.recompute = "full"`` wraps a block)
    when ``recompute``."""
    from torch.utils.checkpoint import checkpoint
    layer.zero_grad(set_to_none=True)
    layer.start_step()
    for x in batches:
        run = (lambda t: checkpoint(layer, t, use_reentrant=False)) if recompute else layer
        y, out = run(x)
        ((y.square().sum() + out.loss) / len(batches)).backward()
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_a_recomputed_forward_repeats_the_step_counts_its_first_forward_used():
    """Activation recomputation runs each micro-batch's forward again in its backward: it must take the counts
    its first forward took, neither adding them again nor reading a later micro-batch's, so the step's
    gradients are those without recomputation (exactly, fp64), and the step's sum is the micro-batches'; also
    when both forwards of a two-micro-batch step run before both backwards (GPipe's order, 1F1B's warm-up),
    the recomputations then coming in the forwards' order, after micro-batch 2 has added its counts."""
    from torch.utils.checkpoint import checkpoint
    layer = _step_layer()
    batches = _leaning_batches(layer, [0, 3, 5])
    plain = _accumulated_grads(layer, batches, recompute=False)
    total = layer.step_counts.total.clone()
    again = _accumulated_grads(layer, batches, recompute=True)
    assert torch.equal(layer.step_counts.total, total)
    for n, g in plain.items():
        assert torch.equal(again[n], g), n
    # both forwards before both backwards: micro-batch 1's recomputation comes after micro-batch 2 added its
    layer.zero_grad(set_to_none=True)
    layer.start_step()
    outs = [checkpoint(layer, x, use_reentrant=False) for x in batches[:2]]
    for y, out in outs:
        ((y.square().sum() + out.loss) / 2).backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    ref = _accumulated_grads(layer, batches[:2], recompute=False)
    for n, g in ref.items():
        assert torch.equal(got[n], g), n
