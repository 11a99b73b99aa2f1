"""The planner's GPT-MoE under tensor parallelism as podscale runs it (podscale.parallel.moe.layer.MoELayer:
each tp rank routes 1/tp of the samples through whole experts), checked against what a real rank holds."""
import math

import pytest
import torch

from podscale.models.gpt_moe import GPTMoE, GPTMoEConfig
from podscale.parallel.param_tags import tags
from podscale.parallel.tensor import apply_tensor_parallel
from podscale.plan import gpt_cost, predict
from podscale.plan import network as net
from podscale.plan.hardware import as_system
from podscale.plan.layout import Layout, LayoutError
from podscale.plan.models import GPT

# every other block MoE: two dense blocks (tensor-parallel MLP) and two MoE blocks
CFG = dict(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=256, experts=4, top_k=2, moe_every=2)


def planner_model(**kw) -> GPT:
    c = {**CFG, **kw}
    return GPT(layers=c["n_layer"], hidden=c["n_embd"], heads=c["n_head"], seq=c["block_size"],
               vocab=c["vocab_size"], experts=c["experts"], top_k=c["top_k"], moe_every=c["moe_every"],
               shared_experts=c.get("shared_experts", 0))


def real_rank(tp: int, ep: int, rank: int, fold: bool = False, split: bool = False, shared: int = 0) -> dict:
    """Parameter counts of global rank ``rank`` of a tp x ep mesh, as podscale builds it: the GPT-MoE on the
    meta device with the rank's mesh coordinates (its experts; ``fold``: MoE parallel folding, experts sharded
    over ep x tp; ``split``: expert tensor parallelism, each expert's width split over tp; ``shared``: shared
    experts), then sharded over tp. Building needs no process group (no collective runs until the first
    forward). ``expert_tags``: the (tensor_parallel, sequence_parallel) marks its experts carry; ``shared``:
    the shared experts' parameters."""
    from podscale.runtime.mesh import Mesh
    mesh = Mesh(sizes={"pp": 1, "dp": 1, "ep": ep, "tp": tp}, rank=rank)
    with torch.device("meta"):
        model = GPTMoE(GPTMoEConfig(**CFG, shared_experts=shared), mesh, False, fold_tp=fold,
                       expert_tensor_parallel=split)
    apply_tensor_parallel(model, mesh)
    out = {"total": 0, "expert": 0, "tp_summed": 0, "tp_replicated_dense": 0, "expert_tags": set(), "shared": 0}
    for name, p in model.named_parameters():
        n, tg = p.numel(), tags(p)
        out["total"] += n
        out["expert"] += n * tg.expert_parallel
        out["tp_summed"] += n * tg.sequence_parallel          # no sequence parallelism: the MoE layers' only
        # whole on every tp rank though not an MoE layer's (layer norms, row-parallel biases, position embedding)
        out["tp_replicated_dense"] += n * (tg.tp_layout is None and ".moe." not in name)
        if tg.expert_parallel:
            out["expert_tags"].add((tg.tensor_parallel, tg.sequence_parallel))
        out["shared"] += n * (".moe.shared." in name)
    return out


@pytest.mark.parametrize("ep", [1, 2])
def test_a_ranks_parameters_under_tp_are_what_podscale_builds(ep):
    """tp = 2: a rank holds experts / ep whole experts and the whole router (podscale does not shard an MoE
    layer over tp); the planner's per-rank count is a real rank's, to the parameter, in every class: the
    experts (reduced and ZeRO-sharded over dp), the ones summed over tp, and the total, which differs only
    by the planner's dense rule (a dense block's layer norms and row-parallel biases, and the position
    embedding, counted as divided by tp, which podscale keeps whole: the same for dense GPTs)."""
    tp = 2
    model = planner_model()
    planned = gpt_cost.rank_params(model, Layout(tp=tp, dp=1, ep=ep, microbatch=2))
    for rank in range(tp * ep):                   # every rank of the tp x ep mesh holds as many
        real = real_rank(tp, ep, rank)
        assert planned.expert == real["expert"]
        assert planned.tp_summed == real["tp_summed"]
        assert planned.total == real["total"] - real["tp_replicated_dense"] * (1 - 1 / tp)
    # against an independent count: the two MoE blocks' experts, whole, E/ep of them on a rank
    h, f = CFG["n_embd"], 4 * CFG["n_embd"]
    assert planned.expert == 2 * CFG["experts"] // ep * (2 * h * f + f + h)
    # at tp = 1 nothing is summed over tp, and the experts are the same
    one = gpt_cost.rank_params(model, Layout(tp=1, dp=1, ep=ep, microbatch=2))
    assert one.tp_summed == 0 and one.expert == planned.expert


@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("shared", [0, 1])
def test_a_ranks_split_experts_are_what_podscale_builds(ep, shared):
    """Expert tensor parallelism at tp = 2: the planner's per-rank expert parameters, the ones summed over tp
    (router and the whole ``b_proj``s) and the total are a real rank's, to the parameter, on every rank of the
    mesh; with a shared expert too, which is split over tp like the routed ones (its part of the width and its
    whole ``b_proj``: half its one-process parameters but h/2), dense (not an expert parameter)."""
    tp = 2
    planned = gpt_cost.rank_params(planner_model(shared_experts=shared),
                                   Layout(tp=tp, dp=1, ep=ep, microbatch=2, expert_tensor_parallel=True))
    h, f = CFG["n_embd"], 4 * CFG["n_embd"]
    for rank in range(tp * ep):
        real = real_rank(tp, ep, rank, split=True, shared=shared)
        assert real["shared"] == shared * 2 * (2 * h * f // tp + f // tp + h)   # two MoE blocks
        assert planned.expert == real["expert"]
        assert planned.tp_summed == real["tp_summed"]
        assert planned.total == real["total"] - real["tp_replicated_dense"] * (1 - 1 / tp)


def test_the_gradient_sum_over_tp_is_paid_once_per_reduction():
    """The router's and experts' gradients, partial per tp rank, are all-reduced over tp every time they are
    reduced: once a step after the data-parallel all-reduce (replicated; ZeRO-1, ZeRO-2 in a pipeline), and
    before every micro-batch's reduce-scatter under ZeRO-2 without a pipeline. The activation collectives
    are the same in all of them."""
    system = as_system("dgx-a100-80g")
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    m = 4

    def tp_comm(stage):
        lay = Layout(tp=2, dp=4, ep=2, microbatch=2, zero_stage=stage)
        return predict(system, 16, model, lay, 4 * 2 * 2 * m).time_breakdown_s["tp_communication"]

    summed = gpt_cost.rank_params(model, Layout(tp=2, dp=4, ep=2, microbatch=2)).tp_summed
    one_sum = net.all_reduce_time(system, system.device.dtype_bytes * summed, 2, 1)
    assert one_sum > 0
    assert tp_comm(1) == pytest.approx(tp_comm(0), rel=1e-12)
    assert tp_comm(2) - tp_comm(1) == pytest.approx((m - 1) * one_sum, rel=1e-9)


def test_an_moe_blocks_tp_collectives_are_the_attentions_and_the_gather_of_its_samples():
    """Per MoE block and micro-batch, without sequence parallelism: the attention's all-reduce in each pass
    (Megatron's), the MoE layer's all-gather over tp of its samples' outputs (forward) and of their
    input gradients (backward), and the forward's all-reduce of its aux and z loss over tp (one float); no
    MLP all-reduce. Every block MoE, no overlap, one micro-batch: the tp
    communication of a step is these, the vocabulary-parallel embedding's all-reduce and the one gradient sum
    (the head's and the loss's are the output layer's)."""
    system = as_system("dgx-a100-80g")
    model = planner_model(n_layer=4, n_embd=1024, n_head=16, experts=8, block_size=1024, moe_every=1)
    lay = Layout(tp=2, dp=8, microbatch=2)
    pred = predict(system, 16, model, lay, 16)
    act = system.device.dtype_bytes * 2 * model.seq * model.hidden
    per_block = (2 * (net.all_reduce_time(system, act, 2, 1) + net.all_gather_time(system, act, 2, 1))
                 + net.all_reduce_time(system, 4, 2, 1))
    grads = net.all_reduce_time(system, system.device.dtype_bytes * gpt_cost.rank_params(model, lay).tp_summed, 2, 1)
    embedding = net.all_reduce_time(system, act, 2, 1)
    assert pred.time_breakdown_s["tp_communication"] == pytest.approx(model.layers * per_block + grads + embedding,
                                                                      rel=1e-9)


def test_an_moe_micro_batch_must_split_over_tp():
    """podscale's MoE layer splits a micro-batch's samples over tp (the config refuses otherwise): so does
    the planner, with a one-line error."""
    with pytest.raises(LayoutError, match="microbatch=3 must be a multiple of 2"):
        predict("dgx-a100-80g", 16, planner_model(), Layout(tp=2, dp=8, microbatch=3), 24)
    predict("dgx-a100-80g", 16, planner_model(experts=1), Layout(tp=2, dp=8, microbatch=3), 24)   # dense: fine


def test_shared_experts_are_priced_as_one_more_dense_mlp_per_moe_layer():
    """``shared_experts`` = s: every MoE layer also runs one dense GELU MLP of width s x ffn on every token,
    which podscale's MoE layer under tp runs whole on the rank's 1/tp of the samples, like the experts. The
    prediction is the same model's plus exactly that MLP in each MoE layer, counted independently here: its
    parameters (dense: on every ep and tp rank, summed over tp), 16 bytes of model states each (ZeRO 0, mixed
    precision), its GELU's input and output (2 bytes each per element), its FLOPs, and its two linears and
    bias + GELU pass on tokens / tp rows of width s x ffn. Leaving it out or counting it twice fails."""
    from dataclasses import replace

    from podscale.plan.compute import linear_time, stream_time
    system = as_system("dgx-a100-80g")
    dev = system.device
    base = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    s = 2
    shared = replace(base, shared_experts=s)
    h, fs, n_moe = base.hidden, s * base.ffn, base.moe_layers
    assert n_moe == 4 and fs == 8192
    mlp = 2 * h * fs + fs + h                                   # two weights with their biases
    assert shared.params - base.params == n_moe * mlp

    tp, b, batch = 2, 2, 64
    lay = Layout(tp=tp, dp=4, ep=2, microbatch=b)
    m = batch // (4 * 2 * b)
    rows = b * base.seq // tp                                   # a rank's own tokens
    with_s, without = (predict(system, 16, x, lay, batch) for x in (shared, base))
    rp_s, rp_0 = (gpt_cost.rank_params(x, lay) for x in (shared, base))
    assert (rp_s.dense - rp_0.dense, rp_s.expert - rp_0.expert, rp_s.tp_summed - rp_0.tp_summed) == \
        (n_moe * mlp, 0, n_moe * mlp)

    mem_s, mem_0 = with_s.memory_breakdown_bytes, without.memory_breakdown_bytes
    assert mem_s["model_states"] - mem_0["model_states"] == pytest.approx(16 * n_moe * mlp, rel=1e-12)
    assert mem_s["activations"] - mem_0["activations"] == pytest.approx(n_moe * 2 * 2 * rows * fs, rel=1e-9)
    assert with_s.model_flops_per_step - without.model_flops_per_step == \
        pytest.approx(3 * n_moe * 4 * batch * base.seq * h * fs, rel=1e-12)

    fc, proj = linear_time(dev, rows, fs, h), linear_time(dev, rows, h, fs)
    gelu = stream_time(dev, 4 * rows * fs)                       # bias + GELU: read and write, 2 bytes each
    t_s, t_0 = with_s.time_breakdown_s, without.time_breakdown_s
    assert t_s["forward"] - t_0["forward"] == pytest.approx(m * n_moe * (fc[0] + proj[0] + gelu), rel=1e-9)
    assert t_s["backward"] - t_0["backward"] == pytest.approx(m * n_moe * (fc[1] + proj[1] + 2 * gelu), rel=1e-9)
    # its gradient joins the experts' and the router's in the one sum over tp
    grad_sum = [net.all_reduce_time(system, dev.dtype_bytes * rp.tp_summed, tp, 1) for rp in (rp_s, rp_0)]
    assert t_s["tp_communication"] - t_0["tp_communication"] == pytest.approx(grad_sum[0] - grad_sum[1], rel=1e-9)
    # not routed: nothing more exchanged; the count exchange now runs under the shared experts' forward
    counts = net.all_to_all_time(system, 8 * base.experts, 2, tp)
    assert counts < fc[0] + proj[0]
    assert t_0["ep_communication"] - t_s["ep_communication"] == pytest.approx(m * n_moe * counts, rel=1e-9)


@pytest.mark.parametrize("model_extra,layout_extra,line,whole", [
    (', "shared_experts": 2', "", "custom (experts 8 top2 +2 shared) on 16 x dgx-a100-80g", False),
    ("", ', "fold_tp_into_ep": true', "custom (experts 8 top2, folded: 2 a rank over ep*tp = 4) on 16 x dgx-a100-80g, "
     "batch 64, tp2 pp1 dp4 ep2 mb2 fold", True),
    ("", ', "expert_tensor_parallel": true', "custom (experts 8 top2, split over tp: 4 a rank at 1/2 of their width) on "
     "16 x dgx-a100-80g, batch 64, tp2 pp1 dp4 ep2 mb2 etp", True),
    (', "aux_loss_scope": "global"', "", "custom (experts 8 top2, global aux loss) on 16 x dgx-a100-80g", False),
    (', "aux_loss_scope": "global_step"', "", "custom (experts 8 top2, step-global aux loss) on 16 x dgx-a100-80g",
     False),
], ids=["shared", "folded", "split", "global-aux-loss", "step-global-aux-loss"])
def test_plan_predict_names_the_moe_model_and_where_its_experts_are(capsys, model_extra, layout_extra, line, whole):
    """`plan predict`'s first line names an MoE model's shared experts and global (or step-global) aux loss, and
    where a layout
    puts its experts (folded over ep x tp, or split over tp)."""
    from podscale.plan.cli import main
    model = '{"layers": 8, "hidden": 1024, "heads": 16, "seq": 1024, "vocab": 32000, "experts": 8, "top_k": 2' + \
        model_extra + "}"
    layout = '{"tp": 2, "pp": 1, "dp": 4, "ep": 2, "microbatch": 2' + layout_extra + "}"
    assert main(["plan", "predict", "--system", "dgx-a100-80g", "--devices", "16", "--batch", "64", "--model", model,
                 "--layout", layout]) == 0
    out = capsys.readouterr().out
    if whole:
        assert out.splitlines()[0] == line
    else:
        assert out.startswith(line)


def test_gpt_of_passes_the_shared_experts_through():
    """``--layout auto`` plans the config's model: its shared experts too."""
    from podscale.config import parse_config
    from podscale.plan.auto import gpt_of
    section = {"kind": "gpt-moe", "n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 32, "experts": 8}
    assert gpt_of(parse_config({"run": {"name": "moe"}, "model": section})).shared_experts == 0
    cfg = parse_config({"run": {"name": "moe"}, "model": {**section, "shared_experts": 2}})
    assert gpt_of(cfg).shared_experts == 2


# MoE parallel folding (Liu et al. 2025; Megatron-core's expert_tensor_parallel_size = 1): the experts sharded
# over ep x tp, the tokens exchanged over that group, no tp sum of expert gradients.

def _mlp(h: int, f: int) -> int:
    return 2 * h * f + f + h                        # an expert: two weights with their biases


@pytest.mark.parametrize("ep", [1, 2])
def test_a_folded_ranks_parameters_are_what_podscale_builds(ep):
    """Folded, rank (ep_i, tp_j) of a tp = 2 mesh holds experts / (ep tp) whole experts, tagged tensor- and
    expert-parallel and not sequence-parallel (their gradients are complete on their one holder); the router
    stays whole on every tp rank, summed over tp. The planner's count is a real rank's in every class, and
    an independent count's. (Needs the runtime's ``GPTMoE(..., fold_tp=True)``.)"""
    tp = 2
    model = planner_model()
    planned = gpt_cost.rank_params(model, Layout(tp=tp, dp=1, ep=ep, microbatch=2, fold_tp_into_ep=True))
    for rank in range(tp * ep):
        real = real_rank(tp, ep, rank, fold=True)
        assert real["expert_tags"] == {(True, False)}
        assert planned.expert == real["expert"]
        assert planned.tp_summed == real["tp_summed"]
        assert planned.total == real["total"] - real["tp_replicated_dense"] * (1 - 1 / tp)
    h, e, n_moe = CFG["n_embd"], CFG["experts"], 2
    assert planned.expert == n_moe * e // (ep * tp) * _mlp(h, 4 * h)
    assert planned.tp_summed == n_moe * h * e                   # the routers only


def test_folding_divides_the_experts_memory_by_tp_and_sums_no_expert_gradient_over_tp():
    """Same layout, folded or not: a rank's experts (and their model states) are 1/tp as many, its dense
    parameters the same, and its tp-summed parameters the routers alone. Counted independently: 16 bytes a
    parameter replicated (ZeRO 0, mixed precision); ZeRO-3 partitions an expert's 16 bytes over dp, its
    replicas, not over dp x ep. Activations do not change (a rank runs the same rows)."""
    system = as_system("dgx-a100-80g")
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    h, f, e, n_moe = 1024, 4096, 8, 4
    assert model.moe_layers == n_moe
    tp, dp, ep, b = 2, 4, 2, 2
    expert_unfolded = n_moe * e // ep * _mlp(h, f)
    expert_folded = n_moe * e // (ep * tp) * _mlp(h, f)
    assert expert_folded * tp == expert_unfolded
    for stage, bytes_per_expert_param in ((0, 16), (3, 16 / dp)):
        lay = Layout(tp=tp, dp=dp, ep=ep, microbatch=b, zero_stage=stage)
        folded = Layout(tp=tp, dp=dp, ep=ep, microbatch=b, zero_stage=stage, fold_tp_into_ep=True)
        rp_u, rp_f = gpt_cost.rank_params(model, lay), gpt_cost.rank_params(model, folded)
        assert (rp_u.expert, rp_f.expert) == (expert_unfolded, expert_folded)
        assert rp_u.dense == rp_f.dense
        assert (rp_u.tp_summed, rp_f.tp_summed) == (n_moe * (h * e + e // ep * _mlp(h, f)), n_moe * h * e)
        p_u, p_f = (predict(system, 16, model, x, 64).memory_breakdown_bytes for x in (lay, folded))
        assert p_u["model_states"] - p_f["model_states"] == pytest.approx(
            bytes_per_expert_param * (expert_unfolded - expert_folded), rel=1e-12)
        assert p_u["activations"] == p_f["activations"]


def test_folding_exchanges_over_ep_x_tp_and_drops_the_expert_gradient_sum():
    """Folded, each MoE layer's four all-to-alls of a micro-batch (dispatch and combine, forward and
    backward) run over the ep x tp consecutive ranks (stride 1) instead of the ep ranks of one tp index
    (stride tp), with the same bytes a rank (its own samples' rows); the tp all-reduce of gradients is the
    routers' alone; the expert GEMMs run the same rows a rank on E/(ep tp) experts. The activations' tp
    collectives are the same. 32 experts, so that the segments are short and no expert work hides an
    exchange (podscale.parallel.moe.layer.overlaps_exchange) in either layout."""
    from podscale.parallel.moe.layer import overlaps_exchange
    from podscale.plan.compute import linear_time
    system = as_system("dgx-a100-80g")
    dev = system.device
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=32, block_size=1024)
    h, f, s, e, n_moe, top_k = 1024, 4096, 1024, 32, 4, 2
    tp, dp, ep, b, batch = 2, 4, 2, 2, 64
    m = batch // (dp * ep * b)
    rows = b * s // tp * top_k                                  # a rank's routed rows (capacity factor 1)
    assert not overlaps_exchange(rows, e)
    lay = Layout(tp=tp, dp=dp, ep=ep, microbatch=b)
    folded = Layout(tp=tp, dp=dp, ep=ep, microbatch=b, fold_tp_into_ep=True)
    p_u, p_f = (predict(system, 16, model, x, batch).time_breakdown_s for x in (lay, folded))

    sent = dev.dtype_bytes * rows * h
    a2a_u, a2a_f = net.all_to_all_time(system, sent, ep, tp), net.all_to_all_time(system, sent, ep * tp, 1)
    assert a2a_f != a2a_u
    # and the count exchange before them (E int64 a rank), over the same group
    counts_u, counts_f = net.all_to_all_time(system, 8 * e, ep, tp), net.all_to_all_time(system, 8 * e, ep * tp, 1)
    assert p_u["ep_communication"] == pytest.approx(m * n_moe * (4 * a2a_u + counts_u), rel=1e-9)
    assert p_f["ep_communication"] == pytest.approx(m * n_moe * (4 * a2a_f + counts_f), rel=1e-9)

    def grad_sum(params):
        return net.all_reduce_time(system, dev.dtype_bytes * params, tp, 1)
    router, experts = n_moe * h * e, n_moe * e // ep * _mlp(h, f)
    assert p_u["tp_communication"] - p_f["tp_communication"] == pytest.approx(
        grad_sum(router + experts) - grad_sum(router), rel=1e-9)

    def expert_gemms(local):       # the two linears of ``local`` experts side by side, rows / local each
        return [linear_time(dev, rows / local, f, h, batch=local, bytes_per_element=dev.dtype_bytes),
                linear_time(dev, rows / local, h, f, batch=local, bytes_per_element=dev.dtype_bytes)]
    g_u, g_f = expert_gemms(e // ep), expert_gemms(e // (ep * tp))
    for i, phase in enumerate(("forward", "backward")):
        assert p_u[phase] - p_f[phase] == pytest.approx(m * n_moe * sum(u[i] - v[i] for u, v in zip(g_u, g_f)),
                                                        rel=1e-9, abs=1e-12)


def test_folding_needs_tp_and_experts_that_ep_x_tp_divides():
    with pytest.raises(LayoutError, match="fold_tp_into_ep needs tp > 1"):
        Layout(tp=1, dp=4, ep=2, fold_tp_into_ep=True)
    with pytest.raises(LayoutError, match=r"experts \(4\) ep\*tp = 4\*2 = 8 divides"):
        predict("dgx-a100-80g", 16, planner_model(), Layout(tp=2, dp=2, ep=4, microbatch=2, fold_tp_into_ep=True), 16)
    with pytest.raises(LayoutError, match=r"experts \(1\) ep\*tp = 1\*2 = 2 divides"):     # nothing to fold
        predict("dgx-a100-80g", 16, planner_model(experts=1), Layout(tp=2, dp=8, microbatch=2, fold_tp_into_ep=True),
                16)
    predict("dgx-a100-80g", 16, planner_model(), Layout(tp=2, dp=4, ep=2, microbatch=2, fold_tp_into_ep=True), 16)


def test_the_search_tries_folding_where_ep_x_tp_divides_the_experts_and_auto_passes_it_on():
    """Folded layouts are candidates for an MoE model at tp > 1 whose experts ep x tp divides, never for a
    dense model; ``--layout auto``'s overrides set parallel.fold_tp_into_ep either way."""
    from podscale.plan.auto import layout_overrides
    from podscale.plan.search import candidate_layouts
    system = as_system("dgx-a100-80g")
    moe = list(candidate_layouts(system, 16, planner_model(experts=8), 64, microbatches=(2,)))
    folded = {(x.tp, x.ep) for x in moe if x.fold_tp_into_ep}
    assert folded == {(x.tp, x.ep) for x in moe if x.tp > 1 and 8 % (x.tp * x.ep) == 0}
    assert (2, 2) in folded and (2, 8) not in folded and all(tp > 1 for tp, _ in folded)
    assert not any(x.fold_tp_into_ep for x in candidate_layouts(system, 16, planner_model(experts=1), 64,
                                                                microbatches=(2,)))
    lay = Layout(tp=2, dp=4, ep=2, microbatch=2, fold_tp_into_ep=True)
    assert "parallel.fold_tp_into_ep=true" in layout_overrides(lay)
    assert "parallel.fold_tp_into_ep=false" in layout_overrides(Layout(tp=2, dp=8, microbatch=2))


# Expert tensor parallelism (Megatron-core's expert_tensor_parallel_size = tp, alltoall token dispatcher): each tp
# rank holds its ep rank's experts at 1/tp of their hidden width (w_fc's columns, b_fc, w_proj's rows; b_proj
# whole), runs all the tp ranks' exchanged rows through them (all-gathered over tp) and reduce-scatters the
# partial outputs back.

def test_expert_tensor_parallelism_halves_the_expert_parameters_at_tp_2():
    """At tp 2 a rank's expert parameters are, per expert, w_fc (h x f/2), b_fc (f/2), w_proj (f/2 x h) and the
    whole b_proj (h), written out from the design, not from the planner's helpers; their model states (16
    bytes each, ZeRO 0, mixed precision) shrink accordingly; of them only b_proj is summed over tp, beside the
    routers; the GELU keeps the same bytes (tp times the rows at half the width) and the experts keep the other
    tp rank's gathered input rows (2 bytes x h each) for their weight gradients."""
    system = as_system("dgx-a100-80g")
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    h, f, e, n_moe, s = 1024, 4096, 8, 4, 1024
    tp, dp, ep, b, batch = 2, 4, 2, 2, 64
    whole = e // ep * (h * f + f + f * h + h)                    # a rank's experts of one layer, replicated
    split = e // ep * (h * (f // 2) + f // 2 + (f // 2) * h + h)     # ... split over tp 2 by width
    assert 2 * split - whole == e // ep * h                       # half, but for the whole output biases
    lay = Layout(tp=tp, dp=dp, ep=ep, microbatch=b)
    etp = Layout(tp=tp, dp=dp, ep=ep, microbatch=b, expert_tensor_parallel=True)
    rp_r, rp_e = gpt_cost.rank_params(model, lay), gpt_cost.rank_params(model, etp)
    assert (rp_r.expert, rp_e.expert) == (n_moe * whole, n_moe * split)
    assert rp_r.dense == rp_e.dense
    assert rp_e.tp_summed == n_moe * (h * e + e // ep * h)       # the routers and the whole output biases
    p_r, p_e = (predict(system, 16, model, x, batch).memory_breakdown_bytes for x in (lay, etp))
    assert p_r["model_states"] - p_e["model_states"] == pytest.approx(16 * n_moe * (whole - split), rel=1e-12)
    rows_other_rank = b * s // tp * 2 * 1.0                       # top-2, capacity factor 1
    assert p_e["activations"] - p_r["activations"] == pytest.approx(n_moe * 2 * rows_other_rank * h, rel=1e-9)


def test_expert_tensor_parallelism_gathers_and_reduce_scatters_the_rows_over_tp():
    """Per MoE layer and micro-batch: an all-gather over tp of the exchanged rows before the experts and a
    reduce-scatter of their partial outputs after, in the forward, and again in the backward (output gradients
    gathered, input gradients reduce-scattered), each of tp x a rank's rows, whole width; the tp sum of
    gradients is the routers' and the output biases' alone; the ep exchange is the unsplit one (32 experts:
    short segments, so no expert work hides it in either layout); the experts run tp times the rows at 1/tp
    of the width."""
    from podscale.plan.compute import linear_time
    system = as_system("dgx-a100-80g")
    dev = system.device
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=32, block_size=1024)
    h, f, s, e, n_moe, top_k = 1024, 4096, 1024, 32, 4, 2
    tp, dp, ep, b, batch = 2, 4, 2, 2, 64
    m = batch // (dp * ep * b)
    lay = Layout(tp=tp, dp=dp, ep=ep, microbatch=b)
    etp = Layout(tp=tp, dp=dp, ep=ep, microbatch=b, expert_tensor_parallel=True)
    p_r, p_e = (predict(system, 16, model, x, batch).time_breakdown_s for x in (lay, etp))
    assert p_e["ep_communication"] == pytest.approx(p_r["ep_communication"], rel=1e-12)
    assert p_r["ep_communication"] > 0

    gathered = dev.dtype_bytes * tp * (b * s // tp) * top_k * h          # every tp rank's rows, whole width
    rows_tp = net.all_gather_time(system, gathered, tp, 1) + net.reduce_scatter_time(system, gathered, tp, 1)
    assert rows_tp > 0

    def grad_sum(params):
        return net.all_reduce_time(system, dev.dtype_bytes * params, tp, 1)
    router, experts, out_bias = n_moe * h * e, n_moe * e // ep * _mlp(h, f), n_moe * e // ep * h
    assert p_e["tp_communication"] - p_r["tp_communication"] == pytest.approx(
        m * n_moe * 2 * rows_tp + grad_sum(router + out_bias) - grad_sum(router + experts), rel=1e-9)

    rows = b * s // tp * top_k                                   # a rank's own routed rows (capacity factor 1)

    def expert_gemms(rows_per_rank, width):      # E/ep experts side by side
        local = e // ep
        return [linear_time(dev, rows_per_rank / local, width, h, batch=local, bytes_per_element=dev.dtype_bytes),
                linear_time(dev, rows_per_rank / local, h, width, batch=local, bytes_per_element=dev.dtype_bytes)]
    g_r, g_e = expert_gemms(rows, f), expert_gemms(tp * rows, f // tp)
    for i, phase in enumerate(("forward", "backward")):
        assert p_e[phase] - p_r[phase] == pytest.approx(m * n_moe * sum(v[i] - u[i] for u, v in zip(g_r, g_e)),
                                                        rel=1e-9, abs=1e-12)


def test_a_split_shared_expert_is_priced_at_1_over_tp_of_its_width_with_its_tokens_gathered_over_tp():
    """With expert tensor parallelism the shared experts' MLP (width s x ffn) is split over tp like the routed
    experts (podscale.parallel.moe.layer.WidthSplit.run_dense): the prediction is the same model's without it
    plus exactly, per MoE layer, written out here: its parameters at 1/tp of the width with the whole output
    bias (dense; of them only b_proj summed over tp), 16 bytes of model states each; its GELU's input and
    output (2 bytes each) on every tp rank's tokens at 1/tp of the width, and the other tp rank's gathered
    tokens (2 bytes x h) kept for its weight gradients; its two linears on tp x a rank's tokens at width
    s x ffn / tp; and an all-gather of the tokens over tp and a reduce-scatter of the partial outputs, in each
    pass, of every tp rank's tokens at whole width."""
    from dataclasses import replace

    from podscale.plan.compute import linear_time, stream_time
    system = as_system("dgx-a100-80g")
    dev = system.device
    base = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    s, tp, b, batch = 2, 2, 2, 64
    shared = replace(base, shared_experts=s)
    h, fs, n_moe, seq = base.hidden, s * base.ffn, base.moe_layers, base.seq
    lay = Layout(tp=tp, dp=4, ep=2, microbatch=b, expert_tensor_parallel=True)
    m = batch // (4 * 2 * b)
    rows = b * seq // tp                                        # a rank's own tokens
    part = 2 * h * (fs // tp) + fs // tp + h                    # w_fc, w_proj, b_fc at 1/tp; b_proj whole
    with_s, without = (predict(system, 16, x, lay, batch) for x in (shared, base))
    rp_s, rp_0 = (gpt_cost.rank_params(x, lay) for x in (shared, base))
    assert (rp_s.dense - rp_0.dense, rp_s.expert - rp_0.expert, rp_s.tp_summed - rp_0.tp_summed) == \
        (n_moe * part, 0, n_moe * h)

    mem_s, mem_0 = with_s.memory_breakdown_bytes, without.memory_breakdown_bytes
    assert mem_s["model_states"] - mem_0["model_states"] == pytest.approx(16 * n_moe * part, rel=1e-12)
    assert mem_s["activations"] - mem_0["activations"] == pytest.approx(
        n_moe * (2 * 2 * tp * rows * fs / tp + 2 * (tp - 1) * rows * h), rel=1e-9)

    fc, proj = linear_time(dev, tp * rows, fs / tp, h), linear_time(dev, tp * rows, h, fs / tp)
    gelu = stream_time(dev, 4 * tp * rows * fs / tp)             # bias + GELU: read and write, 2 bytes each
    t_s, t_0 = with_s.time_breakdown_s, without.time_breakdown_s
    assert t_s["forward"] - t_0["forward"] == pytest.approx(m * n_moe * (fc[0] + proj[0] + gelu), rel=1e-9)
    assert t_s["backward"] - t_0["backward"] == pytest.approx(m * n_moe * (fc[1] + proj[1] + 2 * gelu), rel=1e-9)
    tokens = dev.dtype_bytes * tp * rows * h                    # every tp rank's tokens, whole width
    rows_tp = net.all_gather_time(system, tokens, tp, 1) + net.reduce_scatter_time(system, tokens, tp, 1)
    grad_sum = [net.all_reduce_time(system, dev.dtype_bytes * rp.tp_summed, tp, 1) for rp in (rp_s, rp_0)]
    assert t_s["tp_communication"] - t_0["tp_communication"] == pytest.approx(
        m * n_moe * 2 * rows_tp + grad_sum[0] - grad_sum[1], rel=1e-9)
    assert with_s.model_flops_per_step - without.model_flops_per_step == \
        pytest.approx(3 * n_moe * 4 * batch * seq * h * fs, rel=1e-12)


@pytest.mark.parametrize("layout, model_kw, message", [
    (dict(tp=1, dp=16), {}, "expert_tensor_parallel needs tp > 1 (it splits each expert's hidden width over the tp "
                            "ranks): set tp > 1 or expert_tensor_parallel false"),
    (dict(tp=2, dp=4, ep=2, fold_tp_into_ep=True), {}, "expert_tensor_parallel and fold_tp_into_ep exclude each "
                                                       "other"),
    (dict(tp=2, dp=8), dict(experts=1), "expert_tensor_parallel needs an MoE model (experts > 1): set "
                                        "expert_tensor_parallel false"),
    (dict(tp=4, dp=4), dict(ffn=1026), "expert_tensor_parallel splits each expert's hidden width (1026) over tp=4, "
                                       "which does not divide it: choose tp among [2, 3, 6, 9"),
])
def test_expert_tensor_parallelism_refusals_are_one_line_naming_the_key_and_the_fix(layout, model_kw, message):
    kw = {**dict(layers=4, hidden=256, heads=4, seq=64, vocab=512, experts=4, top_k=2, moe_every=2), **model_kw}
    with pytest.raises(LayoutError) as err:
        predict("dgx-a100-80g", 16, GPT(**kw), Layout(microbatch=4, expert_tensor_parallel=True, **layout), 64)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert ("set" in str(err.value) or "choose" in str(err.value))


def test_the_search_tries_expert_tensor_parallelism_and_auto_passes_it_on():
    """Split layouts are candidates for an MoE model at every tp > 1 that divides the experts' width, also
    where the experts are fewer than ep x tp (no folding: splitting is then the one way to shard them over
    tp), never for a dense model or at tp 1, never folded too; ``--layout auto``'s overrides set
    parallel.expert_tensor_parallel either way, and the trainer's config accepts an ETP layout's overrides
    (and refuses them for a dense model)."""
    from podscale.plan.auto import layout_overrides
    from podscale.plan.search import candidate_layouts
    system = as_system("dgx-a100-80g")
    moe = list(candidate_layouts(system, 16, planner_model(experts=4), 64, microbatches=(2,)))
    split = {(x.tp, x.ep) for x in moe if x.expert_tensor_parallel}
    assert split == {(x.tp, x.ep) for x in moe if x.tp > 1}
    assert (4, 4) in split and (4, 4) not in {(x.tp, x.ep) for x in moe if x.fold_tp_into_ep}   # 16 > 4 experts
    assert not any(x.expert_tensor_parallel and x.fold_tp_into_ep for x in moe)
    assert not any(x.expert_tensor_parallel for x in candidate_layouts(system, 16, planner_model(experts=1), 64,
                                                                       microbatches=(2,)))
    for x in moe:
        if x.expert_tensor_parallel:
            predict(system, 16, planner_model(experts=4), x, 64)      # every candidate is a valid layout
            break
    lay = Layout(tp=2, dp=4, ep=2, microbatch=2, expert_tensor_parallel=True)
    assert "parallel.expert_tensor_parallel=true" in layout_overrides(lay)
    assert "parallel.fold_tp_into_ep=false" in layout_overrides(lay)
    assert "parallel.expert_tensor_parallel=false" in layout_overrides(Layout(tp=2, dp=8, microbatch=2))
    from podscale.config import ConfigError, load_config
    cfg = load_config("examples/gpt-moe.toml", ["parallel.nproc=16", "train.global_batch=64"] + layout_overrides(lay))
    assert (cfg.parallel.tp, cfg.parallel.ep, cfg.parallel.expert_tensor_parallel) == (2, 2, True)
    cfg.check_layout(16)
    with pytest.raises(ConfigError, match="parallel.expert_tensor_parallel splits a mixture-of-experts model's"):
        dense = Layout(tp=2, dp=8, microbatch=2, expert_tensor_parallel=True)
        load_config("examples/gpt-small.toml", ["parallel.nproc=16"] + layout_overrides(dense)).check_layout(16)
    # a per-rank layout's dispatch reaches the trainer too, and a per-choice one's overrides a config's "rank"
    rank = Layout(tp=1, dp=8, ep=2, microbatch=2, expert_dispatch="rank")
    cfg = load_config("examples/gpt-moe.toml", ["parallel.nproc=16", "train.global_batch=64"] + layout_overrides(rank))
    assert cfg.parallel.expert_dispatch == "rank"
    cfg.check_layout(16)
    back = ["parallel.expert_dispatch='rank'"] + layout_overrides(Layout(tp=1, dp=8, ep=2, microbatch=2))
    assert load_config("examples/gpt-moe.toml", back).parallel.expert_dispatch == "choice"


# What an MoE layer costs beyond its GEMMs and token exchanges: its routing, dispatch and combine, its count
# exchange, and its token exchanges' overlap with its own rows as every overlapped collective is priced.

def test_the_routing_dispatch_and_combine_are_priced_as_their_counted_bytes():
    """Each MoE layer's forward and backward pay ``moe_routing_bytes`` of its rank's own tokens (1/tp of the
    samples) at the device's memory bandwidth (no measured routing rate on a GPU): the ``routing`` component is
    exactly that, on every micro-batch; the count grows linearly with the tokens, and a dense model has none."""
    from podscale.plan.compute import stream_time
    system = as_system("dgx-a100-80g")
    dev = system.device
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    tp, dp, ep, b, batch = 2, 4, 2, 2, 64
    m, n_moe, own = batch // (dp * ep * b), 4, b * 1024 // tp
    fwd, bwd = gpt_cost.moe_routing_bytes(own, 8, 2, 1024, dev.dtype_bytes)
    assert gpt_cost.moe_routing_bytes(2 * own, 8, 2, 1024, dev.dtype_bytes) == (2 * fwd, 2 * bwd)
    # the rows dominate: the dispatch's and combine's 5 C + 3 N, and 7 C + 3 N back, rows of 2 x 1024 bytes
    assert fwd > 2 * 1024 * (5 * 2 * own + 3 * own) and bwd > 2 * 1024 * (7 * 2 * own + 3 * own)
    pred = predict(system, 16, model, Layout(tp=tp, dp=dp, ep=ep, microbatch=b), batch)
    assert pred.components_s["routing"] == pytest.approx(m * n_moe * (stream_time(dev, fwd) + stream_time(dev, bwd)),
                                                         rel=1e-9)
    assert sum(pred.components_s.values()) == pytest.approx(pred.step_time_s, rel=1e-12)    # and in the step
    dense = predict(system, 16, planner_model(experts=1, n_layer=8, n_embd=1024, n_head=16, block_size=1024),
                    Layout(tp=tp, dp=8, microbatch=b), batch)
    assert dense.components_s["routing"] == 0.0


def test_a_calibrated_routing_rate_is_read_at_the_layers_bytes():
    """A measured ``routing_table`` (bytes, bytes/s) prices a layer's routing bytes at the rate interpolated
    (log-log) at its forward + backward bytes, the end rates beyond the measured sizes."""
    import dataclasses
    from podscale.plan.compute import routing_time
    dev = as_system("dgx-a100-80g").device
    cpu = dataclasses.replace(dev, routing_table=((1e6, 2e9), (1e8, 8e9)))
    assert routing_time(cpu, 3e6, 1e7) == pytest.approx(3e6 / 4e9, rel=1e-12)        # halfway in log: 4 GB/s
    assert routing_time(cpu, 1e5, 1e5) == pytest.approx(1e5 / 2e9, rel=1e-12)
    assert routing_time(cpu, 1e9, 1e9) == pytest.approx(1e9 / 8e9, rel=1e-12)
    assert routing_time(dev, 1e6, 1e6) == pytest.approx(1e6 / (dev.memory_bw * dev.memory_efficiency), rel=1e-12)


def test_the_token_exchange_under_its_own_rows_pays_the_measured_exposed_share():
    """The own rows' expert work hides the token all-to-alls only as far as the device lets an overlapped
    collective hide (``overlap_exposed``, measured on a CPU, 0 on GPUs): at 1 the exchanges cost what they cost
    with no overlap at all, at 0 the long segments hide them (8 experts, long segments)."""
    import dataclasses
    from podscale.parallel.moe.layer import overlaps_exchange
    system = as_system("dgx-a100-80g")
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    tp, dp, ep, b, batch = 1, 8, 2, 4, 64
    m, n_moe, rows = batch // (dp * ep * b), 4, b * 1024 * 2
    assert overlaps_exchange(rows, 8)
    lay = Layout(tp=tp, dp=dp, ep=ep, microbatch=b)
    exposed = dataclasses.replace(system, device=dataclasses.replace(system.device, overlap_exposed=1.0))
    a2a = net.all_to_all_time(system, system.device.dtype_bytes * rows * 1024, ep, tp)
    counts = net.all_to_all_time(system, 8 * 8, ep, tp)
    assert predict(exposed, 16, model, lay, batch).time_breakdown_s["ep_communication"] == pytest.approx(
        m * n_moe * (4 * a2a + counts), rel=1e-9)
    assert predict(system, 16, model, lay, batch).time_breakdown_s["ep_communication"] < m * n_moe * (4 * a2a)


def test_calibration_measures_the_routing_rate_in_the_planners_bytes():
    """``plan calibrate``'s measurement of an MoE layer's work beyond its GEMMs (the layer forward and backward
    less its experts and router alone): one [bytes, bytes/s] row per size, the bytes the planner's count of the
    routing, dispatch and combine; and its line in the system file's [device] section."""
    import torch
    from podscale.plan.calibrate import moe_routing_table, routing_line
    from podscale.plan.hardware import GB
    rows = moe_routing_table(torch, 0.001, sizes=((256, 8, 32),))
    assert len(rows) == 1 and rows[0][0] == sum(gpt_cost.moe_routing_bytes(256, 8, 2, 32, 4)) and rows[0][1] > 0
    assert routing_line([[1000, 2.5 * GB]]).startswith("moe_routing_table = [[1000, 2.5]]")


# the global-batch load-balancing loss (Qiu et al. 2025; Megatron-core's global_aux_loss): E + 1 counts all-reduced
# over the ranks that route other tokens in every MoE layer's forward

@pytest.mark.parametrize("scope", ["global", "global_step"])
@pytest.mark.parametrize("tp,dp,ep", [(1, 8, 2), (2, 4, 2), (2, 8, 1)])
def test_the_global_aux_loss_pays_an_all_reduce_of_the_counts_per_moe_layer_and_micro_batch(tp, dp, ep, scope):
    """With ``aux_loss_scope = "global"`` every MoE layer's forward of every micro-batch sums E + 1 int64 over the
    dp x ep ranks (stride tp) and over tp; nothing else changes, and the group scope pays none of it.
    ``"global_step"`` adds those counts up over the step's micro-batches: the same one all-reduce a forward, but
    none in a forward recomputed in the backward (it replays its first forward's sum)."""
    system = as_system("dgx-a100-80g")
    experts, n_moe, b, batch = 8, 4, 2, 64
    m = batch // (dp * ep * b)
    group = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=experts, block_size=1024)
    glob = GPT(**{**group.to_dict(), "aux_loss_scope": scope})
    lay = Layout(tp=tp, dp=dp, ep=ep, microbatch=b)
    p_group, p_glob = (predict(system, tp * dp * ep, x, lay, batch).time_breakdown_s for x in (group, glob))
    nbytes = 8 * (experts + 1)
    reduce = net.all_reduce_time(system, nbytes, dp * ep, tp) + (net.all_reduce_time(system, nbytes, tp, 1)
                                                                 if tp > 1 else 0.0)
    assert reduce > 0
    assert p_glob["ep_communication"] - p_group["ep_communication"] == pytest.approx(m * n_moe * reduce, rel=1e-9)
    for key in p_group.keys() - {"ep_communication", "collective", "total"}:
        assert p_glob[key] == pytest.approx(p_group[key], rel=1e-12, abs=1e-15), key
    # under full recomputation "global" all-reduces again in the recomputed forward; "global_step" replays its sum
    full = Layout(tp=tp, dp=dp, ep=ep, microbatch=b, recompute="full")
    f_group, f_glob = (predict(system, tp * dp * ep, x, full, batch).time_breakdown_s for x in (group, glob))
    again = 2 if scope == "global" else 1
    assert f_glob["ep_communication"] - f_group["ep_communication"] == pytest.approx(again * m * n_moe * reduce,
                                                                                     rel=1e-9)


def test_the_global_aux_loss_on_one_rank_costs_nothing():
    """One device: the counts are the whole batch's already, no all-reduce."""
    system = as_system("dgx-a100-80g")
    group = planner_model()
    glob = GPT(**{**group.to_dict(), "aux_loss_scope": "global"})
    lay = Layout(microbatch=2)
    assert predict(system, 1, glob, lay, 8).step_time_s == predict(system, 1, group, lay, 8).step_time_s


@pytest.mark.parametrize("key,default,others,bad,known", [
    ("aux_loss_scope", "group", ("global", "global_step"), "batch", "group, global, global_step"),
    ("drop_policy", "position", ("priority", "probs"), "tokens", "position, priority, probs"),
])
def test_gpt_of_passes_the_routing_keys_through_and_the_planner_refuses_an_unknown_one(key, default, others, bad,
                                                                                       known):
    from podscale.config import parse_config
    from podscale.plan.auto import gpt_of
    from podscale.plan.models import ModelError, get_model
    section = {"kind": "gpt-moe", "n_layer": 4, "n_head": 2, "n_embd": 32, "block_size": 32, "experts": 8}
    assert getattr(gpt_of(parse_config({"run": {"name": "moe"}, "model": section})), key) == default
    for value in others:
        cfg = parse_config({"run": {"name": "moe"}, "model": {**section, key: value}})
        assert getattr(gpt_of(cfg), key) == value
        assert getattr(get_model('{"layers": 2, "hidden": 64, "heads": 2, "seq": 64, "vocab": 128, "experts": 4, '
                                 f'"top_k": 2, "{key}": "{value}"}}'), key) == value
    with pytest.raises(ModelError, match=rf"^{key} '{bad}' must be one of {known}$"):
        GPT(**{**planner_model().to_dict(), key: bad})


# Per-rank expert dispatch (DeepEP's dispatch/combine, DeepSeek-AI 2025, github.com/deepseek-ai/DeepEP; DeepSeek-V3,
# Sec. 3.2.2): a token sent once to each expert-group rank among its choices, one summed row back per rank.

# one MoE block as wide as DeepSeek-V3's (d 7168, 256 experts of width 2048, top 8)
WIDE = GPT(layers=1, hidden=7168, heads=56, seq=4096, vocab=32000, ffn=2048, experts=256, top_k=8)


def _ranks_per_token(e: int, n: int, k: int) -> float:
    """E[D] under uniform routing of k distinct choices among e experts, e/n on each of n ranks, from the
    binomials (the planner's own product form is not used)."""
    return n * (1 - math.comb(e - e // n, k) / math.comb(e, k))


def test_expected_ranks_per_token_hand_cases():
    assert gpt_cost.expected_ranks_per_token(64, 1, 8) == 1.0                   # one choice, one rank
    assert gpt_cost.expected_ranks_per_token(64, 8, 1) == 1.0                   # one rank holds them all
    assert gpt_cost.expected_ranks_per_token(4, 2, 2) == pytest.approx(5 / 3, rel=1e-12)
    assert gpt_cost.expected_ranks_per_token(8, 8, 2) == 2.0                    # every choice taken: both ranks
    assert gpt_cost.expected_ranks_per_token(8, 4, 8) == 4.0                    # one expert a rank, 4 distinct
    # DeepSeek-V3's shape over 8 ranks: 256 experts, top 8 -> D ~ 5.25, ~0.66 of per-choice's bytes
    d = gpt_cost.expected_ranks_per_token(256, 8, 8)
    assert d == pytest.approx(_ranks_per_token(256, 8, 8), rel=1e-12) and 5.2 < d < 5.3
    for e, k, n in ((64, 2, 8), (64, 2, 16), (32, 4, 4), (16, 3, 2)):
        assert gpt_cost.expected_ranks_per_token(e, k, n) == pytest.approx(_ranks_per_token(e, n, k), rel=1e-12)


def _dispatch_case(top_k: int, experts: int = 32, fold: bool = False):
    """Both dispatches of one layout whose segments are short (no own-row overlap in either), predicted, with
    what a test needs to price them by hand."""
    from podscale.parallel.moe.layer import overlaps_exchange
    system = as_system("dgx-a100-80g")
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=experts, top_k=top_k, block_size=1024)
    tp, dp, ep, b, batch = 2, 4, 2, 2, 64
    rows = b * 1024 // tp * top_k                       # a rank's kept choices (capacity factor 1)
    assert not overlaps_exchange(rows, experts)
    lays = {d: Layout(tp=tp, dp=dp, ep=ep, microbatch=b, fold_tp_into_ep=fold, expert_dispatch=d)
            for d in ("choice", "rank")}
    preds = {d: predict(system, 16, model, lay, batch) for d, lay in lays.items()}
    group, stride = (ep * tp, 1) if fold else (ep, tp)
    return dict(system=system, preds=preds, rows=rows, group=group, stride=stride, m=batch // (dp * ep * b),
                n_moe=4, h=1024, e=experts, k=top_k)


@pytest.mark.parametrize("fold", [False, True], ids=["ep", "folded"])
def test_per_rank_dispatch_sends_d_over_k_of_the_token_bytes_and_pays_its_extra_all_to_alls(fold):
    """Per rank, each of the four token all-to-alls of an MoE layer and micro-batch carries D / k of the
    per-choice bytes (D from the binomials), the count exchange n x (E/n + 1) int64, and two of them carry more:
    16 bytes a kept choice with the rows out in the forward, 4 with the input gradients back in the backward
    (one collective each: bandwidth, no latency). Its routing moves more bytes (the unique (token, rank) rows,
    the choices' metadata: ``moe_routing_bytes``); everything else (GEMMs, memory) is per-choice's."""
    c = _dispatch_case(top_k=2, fold=fold)
    system, n, stride, rows, e = c["system"], c["group"], c["stride"], c["rows"], c["e"]
    a2a = lambda nbytes: net.all_to_all_time(system, nbytes, n, stride)     # noqa: E731
    sent = system.device.dtype_bytes * rows * c["h"]
    d = _ranks_per_token(e, n, 2)
    choice = 4 * a2a(sent) + a2a(8 * e)
    tokens = sent * d / 2
    meta = a2a(tokens + 16 * rows) - a2a(tokens) + a2a(tokens + 4 * rows) - a2a(tokens)
    rank = 4 * a2a(tokens) + a2a(8 * (e + n)) + meta
    p_c, p_r = (c["preds"][x].time_breakdown_s for x in ("choice", "rank"))
    per = c["m"] * c["n_moe"]
    assert p_c["ep_communication"] == pytest.approx(per * choice, rel=1e-9)
    assert p_r["ep_communication"] == pytest.approx(per * rank, rel=1e-9)
    # the token exchange the planner prices (its ep communication less the count and metadata exchanges), less
    # the collective's latency, scales by D / k exactly
    latency = a2a(0.0)
    token_c = (p_c["ep_communication"] / per - a2a(8 * e)) / 4 - latency
    token_r = (p_r["ep_communication"] / per - a2a(8 * (e + n)) - meta) / 4 - latency
    assert token_r / token_c == pytest.approx(d / 2, rel=1e-9)
    # (the routing's extra work lengthens the backward, under which the dp gradient reduction runs)
    for key in p_c.keys() - {"ep_communication", "collective", "total", "forward", "backward", "dp_communication"}:
        assert p_r[key] == pytest.approx(p_c[key], rel=1e-12, abs=1e-15), key
    assert p_r["forward"] > p_c["forward"] and p_r["backward"] > p_c["backward"]
    assert p_r["dp_communication"] <= p_c["dp_communication"]
    assert c["preds"]["rank"].memory_breakdown_bytes == c["preds"]["choice"].memory_breakdown_bytes


def test_per_rank_dispatch_at_top_1_is_priced_as_per_choice():
    """A top-1 token's one choice is on one rank: the runtime sends it per choice (``layer.make_dispatch``), the
    same rows without the choices' metadata, and the planner prices it so, to the bit."""
    c = _dispatch_case(top_k=1)
    p_c, p_r = (c["preds"][x] for x in ("choice", "rank"))
    assert p_r.time_breakdown_s == p_c.time_breakdown_s and p_r.step_time_s == p_c.step_time_s


def test_both_dispatches_hide_the_token_exchanges_under_the_own_rows():
    """Long segments (8 experts): under either dispatch a rank's own rows (per rank: its own choices) run while
    the token exchanges are in flight, so part of those is hidden; the per-rank dispatch's count exchange and
    the bytes of its metadata and gate gradients stay exposed."""
    from podscale.parallel.moe.layer import overlaps_exchange
    system = as_system("dgx-a100-80g")
    model = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    tp, dp, ep, b, batch = 1, 8, 2, 4, 64
    m, n_moe, rows = batch // (dp * ep * b), 4, b * 1024 * 2
    assert overlaps_exchange(rows, 8)
    a2a = lambda nbytes: net.all_to_all_time(system, nbytes, ep, tp)     # noqa: E731
    d = _ranks_per_token(8, ep, 2)
    tokens = system.device.dtype_bytes * rows * 1024 * d / 2
    exposed = a2a(8 * (8 + ep)) + a2a(tokens + 16 * rows) - a2a(tokens) + a2a(tokens + 4 * rows) - a2a(tokens)
    full = 4 * a2a(tokens) + exposed
    rank = predict(system, 16, model, Layout(tp=tp, dp=dp, ep=ep, microbatch=b, expert_dispatch="rank"), batch)
    assert m * n_moe * exposed <= rank.time_breakdown_s["ep_communication"] < m * n_moe * full
    choice = predict(system, 16, model, Layout(tp=tp, dp=dp, ep=ep, microbatch=b), batch)
    assert choice.time_breakdown_s["ep_communication"] < m * n_moe * 4 * a2a(system.device.dtype_bytes * rows * 1024)


def test_the_search_picks_per_rank_dispatch_for_a_wide_top_8_model_across_slow_nodes_and_per_choice_for_a_tiny_one():
    """One MoE block as wide as DeepSeek-V3's (d 7168, 256 experts of width 2048, top 8) on 4 nodes of 8 A100s
    with 4 x 100 Gb/s each (Jean Zay): the fastest layout exchanges tokens per rank (D ~ 3.6 of 8 choices over
    4 ranks); a tiny top-2 model's exchanges are latency, which the extra all-to-all only adds to. Per-rank
    candidates exist only where they can differ (top_k > 1, an expert group > 1, no expert tensor parallelism)."""
    from podscale.plan.search import candidate_layouts, search
    ranked = search("jean-zay-a100", 32, WIDE, 64, top=0).ranked
    best = next(x for x in ranked if x.layout["expert_dispatch"] != "node")   # per node: its own test below
    assert best.layout["expert_dispatch"] == "rank"
    assert "per-rank" in Layout(**best.layout).short()
    tiny = planner_model(experts=8)
    assert search("dgx-a100-80g", 8, tiny, 32, top=1).ranked[0].layout["expert_dispatch"] == "choice"
    system = as_system("dgx-a100-80g")
    moe = list(candidate_layouts(system, 16, planner_model(experts=8), 64, microbatches=(2,)))
    rank = [x for x in moe if x.expert_dispatch == "rank"]
    assert rank and all(x.expert_group > 1 and not x.expert_tensor_parallel for x in rank)
    assert {(x.tp, x.ep, x.fold_tp_into_ep) for x in rank} == {
        (x.tp, x.ep, x.fold_tp_into_ep) for x in moe if x.expert_group > 1 and not x.expert_tensor_parallel}
    assert not any(x.expert_dispatch == "rank" for x in candidate_layouts(system, 16, planner_model(experts=8, top_k=1),
                                                                           64, microbatches=(2,)))


@pytest.mark.parametrize("layout, model_kw, message", [
    (dict(tp=1, dp=8, ep=2, expert_dispatch="token"), {}, "expert_dispatch must be one of ('choice', 'rank', 'node'), "
                                                          "got 'token': set expert_dispatch to 'choice'"),
    (dict(tp=2, dp=4, ep=2, expert_dispatch="rank", expert_tensor_parallel=True), {},
     "expert_dispatch 'rank' does not run with expert_tensor_parallel"),
    (dict(tp=2, dp=8, expert_dispatch="rank"), {}, "expert_dispatch 'rank' needs an MoE model exchanging tokens over "
                                                   "an expert group of more than one rank (experts 4, expert group 1)"),
    (dict(tp=1, dp=16, expert_dispatch="rank"), dict(experts=1), "expert_dispatch 'rank' needs an MoE model"),
    (dict(tp=2, dp=4, ep=2, expert_dispatch="node", expert_tensor_parallel=True), {},
     "expert_dispatch 'node' does not run with expert_tensor_parallel"),
    (dict(tp=2, dp=8, expert_dispatch="node"), {}, "expert_dispatch 'node' needs an MoE model exchanging tokens over "
                                                   "an expert group of more than one rank (experts 4, expert group 1)"),
    (dict(tp=1, dp=16, expert_dispatch="node"), dict(experts=1), "expert_dispatch 'node' needs an MoE model"),
])
def test_expert_dispatch_refusals_are_one_line_naming_the_key_and_the_fix(layout, model_kw, message):
    kw = {**dict(layers=4, hidden=256, heads=4, seq=64, vocab=512, experts=4, top_k=2, moe_every=2), **model_kw}
    with pytest.raises(LayoutError) as err:
        predict("dgx-a100-80g", 16, GPT(**kw), Layout(microbatch=4, **layout), 64)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert "set" in str(err.value)
    # folding makes the expert group ep x tp: per rank then runs at ep 1
    kw = dict(layers=4, hidden=256, heads=4, seq=64, vocab=512, experts=4, top_k=2, moe_every=2)
    predict("dgx-a100-80g", 16, GPT(**kw), Layout(tp=2, dp=8, microbatch=4, fold_tp_into_ep=True,
                                                  expert_dispatch="rank"), 64)


def test_expert_dispatch_round_trips_through_json_plan_predict_and_auto(capsys):
    import json
    from podscale.plan.auto import layout_overrides
    from podscale.plan.cli import main
    from podscale.plan.layout import layout_from_dict
    lay = Layout(tp=2, dp=4, ep=2, microbatch=2, expert_dispatch="rank")
    assert layout_from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    assert Layout().expert_dispatch == "choice"
    model = '{"layers": 8, "hidden": 1024, "heads": 16, "seq": 1024, "vocab": 32000, "experts": 8, "top_k": 2}'
    assert main(["plan", "predict", "--system", "dgx-a100-80g", "--devices", "16", "--batch", "64", "--model", model,
                 "--layout", json.dumps(lay.to_dict()), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["expert_dispatch"] == "rank" and layout_from_dict(out["layout"]) == lay
    assert main(["plan", "predict", "--system", "dgx-a100-80g", "--devices", "16", "--batch", "64", "--model", model,
                 "--layout", '{"tp": 2, "pp": 1, "dp": 4, "ep": 2, "microbatch": 2, "expert_dispatch": "rank"}']) == 0
    assert capsys.readouterr().out.splitlines()[0] == ("custom (experts 8 top2, per-rank dispatch) on 16 x dgx-a100-80g, "
                                                       "batch 64, tp2 pp1 dp4 ep2 mb2 per-rank")
    assert "parallel.expert_dispatch='rank'" in layout_overrides(lay)
    assert "parallel.expert_dispatch='choice'" in layout_overrides(Layout(tp=2, dp=4, ep=2, microbatch=2))


# Per-node expert dispatch (DeepEP's internode dispatch/combine: RDMA to the same-index GPU of each node, then NVLink
# forwarding; DeepSeek-V3, Sec. 3.2.2): once to each node among a token's choices, then per rank inside the node.

def _wide_ep(system: str, ep: int, dispatch: str, fold: bool = False, tp: int = 1, exposed: bool = False):
    """The wide one-block model with its experts over ep ranks (x tp folded), one micro-batch of 1 sample a rank,
    predicted under ``dispatch`` (``exposed``: a device that hides no collective under compute)."""
    import dataclasses
    sys_ = as_system(system)
    if exposed:
        sys_ = dataclasses.replace(sys_, device=dataclasses.replace(sys_.device, overlap_exposed=1.0))
    lay = Layout(tp=tp, dp=1, ep=ep, microbatch=tp, fold_tp_into_ep=fold, expert_dispatch=dispatch)
    return predict(sys_, ep * tp, WIDE, lay, ep * tp)


@pytest.mark.parametrize("ep", [16, 32])
def test_per_node_dispatch_prices_below_per_rank_below_per_choice_across_nodes(ep):
    """An expert group of 16 or 32 ranks on 2 or 4 nodes of 8 A100s: per node sends a token's row between nodes
    once per node of its 8 choices (D_node ~ 1.99 or 3.6), per rank once per rank (~ 6.5 or 7.3), per choice 8
    times, so their ep communication is in that order; besides it only the routing's work changes (per node
    it runs two stages' index and row work: ``moe_routing_bytes``)."""
    p = {d: _wide_ep("dgx-a100-80g", ep, d) for d in ("choice", "rank", "node")}
    ep_comm = {d: x.time_breakdown_s["ep_communication"] for d, x in p.items()}
    assert ep_comm["node"] < ep_comm["rank"] < ep_comm["choice"]
    assert p["node"].step_time_s < p["rank"].step_time_s < p["choice"].step_time_s
    for key in p["choice"].time_breakdown_s.keys() - {"ep_communication", "forward", "backward", "total"}:
        assert p["node"].time_breakdown_s[key] == pytest.approx(p["rank"].time_breakdown_s[key], rel=1e-12, abs=1e-15)
    assert p["node"].time_breakdown_s["forward"] > p["rank"].time_breakdown_s["forward"]
    assert p["node"].memory_breakdown_bytes == p["rank"].memory_breakdown_bytes


@pytest.mark.parametrize("system, ep, tp, fold", [("dgx-a100-80g", 8, 1, False), ("dgx-a100-80g", 4, 2, False),
                                                  ("dgx-a100-80g", 4, 2, True), ("tpu-v4-pod", 16, 1, False)])
def test_per_node_dispatch_within_one_node_is_per_rank(system, ep, tp, fold):
    """An expert group inside one node (8 at stride 1, 4 at stride 2, 4 x 2 folded; on a torus there are no
    nodes): the runtime dispatches per rank, and so is it priced, to the bit."""
    node, rank = (_wide_ep(system, ep, d, fold=fold, tp=tp) for d in ("node", "rank"))
    assert node.time_breakdown_s == rank.time_breakdown_s and node.step_time_s == rank.step_time_s
    assert node.memory_breakdown_bytes == rank.memory_breakdown_bytes


@pytest.mark.parametrize("ep, stride_tp, fold", [(16, 1, False), (32, 1, False), (8, 2, False), (8, 2, True)])
def test_per_node_dispatch_sends_d_node_over_k_of_the_rows_between_nodes(ep, stride_tp, fold):
    """With nothing hidden, an MoE layer's ep communication per micro-batch is, by hand, stage 1 between the N nodes
    (one peer a node, L x the group's stride apart: 2 int64 of counts a destination, 4 all-to-alls of D_node / k of
    the per-choice rows, 24 bytes a kept choice of metadata each way in the same all-to-alls as the rows out and
    the input gradients back) plus stage 2, per rank over the L ranks of a node (counts of L x (E/n + 1) int64, 4
    all-to-alls of D / k of the rows, 16 and 4 bytes a kept choice likewise), with D_node and D from the
    binomials; and the stage-1 token exchange less its latency is D_node / k of the per-choice rows' exactly."""
    system = as_system("dgx-a100-80g")
    tp = stride_tp
    n = ep * tp if fold else ep
    stride = 1 if fold else tp
    per_node = system.devices_per_node
    L = min(n, per_node // stride)
    N = n // L
    assert N > 1
    e, k, h = WIDE.experts, WIDE.top_k, WIDE.hidden
    own = WIDE.seq                                   # one sample a rank (microbatch tp, split over tp)
    choices = own * k * WIDE.expert_load(n)
    sent = system.device.dtype_bytes * choices * h   # a rank's rows, one per kept choice
    d_node, d = _ranks_per_token(e, N, k), _ranks_per_token(e, n, k)

    def across(nbytes):
        return net.all_to_all_time(system, nbytes, N, L * stride)

    def inside(nbytes):
        return net.all_to_all_time(system, nbytes, L, stride)

    rows_across, rows_inside = sent * d_node / k, sent * d / k

    def riding(a2a, rows, nbytes):        # bytes that travel in the rows' all-to-all: bandwidth, no latency
        return a2a(rows + nbytes) - a2a(rows)

    others = (across(16 * N) + inside(8 * (e // N + L)) + 2 * riding(across, rows_across, 24 * choices)
              + riding(inside, rows_inside, 16 * choices) + riding(inside, rows_inside, 4 * choices))
    by_hand = 4 * (across(sent * d_node / k) + inside(sent * d / k)) + others
    pred = _wide_ep("dgx-a100-80g", ep, "node", fold=fold, tp=tp, exposed=True)
    assert pred.time_breakdown_s["ep_communication"] == pytest.approx(by_hand, rel=1e-9)
    stage1 = (pred.time_breakdown_s["ep_communication"] - others) / 4 - inside(sent * d / k) - across(0.0)
    assert stage1 / (across(sent) - across(0.0)) == pytest.approx(d_node / k, rel=1e-9)


def test_every_expert_dispatch_the_runtime_names_is_priced():
    from podscale.parallel.moe.layer import EXPERT_DISPATCHES
    assert "node" in EXPERT_DISPATCHES
    for dispatch in EXPERT_DISPATCHES:
        assert _wide_ep("dgx-a100-80g", 16, dispatch).step_time_s > 0


def test_the_search_tries_per_node_dispatch_where_the_expert_group_spans_nodes_and_picks_it_for_the_wide_model():
    """Per-node candidates exist where per-rank ones do and the expert group spans more than one node (8 devices a
    node: an ep group of 16, of 8 at stride 2, or folded ep x tp of 16); on 4 Jean Zay nodes the wide top-8 block's
    fastest layout dispatches per node."""
    from podscale.plan import network
    from podscale.plan.search import candidate_layouts, search
    system = as_system("dgx-a100-80g")
    lays = list(candidate_layouts(system, 32, planner_model(experts=16), 64, microbatches=(2,)))
    node = [x for x in lays if x.expert_dispatch == "node"]
    spans = {(x.tp, x.ep, x.fold_tp_into_ep) for x in lays if x.expert_dispatch == "rank"
             and network.node_members(system, x.expert_group, x.expert_group_stride) < x.expert_group}
    assert node and {(x.tp, x.ep, x.fold_tp_into_ep) for x in node} == spans
    assert (1, 16, False) in spans and (2, 8, False) in spans and (2, 8, True) in spans
    assert (1, 8, False) not in spans and (2, 4, False) not in spans
    top1 = candidate_layouts(system, 32, planner_model(experts=16, top_k=1), 64, microbatches=(2,))
    assert not any(x.expert_dispatch == "node" for x in top1)
    best = search("jean-zay-a100", 32, WIDE, 64, top=1).ranked[0]
    assert best.layout["expert_dispatch"] == "node" and "per-node" in Layout(**best.layout).short()


def test_plan_predict_says_per_node_dispatch(capsys):
    import json
    from podscale.plan.cli import main
    from podscale.plan.layout import layout_from_dict
    lay = Layout(tp=2, dp=4, ep=2, microbatch=2, expert_dispatch="node")
    assert layout_from_dict(json.loads(json.dumps(lay.to_dict()))) == lay
    model = '{"layers": 8, "hidden": 1024, "heads": 16, "seq": 1024, "vocab": 32000, "experts": 8, "top_k": 2}'
    assert main(["plan", "predict", "--system", "dgx-a100-80g", "--devices", "16", "--batch", "64", "--model", model,
                 "--layout", '{"tp": 2, "pp": 1, "dp": 4, "ep": 2, "microbatch": 2, "expert_dispatch": "node"}']) == 0
    assert capsys.readouterr().out.splitlines()[0] == ("custom (experts 8 top2, per-node dispatch) on 16 x dgx-a100-80g, "
                                                       "batch 64, tp2 pp1 dp4 ep2 mb2 per-node")


# model.drop_policy (podscale.parallel.moe.gate.DROP_POLICIES): "priority" and "probs" sort the choices before the
# slots are handed out; the planner prices those sorts as routing bytes, "position" as before.

def test_a_stable_sort_is_counted_as_libstdcxx_runs_it():
    """Hand counts of torch's CPU stable sort of fp32 keys (16 bytes a key to copy them and fill the indices, then
    24 a key a pass): 1 key none; 7 keys (halves of 4: insertion only) 1 + 1.5 passes; 128 keys (halves of 64:
    runs of 7 and 28 shorter, two pairs of merge passes) 1 + 4 + 1.5; 2,048 keys (halves of 1,024: runs of 7, 28,
    112 and 448 shorter) 1 + 8 + 1.5."""
    assert gpt_cost.stable_sort_bytes(1) == 0
    assert gpt_cost.stable_sort_bytes(7) == 7 * (16 + 24 * 2.5)
    assert gpt_cost.stable_sort_bytes(128) == 128 * (16 + 24 * 6.5)
    assert gpt_cost.stable_sort_bytes(2048) == 2048 * (16 + 24 * 10.5)


def test_the_drop_policies_sorts_are_counted_beyond_the_position_listing():
    """Hand counts at 1,024 tokens a rank, groups of 128, top-2 (C = 2,048): ``"priority"`` sorts each group's
    top scores (8 groups of 128: 1,024 x 172 = 176,128 bytes) and gathers the ids by that order (3 int64 passes
    over C: 49,152); ``"probs"`` sorts all C gate values (2,048 x 268 = 548,864) and skips position's arange and
    transposed copy (3 int64 passes over C: -49,152). At top-1 position has no listing, so both also pay the
    gathers through theirs."""
    assert gpt_cost.drop_policy_bytes(1024, 2, 128, "position") == 0
    assert gpt_cost.drop_policy_bytes(1024, 2, 128, "priority") == 225_280
    assert gpt_cost.drop_policy_bytes(1024, 2, 128, "probs") == 499_712
    # top-1 (C = 1,024): priority 176,128 + 8 x 1,024 x (3 + 7); probs 1,024 x 268 + 6 int64 passes over C
    assert gpt_cost.drop_policy_bytes(1024, 1, 128, "priority") == 258_048
    assert gpt_cost.drop_policy_bytes(1024, 1, 128, "probs") == 323_584
    # the forward of moe_routing_bytes carries them, the backward does not
    pos = gpt_cost.moe_routing_bytes(1024, 8, 2, 128, 4)
    assert gpt_cost.moe_routing_bytes(1024, 8, 2, 128, 4, drop_policy="position", group_size=128) == pos
    assert gpt_cost.moe_routing_bytes(1024, 8, 2, 128, 4, drop_policy="probs", group_size=128) == (
        pos[0] + 499_712, pos[1])


@pytest.mark.parametrize("policy,extra", [("priority", 323_584), ("probs", 499_712)])
def test_a_sorting_drop_policy_adds_its_sort_to_every_moe_layers_forward_and_position_stays_as_it_was(policy, extra):
    """On a GPU (routing at the memory bandwidth) the step grows by exactly the sort's bytes in every MoE layer's
    forward of every micro-batch: 1,024 tokens a rank (micro-batch 2 of 1,024 over tp 2), groups of 1,024 tokens
    (the sequence). Nothing else changes; the default policy predicts what the model without the key does."""
    system = as_system("dgx-a100-80g")
    dev = system.device
    base = planner_model(n_layer=8, n_embd=1024, n_head=16, experts=8, block_size=1024)
    lay, batch = Layout(tp=2, dp=4, ep=2, microbatch=2), 64
    m, n_moe = batch // (4 * 2 * 2), 4
    pos = predict(system, 16, GPT(**{**base.to_dict(), "drop_policy": "position"}), lay, batch)
    assert pos.step_time_s == predict(system, 16, base, lay, batch).step_time_s
    other = predict(system, 16, GPT(**{**base.to_dict(), "drop_policy": policy}), lay, batch)
    # (priority: one group of 1,024 tokens, 1,024 x 268 + 3 int64 passes over C = 2,048; probs: as at 128 a group)
    assert other.components_s["routing"] - pos.components_s["routing"] == pytest.approx(
        m * n_moe * extra / (dev.memory_bw * dev.memory_efficiency), rel=1e-9)
    for key in pos.components_s.keys() - {"routing"}:
        assert other.components_s[key] == pytest.approx(pos.components_s[key], rel=1e-12, abs=1e-15), key
