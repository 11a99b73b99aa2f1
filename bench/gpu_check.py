"""The CUDA paths on one GPU, in one run: correctness, model-state memory, throughput, optimizer step.

    python bench/gpu_check.py --data PATH/tinyshakespeare.txt --out DIR [--skip adam,throughput,...]

1. correctness: ``podscale train`` (nproc 1: NCCL, one rank) for ZeRO stages 0-3, CPU and NVMe offload,
   bf16 and fp16, against the same run on the CPU (gloo, ``run.device = 'cpu'``): loss curves over 20 steps.
2. memory: CUDA memory held by model states after two steps (``torch.cuda.memory_allocated``; activations
   and gathers are gone by then) and the allocator's peak, beside the estimator
   (:func:`podscale.parallel.zero.memory.estimate_model_states`), per stage and offload mode.
3. throughput: a 24-layer 1024-wide GPT (~300M parameters) in bf16 under ``podscale train`` for stages 0, 2, 3
   and stage 3 with CPU optimizer offload, beside a plain PyTorch loop on the same model and data
   (torch.autocast bf16, ``AdamW(fused=True)``, clipping): median step time and the ratio; and the planner's
   prediction (``podscale plan predict``, one dgx-h100 GPU: the H200 has the H100's arithmetic) over the
   measured step.
4. the AdamW step over 100M fp32 parameters: ``bench/adam.py --device cuda``.
5. the MoE layer (:func:`moe`): its fast path against GShard's einsum reference on the GPU, the grouped-GEMM
   kernel against the per-segment one in bf16, the expert kernels' forward + backward times there
   (``SegmentKernel``, the default for fp32, against ``GroupedGemmKernel``, the default for bf16 on SM90 and SM100,
   and the CPU's ``CacheTiledKernel``), and ``bench/moe.py --nproc 1`` (podscale against DeepSpeed's MoE at ep = 1;
   skipped with a note where deepspeed does not import).

One GPU only: NCCL refuses two ranks on one device, so dp > 1 is not exercised here (the CPU suite covers
it with gloo).  Writes ``gpu_check.json`` and prints a table at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ONLY: set[str] = set()  # --only: the correctness/throughput cases to run (the CPU references always run)
RUNS = Path(tempfile.gettempdir()) / "podscale-gpu-check-runs"  # not under --out: few files come back
DEVICE = "cuda"  # --dry-cpu: the same script on the CPU with a small model, to check it before a GPU run

SMALL = {"model.n_layer": 4, "model.n_head": 4, "model.n_embd": 128, "model.block_size": 128,
         "train.global_batch": 16, "train.micro_batch": 8, "train.lr": 1e-3, "train.warmup_steps": 5,
         "run.log_every": 1, "run.eval_every": 0, "run.sample_tokens": 0, "checkpoint.at_end": False,
         "zero.reduce_bucket_mb": 0.25, "zero.param_persistence_threshold": 1000}
BIG = {"model.n_layer": 24, "model.n_head": 16, "model.n_embd": 1024, "model.block_size": 1024,
       "train.global_batch": 8, "train.micro_batch": 8, "train.precision": "bf16", "train.warmup_steps": 2,
       "run.log_every": 1, "run.eval_every": 0, "run.sample_tokens": 0, "checkpoint.at_end": False}


MEM_MODEL = {"n_layer": 8, "n_head": 12, "n_embd": 768, "block_size": 64}  # 57M parameters


def _sets(d: dict) -> list[str]:
    out = []
    for k, v in d.items():
        out += ["--set", f"{k}={json.dumps(v) if not isinstance(v, bool) else str(v).lower()}"]
    return out


def train(out: Path, name: str, settings: dict, steps: int, cpu: bool = False) -> dict:
    """Run ``podscale train`` with one rank; the metrics records, or the error."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("PODSCALE_DEVICE", None)
    cmd = [sys.executable, "-m", "podscale", "train", "--nproc", "1", "--steps", str(steps), "--name", name,
           "--out-dir", str(RUNS), "--fresh"] + _sets(dict(settings, **{"run.device": "cpu" if cpu else DEVICE}))
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    if r.returncode:
        return {"error": (r.stderr or r.stdout)[-1500:], "wall_s": wall}
    recs = [json.loads(line) for line in (RUNS / name / "metrics.jsonl").read_text().splitlines()]
    return {"records": recs, "wall_s": wall}


def correctness(out: Path, data: str) -> list[dict]:
    base = dict(SMALL, **{"data.path": data})
    nvme = out / "nvme"
    nvme.mkdir(exist_ok=True)
    cases = [
        ("cpu-ref", {}, True),
        ("s0", {}, False),
        ("s1", {"zero.stage": 1}, False),
        ("s2", {"zero.stage": 2}, False),
        ("s3", {"zero.stage": 3}, False),
        ("s2-optcpu", {"zero.stage": 2, "zero.offload_optimizer": "cpu"}, False),
        ("s3-cpu-cpu", {"zero.stage": 3, "zero.offload_optimizer": "cpu", "zero.offload_param": "cpu"}, False),
        ("s3-nvme-nvme", {"zero.stage": 3, "zero.offload_optimizer": "nvme", "zero.offload_param": "nvme",
                          "zero.nvme_path": str(nvme)}, False),
        ("cpu-s3-lamb", {"zero.stage": 3, "zero.optimizer": "lamb"}, True),
        ("s3-lamb", {"zero.stage": 3, "zero.optimizer": "lamb"}, False),
        ("s0-bf16", {"train.precision": "bf16"}, False),
        ("s3-bf16", {"zero.stage": 3, "train.precision": "bf16"}, False),
        ("s2-fp16", {"zero.stage": 2, "train.precision": "fp16"}, False),
    ]
    rows, ref = [], {}
    for name, extra, cpu in cases:
        if ONLY and name not in ONLY and not name.startswith("cpu"):
            continue
        res = train(out, name, dict(base, **extra), 20, cpu)
        row = {"case": name, "wall_s": round(res["wall_s"], 1)}
        if "error" in res:
            row["error"] = res["error"]
        else:
            losses = [r["loss"] for r in res["records"]]
            row["losses"] = losses
            ref_name = "cpu-s3-lamb" if "lamb" in name else "cpu-ref"
            if name.startswith("cpu"):
                ref[name] = losses
            if ref_name in ref and not name.startswith("cpu"):
                diff = max(abs(a - b) for a, b in zip(losses, ref[ref_name]))
                tol = 1e-4 if "16" not in name else 5e-2
                row.update(max_abs_diff=diff, tol=tol, ok=diff <= tol and all(l == l for l in losses))
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
    return rows


def memory(out: Path, data: str) -> list[dict]:
    """Model-state memory on the GPU, in a one-rank job (so NCCL is initialised as in training)."""
    from podscale.runtime.launcher import launch
    os.environ.pop("PODSCALE_DEVICE", None)
    nvme = out / "nvme-mem"
    nvme.mkdir(exist_ok=True)
    cases = [(0, "fp32", {}), (1, "fp32", {}), (2, "fp32", {}), (3, "fp32", {}), (2, "bf16", {}),
             (3, "bf16", {}), (2, "bf16", {"offload_optimizer": "cpu"}),
             (3, "bf16", {"offload_optimizer": "cpu", "offload_param": "cpu"}),
             (3, "bf16", {"offload_optimizer": "nvme", "offload_param": "nvme", "nvme_path": str(nvme)})]
    return launch(_memory_worker, (data, cases, DEVICE, MEM_MODEL), nproc=1, start_method="spawn")[0]


def _memory_worker(data: str, cases: list, device: str, dims: dict) -> list[dict]:
    import gc

    import torch

    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.train.data import load_tokens, split_tokens

    info = init_process(device=device)
    cuda = info.device.type == "cuda"
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    peak_allocated = torch.cuda.max_memory_allocated if cuda else (lambda: 0)
    mesh = Mesh.build(info.device, pp=1, dp=1, ep=1, tp=1)
    tokens, _ = split_tokens(load_tokens(data), 0.1)
    rows = []
    for stage, prec, zero in cases:
        d = {"model": dict(dims),
             "data": {"path": data}, "train": {"global_batch": 2, "micro_batch": 2, "precision": prec},
             "parallel": {"nproc": 1}, "zero": dict({"stage": stage}, **zero)}
        try:
            rows.append(_memory_case(d, tokens, mesh, allocated, peak_allocated, cuda))
        except Exception as err:  # one broken case must not hide the others
            rows.append({"stage": stage, "precision": prec, "zero": zero, "error": f"{type(err).__name__}: {err}"})
        gc.collect()
    return rows


def _memory_case(d, tokens, mesh, allocated, peak_allocated, cuda) -> dict:
    import gc

    import torch

    from podscale.config import parse_config
    from podscale.models.gpt import GPT
    from podscale.parallel.compose import build_engine
    from podscale.parallel.zero import ZeroStrategy
    from podscale.parallel.zero.memory import estimate_model_states
    from podscale.train.data import ShardedLoader
    from podscale.tasks.gpt import gpt_config

    stage, prec, zero = d["zero"]["stage"], d["train"]["precision"], d["zero"]
    cfg = parse_config(d)
    loader = ShardedLoader(tokens, 64, 2, 2, 0, 1, seed=0)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = allocated()
    with torch.device("meta"):
        model = GPT(gpt_config(cfg))
    n_params = sum(p.numel() for p in model.parameters())
    small = sum(p.numel() for p in model.parameters() if p.numel() < cfg.zero.param_persistence_threshold)
    engine = build_engine(model, mesh, cfg)
    t0 = time.perf_counter()
    for _ in range(3):
        res = engine.step(loader.next_step())
    st = engine.strategy
    if isinstance(st, ZeroStrategy):
        st.wait_params()
    if cuda:
        torch.cuda.synchronize()
    held, peak = allocated() - before, peak_allocated() - before
    est = estimate_model_states(n_params, 1, stage, prec, zero.get("offload_optimizer", "none"),
                                zero.get("offload_param", "none"),
                                persistent_params=small if stage == 3 else 0)
    dev_states = est.device["params"] + est.device["grads"] + est.device["optim"]
    row = {"stage": stage, "precision": prec,
           "zero": {k: v for k, v in zero.items() if k not in ("nvme_path", "stage")},
           "params": n_params, "held_MiB": held / 2**20, "peak_MiB": peak / 2**20,
           "estimate_states_MiB": dev_states / 2**20, "estimate_buffers_MiB": est.device_buffers / 2**20,
           "held_over_estimate": held / max(1, dev_states), "loss": res.loss,
           "s_per_step": (time.perf_counter() - t0) / 3}
    if hasattr(st, "remove_hooks"):
        st.remove_hooks()
    del engine, st, model, res
    return row


def plain_torch(data: str, steps: int, device: str = "cuda", big: dict = BIG) -> dict:
    """The peer: the same GPT, data and optimizer in a plain single-GPU PyTorch loop."""
    import torch

    from podscale.config import load_config
    from podscale.models.gpt import GPT
    from podscale.train.data import ShardedLoader, load_tokens, split_tokens
    from podscale.tasks.gpt import gpt_config

    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in dict(big, **{"data.path": data}).items()])
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(cfg.run.seed)
    model = GPT(gpt_config(cfg)).to(dev)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.train.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.train.lr,
                            betas=(cfg.train.beta1, cfg.train.beta2), eps=cfg.train.eps, fused=True)
    tokens, _ = split_tokens(load_tokens(data), 0.1)
    loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch, 0, 1,
                           seed=cfg.run.seed)
    times, losses = [], []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        for x, y in loader.next_step():
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - t0)
    return {"median_step_s": statistics.median(times[2:]), "losses": losses,
            "peak_MiB": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}


def throughput(out: Path, data: str) -> list[dict]:
    steps = 12
    rows = []
    peer = subprocess.run([sys.executable, "-c", "import json,sys; sys.path.insert(0, 'bench'); import gpu_check; "
                           f"print('RESULT', json.dumps(gpu_check.plain_torch({data!r}, {steps}, {DEVICE!r}, {BIG!r})))"],
                          capture_output=True, text=True, cwd=ROOT)
    line = [x for x in peer.stdout.splitlines() if x.startswith("RESULT ")]
    ref = json.loads(line[0][7:]) if line else {"error": peer.stderr[-1500:]}
    rows.append(dict({"case": "plain torch"}, **{k: v for k, v in ref.items() if k != "losses"}))
    for name, extra in [("s0", {}), ("s2", {"zero.stage": 2}), ("s3", {"zero.stage": 3}),
                        ("s3-optcpu", {"zero.stage": 3, "zero.offload_optimizer": "cpu"})]:
        if ONLY and name not in ONLY and name != "s0":
            continue
        res = train(out, "big-" + name, dict(BIG, **{"data.path": data}, **extra), steps)
        row = {"case": name}
        if "error" in res:
            row["error"] = res["error"]
        else:
            recs = res["records"][2:]
            row.update(median_step_s=statistics.median(r["step_time_s"] for r in recs),
                       mfu=statistics.median(r["mfu"] for r in recs),
                       tokens_per_s=statistics.median(r["tokens_per_s"] for r in recs),
                       peak_MiB=max(res["records"][-1]["peak_mem_bytes"]) / 2**20)
            if "median_step_s" in ref:
                row["speed_vs_plain_torch"] = ref["median_step_s"] / row["median_step_s"]
                row["first_loss_diff"] = abs(res["records"][0]["loss"] - ref["losses"][0])
        rows.append(row)
        print(json.dumps(row), flush=True)
    pred = subprocess.run([sys.executable, "-m", "podscale", "plan", "predict", "--system", "dgx-h100", "--devices",
                           "1", "--batch", "8", "--model",
                           json.dumps({"layers": 24, "hidden": 1024, "heads": 16, "seq": 1024, "vocab": 256}),
                           "--layout", json.dumps({"tp": 1, "pp": 1, "dp": 1, "microbatch": 8}), "--json"],
                          capture_output=True, text=True, cwd=ROOT)
    if pred.returncode == 0 and rows[1].get("median_step_s"):
        p = json.loads(pred.stdout)["step_time_s"]
        rows.append({"case": "planner dgx-h100 x1", "predicted_step_s": p,
                     "predicted_over_measured_s0": p / rows[1]["median_step_s"]})
    else:
        rows.append({"case": "planner", "error": pred.stderr[-500:]})
    return rows


def profile(out: Path, data: str) -> dict:
    """torch.profiler over two steps of podscale (stage 0) and of the plain loop on the BIG model: where
    the device time goes in each (tables written to ``profile_*.txt``)."""
    from podscale.runtime.launcher import launch
    os.environ.pop("PODSCALE_DEVICE", None)
    return launch(_profile_worker, (data, str(out), DEVICE, dict(BIG)), nproc=1)[0]


def _profile_worker(data: str, out: str, device: str, big: dict) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from podscale.config import load_config
    from podscale.models.gpt import GPT
    from podscale.parallel.compose import build_engine
    from podscale.runtime.mesh import Mesh
    from podscale.runtime.process import init_process
    from podscale.train.data import ShardedLoader, load_tokens, split_tokens
    from podscale.tasks.gpt import gpt_config

    info = init_process(device=device)
    mesh = Mesh.build(info.device, pp=1, dp=1, ep=1, tp=1)
    cfg = load_config(None, [f"{k}={json.dumps(v)}" for k, v in dict(big, **{"data.path": data}).items()])
    tokens, _ = split_tokens(load_tokens(data), 0.1)
    loader = ShardedLoader(tokens, cfg.model.block_size, cfg.train.global_batch, cfg.train.micro_batch, 0, 1, seed=0)
    batches = [loader.next_step() for _ in range(5)]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if info.device.type == "cuda" else [])
    sort = "self_cuda_time_total" if info.device.type == "cuda" else "self_cpu_time_total"
    result = {}

    with torch.device("meta"):
        model = GPT(gpt_config(cfg))
    engine = build_engine(model, mesh, cfg)

    def podscale_step(b):
        engine.step(b)

    plain = GPT(gpt_config(cfg)).to(info.device)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=info.device.type == "cuda")

    def plain_step(b):
        for x, y in b:
            x, y = x.to(info.device), y.to(info.device)
            with torch.autocast(info.device.type, dtype=torch.bfloat16):
                _, loss = plain(x, y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    for name, fn in (("podscale", podscale_step), ("plain", plain_step)):
        for b in batches[:3]:
            fn(b)
        with torch_profile(activities=acts) as prof:
            for b in batches[3:]:
                fn(b)
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
        Path(out, f"profile_{name}.txt").write_text(table)
        result[name] = table.splitlines()[-2:] + table.splitlines()[:14]
    return result


def moe(data: str) -> dict:
    """The MoE layer on the device: (a) the fast path (the device's kernel) equals the einsum reference,
    outputs and gradients, fp32 with TF32 off, top-1 / top-2 / dropless, and the grouped-GEMM kernel equals
    the per-segment one in bf16; (b) ``bench/moe.py --kernels``: the expert kernels side by side on the
    same layer (the per-segment one as the baseline, the grouped GEMM, the CPU's, and the two accelerator
    kernels keeping only the pre-activation), fp32 and bf16 (d_model 1024, expert width 4096 on a
    GPU); (c) :func:`moe_training`: a GPT-MoE trained in bf16 with each accelerator kernel; (d)
    ``bench/moe.py --nproc 1``: podscale beside DeepSpeed's MoE at ep = 1, where deepspeed is installed."""
    import importlib.util

    import torch

    from podscale.parallel.moe import MoELayer

    dev = torch.device(DEVICE)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    result: dict = {"reference": []}
    for mode in ({"top_k": 1}, {"top_k": 2}, {"top_k": 2, "dropless": True}):
        torch.manual_seed(0)
        layer = MoELayer(64, 128, 8, capacity_factor=1.0, **mode).to(dev)
        with torch.no_grad():
            layer.router.weight.normal_(0.0, 0.3)
        x = torch.randn(4, 256, 64, device=dev)
        grads = []
        for ref in (False, True):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y, out = (layer.forward_reference if ref else layer)(xi)
            (y.square().sum() + out.loss).backward()
            grads.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
        err = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for a, b in zip(*grads))
        result["reference"].append({**mode, "max_rel_diff": err, "ok": err < 1e-4})
    # the grouped-GEMM kernel (the default for bf16 on SM90 and SM100) against the per-segment one, both in bf16
    from podscale.parallel.moe.kernels import GroupedGemmKernel, SegmentKernel, kernel_for
    x = torch.randn(4, 256, 64, device=dev, dtype=torch.bfloat16)
    grads = []
    for kernel in (GroupedGemmKernel(), SegmentKernel()):
        torch.manual_seed(0)
        layer = MoELayer(64, 128, 8, top_k=2, capacity_factor=1.0, kernel=kernel).to(dev, torch.bfloat16)
        with torch.no_grad():
            layer.router.weight.normal_(0.0, 0.3)
        xi = x.clone().requires_grad_(True)
        y, out = layer(xi)
        (y.float().square().sum() + out.loss).backward()
        grads.append([y.detach(), xi.grad] + [p.grad for p in layer.parameters()])
    err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
              for a, b in zip(*grads))
    result["reference"].append({"kernels": "grouped vs segment, bf16", "max_rel_diff": err, "ok": err < 2e-2,
                                "default_bf16_kernel": type(kernel_for(dev, torch.bfloat16, 1024, 4096)).__name__})
    dims = ["--d-model", "1024", "--d-hidden", "4096"]
    big = dims + ["--experts", "8", "64", "--tokens", "4096", "16384"]
    small = ["--experts", "8", "--tokens", "512", "--top-k", "2"]
    kernels = [sys.executable, "bench/moe.py", "--kernels", "segment", "grouped", "tiled", "segment-recompute",
               "grouped-recompute",
               "--device", DEVICE, "--dtype", "fp32", "bf16",
               "--rounds", "5", "--json", str(RUNS / "moe_kernels.json")] + (big if dev.type == "cuda" else small)
    RUNS.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(kernels, capture_output=True, text=True, cwd=ROOT)
    result["kernels"] = (json.loads((RUNS / "moe_kernels.json").read_text()) if r.returncode == 0
                         else {"error": (r.stdout + r.stderr)[-1500:]})
    result["train"] = moe_training(data)
    if importlib.util.find_spec("deepspeed") is None:
        result["bench_moe"] = "skipped: deepspeed is not installed (bench/moe.py compares against it)"
    else:
        cmd = [sys.executable, "bench/moe.py", "--nproc", "1", "--rounds", "5"] + (
            dims + ["--tokens", "4096", "16384"] if dev.type == "cuda" else ["--quick"])
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        result["bench_moe"] = (r.stdout + r.stderr)[-4000:]
    return result


MOE = {"model.kind": "gpt-moe", "model.experts": 8, "model.top_k": 2, "model.moe_every": 2,
       "model.random_routing": False}


def moe_training(data: str) -> list[dict]:
    """``podscale train`` of a GPT-MoE (BIG's width, at most 8 layers, 8 experts in every other block) in bf16
    with each accelerator kernel: under autocast the experts compute in bf16, where ``auto`` picks the grouped
    GEMM on SM90/SM100; then with ``auto``: ``train.compile`` (inductor's Triton kernels for the blocks'
    attention halves, the MoE layers eager between them), one shared expert, DeepSeek-V3's balance
    biases instead of the aux loss, and with its gating too (sigmoid scores, 2 of 4 expert groups, gates x 2.5)
    (other models: their losses are not compared).
    Median step time after two warm-up steps, peak memory, and the largest loss difference from ``segment``
    over the steps (the same data and seed: bf16 rounding only)."""
    rows, ref = [], None
    cases = [(k, {"model.expert_kernel": k}, True) for k in ("segment", "auto", "grouped")] + [
        ("auto compile", {"train.compile": True}, True), ("auto shared_experts=1", {"model.shared_experts": 1}, False),
        ("auto bias_balancing", {"model.bias_balancing": True, "model.aux_loss_coef": 0.0}, False),
        ("auto deepseek-v3 gating", {"model.bias_balancing": True, "model.aux_loss_coef": 0.0,
                                     "model.router_score": "sigmoid", "model.router_groups": 4,
                                     "model.router_group_top_k": 2, "model.router_scale": 2.5}, False)]
    for label, extra, same_model in cases:
        settings = dict(BIG, **MOE, **{"data.path": data, "model.n_layer": min(8, BIG["model.n_layer"])}, **extra)
        res = train(RUNS, f"moe-bf16-{label.replace(' ', '-').replace('=', '')}", settings, 12)
        row = {"case": f"gpt-moe bf16 expert_kernel={label}"}
        if "error" in res:
            row["error"] = res["error"]
        else:
            losses = [r["loss"] for r in res["records"]]
            row.update(median_step_s=statistics.median(r["step_time_s"] for r in res["records"][2:]),
                       peak_MiB=max(res["records"][-1]["peak_mem_bytes"]) / 2**20, last_loss=losses[-1])
            if ref is None:
                ref = losses
            elif same_model:
                row["max_loss_diff_vs_segment"] = max(abs(a - b) for a, b in zip(losses, ref))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def adam() -> str:
    n = "100e6" if DEVICE == "cuda" else "1e6"
    r = subprocess.run([sys.executable, "bench/adam.py", "--device", DEVICE, "--params", n, "--repeat", "20"],
                       capture_output=True, text=True, cwd=ROOT)
    return (r.stdout + r.stderr)[-2000:]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="Tiny Shakespeare (or any text) file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip", default="",
                    help="comma-separated parts to skip: adam,correctness,memory,throughput,profile,moe")
    ap.add_argument("--dry-cpu", action="store_true", help="run everything on the CPU with a small model")
    ap.add_argument("--only", default="", help="comma-separated case names of correctness and throughput")
    args = ap.parse_args(argv)
    ONLY.update(filter(None, args.only.split(",")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    import torch
    if args.dry_cpu:
        global DEVICE
        DEVICE = "cpu"
        BIG.update({"model.n_layer": 2, "model.n_embd": 128, "model.n_head": 4, "model.block_size": 128})
        MEM_MODEL.update(n_layer=2, n_embd=128, n_head=4)
        report = {"torch": torch.__version__, "gpu": None}
    else:
        report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                  "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    print(json.dumps(report), flush=True)
    for part, fn in [("adam", lambda: adam()), ("correctness", lambda: correctness(out, args.data)),
                     ("memory", lambda: memory(out, args.data)), ("throughput", lambda: throughput(out, args.data)),
                     ("profile", lambda: profile(out, args.data)), ("moe", lambda: moe(args.data))]:
        if part in skip:
            continue
        t0 = time.perf_counter()
        try:
            report[part] = fn()
        except Exception as err:  # report and go on: one broken part must not hide the others
            report[part] = {"error": f"{type(err).__name__}: {err}"[-1500:]}
        print(f"== {part} done in {time.perf_counter() - t0:.0f} s", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print("\n==== summary")
    print(report.get("adam", ""))
    moe_report = report.get("moe") or {}
    kernel_rows = moe_report.get("kernels", [])
    for row in moe_report.get("reference", []) + (kernel_rows if isinstance(kernel_rows, list) else [kernel_rows]):
        print("moe", json.dumps({k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in row.items()}))
    for row in moe_report.get("train") or []:
        print("moe", json.dumps(row))
    if "bench_moe" in moe_report:
        print("moe bench:", moe_report["bench_moe"][-1500:])
    if "error" in moe_report:
        print("moe error:", moe_report["error"])
    for line in (report.get("profile") or {}).get("podscale", []) + (report.get("profile") or {}).get("plain", []):
        print("profile", line[:320])
    for part in ("correctness", "memory", "throughput"):
        rows = report.get(part, [])
        for row in rows if isinstance(rows, list) else [rows]:
            print(part, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                                    if k not in ("losses",) and not (k == "error" and len(str(v)) > 300)}))
            if "error" in row:
                print("   error:", str(row["error"])[-300:])


if __name__ == "__main__":
    main()
