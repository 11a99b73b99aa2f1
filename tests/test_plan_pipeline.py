"""Uneven pipelines: layers that do not divide the stages predict, with the trainer's own split."""
import json

import pytest
import torch

from podscale.models.gpt import GPT as TrainGPT, GPTConfig
from podscale.parallel.pipeline.partition import stage_layers
from podscale.plan import Layout, predict
from podscale.plan.cli import main
from podscale.plan.models import GPT
from podscale.parallel.pipeline import schedule as schedule_module
from podscale.parallel.pipeline.schedule import schedule_actions, simulate
from podscale.plan import network as net
from podscale.plan.hardware import load_system
from podscale.plan import stages
from podscale.plan.stages import pipeline_chunks, pipeline_message_time


@pytest.mark.parametrize("layers,chunks", [(70, 12), (24, 5), (30, 4), (13, 6), (24, 4)])
def test_planner_splits_layers_as_the_trainer_does(layers, chunks):
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=layers, n_head=4, n_embd=64)
    with torch.device("meta"):
        trainer_model = TrainGPT(cfg)
    trainer = [len(g) for g in stage_layers(trainer_model, chunks)]
    plan_model = GPT(layers=layers, hidden=64, heads=4, seq=128, vocab=256)
    assert list(pipeline_chunks(plan_model, Layout(pp=chunks, dp=1, microbatch=1))) == trainer


def test_70_layers_on_12_stages_predicts_and_the_slowest_stage_sets_the_pace():
    # BLOOM's shape (Le Scao et al. 2022): 70 layers, hidden 14336, 112 heads, tp 4 x pp 12 x dp 8
    bloom = GPT(layers=70, hidden=14336, heads=112, seq=2048, vocab=250880, name="bloom")
    lay = Layout(tp=4, pp=12, dp=8, microbatch=2, recompute="full")
    p = predict("dgx-a100-80g", 384, bloom, lay, 2048)
    split = p.layout["pipeline_layers"]
    assert sum(split) == 70 and len(split) == 12 and len(set(split)) > 1
    # the embedding (250880 x 14336 = 3.6B parameters, ~1.5 layers) leaves the end stages fewer layers
    assert split[0] < max(split) and split[-1] < max(split)
    # an even-as-possible split that ignores the embedding is slower: its end stage sets the pace
    naive = Layout(tp=4, pp=12, dp=8, microbatch=2, recompute="full", pipeline_layers=(6,) * 10 + (5, 5))
    q = predict("dgx-a100-80g", 384, bloom, naive, 2048)
    assert q.step_time_s > p.step_time_s


def test_uneven_stage_bubble_reduces_to_the_even_formula():
    model = GPT(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200)
    even = predict("dgx-a100-80g", 32, model, Layout(tp=8, pp=4, dp=1, microbatch=1,
                                                     pipeline_layers=(6, 6, 6, 6)), 32)
    t = even.time_breakdown_s
    per_mb = (sum(v for k, v in t.items() if k not in ("pipeline_bubble", "dp_communication", "optimizer",
                                                      "grad_passes", "offload", "pp_p2p")) / 32)
    head = t["output_layer"] / 32
    # fill and drain: the three other ranks' micro-batch time, which lacks the output layer, the first rank's with
    # its vocabulary-parallel embedding's all-reduce (bf16 activations of one micro-batch over tp 8)
    embedding = net.all_reduce_time(load_system("dgx-a100-80g"), 2 * 2048 * 2048, 8, 1)
    assert t["pipeline_bubble"] == pytest.approx(3 * (per_mb - head) + embedding, rel=1e-9)


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_pipeline_messages_are_priced_as_the_schedule_simulator_runs_them(p):
    # equal stages, every message msg seconds, sent asynchronously: the planner's fill, drain and messages
    # against the runtime's schedule simulator, for every micro-batch count up to 3p + 1
    for m in range(1, 3 * p + 2):
        for t_f, t_b in ((1.0, 2.0), (1.0, 1.0), (2.0, 3.0)):
            for msg in (0.05, 0.7, 3.0, 10.0):
                for schedule in ("gpipe", "1f1b"):
                    sim = simulate(schedule_actions(schedule, p, m), 1, t_f, t_b, t_msg=msg)["makespan"]
                    priced = (m + p - 1) * (t_f + t_b) + pipeline_message_time(schedule, p, m, 1, msg)
                    assert priced == pytest.approx(sim, rel=1e-12), (schedule, m, t_f, t_b, msg)


@pytest.mark.parametrize("p", range(2, 9))
def test_interleaved_messages_are_priced_as_the_schedule_simulator_runs_them(p):
    # chunks of t_f, t_b per micro-batch; messages from larger than a chunk (stalls in the steady state) to
    # small (only the fill and drain's 2 (p v - 1) exposed). Descending msg (ascending chunk / msg ratios)
    # also exercises the answers taken from a ratio already found without stalls.
    regimes = set()
    for v in (2, 3, 4):
        for m in range(p, 4 * p + 1, p):
            for t_f, t_b in ((0.5, 1.0), (1.0, 1.0), (0.25, 1.0), (0.3, 0.9)):
                # without messages: (m v + p - 1)(t_f + t_b), which the no-stall answers rest on
                ideal = simulate(schedule_actions("interleaved", p, m, v), v, t_f, t_b)["makespan"]
                assert ideal == pytest.approx((m * v + p - 1) * (t_f + t_b), rel=1e-12)
                for msg in (10.0, 3.0, 1.0, 0.4, 0.1, 0.02):
                    sim = simulate(schedule_actions("interleaved", p, m, v), v, t_f, t_b, t_msg=msg)["makespan"]
                    exposed = pipeline_message_time("interleaved", p, m, v, msg, t_f=t_f, t_b=t_b)
                    assert (m * v + p - 1) * (t_f + t_b) + exposed == pytest.approx(sim, rel=1e-9), \
                        (v, m, t_f, t_b, msg)
                    fill_drain = 2 * (p * v - 1) * msg
                    assert exposed >= fill_drain * (1 - 1e-9)
                    regimes.add(exposed > fill_drain * (1 + 1e-9))
                    assert exposed <= 2 * msg * (m * v + p - 1) * (1 + 1e-9)   # every message on the path
    assert regimes == {True, False}      # both: messages hidden, and steady-state stalls


def test_interleaved_messages_hide_under_the_other_chunks_work():
    # p = 4, m = 16, v = 2, chunks of 0.5 + 1: small messages expose the fill and drain's 2 (p v - 1) only,
    # large ones stall the steady state; every message on the critical path would be 2 msg (m v + p - 1)
    assert pipeline_message_time("interleaved", 4, 16, 2, 0.05, t_f=0.5, t_b=1.0) == pytest.approx(0.7)
    assert pipeline_message_time("interleaved", 4, 16, 2, 1.0, t_f=0.5, t_b=1.0) == pytest.approx(23.0)
    with pytest.raises(ValueError, match="chunk times"):
        pipeline_message_time("interleaved", 4, 16, 2, 1.0)


def test_interleaved_ratios_between_two_without_stalls_are_answered_without_simulating(monkeypatch):
    # the chunk / message ratios that stall nothing form a convex region closed upwards (stages._hidden):
    # a point above the segment between two such, dominating neither, is answered without simulating
    p, m, v = 3, 6, 2
    fill_drain = 2 * (p * v - 1)
    for t_f, t_b in ((4.0, 16.0), (16.0, 4.0)):
        assert pipeline_message_time("interleaved", p, m, v, 1.0, t_f=t_f, t_b=t_b) == pytest.approx(fill_drain)
    calls = []
    monkeypatch.setattr(schedule_module, "simulate_schedule", lambda *a, **k: calls.append(a))
    exposed = pipeline_message_time("interleaved", p, m, v, 1.0, t_f=10.5, t_b=10.0)
    assert not calls and exposed == fill_drain
    sim = simulate(schedule_actions("interleaved", p, m, v), v, 10.5, 10.0, t_msg=1.0)["makespan"]
    assert (m * v + p - 1) * 20.5 + exposed == pytest.approx(sim, rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_interleaved_messages_of_many_micro_batches_extrapolate_the_steady_state(p):
    # Beyond 2 STEADY_ROUNDS - 2 rounds (p micro-batches each) the exposure is extrapolated over whole periods
    # of two rounds. In this grid it is exact wherever a message is no longer than a chunk's forward and
    # backward: the messages hide (only the fill and drain are exposed, whatever m) or the steady state repeats
    # every two rounds. Longer messages can give the steady state a longer period (2p - 1 rounds where we
    # looked), and the last two rounds' increment then differs from the long-run average: TOLERANCE, 5 % of the
    # makespan, holds the largest deviation in this grid (4.8 %, p = 2, chunks of 1 + 1, messages of 3), an
    # over-estimate of a pipeline whose messages outlast its chunks.
    TOLERANCE = 0.05
    m = 16 * p
    assert m // p > 2 * stages.STEADY_ROUNDS - 2
    for v in (2, 4):
        for t_f, t_b in ((0.5, 1.0), (1.0, 3.0), (1.0, 1.0)):
            for msg in (0.05, 0.3, 1.0, 3.0):
                sim = simulate(schedule_actions("interleaved", p, m, v), v, t_f, t_b, t_msg=msg)["makespan"]
                priced = (m * v + p - 1) * (t_f + t_b) + pipeline_message_time("interleaved", p, m, v, msg,
                                                                               t_f=t_f, t_b=t_b)
                exact = msg <= t_f + t_b
                assert priced == pytest.approx(sim, rel=1e-9 if exact else TOLERANCE), (v, t_f, t_b, msg)


def test_the_planner_adds_a_pipelines_messages_as_its_schedule_exposes_them():
    model = GPT(layers=24, hidden=2048, heads=16, seq=2048, vocab=51200)
    # pp across nodes (tp fills a node), 16 micro-batches
    system = load_system("dgx-a100-80g")
    msg = net.p2p_time(system, 2 * 2048 * 2048 / 8, 8)   # bf16, Megatron's scatter-gather: 1/tp a rank
    for schedule in ("gpipe", "1f1b"):
        lay = Layout(tp=8, pp=4, dp=1, microbatch=1, schedule=schedule)
        pred = predict("dgx-a100-80g", 32, model, lay, 16)
        assert pred.time_breakdown_s["pp_p2p"] == pytest.approx(pipeline_message_time(schedule, 4, 16, 1, msg))
    # 1F1B: 2 msg (m + p - 3 - floor((m - 2) / p)) = 2 msg x 14, not both sends of every micro-batch (2 msg x 19)
    assert pipeline_message_time("1f1b", 4, 16, 1, 1.0) == 28.0
    # interleaved, v = 2: the messages hide under the other chunks' work, only the fill and drain's across the
    # p v - 1 boundaries are exposed (every message on the critical path would be 2 msg (m v + p - 1))
    pred = predict("dgx-a100-80g", 32, model, Layout(tp=8, pp=4, dp=1, microbatch=1, interleave=2), 16)
    assert pred.time_breakdown_s["pp_p2p"] == pytest.approx(2 * (4 * 2 - 1) * msg, rel=1e-9)


def test_plan_predict_accepts_pipeline_layers(capsys):
    model = json.dumps({"layers": 70, "hidden": 4096, "heads": 32, "seq": 2048, "vocab": 51200})
    args = ["plan", "predict", "--system", "dgx-a100-80g", "--devices", "96", "--batch", "96", "--model", model,
            "--json", "--layout"]
    split = [5] + [6] * 10 + [5]
    assert main(args + [json.dumps({"tp": 8, "pp": 12, "dp": 1, "microbatch": 1, "pipeline_layers": split})]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["layout"]["pipeline_layers"] == split and d["step_time_s"] > 0
    assert main(args + [json.dumps({"tp": 8, "pp": 12, "dp": 1, "microbatch": 1, "pipeline_layers": [6] * 12})]) == 2
    assert "summing to the model's 70 layers" in capsys.readouterr().err


def test_cerebras_cs2_is_modelled_as_weight_streaming():
    """A CS-2 holds no model states: weights and Adam state live in MemoryX, stream in layer by layer (twice
    per micro-batch) and gradients stream out; larger micro-batches amortise the stream."""
    from podscale.plan import search
    from podscale.plan.hardware import load_system
    from podscale.plan.models import PRESETS
    cs2, model = load_system("cerebras-cs2"), PRESETS["gpt-1.3b"]
    small = predict(cs2, 16, model, Layout(dp=16, microbatch=1, recompute="full"), 1024)
    big = predict(cs2, 16, model, Layout(dp=16, microbatch=16, recompute="full"), 1024)
    assert small.memory_breakdown_bytes["model_states"] == 0 and small.host_memory_per_device_bytes > 0
    ws_small = small.time_breakdown_s["weight_streaming"]
    # per micro-batch every layer streams 3 x 2 bytes per parameter over the wafer's I/O, hidden by compute
    per_layer = 3 * 2 * model.layer_params() / cs2.stream.effective
    assert ws_small > 0 and ws_small <= 64 * (model.layers * per_layer + 3 * 2 * model.vocab * model.hidden
                                             / cs2.stream.effective)
    assert big.time_breakdown_s["weight_streaming"] < ws_small and big.step_time_s < small.step_time_s
    assert big.memory_breakdown_bytes["activations"] > small.memory_breakdown_bytes["activations"]
    best = search(cs2, 16, model, 1024, top=1).ranked[0]
    assert best.layout["tp"] == best.layout["pp"] == 1 and best.mfu > 0.2
    assert any("not validated" in n for n in best.notes)


def test_fused_attention_drops_the_score_matrix_traffic_and_memory():
    """FlashAttention / SDPA (what podscale's GPT runs): no s x s softmax and dropout passes and no s x s
    activations kept; Megatron's unfused attention (the validation runs) keeps both."""
    model = GPT(layers=24, hidden=1024, heads=16, seq=1024, vocab=256)
    plain = predict("dgx-h100", 1, model, Layout(microbatch=8), 8)
    fused = predict("dgx-h100", 1, model, Layout(microbatch=8, fused_attention=True), 8)
    assert fused.step_time_s < plain.step_time_s
    assert fused.memory_breakdown_bytes["activations"] < plain.memory_breakdown_bytes["activations"]
    sel = predict("dgx-h100", 1, model, Layout(microbatch=8, recompute="selective"), 8)
    assert fused.memory_breakdown_bytes["activations"] == pytest.approx(sel.memory_breakdown_bytes["activations"])


def _reference_partition(costs, parts):
    """The plain O(parts n^2) dynamic program: smallest largest group, earliest cut among equals."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i] - 1e-12:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def test_fast_partition_equals_the_plain_dynamic_program():
    import random
    from podscale.parallel.pipeline.partition import contiguous_partition
    from podscale.plan.stages import layer_param_costs
    rng = random.Random(1)
    cases = [([1.0] * n, p) for n in (7, 24, 70, 96) for p in (1, 2, 3, 5, 12, n) if p <= n]
    cases += [([rng.choice((1.0, 2.0, 3.0)) for _ in range(n)], p) for n in (10, 33) for p in (2, 4, 7)]
    cases += [([rng.random() for _ in range(n)], p) for n in (13, 40) for p in (3, 6, 11)]
    for layers, hidden, vocab in ((96, 12288, 51200), (70, 14336, 250880), (24, 2304, 51200), (30, 3072, 51200)):
        costs = layer_param_costs(GPT(layers=layers, hidden=hidden, heads=16, seq=2048, vocab=vocab))
        cases += [(costs, p) for p in (2, 3, 4, 5, 8, 12, 16, 24) if p <= layers]
    for costs, parts in cases:
        assert contiguous_partition(costs, parts) == _reference_partition(costs, parts), (len(costs), parts)
