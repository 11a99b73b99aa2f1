"""`podscale plan predict ... --json` (the stable interface), its errors, and the other sub-commands."""
import json
import subprocess
import sys

import pytest

from podscale.plan.cli import main

MODEL = json.dumps({"layers": 24, "hidden": 2304, "heads": 24, "seq": 2048, "vocab": 51200})


def _predict(capsys, layout, system="dgx-a100-80g", devices=32, batch=512, model=MODEL):
    code = main(["plan", "predict", "--system", system, "--devices", str(devices), "--batch", str(batch),
                 "--model", model, "--layout", json.dumps(layout) if isinstance(layout, dict) else layout, "--json"])
    out, err = capsys.readouterr()
    return code, out, err


def test_predict_json_has_the_stable_keys(capsys):
    code, out, err = _predict(capsys, {"tp": 1, "pp": 1, "dp": 32, "microbatch": 16, "recompute": "full"})
    assert code == 0, err
    d = json.loads(out)
    for key in ("step_time_s", "tflops_per_device", "mfu", "memory_per_device_bytes", "tokens_per_s",
                "days_to_train", "time_breakdown_s", "memory_breakdown_bytes"):
        assert key in d
    assert sum(d["time_breakdown_s"].values()) == pytest.approx(d["step_time_s"])
    assert 0 < d["mfu"] < 1 and d["memory_per_device_bytes"] > 0
    assert d["tokens_per_s"] == pytest.approx(512 * 2048 / d["step_time_s"])
    # Table 1 row 1 at the published layout: within 8% of 137 TFLOP/s (with recompute).
    assert d["tflops_per_device"] == pytest.approx(137, rel=0.08)


def test_predict_optional_fields_change_the_answer(capsys):
    base = {"tp": 8, "pp": 4, "dp": 1, "microbatch": 1}
    model = json.dumps({"layers": 48, "hidden": 8192, "heads": 64, "seq": 2048, "vocab": 51200})
    runs = {}
    for name, extra in {"plain": {}, "full": {"recompute": "full"}, "sp": {"sequence_parallel": True},
                        "v2": {"interleave": 2}, "z1": {"zero_stage": 1}}.items():
        code, out, err = _predict(capsys, {**base, **extra}, devices=32, batch=64, model=model)
        assert code == 0, err
        runs[name] = json.loads(out)
    assert runs["full"]["step_time_s"] > runs["plain"]["step_time_s"]                 # recompute costs time
    assert runs["full"]["memory_per_device_bytes"] < runs["plain"]["memory_per_device_bytes"]
    assert runs["sp"]["memory_per_device_bytes"] < runs["plain"]["memory_per_device_bytes"]
    assert runs["v2"]["time_breakdown_s"]["pipeline_bubble"] == \
        pytest.approx(runs["plain"]["time_breakdown_s"]["pipeline_bubble"] / 2, rel=0.05)
    # dp = 1: ZeRO-1 has nothing to shard, so neither the model states nor the total change
    assert runs["z1"]["memory_per_device_bytes"] == pytest.approx(runs["plain"]["memory_per_device_bytes"])
    assert runs["z1"]["memory_breakdown_bytes"]["model_states"] == \
        pytest.approx(runs["plain"]["memory_breakdown_bytes"]["model_states"])
    # dp = 4: ZeRO-1 shards the optimizer states; the total falls by exactly what the model states lose
    dp4 = {}
    for name, extra in {"plain": {}, "z1": {"zero_stage": 1}}.items():
        code, out, err = _predict(capsys, {**base, "pp": 1, "dp": 4, **extra}, devices=32, batch=64, model=model)
        assert code == 0, err
        dp4[name] = json.loads(out)
    saved = dp4["plain"]["memory_breakdown_bytes"]["model_states"] - dp4["z1"]["memory_breakdown_bytes"]["model_states"]
    # (mixed precision: 16 bytes per parameter, 12 of them optimizer states, of which dp-1 = 3 quarters go)
    assert saved == pytest.approx(dp4["plain"]["memory_breakdown_bytes"]["model_states"] * 12 / 16 * 3 / 4)
    assert dp4["plain"]["memory_per_device_bytes"] - dp4["z1"]["memory_per_device_bytes"] == pytest.approx(saved)


def test_zero_on_a_pipeline_holds_the_stage_gradient_and_reduces_once(capsys):
    """ZeRO-2/3 on a pipeline accumulate the stage's full 16-bit gradient over the micro-batches and
    reduce-scatter it once per step; without a pipeline, ZeRO-3 reduce-scatters after every micro-batch."""
    runs = {}
    even = {"pipeline_layers": [6, 6, 6, 6]}   # Megatron's even split (the trainer's default balances parameters)
    for name, lay in {"pp-z1": {"pp": 4, "dp": 8, "zero_stage": 1, **even},
                      "pp-z2": {"pp": 4, "dp": 8, "zero_stage": 2, **even},
                      "pp-z3": {"pp": 4, "dp": 8, "zero_stage": 3, **even},
                      "z3": {"pp": 1, "dp": 32, "zero_stage": 3}}.items():
        code, out, err = _predict(capsys, {"tp": 1, "microbatch": 1, **lay})
        assert code == 0, err
        runs[name] = json.loads(out)
    mem = {k: r["memory_breakdown_bytes"] for k, r in runs.items()}
    assert mem["pp-z1"]["pipeline_grads"] == 0 and mem["z3"]["pipeline_grads"] == 0
    held = mem["pp-z2"]["pipeline_grads"]
    assert held > 0 and mem["pp-z3"]["pipeline_grads"] == pytest.approx(held)
    # 2 bytes per parameter of an end stage (6 of 24 layers of 12 h^2, the word embedding), less the partition
    h = 2304
    assert held == pytest.approx(2 * (6 * 12 * h * h + 51200 * h) * (1 - 1 / 8), rel=0.02)


@pytest.mark.parametrize("args,message", [
    (dict(system="dgx-z9"), "unknown system 'dgx-z9'"),
    (dict(layout={"tp": 5, "pp": 1, "dp": 32, "microbatch": 16}, devices=160), "does not divide the 24 attention heads"),
    (dict(layout={"tp": 2, "pp": 1, "dp": 32, "microbatch": 16}), "but --devices is 32"),
    (dict(layout={"tp": 1, "pp": 5, "dp": 32, "microbatch": 1, "pipeline_layers": [5, 5, 5, 5, 5]}, devices=160),
     "must give 5 positive block counts .* summing to the model's 24 layers"),
    (dict(layout={"tp": 1, "pp": 25, "dp": 32, "microbatch": 1}, devices=800, batch=512), "cannot fill 25 pipeline"),
    (dict(layout={"tp": 1, "pp": 1, "dp": 32, "microbatch": 3}), "not a multiple of dp\\*ep\\*microbatch"),
    (dict(layout={"tp": 1, "pp": 1, "dp": 32}), "lacks keys \\['microbatch'\\]"),
    (dict(layout={"tp": 1, "pp": 1, "dp": 32, "microbatch": 1, "recompute": "some"}), "recompute must be one of"),
    (dict(layout="{tp: 1}"), "--layout is not valid JSON"),
    (dict(model='{"layers": 24}'), "model lacks keys"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "dropless": true, "dropless_peak_load": 0.5}'),
     "dropless_peak_load must be a finite number >= 1"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "capacity_factor": 0}'), "capacity_factor must be a finite number > 0"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "capacity_factor": "1.5"}'), "capacity_factor must be a finite number"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "capacity_factor": 1e400}'), "capacity_factor must be a finite number"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "moe_every": 0}'), "'moe_every' must be an integer >= 1, got 0"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "moe_every": 25}'), "moe_every 25 exceeds layers 24"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "top_k": 0}'), "'top_k' must be an integer >= 1, got 0"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "top_k": 9}'), "top_k 9 exceeds experts 8"),
    (dict(model=MODEL[:-1] + ', "experts": -4}'), "'experts' must be an integer >= 1, got -4"),
    (dict(model=MODEL[:-1] + ', "experts": 8.5}'), "'experts' must be an integer >= 1, got 8.5"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "dropless": "no"}'), "'dropless' must be true or false, got 'no'"),
    (dict(layout={"tp": 1, "pp": 1, "dp": 32, "microbatch": 16, "overlap_grad_reduce": "false"}),
     "layout 'overlap_grad_reduce' must be true or false, got 'false'"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "ffn": -5}'), "'ffn' must be an integer >= 0 \\(0: 4 x hidden\\)"),
    (dict(model=MODEL[:-1] + ', "shared_experts": 1}'),
     "'shared_experts'=1 needs an MoE model: set experts > 1, or shared_experts: 0"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "shared_experts": -1}'), "'shared_experts' must be an integer >= 0"),
    (dict(model=MODEL[:-1] + ', "experts": 8, "shared_experts": 1.5}'), "'shared_experts' must be an integer >= 0"),
    (dict(devices=1200, layout={"tp": 1, "pp": 1, "dp": 1200, "microbatch": 1}, batch=1200,
          system="dgx-a100-superpod"), "at most 1120 devices"),
    (dict(system="cerebras-cs2", devices=4, layout={"tp": 2, "pp": 1, "dp": 2, "microbatch": 1}),
     "data parallelism only"),
])
def test_predict_errors_exit_2_with_one_line(capsys, args, message):
    layout = args.pop("layout", {"tp": 1, "pp": 1, "dp": args.get("devices", 32), "microbatch": 16})
    code, out, err = _predict(capsys, layout, **args)
    assert code == 2
    assert out == ""
    assert err.startswith("podscale: error: ") and err.count("\n") == 1
    import re
    assert re.search(message, err), err


def test_python_dash_m_entry_point(capsys):
    cmd = [sys.executable, "-m", "podscale.plan", "predict", "--system", "dgx-a100-80g", "--devices", "8",
           "--batch", "8", "--model", MODEL, "--layout", '{"tp":8,"pp":1,"dp":1,"microbatch":1}', "--json"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["step_time_s"] > 0
    # the refused command through the entry point that `python -m podscale.plan` calls (podscale/plan/__main__.py
    # exits with main()'s code), in this process: an interpreter start less
    capsys.readouterr()
    code = main(cmd[3:5] + ["nope"] + cmd[6:])
    assert code == 2 and capsys.readouterr().err.startswith("podscale: error: unknown system")


def test_systems_models_and_search_commands(capsys, tmp_path):
    assert main(["plan", "systems"]) == 0
    assert "dgx-a100-superpod" in capsys.readouterr().out
    assert main(["plan", "models"]) == 0
    out = capsys.readouterr().out
    assert "megatron-1t" in out and "gpt-175b" in out and "dlrm-mlperf" in out
    js, png = tmp_path / "top.json", tmp_path / "chart.png"
    assert main(["plan", "--model", "megatron-7.5b", "--system", "dgx-a100-80g", "--devices", "64",
                 "--batch", "512", "--top", "3", "--json", str(js), "--chart", str(png)]) == 0
    data = json.loads(js.read_text())
    assert len(data["layouts"]) == 3 and data["evaluated"] > 100
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["plan", "--model", "no-such-model", "--system", "dgx-a100-80g", "--devices", "8",
                 "--batch", "8"]) == 2
    assert "unknown model 'no-such-model'; presets: megatron-1.7b" in capsys.readouterr().err


def test_other_models_and_systems_predict():
    from podscale.plan import predict
    moe = predict("dgx-a100-80g", 64, "moe-1.3b-64e", {"tp": 1, "pp": 1, "dp": 8, "ep": 8, "microbatch": 1}, 512)
    assert moe.time_breakdown_s["ep_communication"] > 0
    dlrm = predict("dgx-a100-80g", 8, "dlrm-mlperf", {"tp": 1, "pp": 1, "dp": 8, "microbatch": 8192}, 65536)
    assert dlrm.fits and dlrm.time_breakdown_s["all_to_all"] > 0
    tpu = predict("tpu-v4-pod", 256, "gpt-13b", {"tp": 4, "pp": 1, "dp": 64, "microbatch": 2,
                                                 "recompute": "selective"}, 512)
    assert tpu.step_time_s > 0 and tpu.time_breakdown_s["tp_communication"] > 0
    cs2 = predict("cerebras-cs2", 4, "gpt-1.3b", {"tp": 1, "pp": 1, "dp": 4, "microbatch": 2}, 256)
    assert cs2.fits and cs2.time_breakdown_s["tp_communication"] == 0


def test_the_moe_exchange_is_priced_less_the_own_rows_it_overlaps(monkeypatch):
    """An expert-parallel MoE layer runs a rank's own rows (1/ep of its experts' work, in two halves) while
    each of its all-to-alls is in flight, when the rows per (source rank, expert) segment reach the layer's
    MIN_SEGMENT_ROWS; below it, or with the rule switched off, every exchange is exposed."""
    from podscale.parallel.moe import layer as moe_layer
    from podscale.plan import gpt_cost, predict
    lay = {"tp": 1, "pp": 1, "dp": 8, "ep": 8, "microbatch": 1}

    def ep_comm():
        gpt_cost._LAYER_CACHE.clear()
        return predict("dgx-a100-80g", 64, "moe-1.3b-64e", lay, 512).time_breakdown_s["ep_communication"]

    monkeypatch.setattr(moe_layer, "MIN_SEGMENT_ROWS", 64)   # the rule at its edge, whatever its default
    overlapped = ep_comm()                       # 2048 tokens x top-2 / 64 experts = 64 rows a segment
    monkeypatch.setattr(moe_layer, "MIN_SEGMENT_ROWS", 65)
    exposed = ep_comm()
    assert 0 < overlapped < exposed
    # recomputation repeats the forward's two token exchanges and its count exchange, not the backward's:
    # with x a pass's token exchanges and c the count exchange, none = 2x + c and full = 3x + 2c (each pass
    # exposes the same x when nothing overlaps it), so x = 2 none - full and c = 2 full - 3 none, both priced
    lay["recompute"] = "full"
    exposed_full = ep_comm()
    x, c = 2 * exposed - exposed_full, 2 * exposed_full - 3 * exposed
    assert x > 0 and c > 0 and c < x
    monkeypatch.setattr(moe_layer, "MIN_SEGMENT_ROWS", 64)
    overlapped_full = ep_comm()
    assert overlapped < overlapped_full < exposed_full
    lay.update(ep=1, dp=64)
    assert ep_comm() == 0


def test_expert_recompute_keeps_one_gelu_tensor_less_and_prices_the_gelu_again():
    """``expert_recompute``: every MoE layer keeps only its experts' GELU input (2 bytes x ffn per routed
    token slot, Korthikanti et al.'s MLP term halved), and its backward pays one more element-wise pass over
    that tensor; dense layers and every other term are unchanged."""
    from dataclasses import replace

    from podscale.plan import predict
    from podscale.plan.memory import activation_bytes_per_layer
    from podscale.plan.models import get_model
    base = get_model("moe-1.3b-64e")
    lay = {"tp": 1, "pp": 1, "dp": 8, "ep": 8, "microbatch": 1}
    keep, again = (predict("dgx-a100-80g", 64, replace(base, expert_recompute=r), lay, 512) for r in (False, True))
    kw = dict(seq=base.seq, microbatch=1, hidden=base.hidden, heads=base.heads, ffn=base.ffn,
              mlp_scale=base.top_k * base.capacity_factor)
    per_moe_layer = activation_bytes_per_layer(**kw) - activation_bytes_per_layer(gelu_recompute=True, **kw)
    assert per_moe_layer == 2 * base.ffn * base.seq * base.top_k * base.capacity_factor
    saved = keep.memory_breakdown_bytes["activations"] - again.memory_breakdown_bytes["activations"]
    assert saved == pytest.approx(per_moe_layer * base.moe_layers, rel=1e-9)
    assert again.time_breakdown_s["recompute"] > keep.time_breakdown_s["recompute"] == 0.0
    assert again.step_time_s > keep.step_time_s
    for part in ("forward", "backward", "ep_communication"):
        assert again.time_breakdown_s[part] == keep.time_breakdown_s[part]


def test_the_busiest_ep_rank_is_priced_at_the_capacity_or_the_stated_dropless_peak_load():
    """An MoE layer's expert rows on the busiest ep rank: a capacity bounds them (capacity_factor x top_k x
    tokens), dropless only the stated ``dropless_peak_load`` (which training measures as peak_rank_load),
    and never more than every choice of the ep group (ep x), nor at ep = 1 more than a rank's own choices.
    Expert GEMMs, activations and the all-to-all scale with them; the dense layers do not."""
    from dataclasses import replace

    from podscale.plan import predict
    from podscale.plan.models import get_model
    base = get_model("moe-1.3b-64e")                      # top-2, capacity factor 1.25
    assert [base.expert_load(ep) for ep in (1, 2, 8)] == [1.0, 1.25, 1.25]
    drop = replace(base, dropless=True, dropless_peak_load=3.0)
    assert [drop.expert_load(ep) for ep in (1, 2, 8)] == [1.0, 2.0, 3.0]

    def run(model, ep):
        return predict("dgx-a100-80g", 64, model, {"tp": 1, "pp": 1, "dp": 64 // ep, "ep": ep, "microbatch": 1}, 512)

    # dropless at a stated peak is priced as a capacity of that factor would be at ep = 8 ...
    same = run(replace(base, capacity_factor=3.0), 8)
    ours = run(drop, 8)
    assert ours.notes[-1] == ("dropless MoE: the busiest ep rank priced at 3x the mean expert rows "
                              "(dropless_peak_load; a training run logs the measured peak_rank_load)")
    assert not any("dropless" in n for n in same.notes)
    assert ours.memory_breakdown_bytes == same.memory_breakdown_bytes
    assert ours.time_breakdown_s == same.time_breakdown_s
    # ... costs more the higher the peak, in activations, expert compute and the exchange
    low = run(replace(drop, dropless_peak_load=1.5), 8)
    assert ours.memory_breakdown_bytes["activations"] > low.memory_breakdown_bytes["activations"]
    for part in ("forward", "backward", "ep_communication"):
        assert ours.time_breakdown_s[part] > low.time_breakdown_s[part], part
    assert ours.memory_breakdown_bytes["model_states"] == low.memory_breakdown_bytes["model_states"]
    # ... and at ep = 1 a rank runs its own choices, at most: any peak, any capacity factor >= 1, alike
    one = [run(m, 1) for m in (drop, base, replace(base, capacity_factor=1.0))]
    assert one[0].memory_breakdown_bytes == one[1].memory_breakdown_bytes == one[2].memory_breakdown_bytes
    assert one[0].step_time_s == one[1].step_time_s == one[2].step_time_s
