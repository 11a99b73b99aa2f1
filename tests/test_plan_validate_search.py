"""Narayanan et al. SC'21 Table 1 within the error goals; the search is fast and beats the published
GPT-3 175B layout by its own model."""
import dataclasses
import time

import pytest

from podscale.plan import predict, search
from podscale.plan import network as net
from podscale.plan.cli import main
from podscale.plan.search import candidate_layouts, published_gpt175b_layout
from podscale.plan.hardware import load_system
from podscale.plan.models import PRESETS
from podscale.plan.layout import Layout
from podscale.plan.validate import (MPT_RUNS, VALIDATED_WITHIN, TABLE1_LAYOUTS, best_error_by_system, leave_one_out, narayanan_flops, summary, table1, validation_runs,
                                   validation_set)


def test_table1_within_goals():
    rows = table1()
    assert len(rows) == 10
    mean, worst = summary(rows)
    assert mean <= 0.03, f"mean |error| {mean:.3f}"
    assert worst <= 0.08, f"max |error| {worst:.3f}"
    # one system for all rows: the same matmul efficiency everywhere
    assert {r.layout.recompute for r in rows} == {"full"}


def test_leave_one_out_on_the_fitting_set():
    """Fit the A100's one constant on nine Table 1 rows, predict the tenth; for every row."""
    loo = leave_one_out()
    assert len(loo) == 10
    mean, worst = summary([err for _, err in loo])
    assert mean <= 0.03 and worst <= 0.08, (mean, worst, loo)
    # the fitted constant does not hinge on any one row
    assert max(e for e, _ in loo) - min(e for e, _ in loo) <= 0.02


def test_validation_set_is_reported_separately_with_sources():
    rows = validation_set()
    assert len(rows) == len(validation_runs()) >= 10
    assert all(r.source and "20" in r.source for r in rows)          # every run cites its publication
    names = {r.name for r in rows}
    assert {"1T full recompute", "BLOOM 176B", "MT-NLG 530B, 2240 GPUs"} <= names
    assert all(r.name not in TABLE1_LAYOUTS for r in rows)
    # Korthikanti et al. 2022 on Selene, the same system as the fitting set: a regression guard at the level
    # reached without fitting to it (mean 3.8 %, max 7.7 % when this test was written)
    k = [r for r in rows if r.source.startswith("Korthikanti")]
    mean, worst = summary(k)
    assert mean <= 0.05 and worst <= 0.10, (mean, worst)
    # the 70-layer BLOOM on 12 stages predicts with the uneven split (+11.4 % when this test was written)
    bloom = next(r for r in rows if r.name == "BLOOM 176B")
    assert abs(bloom.error) <= 0.15


def test_table1_uses_the_published_configuration():
    for r in table1():
        tp, pp, gpus, batch, mb, per_virtual, published = TABLE1_LAYOUTS[r.name]
        assert (r.layout.tp, r.layout.pp, r.gpus, r.batch, r.layout.microbatch) == (tp, pp, gpus, batch, mb)
        if per_virtual:
            assert PRESETS[r.name].layers // (pp * r.layout.interleave) == per_virtual
    # Narayanan's FLOP formula; the parameter counts of Table 1 come out of our GPT description
    m = PRESETS["megatron-1t"]
    assert m.params / 1e9 == pytest.approx(1008, rel=0.005)
    assert PRESETS["megatron-18b"].params / 1e9 == pytest.approx(18.4, rel=0.005)
    assert narayanan_flops(PRESETS["gpt-175b"], 1) == pytest.approx(
        96 * 2048 * 96 * 12288**2 * (1 + 2048 / (6 * 12288) + 51200 / (16 * 96 * 12288)))


def test_validate_command_prints_the_table(capsys):
    assert main(["plan", "validate"]) == 0
    out = capsys.readouterr().out
    assert "megatron-530b" in out and "mean |error|" in out
    assert "leave-one-out" in out and "Validation set" in out and "Korthikanti et al. 2022: 8 runs on dgx-a100-80g" in out
    assert "systems not validated" in out and "cerebras-cs2" in out.split("systems not validated")[1]
    assert "tpu-v4-pod: best |error|" in out


def test_search_ranks_over_10k_layouts_in_5s_and_beats_the_published_gpt3_layout():
    # CPU seconds of this process: on a shared CI machine other jobs stretch wall time, not the work done
    start = time.process_time()
    result = search("dgx-a100-superpod", 1024, "gpt-175b", 1536, top=0)
    elapsed = time.process_time() - start
    assert result.evaluated >= 10_000
    assert elapsed <= 5.0
    assert result.ranked and all(p.fits for p in result.ranked)
    speeds = [p.tokens_per_s for p in result.ranked]
    assert speeds == sorted(speeds, reverse=True)
    published = predict("dgx-a100-superpod", 1024, "gpt-175b", published_gpt175b_layout(), 1536)
    assert published.fits
    # Narayanan et al. Sec. 5.1: 140 TFLOP/s per GPU, 34 days for 300B tokens at this layout
    assert published.tflops_per_device == pytest.approx(140, rel=0.08)
    assert published.days_to_train(300e9) == pytest.approx(34, rel=0.08)
    assert result.ranked[0].tokens_per_s >= published.tokens_per_s


def test_search_rejects_layouts_that_do_not_fit():
    result = search("dgx-a100-40g", 8, "megatron-7.5b", 64, top=0)
    assert result.rejected_memory > 0
    # one GPU's replica without ZeRO cannot hold 7.5B x 16 bytes on a 40 GB GPU
    assert not any(p.layout["tp"] * p.layout["pp"] == 1 and p.layout["zero_stage"] == 0 for p in result.ranked)
    assert any(p.layout["tp"] * p.layout["pp"] == 1 for p in result.ranked)   # ... but ZeRO-3 can


def test_candidates_respect_divisibility_and_system_rules():
    s = load_system("dgx-a100-80g")
    lays = list(candidate_layouts(s, 64, PRESETS["megatron-3.6b"], 512))
    assert lays and all(l.devices == 64 and 32 % l.tp == 0 and l.pp * l.interleave <= 30 for l in lays)
    assert any(30 % l.pp for l in lays)      # uneven pipelines (30 layers on 4, 8, 16 stages) are searched
    assert max(l.tp for l in lays) <= 8
    cs2 = list(candidate_layouts(load_system("cerebras-cs2"), 4, PRESETS["gpt-1.3b"], 256))
    assert cs2 and all((l.tp, l.pp) == (1, 1) for l in cs2)


@pytest.mark.parametrize("system,devices,model,batch", [
    ("tpu-v3-pod", 64, "gpt-1.3b", 256), ("cerebras-cs2", 4, "gpt-1.3b", 256),
    ("dgx-a100-80g", 16, "moe-1.3b-64e", 128), ("dgx-a100-80g", 8, "dlrm-mlperf", 65536)])
def test_search_on_every_kind_of_system_and_model(system, devices, model, batch):
    result = search(system, devices, model, batch, top=5)
    assert result.ranked, result.notes
    best = result.ranked[0]
    assert best.fits and best.step_time_s > 0 and 0 < best.mfu < 1


def test_other_systems_are_validated_only_within_the_stated_error():
    """TPU v4 (PaLM), H100 (MosaicML's MPT runs): a system's TOML carries a ``validated`` list exactly when one
    of its published runs is predicted within VALIDATED_WITHIN; systems without such a run stay flagged."""
    rows = validation_set()
    best = best_error_by_system(rows)
    assert {"tpu-v4-pod", "dgx-h100", "dgx-a100-80g", "dgx-a100-40g", "jean-zay-a100"} <= set(best)
    for name, err in best.items():
        assert bool(load_system(name).validated) == (err <= VALIDATED_WITHIN), (name, err)
    palm = next(r for r in rows if r.name.startswith("PaLM"))
    assert palm.system == "tpu-v4-pod [12x16x16]" and palm.layout.parallel_block
    assert palm.params_b == pytest.approx(540.35, rel=0.001)          # PaLM's published parameter count
    # PaLM's published MFU turned into seconds per 2048-sequence batch: 46.2 % of 6144 x 275 TFLOP/s
    assert palm.published * 0.462 * 6144 * 275e12 == pytest.approx(
        2048 * 2048 * (6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048))
    mpt = [r for r in rows if r.name.startswith("MPT")]
    assert len(mpt) == sum(map(len, MPT_RUNS.values())) and {r.system for r in mpt} == set(MPT_RUNS)
    for r in mpt:           # the published configuration: FSDP full shard over every GPU
        assert (r.layout.zero_stage, r.layout.dp, r.gpus) == (3, r.gpus, r.gpus) and r.layout.fused_attention
    # never validated without a run: the CS-2 and TPU v3 have none
    assert not load_system("cerebras-cs2").validated and not load_system("tpu-v3-pod").validated
    notes = predict("dgx-h100", 8, "gpt-1.3b", {"tp": 1, "pp": 1, "dp": 8, "microbatch": 4}, 32).notes
    assert any("not validated" in n for n in notes)
    assert not any("not validated" in n for n in
                   predict("tpu-v4-pod", 64, "gpt-1.3b", {"tp": 1, "pp": 1, "dp": 64, "microbatch": 1}, 64).notes)


def test_parallel_block_halves_the_tensor_parallel_collectives():
    """PaLM's parallel formulation: one tp collective per layer and pass instead of Megatron's two (the
    vocabulary-parallel embedding's all-reduce, once a micro-batch, is not a layer's)."""
    model = PRESETS["gpt-13b"]
    base = dict(tp=8, dp=1, microbatch=1, recompute="full")
    seq = predict("dgx-a100-80g", 8, model, Layout(**base), 8).time_breakdown_s
    par = predict("dgx-a100-80g", 8, model, Layout(**base, parallel_block=True), 8).time_breakdown_s
    embedding = 8 * net.all_reduce_time(load_system("dgx-a100-80g"), 2 * model.seq * model.hidden, 8, 1)   # 8 micro-batches
    assert par["tp_communication"] - embedding == pytest.approx((seq["tp_communication"] - embedding) / 2, rel=1e-9)
    assert par["forward"] == seq["forward"]
    # MoE all-to-alls do not depend on it
    moe = PRESETS["moe-1.3b-64e"]
    lay = dict(tp=1, dp=1, ep=8, microbatch=1)
    a = predict("dgx-a100-80g", 8, moe, Layout(**lay), 8).time_breakdown_s["ep_communication"]
    b = predict("dgx-a100-80g", 8, moe, Layout(**lay, parallel_block=True), 8).time_breakdown_s["ep_communication"]
    assert a == b > 0


def test_every_published_run_fits_in_the_modelled_memory():
    """The published runs ran, so the memory model must not call them impossible. MPT 13B on 128 A100-40GB
    (micro-batch 16, full recompute, FlashAttention) was "45.2 GiB of 40" while the layer re-materialised in
    the backward was counted with its s x s attention tensors, which a fused attention kernel never keeps."""
    for name, model, sysname, lay, gpus, batch, *_ in validation_runs():
        system = load_system(sysname) if isinstance(sysname, str) else \
            dataclasses.replace(load_system(sysname[0]), **sysname[1])
        p = predict(system, gpus, model, lay, batch)
        assert p.memory_per_device_bytes <= p.memory_capacity_bytes, (name, p.memory_per_device_bytes / 2**30)
