"""Starting workers through torch's elastic agent (the engine behind ``torchrun``).

``launch`` spawns ``nproc`` local workers that rendezvous on 127.0.0.1 by default (c10d rendezvous, a free
port), restarts the whole group up to ``max_restarts`` times when a worker dies, and returns each rank's
return value.  Under an existing ``torchrun`` the caller joins instead (see ``process.under_launcher``), so
the same entry point runs multi-node.
"""
from __future__ import annotations

import os
import socket
import uuid
from typing import Any, Callable, Literal

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, RendezvousTimeout
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from podscale.runtime import forkserver

LOOPBACK = "127.0.0.1"
_LOOPBACK_BACKEND = "podscale-loopback"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def loopback_store(port: int = 0) -> dist.TCPStore:
    """A TCPStore server that listens on 127.0.0.1 only (TCPStore alone would listen on every interface)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, master_listen_fd=sock.detach())


class _LoopbackBackend(C10dRendezvousBackend):
    @property
    def name(self) -> str:
        return _LOOPBACK_BACKEND


class _LoopbackRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous with the workers' bootstrap store on loopback, and a new one each round.

    torch keeps the bootstrap store of the first round for later rounds; restarted workers then find the
    failed attempt's process-group keys in it and dial dead peers.  A fresh store per round avoids that.
    """

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return loopback_store(0)

    def next_rendezvous(self):
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None
        return super().next_rendezvous()


def _loopback_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    _, _, port = params.endpoint.rpartition(":")
    store = loopback_store(int(port))
    return _LoopbackRendezvousHandler.from_backend(
        params.run_id, store, _LoopbackBackend(store, params.run_id), params.min_nodes, params.max_nodes,
        params.local_addr, RendezvousTimeout())


if _LOOPBACK_BACKEND not in rendezvous_handler_registry._registry:
    rendezvous_handler_registry.register(_LOOPBACK_BACKEND, _loopback_handler)


def launch(fn: Callable | str, args: tuple = (), nproc: int = 2, max_restarts: int = 0,
           host: str = LOOPBACK, port: int | None = None, run_id: str | None = None,
           log_dir: str | None = None, quiet: bool = False,
           start_method: Literal["forkserver", "spawn"] = "forkserver") -> dict[int, Any]:
    """Run ``fn(*args)`` on ``nproc`` local workers; ``fn`` may be a callable or a program path.

    A callable runs in workers forked from a server that has imported torch and podscale once
    (:mod:`podscale.runtime.forkserver`; ``start_method="spawn"`` starts each worker as a new interpreter).

    Returns ``{rank: return value}`` for a callable.  Raises ``ChildFailedError`` when the group fails
    after ``max_restarts`` restarts.
    """
    port = port or free_port(host)
    logs = DefaultLogsSpecs(log_dir=log_dir, redirects=Std.ALL if quiet else Std.NONE,
                            tee=Std.NONE) if log_dir or quiet else DefaultLogsSpecs()
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc,
        run_id=run_id or uuid.uuid4().hex[:12],
        # On loopback (the default) both rendezvous stores listen on 127.0.0.1 only; any other host is
        # the user asking for a multi-node rendezvous on that address.
        rdzv_backend=_LOOPBACK_BACKEND if host == LOOPBACK else "c10d", rdzv_endpoint=f"{host}:{port}",
        rdzv_configs={"is_host": True},
        max_restarts=max_restarts, monitor_interval=0.1, start_method=start_method,
        local_addr=host, logs_specs=logs,
    )
    # Workers on a CPU split its cores instead of each taking all of them.
    os.environ.setdefault("PODSCALE_LOCAL_WORLD", str(nproc))
    if callable(fn) and start_method == "forkserver":
        forkserver.start_server()
        streams = None if log_dir or quiet else forkserver.parent_streams()  # (else the agent's log files)
        return elastic_launch(config, forkserver.run_with_parent_env)(fn, dict(os.environ), streams, *args)
    return elastic_launch(config, fn)(*args)
