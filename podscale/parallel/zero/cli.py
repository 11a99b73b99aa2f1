"""``podscale memory``: per-rank bytes of model states under ZeRO (see :mod:`.memory`)."""
from __future__ import annotations

import argparse
import sys


def add_memory_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``podscale memory --params N --dp D --stage S [...]`` on an argparse subparsers object."""
    p = subparsers.add_parser("memory", help="per-rank memory of parameters, gradients and optimizer state "
                                             "under ZeRO stage 0-3 with optional offload")
    p.add_argument("--params", required=True, type=float, help="number of parameters (e.g. 1.3e9)")
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
    p.set_defaults(func=run_memory)
    return p


def run_memory(args) -> int:
    from podscale.parallel.zero.memory import estimate_model_states, format_estimate
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
