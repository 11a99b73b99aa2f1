"""The local (CPU) system's step terms that a profile of `podscale train` showed the planner missing or
mispricing (bench/plan_profile_step.py): offload to the CPU when the device is the CPU, collectives that an
overlap does not hide on busy cores, the optimizer's own rate, the gradient norm/clip/zero passes."""
import dataclasses
import tomllib

import pytest

from podscale.plan import predict
from podscale.plan.calibrate import overlap_exposed, system_toml
from podscale.plan.auto import as_trained
from podscale.plan.compute import attention_time
from podscale.plan.gpt_cost import (ADAM_BYTES_PER_PARAM, GRAD_ACCUMULATE_BYTES, GRAD_PASS_BYTES_REPLICATED,
                                    GRAD_PASS_BYTES_ZERO, GRAD_SCALE_BYTES, gradient_bookkeeping_bytes)
from podscale.plan.hardware import load_system, system_from_dict
from podscale.plan.layout import Layout
from podscale.plan.models import GPT
from podscale.plan.search import candidate_layouts

MODEL = GPT(layers=4, hidden=256, heads=8, seq=128, vocab=256)


def _local(attention=(), first_touch_bw=0.0, **sync) -> object:
    """A calibrated-CPU system from synthetic measurements (ring all-reduce 50 us + 2 GB/s)."""
    alpha, bw, n = 50e-6, 2e9, 2
    samples = [(s, 2 * (n - 1) * alpha + 2 * (n - 1) / n * s / bw) for s in (1 << 12, 1 << 16, 1 << 20, 1 << 24)]
    data = {"matmul": [[64, 64, 64, 1e10], [1024, 1024, 1024, 1e11]], "memory_bw": 1e10, "elementwise_bw": 4e9,
            "kernel_overhead": 5e-6, "allreduce": samples, "threads": 1, "nvme_bw": 1e9,
            "optimizer_bw": 8e9, "grad_pass_bw": 6e9, "attention": list(attention), "first_touch_bw": first_touch_bw,
            "sync": {"bytes": 1 << 19, "pair_s": 1.4e-3, "mm_s": 1.0e-3, "allreduce_s": 0.4e-3,
                     "overlapped_s": 1.0e-3, **sync}}
    return system_from_dict(tomllib.loads(system_toml(data, n, quick=True)))


def test_offload_to_the_cpu_is_not_searched_and_not_cheaper_when_the_device_is_the_cpu():
    """On a CPU system the optimizer state already lives in host memory: "offload to CPU" frees nothing,
    runs the same optimizer step and adds podscale's copy into the compute buffers. The auto-layout
    search ranked such layouts first when it priced them as a GPU's PCIe copy (BENCHMARKS, 1.75x)."""
    local = _local()
    assert local.device_is_host
    assert all(lay.offload_optimizer == "none" for lay in candidate_layouts(local, 2, MODEL, 16))
    gpu = load_system("dgx-a100-80g")
    assert any(lay.offload_optimizer == "cpu" for lay in candidate_layouts(gpu, 8, MODEL, 16))
    plain = predict(local, 2, MODEL, Layout(dp=2, microbatch=4, zero_stage=3), 16)
    off = predict(local, 2, MODEL, Layout(dp=2, microbatch=4, zero_stage=3, offload_optimizer="cpu"), 16)
    assert off.time_breakdown_s["optimizer"] == plain.time_breakdown_s["optimizer"] > 0
    assert off.step_time_s > plain.step_time_s
    assert off.memory_per_device_bytes >= plain.memory_per_device_bytes and off.host_memory_per_device_bytes == 0


def test_an_overlapped_collective_pays_the_measured_exposed_fraction():
    """dp's gradient all-reduce under the backward: hidden when overlap_exposed = 0 (as on a GPU), paid in full
    when the calibration measured that overlapping a bucket costs as much as running it after the matmuls."""
    s = {"bucket_bytes": 1 << 23, "bucket_allreduce_s": 4e-3, "bucket_mm_s": 10e-3}
    hidden, exposed = _local(**s, bucket_overlapped_s=9e-3), _local(**s, bucket_overlapped_s=14e-3)
    assert overlap_exposed({"sync": {**s, "bucket_overlapped_s": 14e-3}}) == pytest.approx(1.0)
    assert hidden.device.overlap_exposed == 0 and exposed.device.overlap_exposed == pytest.approx(1.0)
    lay = Layout(dp=2, microbatch=8)
    a = predict(hidden, 2, MODEL, lay, 16).time_breakdown_s["dp_communication"]
    b = predict(exposed, 2, MODEL, lay, 16).time_breakdown_s["dp_communication"]
    no_overlap = predict(exposed, 2, MODEL, dataclasses.replace(lay, overlap_grad_reduce=False), 16)
    assert a < b == pytest.approx(no_overlap.time_breakdown_s["dp_communication"])


def test_optimizer_and_gradient_passes_use_their_measured_rates():
    local = _local()
    params = MODEL.params
    rep = predict(local, 2, MODEL, Layout(dp=2, microbatch=8), 16).time_breakdown_s
    assert rep["optimizer"] == pytest.approx(ADAM_BYTES_PER_PARAM * params / 8e9, rel=1e-9)
    assert rep["grad_passes"] == pytest.approx(GRAD_PASS_BYTES_REPLICATED * params / 6e9, rel=1e-9)
    z2 = predict(local, 2, MODEL, Layout(dp=2, microbatch=8, zero_stage=2), 16).time_breakdown_s
    assert z2["grad_passes"] == pytest.approx(GRAD_PASS_BYTES_ZERO * params / 2 / 6e9, rel=1e-9)
    p = predict(local, 2, MODEL, Layout(dp=2, microbatch=8), 16)
    assert sum(p.components_s.values()) == pytest.approx(p.step_time_s, rel=1e-9)


def test_fused_attention_is_priced_from_its_measured_forward_and_backward_rates():
    """On a CPU, torch's fused attention runs far below the matmul rate (a profile: 2x the planner's GEMM-based
    term), so calibration measures the kernel by (sequence, head size); the planner interpolates in log
    space, an exact shape returning its own rates, and without a table falls back to GEMMs + softmax."""
    rows = [(64, 32, 4e9, 1e9), (128, 32, 8e9, 2e9), (128, 64, 16e9, 4e9), (256, 64, 32e9, 8e9)]
    local = _local(attention=rows)
    assert local.device.attention_table == tuple(tuple(float(x) for x in r) for r in rows)
    fwd, bwd = attention_time(local.device, 128, 32, 10)
    flops = 2 * 128 * 128 * 32 * 10
    assert fwd == pytest.approx(flops / 8e9) and bwd == pytest.approx(flops / 2e9)
    f_mid, _ = attention_time(local.device, 181, 45, 10)           # between measured shapes
    assert 2 * 181 * 181 * 45 * 10 / 32e9 < f_mid < 2 * 181 * 181 * 45 * 10 / 4e9
    assert attention_time(_local().device, 128, 32, 10) is None
    lay = as_trained(Layout(dp=2, microbatch=8))                 # MODEL: h 256, 8 heads of 32, seq 128
    with_table = predict(local, 2, MODEL, lay, 16).components_s["attention"]
    heads = 8 * 8                                                 # micro-batch x heads, per layer
    per_layer = sum(attention_time(local.device, 128, 32, heads))
    assert with_table == pytest.approx(MODEL.layers * per_layer, rel=1e-9)    # one micro-batch per rank
    assert with_table != pytest.approx(predict(_local(), 2, MODEL, lay, 16).components_s["attention"])


def test_podscale_trainer_pays_its_gradient_accumulation_and_scaling_passes():
    """Autograd adds every micro-batch's gradient into the buffer a strategy keeps (no fused accumulation
    as in Megatron-LM), data parallelism and ZeRO-1 divide it in place, ZeRO-2/3 copy it scaled into a
    staging bucket: passes over all the stage's gradients, priced at the measured gradient-pass rate. A GPU
    layout (accumulation fused) keeps its prediction; ZeRO-1, whose full gradient buffer is added into,
    divided and zeroed, now costs more than ZeRO-2 (as measured: bench/plan_local_vs_train.py)."""
    local = _local()
    params = MODEL.params

    def passes(**kw):
        lay = Layout(dp=2, microbatch=4, **kw)
        fused = predict(local, 2, MODEL, lay, 16).time_breakdown_s["grad_passes"]
        trained = predict(local, 2, MODEL, as_trained(lay), 16).time_breakdown_s["grad_passes"]
        return fused, trained
    m = 2                                                           # 16 / (dp 2 x micro-batch 4)
    f0, t0 = passes()
    assert t0 - f0 == pytest.approx((GRAD_ACCUMULATE_BYTES * m + GRAD_SCALE_BYTES) * params / 6e9, rel=1e-9)
    assert gradient_bookkeeping_bytes(Layout(tp=2, microbatch=4), 1) == 0     # one replica: autograd's own
    f1, t1 = passes(zero_stage=1)
    f2, t2 = passes(zero_stage=2)
    assert f1 == f2 and t1 > t2
    assert t2 - f2 == pytest.approx(GRAD_SCALE_BYTES * m * params / 6e9, rel=1e-9)


def test_zero_1_and_2_wait_for_the_parameter_all_gather_after_the_step():
    """ZeRO-1/2 reduce-scatter the gradients under the backward, but all-gather the updated parameters after
    the optimizer step, which the next forward waits for: that half of the traffic is exposed even where the
    backward hides the reduction (a GPU), so it orders ZeRO-0 ahead of ZeRO-1/2 when the rest is equal. ZeRO-2
    also pays a reduce-scatter for every micro-batch (ZeRO-1 accumulates and reduces once)."""
    from podscale.plan import network as net
    gpu = load_system("dgx-a100-80g")
    model = GPT(layers=8, hidden=1024, heads=16, seq=1024, vocab=32000)
    comm = {z: predict(gpu, 8, model, Layout(dp=8, microbatch=4, zero_stage=z), 64).time_breakdown_s["dp_communication"]
            for z in (0, 1, 2)}
    grad_bytes = 2 * (model.params)           # 16-bit gradients of the whole model, one stage
    gather = net.all_gather_time(gpu, grad_bytes, 8, 1)
    assert comm[2] > comm[1] > comm[0]
    # ZeRO-0 waits for its last bucket's all-reduce (1/layers of it), ZeRO-1/2 for the last bucket's
    # reduce-scatter plus the whole all-gather: the difference is the all-gather less its last-bucket share
    assert comm[1] - comm[0] == pytest.approx(gather * (1 - 1 / model.layers), rel=1e-6)
    # ZeRO-2 reduce-scatters every micro-batch's gradients (no full gradient buffer to accumulate in): with
    # m = 64 / (8 x 4) = 2 it waits for a second last bucket
    rs = net.reduce_scatter_time(gpu, grad_bytes, 8, 1)
    assert comm[2] - comm[1] == pytest.approx(rs / model.layers, rel=1e-6)
    # one micro-batch a step: one reduction, as ZeRO-1; a pipeline accumulates locally and reduces once
    one = {z: predict(gpu, 8, model, Layout(dp=8, microbatch=8, zero_stage=z), 64).time_breakdown_s[
        "dp_communication"] for z in (1, 2)}
    assert one[1] == one[2]


def test_zero3_on_a_cpu_faults_its_working_set_in_again_every_step():
    """ZeRO-3 on a CPU trims its heap at the end of every step (ZeroStrategy, hostmem.trim_heap), so the next
    step's activations and gathered blocks land in pages the OS faults in again: priced at the calibrated
    first-touch rate, for stage 3 only, and not at all where the rate was not measured."""
    measured, unmeasured = _local(first_touch_bw=2e9), _local()
    assert measured.device.first_touch_bw == pytest.approx(2e9)
    z3 = predict(measured, 2, MODEL, Layout(dp=2, microbatch=4, zero_stage=3), 16)
    mem = z3.memory_breakdown_bytes
    want = (mem["activations"] + mem["logits"] + mem["zero3_gathered"]) / 2e9
    assert want > 0 and z3.time_breakdown_s["first_touch"] == pytest.approx(want)
    assert z3.step_time_s == pytest.approx(sum(z3.time_breakdown_s.values()))
    plain = predict(unmeasured, 2, MODEL, Layout(dp=2, microbatch=4, zero_stage=3), 16)
    assert "first_touch" not in plain.time_breakdown_s
    assert z3.step_time_s - plain.step_time_s == pytest.approx(want)
    for stage in (0, 1, 2):
        assert "first_touch" not in predict(measured, 2, MODEL, Layout(dp=2, microbatch=4, zero_stage=stage),
                                            16).time_breakdown_s
