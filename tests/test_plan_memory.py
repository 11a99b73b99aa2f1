"""Memory formulas against hand-computed numbers: ZeRO paper, DeepSpeed's estimators, Korthikanti et al."""
import pytest

from podscale.plan import Layout, predict
from podscale.plan.memory import (activation_bytes_per_layer, deepspeed_zero2_estimate, deepspeed_zero3_estimate,
                                  pipeline_inflight_layers, zero_model_state_bytes)

P = 1_000_000_000


@pytest.mark.parametrize("stage,expected", [(0, 16e9), (1, 4e9 + 12e9 / 8), (2, 2e9 + 14e9 / 8), (3, 16e9 / 8)])
def test_zero_stages_partition_2_2_12_bytes(stage, expected):
    got = zero_model_state_bytes(P, dp=8, stage=stage)
    assert got.device == pytest.approx(expected)
    assert got.host == 0 and got.nvme == 0


def test_zero_offload_moves_optimizer_and_params():
    z2 = zero_model_state_bytes(P, dp=8, stage=2, offload_optimizer="cpu")
    assert z2.device == pytest.approx(2e9)            # fp16 parameters stay
    assert z2.host == pytest.approx(14e9 / 8)         # grads + Adam partition on CPU
    z3 = zero_model_state_bytes(P, dp=8, stage=3, offload_optimizer="nvme", offload_param="cpu")
    assert z3.device == pytest.approx(0.0)
    # on NVMe: the 12-byte Adam partition and the gradient shard, which ZeRO writes to the swap file in fp32
    # (the one ZeRO memory model, podscale.parallel.zero.memory; DeepSpeed's estimator also counts 4 bytes)
    assert z3.nvme == pytest.approx(16e9 / 8) and z3.host == pytest.approx(2e9 / 8)
    with pytest.raises(ValueError):
        zero_model_state_bytes(P, dp=8, stage=2, offload_param="cpu")


def test_planner_and_podscale_memory_share_one_zero_model():
    from podscale.parallel.zero.memory import estimate_model_states
    for stage in (0, 1, 2, 3):
        for prec in ("bf16", "fp32"):
            for opt in (("none",) if stage == 0 else ("none", "cpu", "nvme")):
                est = estimate_model_states(P, 8, stage, prec, opt)
                got = zero_model_state_bytes(P, 8, stage, opt, precision=prec)
                assert got.device == est.device_states
                assert got.total == pytest.approx(est.total_states)


def test_deepspeed_zero2_estimator():
    # gpu 4P + 16P/N, cpu 4P * gpus_per_node * 1.5; with offload gpu 2P, cpu max(4N, 16) P * 1.5
    assert deepspeed_zero2_estimate(P, 8, 1, cpu_offload=False) == (48_000_000_000, 6_000_000_000)
    assert deepspeed_zero2_estimate(P, 8, 1, cpu_offload=True) == (48_000_000_000, 2_000_000_000)
    assert deepspeed_zero2_estimate(P, 1, 1, cpu_offload=True) == (24_000_000_000, 2_000_000_000)


def test_deepspeed_zero3_estimator():
    big = 100_000_000
    assert deepspeed_zero3_estimate(P, big, 8, 2, cpu_offload=False) == (4_800_000_000, 1_525_000_000)
    assert deepspeed_zero3_estimate(P, big, 8, 2, cpu_offload=True, cpu_offload_params=True) == \
        (13_500_000_000, 400_000_000)
    assert deepspeed_zero3_estimate(P, big, 8, 2, cpu_offload=True, cpu_offload_params=False) == \
        (12_000_000_000, 400_000_000 + 125_000_000)


# GPT-3 175B layer, s=2048, b=1, h=12288, a=96, t=8 (Korthikanti et al. 2022, Table 2 formulas)
SBH = 2048 * 1 * 12288           # 25,165,824; 5as/h = 80
KW = dict(seq=2048, microbatch=1, hidden=12288, heads=96)


def test_korthikanti_activation_formulas():
    assert activation_bytes_per_layer(**KW) == pytest.approx(SBH * (34 + 80))
    assert activation_bytes_per_layer(**KW, tp=8) == pytest.approx(SBH * (10 + 24 / 8 + 80 / 8))
    assert activation_bytes_per_layer(**KW, tp=8, sequence_parallel=True) == pytest.approx(SBH * 114 / 8)
    assert activation_bytes_per_layer(**KW, tp=8, recompute="selective") == pytest.approx(SBH * (10 + 24 / 8))
    assert activation_bytes_per_layer(**KW, tp=8, sequence_parallel=True, recompute="selective") == \
        pytest.approx(SBH * 34 / 8)
    assert activation_bytes_per_layer(**KW, tp=8, recompute="full") == pytest.approx(2 * SBH)
    assert activation_bytes_per_layer(**KW) == pytest.approx(2_868_903_936)


def test_pipeline_inflight_activations():
    assert pipeline_inflight_layers(12, pp=8, microbatches=64, schedule="1f1b") == 12 * 8
    assert pipeline_inflight_layers(12, pp=8, microbatches=4, schedule="1f1b") == 12 * 4
    assert pipeline_inflight_layers(12, pp=8, microbatches=64, schedule="gpipe") == 12 * 64
    assert pipeline_inflight_layers(12, pp=8, microbatches=64, schedule="interleaved", interleave=2) == \
        pytest.approx(12 * 8 * (1 + 7 / 16))


def test_prediction_uses_the_formulas():
    # 18.4B model, tp8 pp1: model states = 16 bytes x params/8; activations = layers x Korthikanti + logits.
    lay = Layout(tp=8, pp=1, dp=4, microbatch=2, recompute="selective", sequence_parallel=True)
    p = predict("dgx-a100-80g", 32, "megatron-18b", lay, 64)
    from podscale.plan.models import PRESETS
    m = PRESETS["megatron-18b"]
    assert p.memory_breakdown_bytes["model_states"] == pytest.approx(16 * m.params / 8, rel=1e-9)
    per_layer = activation_bytes_per_layer(seq=2048, microbatch=2, hidden=6144, heads=48, tp=8,
                                           sequence_parallel=True, recompute="selective")
    assert p.memory_breakdown_bytes["activations"] == pytest.approx(40 * per_layer)
    z1 = predict("dgx-a100-80g", 32, "megatron-18b", Layout(**{**lay.to_dict(), "zero_stage": 1}), 64)
    assert z1.memory_breakdown_bytes["model_states"] == pytest.approx((4 + 12 / 4) * m.params / 8, rel=1e-9)


def test_nvme_optimizer_step_streams_under_the_forward_at_stage_3():
    """ZeRO-Infinity's optimizer traffic is exposed in full at stage 2; at stage 3 podscale streams it
    under the next forward, so only what exceeds the forward's compute is."""
    base = dict(tp=8, pp=1, dp=4, microbatch=2, offload_optimizer="nvme")
    p2 = predict("dgx-a100-80g", 32, "megatron-18b", Layout(**base, zero_stage=2), 64)
    p3 = predict("dgx-a100-80g", 32, "megatron-18b", Layout(**base, zero_stage=3), 64)
    t2, t3 = p2.time_breakdown_s, p3.time_breakdown_s
    assert t2["offload"] > t2["forward"] > 0  # NVMe-bound at this size: the forward hides part of it
    assert t3["offload"] == pytest.approx(t2["offload"] - t3["forward"])
