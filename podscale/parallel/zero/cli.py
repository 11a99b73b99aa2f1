"""``podscale memory``: per-rank bytes of model states under ZeRO (see :mod:`.memory`)."""
from __future__ import annotations

import argparse
import sys


def add_memory_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``podscale memory --params N --dp D --stage S [...]`` on an argparse subparsers object."""
    p = subparsers.add_parser("memory", help="per-rank memory of parameters, gradients and optimizer state "
                                             "under ZeRO stage 0-3 with optional offload")
    p.add_argument("--params", type=float, help="number of parameters (e.g. 1.3e9)")
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3)
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default="bf16")
    p.add_argument("--offload-optimizer", choices=("none", "cpu", "nvme"), default="none")
    p.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="none")
    p.add_argument("--largest-layer", type=float, default=0, help="parameters of the largest block (stage 3)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="gradient reduce dtype (default: --precision); the gradient shard keeps it")
    p.add_argument("--grad-accum-dtype", choices=("fp32",), default=None,
                   help="keep an fp32 gradient shard (zero.grad_accum_dtype)")
    t = p.add_argument_group("table mode", "memory per tier and DRAM hit rate of a sharded embedding table")
    t.add_argument("--table-rows", type=float, help="keys of the table (e.g. 1e9): switches to table mode")
    t.add_argument("--dim", type=int, default=64, help="table mode: columns per row")
    t.add_argument("--shards", type=int, default=1, help="table mode: ranks the rows are spread over")
    t.add_argument("--sparse-optimizer", choices=("adagrad", "sgd", "adam"), default="adagrad")
    t.add_argument("--dram-budget-mb", type=float, default=None, help="table mode: DRAM cache per shard (MiB)")
    t.add_argument("--alpha", type=float, default=1.05, help="table mode: Zipf exponent of the ids")
    t.add_argument("--policy", choices=("lfu", "lru"), default="lfu", help="table mode: cache policy")
    t.add_argument("--ssd-engine", choices=("log", "rocksdb"), default="log",
                   help="table mode: SSD tier engine (log: key index in DRAM; rocksdb: index on disk)")
    t.add_argument("--ids-per-step", type=int, default=None,
                   help="table mode: ids of this table in one global batch (hit rate per step's distinct ids)")
    p.set_defaults(func=run_memory)
    return p


def run_table_memory(args) -> int:
    from podscale.table.estimate import estimate_table, format_table_estimate
    try:
        budget = None if args.dram_budget_mb is None else int(args.dram_budget_mb * 2 ** 20)
        est = estimate_table(int(args.table_rows), args.dim, args.shards, args.sparse_optimizer, budget, args.alpha,
                             args.policy, args.ids_per_step, args.ssd_engine)
    except ValueError as err:
        print(f"podscale: error: {err}", file=sys.stderr)
        return 2
    print(format_table_estimate(est, args.alpha, args.policy))
    return 0


def run_memory(args) -> int:
    from podscale.parallel.zero.memory import estimate_model_states, format_estimate
    if args.table_rows is not None:
        return run_table_memory(args)
    if args.params is None:
        print("podscale: error: memory: give --params N (model states) or --table-rows N (a table)", file=sys.stderr)
        return 2
    n = int(args.params)
    if n <= 0 or args.dp < 1:
        print(f"podscale: error: --params={args.params:g} and --dp={args.dp} must be positive", file=sys.stderr)
        return 2
    try:
        est = estimate_model_states(n, args.dp, args.stage, args.precision, args.offload_optimizer,
                                    args.offload_param, largest_layer=int(args.largest_layer),
                                    bucket_mb=args.bucket_mb, reduce_dtype=args.reduce_dtype,
                                    grad_accum_dtype=args.grad_accum_dtype)
    except ValueError as err:
        print(f"podscale: error: {err}", file=sys.stderr)
        return 2
    print(format_estimate(est, n, args.dp, args.stage))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="podscale")
    add_memory_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
