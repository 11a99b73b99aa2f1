"""The ``podscale`` command: train, launch, report, export, memory, plan, graph."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from podscale.config import Config, ConfigError, load_config
from podscale.runtime.env import under_launcher


def _fail(message: str, code: int = 2) -> int:
    print(f"podscale: error: {message}", file=sys.stderr)
    return code


def _train_entry(config_json: str, resume: bool) -> dict:
    """What each spawned worker runs (module level, so the elastic agent can start it by spawn)."""
    from podscale.runtime.errors import exit_on_input_error
    from podscale.train.loop import run_worker
    with exit_on_input_error(int(os.environ.get("RANK", "0"))):
        return run_worker(Config.model_validate_json(config_json), resume)


def cmd_train(args) -> int:
    overrides = list(args.set or [])
    if args.nproc is not None:
        overrides.append(f"parallel.nproc={args.nproc}")
    if args.steps is not None:
        overrides.append(f"run.steps={args.steps}")
    if args.name is not None:
        overrides.append(f"run.name='{args.name}'")
    if args.out_dir is not None:
        overrides.append(f"run.out_dir='{args.out_dir}'")
    if args.max_restarts < 0:
        return _fail(f"--max-restarts={args.max_restarts} must be >= 0")
    try:
        cfg = load_config(args.config, overrides)
        if under_launcher():  # torchrun decides the world; the config's nproc only counts local spawns
            cfg.parallel.nproc = int(os.environ["WORLD_SIZE"])
        if args.layout == "auto":  # the planner's fastest layout that fits (podscale.plan.auto)
            from podscale.plan.auto import choose_layout
            choice = choose_layout(cfg, cfg.parallel.nproc, args.system)
            print(choice.describe(), flush=True)
            nproc = cfg.parallel.nproc
            cfg = load_config(args.config, overrides + choice.overrides)
            cfg.parallel.nproc = nproc
        cfg.check_layout(cfg.parallel.nproc)
        from podscale.runtime.process import device_kind
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if under_launcher() else cfg.parallel.nproc
        device_kind(cfg.run.device, local)
    except (ConfigError, ValueError) as err:
        return _fail(str(err))

    from podscale.train import checkpoint, rundir
    if args.fresh and args.resume:
        return _fail("--fresh and --resume contradict each other: pass one of them")
    if args.fresh and under_launcher():
        return _fail("--fresh cannot delete a run directory from inside torchrun's workers: delete "
                     f"'{cfg.run_dir}' before launching, or choose another run.name")
    try:
        rundir.resolve_run_dir(cfg.run.out_dir, cfg.run.name)
        if args.fresh:
            rundir.check_fresh(cfg.run_dir)
    except rundir.RunDirError as err:
        return _fail(str(err))
    # A worker restarted by torchrun's agent resumes by itself (see run_worker).
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
    if checkpoint.completed(cfg.run_dir / "checkpoints") and not (args.resume or args.fresh or restarted):
        return _fail(f"run directory '{cfg.run_dir}' already has checkpoints: pass --resume to continue it, "
                     f"--fresh to start over, or choose another run.name")

    if args.resume and checkpoint.completed(cfg.run_dir / "checkpoints"):
        # One line here rather than a traceback on every worker; a damaged newest checkpoint is passed over
        # (the workers say so and resume from the previous complete one, see run_worker).
        from podscale.tasks import task_for
        found, skipped = checkpoint.latest_usable(cfg.run_dir / "checkpoints", checkpoint.expected_of(task_for(cfg)))
        if found is None:
            return _fail(f"no checkpoint of '{cfg.run_dir}' can be resumed; the newest: {skipped[0]}")

    if cfg.train.init_from is not None and not (args.resume and checkpoint.completed(cfg.run_dir / "checkpoints")):
        # the source's one line here rather than on every worker (it is read again there, any layout)
        import torch
        from podscale.tasks import task_for
        task = task_for(cfg)
        with torch.device("meta"):
            shapes = checkpoint.expected_of(task, task.build_model()).shapes
        try:
            checkpoint.initial_weights(Path(cfg.train.init_from), task, shapes)
        except ValueError as err:
            return _fail(str(err))

    if under_launcher():  # already a torchrun worker: join the job instead of spawning
        from podscale.runtime.errors import exit_on_input_error
        from podscale.train.loop import run_worker
        with exit_on_input_error(int(os.environ.get("RANK", "0"))):
            run_worker(cfg, args.resume)
        return 0

    try:
        rundir.prepare(cfg.run_dir, fresh=args.fresh)
    except rundir.RunDirError as err:
        return _fail(str(err))
    (cfg.run_dir / "config.json").write_text(cfg.model_dump_json(indent=1))
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from podscale.runtime.errors import quiet_input_exits
    from podscale.runtime.launcher import launch
    quiet_input_exits()
    try:
        results = launch(_train_entry, (cfg.model_dump_json(), args.resume), nproc=cfg.parallel.nproc,
                         max_restarts=args.max_restarts, host=args.host, port=args.port)
    except ChildFailedError as err:
        # bad input found inside the workers (podscale.runtime.errors): its one line, once
        from podscale.runtime.errors import input_error_line
        line = input_error_line({r: f.message for r, f in err.failures.items()})
        if line is not None:
            return _fail(line, code=1)
        failures = "; ".join(f"rank {r}: exit {f.exitcode}" for r, f in err.failures.items())
        return _fail(f"training failed ({failures}); logs above. Resume with --resume", code=1)
    summary = results[0]
    print(f"podscale: done: {summary['steps']} steps, final loss {summary['final_loss']:.4f}"
          + (f", val loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else "")
          + f"; metrics and checkpoints in {summary['run_dir']}")
    return 0


def cmd_launch(args) -> int:
    script = Path(args.script)
    if not script.is_file():
        return _fail(f"script '{script}' does not exist: give the path of a Python file")
    if args.nproc < 1:
        return _fail(f"-n {args.nproc} must be at least 1")
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from podscale.runtime.launcher import launch
    try:
        command = (("-m", "podscale.runtime.bind") if args.bind_cores else ()) + (str(script), *args.script_args)
        launch(sys.executable, command, nproc=args.nproc,
               max_restarts=args.max_restarts, host=args.host, port=args.port)
    except ChildFailedError as err:
        failures = "; ".join(f"rank {r}: exit {f.exitcode}" for r, f in err.failures.items())
        return _fail(f"{script} failed ({failures})", code=1)
    return 0


def cmd_report(args) -> int:
    from podscale.train.report import write_report
    try:
        paths = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    except (FileNotFoundError, ValueError) as err:
        return _fail(str(err))
    for p in paths:
        print(p)
    return 0


def cmd_export_tables(args) -> int:
    """``podscale export RUN_DIR OUT --tables``: the sharded tables of a checkpoint for serving, one folder
    (:func:`podscale.table.checkpoint.export_tables`: per table sorted ``keys`` and ``weights`` in
    safetensors files, ``index.json``); the latest checkpoint that holds tables unless one is named."""
    from podscale.table.checkpoint import MANIFEST, export_tables
    from podscale.train import checkpoint
    path = Path(args.checkpoint)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not (path / MANIFEST).is_file():
        found = [p for p in checkpoint.completed(path) if (p / MANIFEST).is_file()]
        if not found:
            return _fail(f"no checkpoint with sharded tables ({MANIFEST}) in '{args.checkpoint}': give the run "
                         "directory of a run with [model] kind = \"dlrm\" (or another task with sharded tables) "
                         "or one of its step_XXXXXXXX folders")
        path = found[-1]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _fail(f"'{out}' is a file: --tables writes a folder (index.json and one safetensors file per "
                     "table chunk); name a folder")
    try:
        out = export_tables(path, out)
    except (ValueError, OSError) as err:  # TableError (damaged manifest or segment): one line naming it
        return _fail(str(err))
    import json
    index = json.loads((out / "index.json").read_text())
    rows = sum(t["rows"] for t in index["tables"])
    print(f"podscale: exported {len(index['tables'])} tables ({rows:,} rows) of {path} to {out} for serving")
    return 0


def cmd_export(args) -> int:
    if args.tables:
        return cmd_export_tables(args)
    from podscale.train import checkpoint
    path = checkpoint.resolve(Path(args.checkpoint))
    if path is None:
        return _fail(f"no checkpoint in '{args.checkpoint}': give a run directory or a step_XXXXXXXX folder")
    fmt = args.format or ("safetensors" if args.out.endswith(".safetensors") else "torch")
    try:
        out = checkpoint.export(path, Path(args.out), fmt)
    except ValueError as err:  # (damaged or not podscale's: one line naming the file)
        return _fail(str(err))
    print(f"podscale: exported {path} to {out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with podscale's one-line errors (exit 2) instead of a usage block; sub-commands inherit it."""

    def error(self, message: str):
        self.exit(2, f"podscale: error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="podscale", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train the task of a TOML config ([model] kind) on local worker processes")
    t.add_argument("config", nargs="?", help="TOML config (default: the bundled examples/gpt-small.toml)")
    t.add_argument("--nproc", type=int, help="local worker processes (overrides parallel.nproc)")
    t.add_argument("--steps", type=int, help="training steps (overrides run.steps)")
    t.add_argument("--name", help="run name (overrides run.name)")
    t.add_argument("--out-dir", help="folder of run directories (overrides run.out_dir)")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override any config key")
    t.add_argument("--resume", action="store_true", help="continue from the run's latest checkpoint")
    t.add_argument("--fresh", action="store_true",
                   help="delete the run directory and start over (only one podscale created: it holds the "
                        ".podscale-run marker)")
    t.add_argument("--max-restarts", type=int, default=0, help="restarts of the worker group on failure")
    t.add_argument("--host", default="127.0.0.1", help="rendezvous address (default: loopback only)")
    t.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    t.add_argument("--layout", choices=("config", "auto"), default="config",
                   help="auto: train with the planner's fastest layout that fits (tp, pp, dp, ZeRO stage, "
                        "offload, micro-batch, recompute); default: the config's")
    t.add_argument("--system", default="local",
                   help="with --layout auto: the system to plan for (default: 'local', from `podscale plan "
                        "calibrate`)")
    t.set_defaults(func=cmd_train)

    la = sub.add_parser("launch", help="run a Python script on N local workers (like torchrun)")
    la.add_argument("-n", "--nproc", type=int, default=2)
    la.add_argument("--max-restarts", type=int, default=0)
    la.add_argument("--host", default="127.0.0.1")
    la.add_argument("--port", type=int, default=None)
    la.add_argument("--bind-cores", action="store_true",
                    help="pin each worker to its own share of the cores, one thread per core (CPU jobs; as "
                         "parallel.bind_cores does for podscale train)")
    la.add_argument("script")
    la.add_argument("script_args", nargs=argparse.REMAINDER)
    la.set_defaults(func=cmd_launch)

    r = sub.add_parser("report", help="write PNG plots of a run's loss and throughput")
    r.add_argument("run_dir")
    r.add_argument("--out", help="folder for the plots (default: the run directory)")
    r.set_defaults(func=cmd_report)

    e = sub.add_parser("export", help="consolidate a checkpoint's model into one plain file (torch or safetensors), "
                                      "or with --tables its sharded embedding tables into a serving folder")
    e.add_argument("checkpoint", help="a run directory or one of its checkpoints/step_XXXXXXXX folders")
    e.add_argument("out", help="output file, e.g. model.pt or model.safetensors (with --tables: a folder)")
    e.add_argument("--format", choices=("torch", "safetensors"), default=None,
                   help="file format (default: safetensors for a .safetensors name, else torch)")
    e.add_argument("--tables", action="store_true",
                   help="export the sharded tables (DLRM's embeddings) for serving instead: per table sorted "
                        "keys and weights (safetensors) and index.json, in folder OUT")
    e.set_defaults(func=cmd_export)

    from podscale.graph.cli import add_graph_parser
    from podscale.parallel.zero.cli import add_memory_parser
    from podscale.plan.cli import add_plan_parser
    add_memory_parser(sub)
    add_plan_parser(sub)
    add_graph_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "plan_func", None) is not None and args.command == "plan":
        return args.plan_func(args)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
