"""Where one `podscale train` step goes, beside the planner's terms for the same layout (issue 15).

Runs the trainer's own worker (``podscale.train.loop.run_worker``, 2 gloo ranks on this CPU) for a few steps and
profiles one step after warm-up on rank 0 with ``torch.profiler`` (record_shapes). The step's phases are the
strategy's calls that ``Engine.step`` makes (forward+backward, gradient sync, norm, clip, optimizer step,
zero_grad), and every aten op's *self* time is put in one class: GEMMs (mm/addmm/bmm by shape), fused
attention, element-wise math (layer norm, GELU, softmax, adds), copies/fills, the loss, collectives (gloo
work and waits). What no op covers is host time (Python, autograd's engine, dispatch). Each class is printed
as a fraction of the step, beside the planner's corresponding term as a fraction of its predicted step
(``podscale.plan.gpt_cost.step_components``). Fractions within one profile are what to compare on a loaded
machine, not absolute times (the profiler adds a few microseconds per op too).

    python bench/plan_profile_step.py --case dp2-L12            # see CASES; --case all runs every one
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import sys
import tempfile

SMALL = ["model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.block_size=128"]
ISSUE = ["model.n_layer=12", "model.n_head=10", "model.n_embd=640", "model.block_size=128"]
# name: (model overrides, global batch, micro batch, tp, pp, zero stage, offload)
CASES = {
    "dp2-L4": (SMALL, 16, 8, 1, 1, 0, "none"),
    "tp2-L4": (SMALL, 16, 8, 2, 1, 0, "none"),
    "pp2-L4": (SMALL, 16, 4, 1, 2, 0, "none"),
    "dp2-L12": (ISSUE, 8, 4, 1, 1, 0, "none"),
    "z1-L12": (ISSUE, 8, 4, 1, 1, 1, "none"),
    "z3-L12": (ISSUE, 8, 4, 1, 1, 3, "none"),
    "tp2-L12": (ISSUE, 4, 4, 2, 1, 0, "none"),
    "pp2-L12": (ISSUE, 8, 2, 1, 2, 0, "none"),
    "z3off-L8": (["model.n_layer=8", "model.n_head=8", "model.n_embd=256", "model.block_size=128"],
                 16, 2, 1, 1, 3, "cpu"),
    "z3-L8": (["model.n_layer=8", "model.n_head=8", "model.n_embd=256", "model.block_size=128"],
              16, 2, 1, 1, 3, "none"),
}

GEMM = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm"}
ATTN = ("flash_attention", "scaled_dot_product", "_efficient_attention")
LOSS = ("log_softmax", "nll_loss", "cross_entropy")
COPY = {"aten::copy_", "aten::clone", "aten::cat", "aten::zero_", "aten::fill_", "aten::_to_copy",
        "aten::contiguous", "aten::empty_like", "aten::stack", "aten::index_select", "aten::embedding_dense_backward",
        "aten::index_add_", "aten::zeros", "aten::empty", "aten::empty_strided", "aten::resize_", "aten::new_zeros",
        "aten::embedding", "aten::index", "aten::set_", "aten::narrow_copy"}
COMM = ("gloo", "c10d", "record_param_comms", "all_reduce", "broadcast", "allgather", "reduce_scatter", "wait",
        "send", "recv", "barrier")
PHASES = ("forward_backward", "finish_grad_sync", "grad_norm", "scale_grads", "step", "zero_grad")


def classify(name: str) -> str:
    low = name.lower()
    if name in GEMM:
        return "gemm"
    if any(k in low for k in ATTN):
        return "attention"
    if any(k in low for k in LOSS):
        return "loss"
    if any(k in low for k in COMM) and not name.startswith("aten::"):
        return "collective"
    if name in COPY:
        return "copy"
    if name.startswith("aten::"):
        return "elementwise"
    return "host"            # autograd engine nodes, our phase labels, Python-side records


def profiled_worker(cfg_json: str, profile_step: int, out_path: str):
    """run_worker with Engine.step wrapped: step ``profile_step`` is profiled on rank 0, its phases labelled."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from podscale.config import Config
    from podscale.train import engine as engine_mod
    from podscale.train.loop import run_worker

    original = engine_mod.Engine.step
    calls = {"n": 0}

    def labelled(strategy):
        for ph in PHASES:
            fn = getattr(strategy, ph)

            def wrap(*a, _fn=fn, _ph=ph, **k):
                with record_function(f"phase::{_ph}"):
                    return _fn(*a, **k)
            setattr(strategy, ph, wrap)

    def step(self, micro_batches):
        calls["n"] += 1
        if calls["n"] == 1:
            labelled(self.strategy)
        if calls["n"] != profile_step or int(os.environ.get("RANK", "0")) != 0:
            return original(self, micro_batches)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.perf_counter()
            res = original(self, micro_batches)
            wall = time.perf_counter() - t0
        main_thread = None
        events = prof.events()
        by_thread = collections.Counter()
        for e in events:
            by_thread[e.thread] += e.self_cpu_time_total
        main_thread = max(by_thread, key=by_thread.get)
        cls = collections.defaultdict(float)
        phase_cls = collections.defaultdict(float)
        gemm_shapes = collections.defaultdict(lambda: [0, 0.0])
        names = collections.Counter()
        ops = 0
        for e in events:
            if e.thread != main_thread:
                continue
            c = classify(e.name)
            t = e.self_cpu_time_total / 1e6
            p = e
            phase = "other"
            while p is not None:
                if p.name.startswith("phase::"):
                    phase = p.name[7:]
                    break
                p = p.cpu_parent
            if e.name.startswith("aten::") and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")):
                ops += 1
            if phase == "step":
                c = "optimizer" if c != "collective" else c
            elif phase in ("grad_norm", "scale_grads"):
                c = "norm+clip" if c != "collective" else c
            elif phase == "zero_grad":
                c = "zero_grad"
            cls[c] += t
            names[f"{c}: {e.name}"] += t
            phase_cls[f"{phase}/{c}"] += t
            if c == "gemm":
                key = f"{e.name} {e.input_shapes}"
                gemm_shapes[key][0] += 1
                gemm_shapes[key][1] += t
        covered = sum(cls.values())
        cls["uncovered (python)"] = max(0.0, wall - covered)
        top = sorted(gemm_shapes.items(), key=lambda kv: -kv[1][1])[:12]
        with open(out_path, "w") as f:
            json.dump({"wall": wall, "classes": cls, "phases": phase_cls, "top_level_ops": ops,
                       "gemms": [(k, n, t) for k, (n, t) in top],
                       "names": names.most_common(30),
                       "table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                                          max_name_column_width=55)}, f)
        return res

    # A collective's wait is Python calling into gloo, recorded by no aten op: label it, or its blocked time
    # would show as the self time of whatever autograd function or phase issued it.
    work_wait = torch.distributed.Work.wait

    def wait(self, *a, **k):
        with record_function("c10d::wait"):
            return work_wait(self, *a, **k)
    torch.distributed.Work.wait = wait
    engine_mod.Engine.step = step
    return run_worker(Config.model_validate_json(cfg_json))


def _mnk(key: str):
    """(m, n, k) of a profiled 'aten::mm [[m, k], [k, n]]' or 'aten::addmm [[bias], [m, k], [k, n], ...]'
    (None for batched products)."""
    shapes = [x for x in ast.literal_eval(key.split(" ", 1)[1]) if len(x) == 2]
    if len(shapes) < 2:
        return None
    (m, k), (_, n) = shapes[0], shapes[1]
    return m, n, k


def planner_side(cfg, tp, pp, dp, mb, zero, offload) -> dict:
    from podscale.plan import load_system
    from podscale.plan.auto import as_trained, gpt_of
    from podscale.plan.gpt_cost import step_components
    from podscale.plan.layout import Layout
    lay = as_trained(Layout(tp=tp, pp=pp, dp=dp, microbatch=mb, zero_stage=zero, offload_optimizer=offload))
    return step_components(load_system("local"), 2, gpt_of(cfg), lay, cfg.train.global_batch)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="dp2-L12", help=f"one of {', '.join(CASES)}, or all")
    ap.add_argument("--step", type=int, default=3, help="which step to profile (after warm-up)")
    ap.add_argument("--table", action="store_true", help="also print torch.profiler's op table")
    args = ap.parse_args(argv)
    from podscale.config import load_config
    from podscale.plan import load_system
    from podscale.plan.compute import gemm_time
    from podscale.runtime.launcher import launch
    names = list(CASES) if args.case == "all" else args.case.split(",")
    for name in names:
        model, gb, mb, tp, pp, zero, off = CASES[name]
        dp = 2 // (tp * pp)
        with tempfile.TemporaryDirectory() as tmp:
            sets = model + [f"train.global_batch={gb}", f"train.micro_batch={mb}", f"parallel.tp={tp}",
                            f"parallel.pp={pp}", f"zero.stage={zero}", f"zero.offload_optimizer='{off}'",
                            "run.eval_every=0", "run.sample_tokens=0", "checkpoint.every=100000",
                            f"run.steps={args.step + 1}", f"run.out_dir='{tmp}'", "run.name='prof'"]
            cfg = load_config(None, sets)
            out = os.path.join(tmp, "profile.json")
            launch(profiled_worker, (cfg.model_dump_json(), args.step, out), nproc=2, quiet=True)
            with open(out) as f:
                r = json.load(f)
        model_terms = planner_side(cfg, tp, pp, dp, mb, zero, off)
        pred = sum(model_terms.values())
        wall = r["wall"]
        print(f"\n== {name}: tp{tp} pp{pp} dp{dp} mb{mb} ZeRO-{zero} offload {off}; measured step {wall:.3f} s "
              f"(profiled, rank 0), predicted {pred:.3f} s; {r['top_level_ops']} top-level ops")
        print(f"{'class':<22}{'measured s':>11}{'frac':>7}   {'planner term':<26}{'pred s':>9}{'frac':>7}")
        keys = sorted(set(r["classes"]) | set(model_terms), key=lambda k: -max(r["classes"].get(k, 0),
                                                                             model_terms.get(k, 0)))
        for k in keys:
            ms, ps = r["classes"].get(k, 0.0), model_terms.get(k, 0.0)
            print(f"{k:<22}{ms:>11.4f}{ms / wall:>7.1%}   {k if k in model_terms else '-':<26}{ps:>9.4f}"
                  f"{ps / pred:>7.1%}")
        print("by phase (measured s):", ", ".join(f"{k} {v:.4f}" for k, v in
                                                 sorted(r["phases"].items(), key=lambda kv: -kv[1])[:14]))
        print("GEMMs by shape: count, measured s (fraction of the measured step), the calibrated table's time for "
              "the same GEMMs (fraction of the predicted step)")
        dev = load_system("local").device
        for k, n, t in r["gemms"]:
            mnk = _mnk(k)
            pt = n * gemm_time(dev, *mnk, bytes_per_element=dev.dtype_bytes) if mnk else 0.0
            print(f"   {n:>4} x {t:8.4f} s ({t / wall:6.1%})  table {pt:8.4f} s ({pt / pred:6.1%})  {k}")
        print("largest op names by self time (class: name, s):")
        for k, t in r["names"][:22]:
            print(f"   {t:8.4f}  {k}")
        if args.table:
            print(r["table"])
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
