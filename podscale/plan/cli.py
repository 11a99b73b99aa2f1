"""``podscale plan``: search layouts, predict one, validate against Megatron Table 1, calibrate,
list systems and models.

    podscale plan --model gpt-175b --system dgx-a100-superpod --devices 1024 --batch 1536
    podscale plan predict --system NAME --devices N --batch B --model JSON --layout JSON --json
    podscale plan validate
    podscale plan calibrate [--out PATH] [--quick] [--swap-dir FOLDER] [--table-only | --moe-routing-only]
    podscale plan systems | podscale plan models

Errors print one line ``podscale: error: ...`` on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_USAGE = 2


class PlanUsageError(Exception):
    pass


def _fail(message: str) -> int:
    print(f"podscale: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _guarded(func):
    """Turn the planner's validation errors into the one-line CLI error and exit code 2."""
    def run(args) -> int:
        from .hardware import CatalogError
        from .layout import LayoutError
        from .models import ModelError
        try:
            return func(args)
        except (CatalogError, LayoutError, ModelError, PlanUsageError) as e:
            return _fail(str(e))
        except ValueError as e:   # e.g. --batch 0, or a torus group that cannot exist
            return _fail(str(e))
    return run


def _parse_json(text: str, what: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanUsageError(f"--{what} is not valid JSON ({e}); e.g. --{what} "
                             + ("'{\"tp\":8,\"pp\":1,\"dp\":4,\"microbatch\":1}'" if what == "layout"
                                else "'{\"layers\":24,\"hidden\":2048,\"heads\":16,\"seq\":2048,\"vocab\":51200}'"))
    if not isinstance(data, dict):
        raise PlanUsageError(f"--{what} must be a JSON object")
    return data


def _check_target_args(args, outputs: tuple[str, ...] = ()) -> None:
    """What argparse cannot check, before any work: positive --tokens, output files in existing folders."""
    if not args.tokens > 0:
        raise PlanUsageError(f"--tokens must be positive, got {args.tokens:g}")
    for flag in outputs:
        path = getattr(args, flag)
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise PlanUsageError(f"--{flag} {path}: folder '{os.path.dirname(os.path.abspath(path))}' does not "
                                 "exist: create it or write elsewhere")


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def cmd_search(args) -> int:
    from .models import get_model
    from .search import search
    if not (args.model and args.system and args.devices and args.batch):
        raise PlanUsageError("podscale plan needs --model, --system, --devices and --batch "
                             "(e.g. podscale plan --model gpt-175b --system dgx-a100-superpod "
                             "--devices 1024 --batch 1536)")
    _check_target_args(args, ("json", "chart"))
    model = get_model(args.model)
    result = search(args.system, args.devices, model, args.batch, top=0)
    top = result.ranked[:args.top]
    _print_search(args, top, result)
    if args.json:
        payload = {"model": model.name, "system": args.system, "devices": args.devices, "batch": args.batch,
                   "evaluated": result.evaluated, "rejected_memory": result.rejected_memory,
                   "seconds": result.seconds, "layouts": [p.to_dict(args.tokens) for p in top]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    if args.chart:
        from .chart import search_chart
        search_chart(result.ranked, args.chart, title=f"{model.name} on {args.devices} x {args.system}")
    return 0 if result.ranked else 1


def _print_search(args, top, result) -> None:
    from rich.console import Console
    from rich.table import Table
    from .layout import Layout
    table = Table(title=f"{args.model} on {args.devices} devices of {args.system}, batch {args.batch}")
    for col in ("#", "layout", "step s", "TFLOP/s/dev", "MFU", "tokens/s", f"days/{args.tokens / 1e9:g}B tok",
                "mem GiB", "bottleneck"):
        table.add_column(col, justify="right" if col not in ("layout", "bottleneck") else "left")
    for i, p in enumerate(top, 1):
        overhead = {k: v for k, v in p.time_breakdown_s.items() if k not in ("forward", "backward")}
        worst = max(overhead, key=overhead.get) if overhead else "-"
        table.add_row(str(i), Layout(**p.layout).short(), f"{p.step_time_s:.2f}", f"{p.tflops_per_device:.1f}",
                      f"{p.mfu:.1%}", f"{p.tokens_per_s:,.0f}", f"{p.days_to_train(args.tokens):.1f}",
                      _gib(p.memory_per_device_bytes), f"{worst} {overhead.get(worst, 0) / p.step_time_s:.0%}")
    console = Console(width=160)
    console.print(table)
    if top and any("not validated" in n for n in top[0].notes):
        console.print(next(n for n in top[0].notes if "not validated" in n))
    console.print(f"{result.evaluated} layouts predicted in {result.seconds:.2f} s; "
                  f"{result.rejected_memory} do not fit in memory; {len(result.ranked)} ranked.")
    for note in result.notes:
        console.print(note)


def cmd_predict(args) -> int:
    from .cost import predict
    from .layout import layout_from_dict
    from .models import get_model, model_from_dict
    for flag in ("system", "devices", "batch", "model", "layout"):
        if getattr(args, flag) in (None, ""):
            raise PlanUsageError(f"plan predict needs --{flag}")
    _check_target_args(args)
    from .hardware import load_system
    system = load_system(args.system)          # unknown systems are reported first
    system.check_devices(args.devices)
    model = (model_from_dict(_parse_json(args.model, "model")) if args.model.lstrip().startswith("{")
             else get_model(args.model))
    layout = layout_from_dict(_parse_json(args.layout, "layout"))
    pred = predict(system, args.devices, model, layout, args.batch)
    if args.json:
        print(json.dumps(pred.to_dict(args.tokens), indent=None if args.compact else 2))
        return 0
    moe = _moe_summary(model, layout)
    print(f"{model.name}{f' ({moe.strip()})' if moe else ''} on {args.devices} x {args.system}, batch {args.batch}, "
          f"{layout.short()}")
    print(f"  step time        {pred.step_time_s:.4g} s   ({pred.tokens_per_s:,.0f} tokens/s, "
          f"{pred.days_to_train(args.tokens):.1f} days for {args.tokens / 1e9:g}B tokens)")
    print(f"  per device       {pred.tflops_per_device:.1f} TFLOP/s, MFU {pred.mfu:.1%}, HFU {pred.hfu:.1%}")
    for note in pred.notes:
        print(f"  note: {note}")
    print(f"  memory/device    {_gib(pred.memory_per_device_bytes)} GiB of {_gib(pred.memory_capacity_bytes)}"
          f"{'' if pred.fits else '  (DOES NOT FIT)'}")
    for k, v in pred.memory_breakdown_bytes.items():
        print(f"    {k:<16} {_gib(v):>8} GiB")
    for k, v in pred.time_breakdown_s.items():
        if v:
            print(f"    {k:<16} {v:>10.4g} s  {v / pred.step_time_s:6.1%}")
    return 0


def cmd_validate(args) -> int:
    from .hardware import load_system, system_names
    from .validate import format_table, leave_one_out, summary, table1, validation_set
    rows = table1()
    print("Fitting set: Narayanan et al. SC'21 Table 1 on dgx-a100-80g (the A100's matmul efficiency is fitted "
          "to these ten rows)")
    print(format_table(rows))
    loo = leave_one_out()
    lm, lw = summary([err for _, err in loo])
    print(f"leave-one-out (efficiency fitted on the other nine rows, "
          f"{min(e for e, _ in loo):.2f}-{max(e for e, _ in loo):.2f}): mean |error| {100 * lm:.1f}%, "
          f"max {100 * lw:.1f}%")
    print()
    print("Validation set: published runs nothing in the planner is fitted to (sources in podscale/plan/validate.py)")
    vrows = validation_set()
    print(format_table(vrows, goal=False))
    groups: dict = {}
    for r in vrows:
        groups.setdefault((r.source.split(",")[0].split(" (")[0], r.system.split(" [")[0]), []).append(r)
    for (source, system), sub in sorted(groups.items()):
        vm, vw = summary(sub)
        print(f"  {source}: {len(sub)} runs on {system}, mean |error| {100 * vm:.1f}%, max {100 * vw:.1f}%")
    print()
    from .validate import VALIDATED_WITHIN, best_error_by_system
    for name, err in sorted(best_error_by_system(vrows).items()):
        mark = "validated" if load_system(name).validated else "not validated"
        print(f"  {name}: best |error| {100 * err:.1f}% (validated when within {100 * VALIDATED_WITHIN:.0f}%): {mark}")
    unvalidated = []
    for name in system_names():
        if name == "local":
            continue
        if not load_system(name).validated:
            unvalidated.append(name)
    print("systems not validated (no published run predicted within 10 %, or none found; predictions are "
          "estimates): "
          + ", ".join(unvalidated))
    mean, worst = summary(rows)
    return 0 if (mean <= 0.03 and worst <= 0.08) else 1


def cmd_calibrate(args) -> int:
    from .calibrate import calibrate, calibrate_gpu, calibrate_moe_routing, calibrate_table
    if args.moe_routing_only:
        path = calibrate_moe_routing(args.out, quick=args.quick, ranks=args.ranks, log=print)
        print(f"wrote {path}")
        return 0
    if args.table_only:
        path = calibrate_table(args.out, quick=args.quick, ranks=args.ranks, log=print)
    elif args.gpu:
        path = calibrate_gpu(out=args.out, log=print)
    else:
        path = calibrate(out=args.out, quick=args.quick, ranks=args.ranks, log=print, swap_dir=args.swap_dir)
    print(f"wrote {path}")
    return 0


def cmd_systems(args) -> int:
    from .hardware import CatalogError, load_system, system_names
    for name in system_names():
        try:
            s = load_system(name)
        except CatalogError as e:
            print(f"{name:<20} ({e})")
            continue
        limit = f"max {s.max_devices}" if s.max_devices else "any number of nodes"
        checked = "validated" if s.validated else ("measured" if name == "local" else "unvalidated")
        print(f"{name:<20} {s.device.peak_flops / 1e12:>7.0f} TFLOP/s {s.device.memory_bytes / 2**30:>6.1f} GiB  "
              f"{s.topology:<16} {limit:<20} {checked:<12} {s.description}")
    return 0


#: what ``plan predict``'s summary says of each load-balancing loss scope (``model.aux_loss_scope``)
_AUX_LOSS_SCOPE_WORDS = {"group": "", "global": ", global aux loss", "global_step": ", step-global aux loss"}


def _moe_summary(m, layout=None) -> str:
    """" experts 64 top2 +2 shared" for a GPT-MoE (the shared experts when it has any; ", global aux loss" with
    the global-batch load-balancing loss, Qiu et al. 2025, ", step-global aux loss" with its counts summed over
    the step's micro-batches); with a ``layout`` that
    sets ``fold_tp_into_ep`` or ``expert_tensor_parallel`` also where its experts are (", folded: 4 a rank over
    ep*tp = 16", ", split over tp: 8 a rank at 1/2 of their width"), and ", per-rank dispatch" with
    ``expert_dispatch`` "rank" (a token sent once to each rank of its experts, DeepEP's dispatch), ", per-node
    dispatch" with "node" (once to each node of its experts, then per rank inside it, DeepEP's internode
    dispatch); "" otherwise."""
    from .gpt_cost import local_experts
    from .models import GPT
    if not isinstance(m, GPT) or m.experts < 2:
        return ""
    out = f" experts {m.experts} top{m.top_k}" + (f" +{m.shared_experts} shared" if m.shared_experts else "")
    out += _AUX_LOSS_SCOPE_WORDS[m.aux_loss_scope]
    if layout is not None and layout.fold_tp_into_ep:
        out += f", folded: {local_experts(m, layout)} a rank over ep*tp = {layout.expert_group}"
    if layout is not None and layout.expert_tensor_parallel:
        out += f", split over tp: {local_experts(m, layout)} a rank at 1/{layout.tp} of their width"
    if layout is not None and layout.expert_dispatch != "choice":
        out += f", per-{layout.expert_dispatch} dispatch"
    return out


def cmd_models(args) -> int:
    from .models import PRESETS, GPT
    for name, m in PRESETS.items():
        if isinstance(m, GPT):
            print(f"{name:<15} {m.params / 1e9:>8.1f}B  layers {m.layers:>3} hidden {m.hidden:>5} heads {m.heads:>3} "
                  f"seq {m.seq} vocab {m.vocab}{_moe_summary(m)}")
        else:
            print(f"{name:<15} {m.params / 1e9:>8.1f}B  DLRM, {len(m.tables)} tables, MLPs {m.bottom_mlp} / {m.top_mlp}")
    return 0


def _add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--system", help="system name (see `podscale plan systems`) or a TOML file")
    p.add_argument("--devices", type=int, help="number of devices (GPUs, TPU chips, CS-2s, local ranks)")
    p.add_argument("--batch", type=int, help="global batch size in sequences (samples for DLRM)")
    p.add_argument("--tokens", type=float, default=300e9, help="tokens to train on, for days-to-train (default 3e11)")


def add_plan_parser(subparsers) -> None:
    """Register ``plan`` and its sub-commands on an argparse sub-parser set; each sets ``plan_func``."""
    plan = subparsers.add_parser("plan", help="predict memory and step time; search parallel layouts",
                                 description="Without a sub-command: search layouts and rank them.")
    plan.add_argument("--model", help="preset (see `podscale plan models`), JSON object, or .json/.toml file")
    _add_target_args(plan)
    plan.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    plan.add_argument("--json", metavar="PATH", help="write the top layouts as JSON")
    plan.add_argument("--chart", metavar="PATH.png", help="write a chart of throughput vs memory")
    plan.set_defaults(plan_func=_guarded(cmd_search))
    sub = plan.add_subparsers(dest="plan_command")

    p = sub.add_parser("predict", help="predict one layout (stable machine-readable interface)")
    _add_target_args(p)
    p.add_argument("--model", help='JSON {"layers","hidden","heads","seq","vocab"[,"ffn"]} or a preset name')
    p.add_argument("--layout", help='JSON {"tp","pp","dp","microbatch"[,"interleave","recompute",'
                                    '"sequence_parallel","zero_stage","expert_dispatch",...]}')
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--compact", action="store_true", help="with --json: on one line")
    p.set_defaults(plan_func=_guarded(cmd_predict))

    p = sub.add_parser("validate", help="reproduce Narayanan et al. SC'21 Table 1")
    p.set_defaults(plan_func=_guarded(cmd_validate))

    p = sub.add_parser("calibrate", help="measure this machine and write the 'local' system file")
    p.add_argument("--out", help="output TOML (default $PODSCALE_CACHE/local.toml or ~/.cache/podscale/local.toml)")
    p.add_argument("--quick", action="store_true", help="few, small measurements (a few seconds)")
    p.add_argument("--ranks", type=int, default=2, help="gloo ranks for the collective measurements (default 2)")
    p.add_argument("--gpu", action="store_true", help="calibrate this machine's GPUs: fit the GEMM shape model "
                                                       "(e_mm, k0) to measured GEMMs")
    p.add_argument("--swap-dir", help="a folder on the disk for NVMe offload, whose bandwidth becomes the local "
                                      "system's nvme_gbps (default: the temporary directory's disk)")
    p.add_argument("--table-only", action="store_true", help="measure only the sharded-table rates (seconds) and "
                                                              "write them into the existing system file")
    p.add_argument("--moe-routing-only", action="store_true", help="measure only the rates of an MoE layer's work "
                   "beyond its GEMMs (routing, dispatch, combine) and write them into the existing system file")
    p.set_defaults(plan_func=_guarded(cmd_calibrate))

    p = sub.add_parser("systems", help="list the hardware catalog")
    p.set_defaults(plan_func=_guarded(cmd_systems))
    p = sub.add_parser("models", help="list model presets")
    p.set_defaults(plan_func=_guarded(cmd_models))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="podscale")
    sub = parser.add_subparsers(dest="command")
    add_plan_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "plan":
        argv = ["plan"] + argv           # `python -m podscale.plan ...` means `podscale plan ...`
    args = parser.parse_args(argv)
    return args.plan_func(args)
