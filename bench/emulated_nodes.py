"""Nodes joined by a network of a chosen speed, emulated on this one Linux machine, for the benches that compare
how much two ways of exchanging data send (`bench/moe.py`, `bench/moe_dispatch.py`: `--link-mbit`).

On loopback, gloo moves a megabyte in well under a millisecond, so bytes saved barely show in time; a real
cluster's inter-node links are far slower against its compute. This builds, for one bench run, one Linux network
namespace per node, each joined to one bridge by a veth pair whose two ends are each rate-limited by a token
bucket (`tc ... tbf`): a node's link carries at most `mbit` Mbit/s each way, like a full-duplex NIC. A worker
enters its node's namespace after it has connected to the launcher's store (on the host's loopback; a launched
program instead reaches a store on the bridge, :attr:`EmulatedNodes.host_address`) and before gloo opens its
sockets, so its traffic to a rank of another node crosses that node's link and the
bridge, and its traffic to a rank of its own node stays inside the namespace (the kernel's loopback: not
limited, as the GPUs of one node are joined by NVLink).

Only what this creates is removed: every name carries a tag of this run. It needs root (network namespaces,
`tc`) and iproute2. No delay is added (`netem` is not in every kernel); the links' latency is the kernel's.

How fast to make the link: what matters is the work a rank does per byte the link carries. `balanced_mbit` gives
a link on which this machine's ranks have the same flops per element sent as GPUs of a given speed and network
have per element they send (an A100 at 312 TFLOP/s dense bf16 with one 200 Gbit/s HDR InfiniBand port a GPU, as
in a DGX A100 cluster, or an H100 at 989 TFLOP/s with one 400 Gbit/s NDR port): the GPUs' data-sheet peak against
the ranks' measured best matmul rate (GPUs reach 80-90 % of theirs on large GEMMs, so the balance holds to about
20 %).
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from podscale.runtime.process import ProcessInfo

_CLONE_NEWNET = 0x40000000
_SUBNET = "10.213.77"
#: (dense 16-bit TFLOP/s a GPU, Gbit/s of inter-node link a GPU) of two clusters, from their makers' data sheets
GPU_CLUSTERS = {"dgx-a100": (312.0, 200.0), "dgx-h100": (989.0, 400.0)}


def balanced_mbit(cluster: str, rank_gflops: float, ranks_per_node: int, element_bytes: int = 4) -> float:
    """A node link's Mbit/s that gives ``ranks_per_node`` ranks of ``rank_gflops`` each, sending ``element_bytes``
    elements, the flops per element sent that ``cluster``'s GPUs have sending 16-bit elements over their links:
    ``F = gpu_flops / (gpu_link_bits / 16)`` flops an element, then ``link_bits = ranks x rank_flops / F x 8
    element_bytes``."""
    tflops, gbit = GPU_CLUSTERS[cluster]
    flops_per_element = tflops * 1e12 / (gbit * 1e9 / 8 / 2)
    return ranks_per_node * rank_gflops * 1e9 / flops_per_element * element_bytes * 8 / 1e6


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip() or done.stdout.strip()}")


@dataclass
class EmulatedNodes:
    """``nodes`` network namespaces on one bridge, each node's link ``mbit`` Mbit/s each way (see the module).
    Use as a context manager in the launching process; pass it to the workers, which call :meth:`init_process`."""

    nodes: int
    mbit: float
    mtu: int = 9000
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    _made: list = field(default_factory=list, repr=False)

    def namespace(self, node: int) -> str:
        return f"podscale-{self.tag}-node{node}"

    def interface(self, node: int) -> str:
        """The node side of its veth pair, inside its namespace (15 characters at most, as Linux wants)."""
        return f"vn{self.tag}n{node}"

    def address(self, node: int) -> str:
        return f"{_SUBNET}.{node + 1}"

    @property
    def host_address(self) -> str:
        """The launching host's address on the nodes' bridge (not rate-limited on its side)."""
        return f"{_SUBNET}.254"

    def __enter__(self) -> "EmulatedNodes":
        if os.geteuid() != 0:
            raise SystemExit("--link-mbit needs root (network namespaces and tc): run as root, or drop --link-mbit")
        if self.nodes < 2 or self.nodes > 200 or self.mbit <= 0:
            raise SystemExit(f"--link-mbit: {self.nodes} nodes at {self.mbit} Mbit/s: want 2-200 nodes and a "
                             "positive rate")
        taken = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
        if f" {_SUBNET}." in taken:
            raise SystemExit(f"--link-mbit: {_SUBNET}.0/24 is in use (another bench's emulated nodes?): wait for it to "
                             "end, or remove that network")
        try:
            self._build()
        except Exception:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self) -> None:
        bridge = f"br{self.tag}"
        # a token bucket as small as the kernel allows at this rate keeps short messages from bursting through
        burst = max(2 * self.mtu, int(self.mbit * 1e6 / 8 * 100e-6))
        shape = ("root", "tbf", "rate", f"{self.mbit}mbit", "burst", str(burst), "latency", "200ms")
        _run("ip", "link", "add", bridge, "type", "bridge")
        self._made.append(("link", bridge))
        _run("ip", "link", "set", bridge, "mtu", str(self.mtu), "up")
        # the host's own address on the bridge: where a launcher's rendezvous store listens for the nodes
        _run("ip", "addr", "add", f"{self.host_address}/24", "dev", bridge)
        for node in range(self.nodes):
            ns, inside, outside = self.namespace(node), self.interface(node), f"vh{self.tag}n{node}"
            _run("ip", "netns", "add", ns)
            self._made.append(("netns", ns))
            _run("ip", "link", "add", outside, "mtu", str(self.mtu), "type", "veth", "peer", "name", inside,
                 "mtu", str(self.mtu))
            self._made.append(("link", outside))
            _run("ip", "link", "set", inside, "netns", ns)
            _run("ip", "link", "set", outside, "master", bridge, "up")
            _run("tc", "qdisc", "add", "dev", outside, *shape)            # into the node
            _run("ip", "-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", inside)
            _run("ip", "-n", ns, "link", "set", inside, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", inside, *shape)   # out of the node

    def __exit__(self, *exc) -> None:
        for kind, name in reversed(self._made):
            cmd = ("ip", "netns", "del", name) if kind == "netns" else ("ip", "link", "del", name)
            subprocess.run(cmd, capture_output=True)
        self._made.clear()

    # -- in a worker -------------------------------------------------------------------------------------

    def enter(self, node: int) -> None:
        """Move the calling thread (and every thread and socket it makes from now on) into ``node``'s namespace."""
        fd = os.open(f"/var/run/netns/{self.namespace(node)}", os.O_RDONLY)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.namespace(node)} failed")
        finally:
            os.close(fd)

    def join(self, ranks_per_node: int) -> None:
        """Enter this worker's node (``RANK // ranks_per_node``) and point gloo at its interface: for a worker whose
        launcher's store listens on :attr:`host_address` (``launch(..., host=nodes.host_address)``), which it
        reaches over its node's link, before it starts its process group."""
        rank = int(os.environ["RANK"])
        node = rank // ranks_per_node
        self.enter(node)
        os.environ["GLOO_SOCKET_IFNAME"] = self.interface(node)
        # what torchrun would tell a worker of a node of ranks_per_node (the per-node dispatch reads it)
        os.environ.update(LOCAL_RANK=str(rank % ranks_per_node), LOCAL_WORLD_SIZE=str(ranks_per_node))

    def init_process(self, ranks_per_node: int, timeout_s: float = 600.0) -> ProcessInfo:
        """The gloo process group of a worker started by podscale's launcher, its sockets on its node's link:
        connects to the launcher's store first (on the host's loopback), then enters node ``rank //
        ranks_per_node`` and starts gloo on that node's interface."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                              timeout=timedelta(seconds=timeout_s))
        node = rank // ranks_per_node
        self.enter(node)
        os.environ["GLOO_SOCKET_IFNAME"] = self.interface(node)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"emulated-{self.tag}", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        return ProcessInfo(rank, world, int(os.environ.get("LOCAL_RANK", "0")), torch.device("cpu"), 0)

    # -- checking the link -----------------------------------------------------------------------------------

    def measure_mbit(self, a: int = 0, b: int = 1, mbytes: int = 16) -> float:
        """Mbit/s one TCP stream gets from node ``a`` to node ``b`` (run in the launching process)."""
        port = 29999
        server = ("import socket;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
                  f"s.bind(('{self.address(b)}',{port}));s.listen();c,_=s.accept()\n"
                  "while c.recv(1<<20): pass")
        srv = subprocess.Popen(["ip", "netns", "exec", self.namespace(b), "python3", "-c", server])
        time.sleep(0.5)
        client = ("import socket,time;s=socket.socket();"
                  f"s.connect(('{self.address(b)}',{port}));d=b'x'*(1<<20);t=time.perf_counter()\n"
                  f"for _ in range({mbytes}): s.sendall(d)\n"
                  "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.perf_counter()-t)")
        out = subprocess.run(["ip", "netns", "exec", self.namespace(a), "python3", "-c", client],
                             capture_output=True, text=True, check=True).stdout
        srv.wait(timeout=30)
        return mbytes * 2**20 * 8 / float(out) / 1e6


def add_link_argument(ap) -> None:
    """The benches' ``--link-mbit`` flag."""
    ap.add_argument("--link-mbit", type=float, default=None,
                    help="emulate nodes on this machine joined by links of this many Mbit/s each way (root only; "
                         "bench/emulated_nodes.py): each node's ranks in a network namespace of its own")


def nodes_for(link_mbit: float | None, nproc: int, ranks_per_node: int) -> EmulatedNodes | None:
    """The emulated nodes a bench run asked for (None: every rank on the host's loopback)."""
    if link_mbit is None:
        return None
    if nproc % ranks_per_node or nproc // ranks_per_node < 2:
        raise SystemExit(f"--link-mbit: {nproc} ranks do not split into 2 or more nodes of {ranks_per_node}: "
                         "set --ranks-per-node to a proper divisor of --nproc")
    return EmulatedNodes(nproc // ranks_per_node, link_mbit)


def main(argv: list[str]) -> None:
    """``python bench/emulated_nodes.py TAG NODES RANKS_PER_NODE -m MODULE ARGS...``: a launched worker that joins its
    emulated node, then runs ``python -m MODULE ARGS...`` (e.g. ``podscale.cli train``, which joins the launcher's
    job); the launcher's store must listen on the nodes' bridge (:meth:`EmulatedNodes.join`)."""
    import runpy
    import sys
    tag, nodes, per_node, flag, module, *rest = argv
    if flag != "-m":
        raise SystemExit("usage: python bench/emulated_nodes.py TAG NODES RANKS_PER_NODE -m MODULE [ARGS ...]")
    EmulatedNodes(int(nodes), 1.0, tag=tag).join(int(per_node))
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    import sys
    main(sys.argv[1:])
