"""ZeRO side by side: podscale vs PyTorch FSDP2 (``fully_shard``) vs DeepSpeed (when importable), same GPT,
same data, fp32, 2 ranks on this CPU (gloo).  Each configuration runs in a fresh launch so its peak RSS is
its own; step time is the median over the measured steps after warm-up.

    python bench/zero.py [--layers 8 --width 768 --steps 6 --warmup 2 --tokens 64]
    python bench/zero.py --shape all --only podscale-3-none,fsdp2-3-none,deepspeed-3-none

``--shape`` picks a model shape instead of ``--layers/--width/--vocab``: ``deep-narrow`` (24 x 384),
``shallow-wide`` (4 x 1536), ``large-vocab`` (8 x 512, 50,257-token vocabulary), ``issue16`` (12 x 640, the
shape on which ZeRO-3's lead shrank), or ``all`` (the first three, and issue16, one after another).

Besides the median step time, each row prints the median process CPU time per step (every thread of the
rank: compute and communication), which a loaded machine inflates far less than wall time.

Model construction is the same on every side (printed with the results): every engine gets the same GPT
built eagerly on the CPU from the same seed (``--construct eager``, the default), so each side's peak RSS
counts one full fp32 model before sharding.  ``--construct meta`` gives each side its documented
construction for a model that does not fit one rank: podscale builds on the meta device and materialises
one unit at a time (stage 3; ``GPT.init_parameter``), FSDP2 builds on meta, shards, then ``to_empty`` and
initialises its own shards (the FSDP2 recipe), and DeepSpeed builds under ``deepspeed.zero.Init`` (stage 3).

Rows: podscale stage 1/2/3, stage 2 + CPU optimizer offload, stage 3 + NVMe offload (optimizer and
parameters; DeepSpeed's row keeps its defaults, under which its parameters stay in host memory — the disk
bytes each engine moved per step are printed beside the NVMe rows); FSDP2 with reshard_after_forward=False (ZeRO-2-like) and True (ZeRO-3); DeepSpeed stage 1/2/3,
CPU and NVMe offload if ``import deepspeed`` works (``pip install -e .[peers]``).  Prints step time and
peak RSS per rank, and the ratios podscale / peer for matching modes.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def _disk_io() -> tuple[int, int]:
    """Bytes this process (all threads) read from / wrote to storage, from ``/proc/self/io``."""
    vals = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(vals["read_bytes"]), int(vals["write_bytes"])


def _data(n_tokens: int, steps: int, rank: int, world: int, block: int, vocab: int):
    from podscale.train.data import ShardedLoader, load_tokens, split_tokens
    path = str(SHAKESPEARE) if SHAKESPEARE.is_file() else None
    tokens, _ = split_tokens(load_tokens(path), 0.1)
    if vocab > 256:  # a large vocabulary: byte pairs spread over it (every id in range, all sides the same)
        tokens = (tokens[:-1].long() * 256 + tokens[1:].long()) % vocab
    micro = max(1, n_tokens // block)
    loader = ShardedLoader(tokens, block, micro * world, micro, rank, world, seed=0)
    return [loader.next_step()[0] for _ in range(steps)]


#: --shape: (layers, width, vocabulary); every shape keeps a 64-wide attention head
SHAPES = {"deep-narrow": (24, 384, 256), "shallow-wide": (4, 1536, 256), "large-vocab": (8, 512, 50257),
          "issue16": (12, 640, 256)}


def _gpt(args: dict, meta: bool = False):
    from podscale.models.gpt import GPT, GPTConfig
    width = args["width"]
    cfg = GPTConfig(n_layer=args["layers"], n_embd=width, n_head=max(1, width // 64), block_size=args["block"],
                    vocab_size=args["vocab"])
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return GPT(cfg), cfg
    return GPT(cfg), cfg


def worker(kind: str, stage: int, offload: str, args: dict) -> dict:
    """One configuration on this rank: returns step times and peak RSS."""
    from podscale.runtime.process import init_process
    info = init_process()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // info.world_size))
    block, steps = args["block"], args["warmup"] + args["steps"]
    batches = _data(args["tokens"], steps, info.rank, info.world_size, block, args["vocab"])
    meta = args["construct"] == "meta"
    times, cpus = [], []  # wall and process CPU time (every thread) per step
    if kind == "podscale":
        from podscale.config import TrainSection, ZeroSection
        from podscale.parallel.zero import build_strategy
        from podscale.runtime.mesh import Mesh
        from podscale.tasks.gpt import gpt_loss_fn
        from podscale.train.engine import Engine
        mesh = Mesh.build(info.device, dp=info.world_size)
        train = TrainSection(lr=1e-4, min_lr=1e-5, warmup_steps=0, decay_steps=1000, grad_clip=1.0)
        z = {"stage": stage}
        if offload == "cpu":
            z["offload_optimizer"] = "cpu"
        if offload == "nvme":
            z.update(offload_optimizer="nvme", offload_param="nvme", nvme_path=args["nvme_path"], nvme_block_mb=16)
        zero = ZeroSection(**z, **args.get("zero_set", {}))
        # --construct meta, stage 3: built on the meta device, each unit materialised by GPT.init_parameter
        model, gcfg = _gpt(args, meta=meta and stage == 3)
        strategy = build_strategy(model, mesh, train, zero)
        engine = Engine(model, mesh, train, strategy, gpt_loss_fn(train.precision, mesh.device))
        for i, (x, y) in enumerate(batches):
            if i == args["warmup"]:
                if offload == "nvme":
                    strategy.complete_step()  # the last warm-up step streams under the next forward
                io0 = _disk_io()
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step([(x, y)])
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        if offload == "nvme":
            strategy.complete_step()
        io1 = _disk_io()
        if hasattr(strategy, "close"):
            strategy.close()
    elif kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model, gcfg = _gpt(args, meta=meta)
        dmesh = init_device_mesh("cpu", (info.world_size,))
        reshard = stage == 3
        for b in model.blocks.values():
            fully_shard(b, mesh=dmesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=dmesh, reshard_after_forward=reshard)
        if meta:  # the FSDP2 recipe: shard on meta, allocate the local shards, initialise them
            model.to_empty(device="cpu")
            _init_dtensors(model)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
        except Exception:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        for x, y in batches:
            t0, c0 = time.perf_counter(), time.process_time()
            _, loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
    elif kind == "deepspeed":
        import deepspeed
        zero = {"stage": stage}
        if offload == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
        if offload == "nvme":
            zero["offload_optimizer"] = {"device": "nvme", "nvme_path": args["nvme_path"]}
            zero["offload_param"] = {"device": "nvme", "nvme_path": args["nvme_path"]}
        ds_cfg = {"train_micro_batch_size_per_gpu": max(1, args["tokens"] // block), "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
                  "zero_optimization": zero}
        deepspeed.init_distributed(dist_backend="gloo")
        if meta and stage == 3:  # DeepSpeed's construction for ZeRO-3: partitioned as each module is built
            with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
                model, gcfg = _gpt(args)
        else:
            model, gcfg = _gpt(args)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
        for i, (x, y) in enumerate(batches):
            if i == args["warmup"]:
                io0 = _disk_io()
            t0, c0 = time.perf_counter(), time.process_time()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        io1 = _disk_io()
    measured = times[args["warmup"]:]
    io = None
    if offload == "nvme" and kind != "fsdp2":  # bytes this process moved to and from storage, per step
        io = ((io1[0] - io0[0]) / args["steps"], (io1[1] - io0[1]) / args["steps"])
    return {"step_s": statistics.median(measured), "io_per_step": io,
            "cpu_s": statistics.median(cpus[args["warmup"]:]),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "params": gcfg.num_params()}


@torch.no_grad()
def _init_dtensors(model) -> None:
    """Initialise an FSDP2 model materialised with ``to_empty``: each rank fills its local shard of every
    parameter with the slice of the parameter's single-process initial value (``GPT.init_parameter``)."""
    from torch.distributed.tensor import DTensor
    for name, p in model.named_parameters():
        full = torch.empty(p.shape, dtype=p.dtype)
        model.init_parameter(name, full)
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(p, DTensor):
            n, r = p.device_mesh.size(), p.device_mesh.get_local_rank()
            rows = -(-full.shape[0] // n)
            local.copy_(full[r * rows:(r + 1) * rows][:local.shape[0]])
        else:
            local.copy_(full)


def run(kind, stage, offload, args, nproc):
    from podscale.runtime.launcher import launch
    res = launch(worker, (kind, stage, offload, args), nproc=nproc, quiet=True, start_method="spawn",
                 log_dir=tempfile.mkdtemp(prefix="podscale-bench-"))
    io = [r.get("io_per_step") for r in res.values()]
    both = [sum(x[k] for x in io) for k in (0, 1)] if all(x is not None for x in io) else None
    return {"step_s": max(r["step_s"] for r in res.values()), "peak_rss": max(r["peak_rss"] for r in res.values()),
            "cpu_s": max(r["cpu_s"] for r in res.values()),
            "params": res[0]["params"], "io_per_step": both}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--shape", default=None, choices=[*SHAPES, "all"],
                    help="a model shape instead of --layers/--width/--vocab (all: the three of issue 16 and issue16)")
    ap.add_argument("--construct", default="eager", choices=["eager", "meta"],
                    help="eager: the same GPT built on the CPU for every side; meta: each side's documented "
                         "construction for a model larger than a rank (see the module docstring)")
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--only", default=None, help="comma list of row names to run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--zero-set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra podscale [zero] keys for the podscale rows, e.g. host_mmap_threshold_mb=0")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every row this many times, round robin, and keep each row's fastest run")
    a = ap.parse_args(argv)
    nvme = a.nvme_path or tempfile.mkdtemp(prefix="podscale-nvme-")
    if not a.nvme_path:  # the engines' swap files (DeepSpeed leaves its own behind) go with the folder
        atexit.register(shutil.rmtree, nvme, True)
    base = {"block": a.block, "tokens": a.tokens, "steps": a.steps, "warmup": a.warmup, "nvme_path": nvme,
            "construct": a.construct,
            "zero_set": {k: json.loads(v) for k, v in (kv.split("=", 1) for kv in a.zero_set)}}
    if a.shape is None:
        shapes = [(f"{a.layers}x{a.width}", (a.layers, a.width, a.vocab))]
    else:
        names = [n for n in SHAPES] if a.shape == "all" else [a.shape]
        shapes = [(n, SHAPES[n]) for n in names]
    rows = [("podscale", 1, "none"), ("podscale", 2, "none"), ("podscale", 3, "none"), ("podscale", 2, "cpu"),
            ("podscale", 3, "nvme"), ("fsdp2", 2, "none"), ("fsdp2", 3, "none")]
    try:
        import deepspeed  # noqa: F401
        rows += [("deepspeed", 1, "none"), ("deepspeed", 2, "none"), ("deepspeed", 3, "none"),
                 ("deepspeed", 2, "cpu"), ("deepspeed", 3, "nvme")]
    except Exception as err:
        print(f"DeepSpeed not importable ({type(err).__name__}): its rows are skipped")
    if a.only:
        keep = set(a.only.split(","))
        rows = [r for r in rows if f"{r[0]}-{r[1]}-{r[2]}" in keep]
    construct = ("every side: the same GPT built eagerly on the CPU (seed 0), then handed to the engine"
                 if a.construct == "eager" else
                 "each side's documented construction: podscale stage 3 on the meta device, materialised unit "
                 "by unit; FSDP2 on meta, fully_shard, to_empty + its shards initialised; DeepSpeed stage 3 "
                 "under deepspeed.zero.Init (other stages and DeepSpeed stages 1/2: eager)")
    print(f"model construction: {construct}", flush=True)
    results = {}
    for shape, (layers, width, vocab) in shapes:
        args = dict(base, layers=layers, width=width, vocab=vocab)
        print(f"\n== shape {shape}: {layers} layers x {width} wide, vocabulary {vocab}, {a.tokens} tokens per rank "
              f"(sequence {a.block}), fp32, {a.nproc} ranks", flush=True)
        out = results[shape] = {}
        for rep in range(a.repeat):
            for kind, stage, off in rows:
                name = f"{kind}-{stage}-{off}"
                try:
                    r = run(kind, stage, off, args, a.nproc)
                except Exception as err:
                    print(f"{name:22s} failed: {type(err).__name__}: "
                          f"{str(err).splitlines()[0][:200] if str(err) else ''}")
                    continue
                extra = ""
                if r.get("io_per_step"):
                    rd, wr = r["io_per_step"]
                    extra = (f"  disk per step {rd / 2**20:.0f} MiB read + {wr / 2**20:.0f} MiB written, "
                             f"{(rd + wr) / r['step_s'] / 1e9:.2f} GB/s (both ranks)")
                print(f"[{rep + 1}/{a.repeat}] {name:22s} {r['params'] / 1e6:6.1f}M params  step "
                      f"{r['step_s'] * 1e3:8.1f} ms  process CPU/rank {r['cpu_s'] * 1e3:8.1f} ms  peak RSS/rank {r['peak_rss'] / 2**20:8.0f} MiB{extra}", flush=True)
                if name not in out or r["step_s"] < out[name]["step_s"]:
                    out[name] = r
    if any(k.endswith("nvme") for out in results.values() for k in out):
        from podscale.storage.aio import measure_sequential_bandwidth
        bw = measure_sequential_bandwidth(nvme, 512 << 20)
        print(f"\nswap folder {nvme}: sequential {'O_DIRECT' if bw['direct'] else 'buffered'} write (fsync) "
              f"{bw['write_Bps'] / 1e9:.2f} GB/s, read {bw['read_Bps'] / 1e9:.2f} GB/s")
    print(f"\nratios podscale / peer (step time: fastest of {a.repeat}; peak RSS) — below 1 is podscale faster / "
          f"smaller; model construction: {a.construct}")
    for shape, out in results.items():
        for peer in ("fsdp2", "deepspeed"):
            for stage, off in ((1, "none"), (2, "none"), (3, "none"), (2, "cpu"), (3, "nvme")):
                ours, theirs = out.get(f"podscale-{stage}-{off}"), out.get(f"{peer}-{stage}-{off}")
                if ours and theirs:
                    print(f"  {shape:13s} stage {stage} offload {off:5s} vs {peer:9s}: step "
                          f"{ours['step_s'] / theirs['step_s']:.2f}x, process CPU {ours['cpu_s'] / theirs['cpu_s']:.2f}x, "
                          f"peak RSS {ours['peak_rss'] / theirs['peak_rss']:.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))

if __name__ == "__main__":
    main()
