"""ZeRO-Infinity NVMe offload, podscale vs DeepSpeed: the swap folder's disk bandwidth, then ZeRO-3 with the
optimizer state and the parameters on NVMe, same GPT, same data, bf16 compute with fp32 master weights and
Adam moments (DeepSpeed swaps parameters in bf16 on a CPU-only machine), 2 ranks on gloo.

    python bench/zero_nvme.py [--layers 8 --width 768 --steps 4 --warmup 2 --nvme-path /some/folder]

1. Sequential bandwidth of the folder's disk with O_DIRECT, 8 MiB requests, 4 and 16 in flight, twice
   (:func:`podscale.storage.aio.measure_sequential_bandwidth`): write + fsync, then read; the best read
   and the best write are the yardstick.
2. Each engine in a fresh launch, round robin ``--repeat`` times: median step time after warm-up, and the
   bytes the disk moved per step, from ``/proc/self/io`` (``read_bytes``/``write_bytes``: storage-layer
   traffic of every thread, the same yardstick for both engines; O_DIRECT traffic counts there too).
   podscale also reports its own counters: time in the optimizer step, the part of it spent waiting for
   I/O (exposed: not hidden behind Adam), and the gathers' waits for parameter reads.
3. Prints the step-time ratio podscale / DeepSpeed and podscale's disk traffic as a fraction of the
   measured bandwidth: ``utilisation = (R / read_bw + W / write_bw) / step_time`` (1.0 = the disk moved
   data at its sequential speed for the whole step), over the whole step and over the optimizer step.

DeepSpeed needs its ``async_io`` op: ``libaio-dev`` installed and a JIT build on first use (minutes).
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
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


def _device_io(folder) -> tuple[int, int]:
    """Bytes read / written by the whole block device holding ``folder`` (``/proc/diskstats``, sectors of
    512 bytes): every process's traffic, a cross-check of ``_disk_io`` on a quiet disk."""
    st = os.stat(folder)
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if int(f[0]) == os.major(st.st_dev) and int(f[1]) == os.minor(st.st_dev):
            return int(f[5]) * 512, int(f[9]) * 512
    return 0, 0


def _data(n_tokens: int, steps: int, rank: int, world: int, block: int):
    from podscale.train.data import ShardedLoader, load_tokens, split_tokens
    path = str(SHAKESPEARE) if SHAKESPEARE.is_file() else None
    tokens, _ = split_tokens(load_tokens(path), 0.1)
    micro = max(1, n_tokens // block)
    loader = ShardedLoader(tokens, block, micro * world, micro, rank, world, seed=0)
    return [loader.next_step()[0] for _ in range(steps)]


def _gpt(layers: int, width: int, block: int, meta: bool):
    from podscale.models.gpt import GPT, GPTConfig
    cfg = GPTConfig(n_layer=layers, n_embd=width, n_head=max(1, width // 64), block_size=block)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return GPT(cfg), cfg
    return GPT(cfg), cfg


def worker(kind: str, args: dict) -> dict:
    from podscale.runtime.process import init_process
    info = init_process()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // info.world_size))
    block, steps = args["block"], args["warmup"] + args["steps"]
    batches = _data(args["tokens"], steps + 1, info.rank, info.world_size, block)
    folder = Path(args["nvme_path"]) / f"{kind}-rank{info.rank}"
    folder.mkdir(parents=True, exist_ok=True)
    times, extra = [], {}
    if kind == "podscale":
        from podscale.config import TrainSection, ZeroSection
        from podscale.parallel.zero import build_strategy
        from podscale.runtime.mesh import Mesh
        from podscale.tasks.gpt import gpt_loss_fn
        from podscale.train.engine import Engine
        mesh = Mesh.build(info.device, dp=info.world_size)
        train = TrainSection(lr=1e-4, min_lr=1e-5, warmup_steps=0, decay_steps=1000, grad_clip=1.0,
                             precision=args["precision"])
        zero = ZeroSection(stage=3, offload_optimizer="nvme", offload_param=args["offload_param"], nvme_path=str(folder),
                           nvme_block_mb=args["block_mb"])
        model, gcfg = _gpt(args["layers"], args["width"], block, meta=True)
        st = build_strategy(model, mesh, train, zero)
        engine = Engine(model, mesh, train, st, gpt_loss_fn(train.precision, mesh.device))
        for i, (x, y) in enumerate(batches[:-1]):
            if i == args["warmup"]:
                st.complete_step()  # the last warm-up step's optimizer step, outside the window
                io0, dev0 = _disk_io(), _device_io(folder)
                sw = st.state.swap
                c0 = (sw.step_s, sw.step_exposed_s, st.state.param_wait_s, st.state.param_demand_reads,
                      sw.file.bytes_read, sw.file.bytes_written, st.state.param_captured)
                t_all = time.perf_counter()
            t0 = time.perf_counter()
            engine.step([(x, y)])
            times.append(time.perf_counter() - t0)
        st.complete_step()  # the last step streams under the next forward (overlap): finish it here
        t_all = (time.perf_counter() - t_all) / args["steps"]
        io1, dev1 = _disk_io(), _device_io(folder)
        sw, n = st.state.swap, args["steps"]
        c1 = (sw.step_s, sw.step_exposed_s, st.state.param_wait_s, st.state.param_demand_reads,
              sw.file.bytes_read, sw.file.bytes_written, st.state.param_captured)
        d = [(b - a) / n for a, b in zip(c0, c1)]
        # one more step with the optimizer step run at once (not under the next forward): the streaming
        # engine's own bandwidth, the disk's whole time devoted to it
        st.overlap_step = False
        s0 = sw.step_s
        engine.step([batches[-1]])
        extra = {"optim_step_s": d[0], "optim_exposed_s": d[1], "param_wait_s": d[2], "demand_reads": d[3],
                 "app_read": d[4], "app_written": d[5], "direct": sw.file.direct, "wall_per_step_s": t_all,
                 "optim_alone_s": sw.step_s - s0, "captured": d[6],
                 # what one optimizer step moves: gradient, master, moments in; master, moments, params out
                 "optim_read": 16 * sw.S, "optim_written": (12 + sw.psize) * sw.S}
        st.close()
    else:
        import deepspeed
        model, gcfg = _gpt(args["layers"], args["width"], block, meta=False)
        if args.get("untie"):  # diagnostic: a separate output head instead of the tied embedding
            model.lm_head.weight = torch.nn.Parameter(model.wte.weight.detach().clone())
        nvme = {"device": "nvme", "nvme_path": str(folder)}
        zero = {"stage": 3,
                "offload_optimizer": dict(nvme, pipeline_read=True, pipeline_write=True, buffer_count=4),
                "offload_param": dict(nvme, buffer_count=args["ds_param_buffers"], buffer_size=int(4e7),
                                      max_in_cpu=args["ds_max_in_cpu"])}
        if args["offload_param"] != "nvme":
            del zero["offload_param"]
        if args.get("ds_no_prefetch"):  # its NVMe parameter prefetch fails on this model (BENCHMARKS.md)
            zero["stage3_prefetch_bucket_size"] = 0
        ds_cfg = {"train_micro_batch_size_per_gpu": max(1, args["tokens"] // block), "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.1}},
                  "zero_optimization": zero, "bf16": {"enabled": args["precision"] == "bf16"},
                  "aio": {"block_size": 1 << 20, "queue_depth": 8, "intra_op_parallelism": 4,
                          "single_submit": False, "overlap_events": True}}
        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
        for i, (x, y) in enumerate(batches):
            if i == args["warmup"]:
                io0, dev0 = _disk_io(), _device_io(folder)
            t0 = time.perf_counter()
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - t0)
            if i + 1 == steps:
                break
        io1, dev1 = _disk_io(), _device_io(folder)
    n = args["steps"]
    import resource
    return dict(extra, step_s=statistics.median(times[args["warmup"]:]), params=gcfg.num_params(),
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                disk_read=(io1[0] - io0[0]) / n, disk_written=(io1[1] - io0[1]) / n,
                device_read=(dev1[0] - dev0[0]) / n, device_written=(dev1[1] - dev0[1]) / n)


def run(kind: str, args: dict, nproc: int) -> dict:
    """One launch; per-rank figures combined: slowest rank's step time, disk bytes summed (one disk)."""
    from podscale.runtime.launcher import launch
    res = launch(worker, (kind, args), nproc=nproc, quiet=True, start_method="spawn", log_dir=tempfile.mkdtemp(prefix="podscale-bench-"))
    rs = list(res.values())
    out = {"step_s": max(r["step_s"] for r in rs), "params": rs[0]["params"],
           "peak_rss": max(r["peak_rss"] for r in rs)}
    for k in ("disk_read", "disk_written", "app_read", "app_written", "optim_read", "optim_written"):
        if k in rs[0]:
            out[k] = sum(r[k] for r in rs)
    for k in ("device_read", "device_written"):  # device-wide already: the larger rank's window
        out[k] = max(r[k] for r in rs)
    for k in ("optim_step_s", "optim_exposed_s", "param_wait_s", "demand_reads", "direct", "wall_per_step_s",
              "optim_alone_s", "captured"):
        if k in rs[0]:
            out[k] = max(r[k] for r in rs)
    return out


def utilisation(r: dict, bw: dict, seconds: float) -> float:
    """Fraction of ``seconds`` the disk would need at its measured sequential speeds for r's traffic."""
    return (r["disk_read"] / bw["read_Bps"] + r["disk_written"] / bw["write_Bps"]) / seconds


def optim_utilisation(r: dict, bw: dict) -> float:
    """The same over podscale's optimizer step run alone, at once after backward (its sub-group reads and
    write-behind; the training steps stream it under the next forward instead)."""
    return (r["optim_read"] / bw["read_Bps"] + r["optim_written"] / bw["write_Bps"]) / r["optim_alone_s"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank per step")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--block-mb", type=float, default=8.0, help="podscale zero.nvme_block_mb")
    ap.add_argument("--bw-mb", type=int, default=1024, help="bytes written and read for the bandwidth test")
    ap.add_argument("--nvme-path", default=None, help="swap folder (default: a new folder under /var/tmp)")
    ap.add_argument("--only", default="podscale,deepspeed")
    ap.add_argument("--ds-param-buffers", type=int, default=5,
                    help="DeepSpeed offload_param.buffer_count (its default is 5)")
    ap.add_argument("--ds-no-prefetch", action="store_true",
                    help="DeepSpeed: stage3_prefetch_bucket_size=0 (no parameter prefetch)")
    ap.add_argument("--untie", action="store_true",
                    help="diagnostic, DeepSpeed only: untie its output head from the input embedding")
    ap.add_argument("--offload-param", default="nvme", choices=["nvme", "cpu", "none"],
                    help="parameters on NVMe too (ZeRO-Infinity) or only the optimizer state")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                    help="compute dtype of both engines (master weights and moments are fp32 either way)")
    ap.add_argument("--ds-max-in-cpu", type=float, default=0,
                    help="DeepSpeed offload_param.max_in_cpu: parameter elements it may keep in host memory "
                         "instead of on NVMe (0: all on NVMe, as podscale; DeepSpeed's default is 1e9)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    nvme = a.nvme_path or tempfile.mkdtemp(prefix="podscale-nvme-", dir="/var/tmp")
    if not a.nvme_path:  # the engines' swap files (DeepSpeed leaves its own behind) go with the folder
        atexit.register(shutil.rmtree, nvme, True)
    from podscale.storage.aio import measure_sequential_bandwidth
    bw = {"write_Bps": 0.0, "read_Bps": 0.0}
    for threads in (4, 16, 4, 16):  # the disk's best: several queue depths, twice (a shared machine)
        m = measure_sequential_bandwidth(nvme, a.bw_mb << 20, threads=threads, block_bytes=8 << 20)
        print(f"swap folder {nvme}: sequential {'O_DIRECT' if m['direct'] else 'buffered'} write+fsync "
              f"{m['write_Bps'] / 1e9:.2f} GB/s, read {m['read_Bps'] / 1e9:.2f} GB/s "
              f"({a.bw_mb} MiB, 8 MiB requests, {threads} in flight)", flush=True)
        bw = {k: max(bw[k], m[k]) for k in bw}
    print(f"yardstick (best of each): write {bw['write_Bps'] / 1e9:.2f} GB/s, read {bw['read_Bps'] / 1e9:.2f} GB/s",
          flush=True)
    args = {"layers": a.layers, "width": a.width, "block": a.block, "tokens": a.tokens, "steps": a.steps,
            "warmup": a.warmup, "nvme_path": nvme, "block_mb": a.block_mb,
            "offload_param": a.offload_param, "ds_param_buffers": a.ds_param_buffers,
            "untie": a.untie, "ds_no_prefetch": a.ds_no_prefetch, "precision": a.precision,
            "ds_max_in_cpu": int(a.ds_max_in_cpu)}
    kinds = a.only.split(",")
    runs: dict[str, list] = {k: [] for k in kinds}
    for rep in range(a.repeat):
        for kind in kinds:
            try:
                r = run(kind, args, a.nproc)
            except Exception as err:
                msg = str(err).strip().splitlines()
                print(f"[{rep + 1}/{a.repeat}] {kind:9s} failed: {type(err).__name__}: "
                      f"{msg[-1][:300] if msg else ''}", flush=True)
                continue
            runs[kind].append(r)
            line = (f"[{rep + 1}/{a.repeat}] {kind:9s} {r['params'] / 1e6:.1f}M params  step {r['step_s'] * 1e3:7.0f} ms"
                    f"  disk per step: read {r['disk_read'] / 2**20:6.0f} MiB, written {r['disk_written'] / 2**20:6.0f} MiB"
                    f"  ({(r['disk_read'] + r['disk_written']) / r['step_s'] / 1e9:.2f} GB/s, "
                    f"utilisation {utilisation(r, bw, r['step_s']):.2f}); whole device: read "
                    f"{r['device_read'] / 2**20:.0f} MiB, written {r['device_written'] / 2**20:.0f} MiB; "
                    f"peak RSS/rank {r['peak_rss'] / 2**20:.0f} MiB")
            if kind == "podscale":
                line += (f"\n      wall time per step with the last step finished {r['wall_per_step_s'] * 1e3:.0f} ms; "
                         f"optimizer step on the main thread {r['optim_step_s'] * 1e3:.0f} ms (waiting for I/O "
                         f"{r['optim_exposed_s'] * 1e3:.0f} ms); run alone {r['optim_alone_s'] * 1e3:.0f} ms, "
                         f"disk utilisation {optim_utilisation(r, bw):.2f}; gathers waited "
                         f"{r['param_wait_s'] * 1e3:.0f} ms for parameter reads, demand reads "
                         f"{r['demand_reads']:.0f}, shards taken from the step's buffers {r['captured']:.0f}, "
                         f"O_DIRECT {r['direct']}; podscale's own count: read {r['app_read'] / 2**20:.0f} MiB, "
                         f"written {r['app_written'] / 2**20:.0f} MiB per step")
            print(line, flush=True)
    med = {k: statistics.median(x["step_s"] for x in v) for k, v in runs.items() if v}
    if "podscale" in med and "deepspeed" in med:
        print(f"\nstep time podscale / DeepSpeed: {med['podscale'] / med['deepspeed']:.2f} "
              f"(medians over {len(runs['podscale'])} and {len(runs['deepspeed'])} runs; < 1: podscale faster; "
              f"throughput ratio {med['deepspeed'] / med['podscale']:.2f}x)")
    if runs.get("podscale"):
        u = statistics.median(utilisation(r, bw, r["step_s"]) for r in runs["podscale"])
        uo = statistics.median(optim_utilisation(r, bw) for r in runs["podscale"])
        print(f"podscale disk utilisation: {u:.2f} over the whole step, {uo:.2f} over the optimizer step run "
              "alone (fraction of the time the disk needs at its measured sequential bandwidth)")
    if a.json:
        Path(a.json).write_text(json.dumps({"bandwidth": bw, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
