"""Hardware catalog: accelerators, nodes, networks and the systems built from them.

Every built-in system is a TOML file in ``podscale/plan/systems/`` whose numbers carry their source
in a comment. Users add their own systems as TOML files with the same keys, either passed by path
(``--system my-cluster.toml``) or dropped into ``$PODSCALE_CACHE/systems/`` (default
``~/.cache/podscale/systems/``). The special name ``local`` reads the file written by
``podscale plan calibrate`` (``$PODSCALE_CACHE/local.toml``).

Units inside TOML are the ones datasheets use (TFLOP/s, GiB, GB/s, microseconds); the dataclasses
below hold SI units (FLOP/s, bytes, bytes/s, seconds) so the cost model never converts.
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import cache_dir

GiB = 1024**3
GB = 1e9

BUILTIN_DIR = Path(__file__).with_name("systems")
TOPOLOGIES = ("switch", "fat-tree", "torus", "weight-streaming", "host")


class CatalogError(ValueError):
    """A system name or file that cannot be used; the message says how to fix it."""


@dataclass(frozen=True)
class Device:
    name: str
    peak_flops: float            # dense 16-bit matmul peak, FLOP/s
    memory_bytes: float
    memory_bw: float             # bytes/s
    matmul_efficiency: float     # achievable fraction of peak on large GEMMs
    memory_efficiency: float     # achievable fraction of memory bandwidth on streaming kernels
    reserved_bytes: float        # runtime overhead never available to the model
    dtype_bytes: int = 2         # bytes per activation/weight element in training (16-bit; 4 on CPU)
    # Measured (local only): achieved bytes/s of element-wise kernels (GeLU, layer norm, softmax),
    # which on a CPU are compute-bound well below the copy bandwidth; 0 -> memory_bw * memory_efficiency.
    elementwise_bw: float = 0.0
    # Measured (local only): the same rate at several activation sizes, tuples (bytes of one tokens x hidden
    # activation, bytes/s); a CPU runs them faster while a layer's activations stay in its caches.
    elementwise_table: tuple = ()
    # Measured (local only): bytes/s of an MoE layer's routing, dispatch and combine (gate.route, the aux and
    # z losses, the gathers and index_add of the rows, forward and backward: many small sorting, counting and
    # indexing kernels) in the planner's byte count of them (``gpt_cost.moe_routing_bytes``), at several sizes,
    # tuples (bytes, bytes/s); () -> memory_bw * memory_efficiency.
    routing_table: tuple = ()
    # Host-side cost per kernel when kernels run synchronously (CPU); GPUs queue kernels asynchronously,
    # so it is 0 there.
    kernel_overhead: float = 0.0
    # Measured (local only): what a collective overlapped with a matmul costs beyond the longer of the two,
    # per collective. On a CPU whose cores all compute, the collective's worker thread competes with them
    # for every message round trip; GPUs run collectives on their own engines, so it is 0 there.
    overlap_penalty: float = 0.0
    # Measured (local only): the fraction of an overlapped collective's own time that the overlap still
    # costs, (overlapped - matmul alone) / all-reduce alone, for a bucket-sized all-reduce under a longer
    # matmul. 0: fully hidden (GPUs: collectives run on their own engines); on a CPU whose cores all
    # compute, gloo's reductions and copies take core time from the matmul, so close to 1 (or above).
    overlap_exposed: float = 0.0
    # Measured (local only): bytes/s of the optimizer step as podscale runs it (torch's fused AdamW,
    # counted as ADAM_BYTES_PER_PARAM per parameter) and of the per-step gradient passes (global norm,
    # clipping, zeroing; GRAD_PASS_BYTES_* per parameter); 0 -> memory_bw * memory_efficiency.
    optimizer_bw: float = 0.0
    grad_pass_bw: float = 0.0
    # Measured (local only): bytes/s of filling memory whose pages went back to the OS. ZeRO-3 on a CPU trims
    # its heap every step (podscale's ZeroStrategy), so each step faults its working set in again; 0: not
    # priced (GPUs: the caching allocator keeps its memory).
    first_touch_bw: float = 0.0
    # Measured matmul throughput by shape (local calibration only): tuples (m, n, k, flop/s).
    matmul_table: tuple = ()
    # Measured fused causal attention (torch's scaled_dot_product_attention) by shape (local calibration
    # only): tuples (seq, head_dim, forward flop/s, backward flop/s), both rates in the forward's FLOPs
    # 2 s^2 d per head (the unmasked half of QK^T and PV), so the backward's time is those FLOPs / its rate.
    attention_table: tuple = ()
    # GEMM shape model (compute.gemm_time): streaming multiprocessors, the output tiles a GEMM library
    # picks from, the k step of its main loop, the per-tile fill/drain in k, and the operand bytes per
    # second one SM can load (L2), which makes small tiles slower. sm_count = 0: no shape model.
    sm_count: int = 0
    gemm_tiles: tuple = ()
    gemm_tile_k: int = 32
    gemm_tile_overhead_k: float = 0.0
    l2_bw: float = 0.0


TABLE_OPS = ("dedup", "keyed_get", "keyed_put", "create", "dense_get", "dense_put", "cached_get", "cached_put",
             "ssd_get", "ssd_put", "pool", "update", "copy", "step_row", "step_pooled")


@dataclass(frozen=True)
class TableRates:
    """Measured host cost of the operations a sharded embedding table runs per step (``[table]`` of a
    calibrated ``local`` system, :func:`podscale.plan.calibrate.measure_table_rates`): each op costs
    ``call + items * per_item + floats * per_float`` seconds (a call's fixed host cost, a per-key cost such
    as a key-index search, a per-float cost of moving row data).  ``step_row`` / ``step_pooled``: a whole
    table step (forward and backward) of one id on one rank, items = tables: the host cost a step pays
    per table and per step whatever its size (Python bookkeeping, and every operation's call once)."""

    ops: dict = field(default_factory=dict)   # name -> (call_s, per_item_s, per_float_s)

    def time(self, op: str, items: float, floats: float = 0.0, call: bool = True) -> float:
        """Seconds of one call on ``items`` (``call=False``: without its fixed cost, which a step pays in
        its ``step_*`` cost)."""
        fixed, per_item, per_float = self.ops[op]
        return (fixed * call + items * per_item + floats * per_float) if items > 0 else 0.0

    @classmethod
    def from_dict(cls, data: dict, source: str = "") -> "TableRates":
        missing = [op for op in TABLE_OPS if op not in data]
        if missing:
            raise CatalogError(f"{source}: [table] lacks {', '.join(missing)}: rerun `podscale plan calibrate`")
        return cls({op: tuple(float(x) for x in data[op]) for op in TABLE_OPS})


@dataclass(frozen=True)
class Link:
    """One class of link as seen by one device: bandwidth per direction, achievable fraction, latency."""

    bandwidth: float             # bytes/s per device per direction
    efficiency: float
    latency: float               # seconds per message (per ring step)
    # Measured (local only): the bandwidth of the transport's reduce-scatter and all-gather as the trainer
    # issues them, when they are not the ring halves of its all-reduce (gloo: a reduce / broadcast per
    # rank); 0 -> the ring's, ``bandwidth``.
    reduce_scatter_bandwidth: float = 0.0
    all_gather_bandwidth: float = 0.0
    # Measured (local only): seconds every collective or message issued between compute kernels pays once
    # beyond its ring-model time, whatever its kind and size (the ranks reach it at different moments, and a
    # gloo thread hand-off now and then waits for a scheduler tick: ``plan calibrate``'s sync_wait_us).
    sync_wait: float = 0.0

    @property
    def effective(self) -> float:
        return self.bandwidth * self.efficiency

    def effective_for(self, collective: str) -> float:
        """Effective bandwidth of ``collective`` ("all_reduce", "reduce_scatter" or "all_gather")."""
        own = {"reduce_scatter": self.reduce_scatter_bandwidth, "all_gather": self.all_gather_bandwidth}
        return (own.get(collective) or self.bandwidth) * self.efficiency


@dataclass(frozen=True)
class Host:
    memory_bytes: float
    memory_bw: float
    pcie_bw: float               # bytes/s per device, host <-> device
    nvme_bw: float               # bytes/s per node


@dataclass(frozen=True)
class System:
    name: str
    description: str
    topology: str
    device: Device
    devices_per_node: int
    max_devices: int             # 0: unbounded (nodes on a switched fabric)
    host: Host
    intra: Link | None = None    # inside a node (NVLink/NVSwitch, shared memory)
    inter: Link | None = None    # across nodes, per device's share of the node's NICs
    torus: tuple = ()            # torus dimensions, fastest-varying first (TPU)
    ici: Link | None = None      # one torus link (TPU); a ring uses both directions
    stream: Link | None = None   # weight-streaming I/O per wafer (Cerebras)
    source: str = ""             # file the description came from
    extra: dict = field(default_factory=dict)
    # Published results this description was checked against (plan validate); () -> unvalidated.
    validated: tuple = ()
    # Measured host cost of a sharded table's operations (calibrated CPU systems only); None: the DLRM cost
    # model prices tables by bytes moved at memory bandwidth.
    table: TableRates | None = None

    @property
    def device_is_host(self) -> bool:
        """The devices are the host's own CPU cores (a calibrated ``local`` CPU system): host memory is the
        devices' memory, so offloading to the CPU moves nothing and frees nothing."""
        return self.topology == "host"

    @property
    def collective_wait(self) -> float:
        """Seconds every collective or point-to-point message pays once beyond its size's time: the measured
        wait of one issued between compute kernels on a calibrated CPU (``Link.sync_wait``), 0 on the catalog's
        systems, whose per-step latencies are all their links have."""
        return max((link.sync_wait for link in (self.intra, self.inter, self.ici, self.stream) if link is not None),
                   default=0.0)

    @property
    def data_parallel_only(self) -> bool:
        return self.topology == "weight-streaming"

    def check_devices(self, devices: int) -> None:
        """Raise CatalogError when ``devices`` cannot be built from this system."""
        if devices < 1:
            raise CatalogError(f"--devices must be >= 1, got {devices}")
        if self.max_devices and devices > self.max_devices:
            raise CatalogError(
                f"system {self.name} has at most {self.max_devices} devices, asked for {devices}; "
                "use a larger system or fewer devices")
        if self.topology in ("switch", "fat-tree") and devices > self.devices_per_node \
                and devices % self.devices_per_node:
            raise CatalogError(
                f"{devices} devices of {self.name} is not a whole number of {self.devices_per_node}-device "
                f"nodes; use a multiple of {self.devices_per_node}")


def _link(table: dict, key: str = "bandwidth_gbps", calibration: dict | None = None) -> Link:
    """A link table of a system file.  ``calibration``: the file's ``[calibration]`` section, for a local file
    written before links carried their own ``sync_wait_us``: its latency then holds the wait spread over an
    all-reduce's 2 (ranks - 1) steps, which is taken back out into the link's per-collective wait."""
    latency, wait = float(table.get("latency_us", 0.0)) * 1e-6, float(table.get("sync_wait_us", 0.0)) * 1e-6
    if "sync_wait_us" not in table and calibration and "sync_wait_us" in calibration:
        wait = float(calibration["sync_wait_us"]) * 1e-6
        latency = max(0.0, latency - wait / (2 * (int(calibration.get("ranks", 2)) - 1)))
    return Link(bandwidth=float(table[key]) * GB, efficiency=float(table.get("efficiency", 1.0)),
                latency=latency, reduce_scatter_bandwidth=float(table.get("reduce_scatter_gbps", 0.0)) * GB,
                all_gather_bandwidth=float(table.get("all_gather_gbps", 0.0)) * GB, sync_wait=wait)


def system_from_dict(data: dict, source: str = "") -> System:
    """Build a System from the parsed TOML schema used by the files in ``plan/systems``."""
    try:
        dev = data["device"]
        topology = data.get("topology", "switch")
        if topology not in TOPOLOGIES:
            raise CatalogError(f"{source}: topology must be one of {', '.join(TOPOLOGIES)}, got {topology!r}")
        table = tuple(tuple(float(x) for x in row) for row in dev.get("matmul_table", ()))
        device = Device(
            name=str(dev.get("name", data["name"])),
            peak_flops=float(dev["peak_tflops"]) * 1e12,
            memory_bytes=float(dev["memory_gib"]) * GiB,
            memory_bw=float(dev["memory_bw_gbps"]) * GB,
            matmul_efficiency=float(dev.get("matmul_efficiency", 1.0)),
            memory_efficiency=float(dev.get("memory_efficiency", 1.0)),
            reserved_bytes=float(dev.get("reserved_gib", 0.0)) * GiB,
            dtype_bytes=int(dev.get("dtype_bytes", 2)),
            elementwise_bw=float(dev.get("elementwise_gbps", 0.0)) * GB,
            elementwise_table=tuple((float(a), float(r) * GB) for a, r in dev.get("elementwise_table", ())),
            routing_table=tuple((float(a), float(r) * GB) for a, r in dev.get("moe_routing_table", ())),
            kernel_overhead=float(dev.get("kernel_overhead_us", 0.0)) * 1e-6,
            overlap_penalty=float(dev.get("overlap_penalty_us", 0.0)) * 1e-6,
            overlap_exposed=float(dev.get("overlap_exposed", 0.0)),
            optimizer_bw=float(dev.get("optimizer_gbps", 0.0)) * GB,
            grad_pass_bw=float(dev.get("grad_pass_gbps", 0.0)) * GB,
            first_touch_bw=float(dev.get("first_touch_gbps", 0.0)) * GB,
            matmul_table=table,
            attention_table=tuple(tuple(float(x) for x in row) for row in dev.get("attention_table", ())),
            sm_count=int(dev.get("sm_count", 0)),
            gemm_tiles=tuple(tuple(int(x) for x in t) for t in dev.get("gemm_tiles", ())),
            gemm_tile_k=int(dev.get("gemm_tile_k", 32)),
            gemm_tile_overhead_k=float(dev.get("gemm_tile_overhead_k", 0.0)),
            l2_bw=float(dev.get("l2_bw_gbps", 0.0)) * GB,
        )
        if device.sm_count and not device.gemm_tiles:
            raise CatalogError(f"{source}: [device] sm_count needs gemm_tiles = [[rows, cols], ...]")
        h = data.get("host", {})
        validated = data.get("validated", [])
        host = Host(memory_bytes=float(h.get("memory_gib", 0)) * GiB,
                    memory_bw=float(h.get("memory_bw_gbps", 0)) * GB,
                    pcie_bw=float(h.get("pcie_gbps", 0)) * GB, nvme_bw=float(h.get("nvme_gbps", 0)) * GB)
        system = System(
            name=str(data["name"]), description=str(data.get("description", "")), topology=topology,
            device=device, devices_per_node=int(data.get("devices_per_node", 1)),
            max_devices=int(data.get("max_devices", 0)), host=host,
            intra=_link(data["intra_node"], calibration=data.get("calibration")) if "intra_node" in data else None,
            inter=_link(data["inter_node"], calibration=data.get("calibration")) if "inter_node" in data else None,
            torus=tuple(int(x) for x in data.get("torus", ())),
            ici=_link(data["ici"], "link_gbps") if "ici" in data else None,
            stream=_link(data["stream"], "io_gbps") if "stream" in data else None,
            source=source, extra={k: v for k, v in data.items() if k == "calibration"},
            validated=tuple(str(x) for x in validated),
            table=TableRates.from_dict(data["table"], source) if "table" in data else None,
        )
    except KeyError as e:
        raise CatalogError(f"system file {source or '<dict>'} lacks key {e.args[0]!r}") from None
    if system.topology in ("switch", "fat-tree", "host") and (system.intra is None or system.inter is None):
        raise CatalogError(f"system {system.name}: topology {system.topology} needs [intra_node] and [inter_node]")
    if system.topology == "torus" and (not system.torus or system.ici is None):
        raise CatalogError(f"system {system.name}: topology torus needs torus = [..] and [ici]")
    if system.topology == "weight-streaming" and system.stream is None:
        raise CatalogError(f"system {system.name}: topology weight-streaming needs [stream]")
    return system


def load_system_file(path: str | os.PathLike) -> System:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise CatalogError(f"system file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise CatalogError(f"system file {path} is not valid TOML: {e}") from None
    return system_from_dict(data, str(path))


def _user_dir() -> Path:
    return cache_dir() / "systems"


def system_names() -> list[str]:
    """Built-in names, then user systems, then ``local``."""
    names = sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))
    if _user_dir().is_dir():
        names += sorted(p.stem for p in _user_dir().glob("*.toml") if p.stem not in names)
    return names + ["local"]


def local_system_path() -> Path:
    return cache_dir() / "local.toml"


def as_system(system: "System | str") -> System:
    """``system`` itself, or the system a name or path resolves to (:func:`load_system`): what every
    planner entry point that takes either does first."""
    return load_system(system) if isinstance(system, str) else system


def load_system(name: str) -> System:
    """Resolve a system by name (built-in, user, ``local``) or by a path to a TOML file."""
    if name.endswith(".toml") or os.sep in name:
        return load_system_file(name)
    if name == "local":
        path = local_system_path()
        if not path.exists():
            raise CatalogError(f"system 'local' is not calibrated yet ({path} missing); "
                               "run `podscale plan calibrate` first")
        return load_system_file(path)
    for folder in (BUILTIN_DIR, _user_dir()):
        path = folder / f"{name}.toml"
        if path.exists():
            return load_system_file(path)
    raise CatalogError(f"unknown system {name!r}; known systems: {', '.join(system_names())} "
                       "(or pass a path to a TOML system file)")
