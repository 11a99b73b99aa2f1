"""Hang watchdog: when a rank stops arriving at collectives, every rank exits with one line naming it.

A collective waits for every member of its group, so one stalled rank (a deadlock in user code, a hung
file system, a GPU that stopped answering) silently freezes the whole job.  torch's process-group timeout
(``timeout=`` of ``init_process_group`` and ``new_group``; gloo and NCCL honour it) eventually raises, but
only on the ranks that wait, after a traceback that does not say which rank is to blame.

Each rank runs one :class:`Watchdog` thread.  The communication layer keeps, in memory and at the cost of
two dict operations per call, a :class:`~podscale.runtime.comm.Ledger`: how many collectives the rank has
entered on each group and which one it waits in.  Every ``interval`` the thread publishes that record,
with a heartbeat, to the job's c10d store (the TCPStore the rendezvous created, under a prefix per restart
round), so no network call lies on the training path.  When the rank has waited in one collective for
``timeout_s`` seconds, the thread reads every rank's record and follows the chain of waits: the waiter's
group has a member whose count for that group is short; if that member itself waits in another collective
the chain goes on; it ends at a rank that is in no collective (busy or stuck outside communication) or
whose heartbeat stopped (its process is frozen).  The first rank to conclude writes its diagnosis to the
store; every rank's watchdog (the stalled one's included) prints it as one line and exits with code
:data:`EXIT_CODE`, so torch's elastic agent sees a failed group and, under ``--max-restarts``, restarts it
from the last checkpoint.

The process-group timeout stays as the backstop for what the ledger does not see (collectives issued
outside :mod:`podscale.runtime.comm`, such as the checkpoint writer's barriers): ``podscale train`` sets it
to :func:`backstop_s` (twice ``run.collective_timeout_s``, at least 2 minutes).
"""
from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

EXIT_CODE = 75  # (EX_TEMPFAIL: the job may succeed when restarted)
_ABORT = "abort"
_SEEN = "seen"


def backstop_s(timeout_s: float) -> float:
    """torch's process-group timeout under a watchdog of ``timeout_s``: twice it, and at least 2 minutes,
    since the same timeout bounds the rendezvous barriers of ``init_process_group`` and ``new_group``,
    where ranks that start seconds apart (a loaded machine, a slow file system) legitimately wait."""
    return max(2 * timeout_s, 120.0)


def interval_for(timeout_s: float) -> float:
    """How often records are published and the abort key is polled: a tenth of the timeout, at most 1 s."""
    return max(0.05, min(1.0, timeout_s / 10))


def _members(key: str) -> list[int]:
    """Global ranks of a ledger key (``"dp:0,1"``, or ``"pp:0>1"`` for a sender/receiver pair)."""
    body = key.split(":", 1)[1]
    return [int(r) for r in body.replace(">", ",").split(",")]


def diagnose(records: dict[int, dict | None], me: int, timeout_s: float, stale_s: float) -> str:
    """The one-line explanation of why rank ``me`` is stuck, from every rank's published record.

    ``records[r]`` is rank r's :meth:`Ledger.snapshot` plus ``"age"`` (seconds since it was published), or
    None when r never published.  Pure function of the records: tested without processes.
    """
    chain, cur, link = [me], me, None
    while True:
        rec = records.get(cur)
        stale = rec is None or rec["age"] > stale_s
        if rec is None or rec["blocked"] is None or (stale and cur != me):
            break
        key, seq, op, axis, waited = rec["blocked"]
        missing = [q for q in _members(key)
                   if q != cur and (records.get(q) is None or records[q]["entered"].get(key, 0) < seq)]
        link = (cur, key, seq, op, axis, waited)
        if not missing:
            return (f"every rank of {op} #{seq} on axis {axis} (ranks {key.split(':', 1)[1]}) entered it in "
                    f"step {rec['step']} but it has not completed after {waited:.1f} s (the transport is stuck, "
                    f"not a rank); run.collective_timeout_s = {timeout_s:g}")
        nxt = missing[0]
        if nxt in chain:
            cycle = chain[chain.index(nxt):]
            return (f"ranks {', '.join(map(str, cycle))} wait for each other (deadlock): rank {cur} waits in "
                    f"{op} #{seq} on axis {axis} of step {rec['step']} for rank {nxt}, which waits in another "
                    f"collective; run.collective_timeout_s = {timeout_s:g}")
        chain.append(nxt)
        cur = nxt
    if link is None:
        return f"rank {me} gave up waiting (run.collective_timeout_s = {timeout_s:g})"
    waiter, key, seq, op, axis, waited = link
    rec = records.get(cur)
    if rec is None:
        state, step = "it never published progress (it died or never started its watchdog)", "?"
    elif rec["age"] > stale_s:
        state, step = f"its process stopped responding {rec['age']:.0f} s ago", rec["step"]
    else:
        state, step = "it is in no collective (busy or stuck outside communication)", rec["step"]
    return (f"rank {cur} stalled in step {step}: it did not enter {op} #{seq} on axis {axis} (ranks "
            f"{key.split(':', 1)[1]}), where rank {waiter} waited {waited:.1f} s; {state}. Every rank exits "
            f"(run.collective_timeout_s = {timeout_s:g}: raise it if such a wait is legitimate)")


class Watchdog(threading.Thread):
    """Publishes this rank's ledger, detects a wait longer than ``timeout_s`` and ends the process.

    ``store`` is any c10d store shared by the job (a :class:`torch.distributed.PrefixStore` keeps the
    keys apart); ``exit`` ends the process (``os._exit`` by default: the main thread may be blocked in a
    collective that never returns).
    """

    def __init__(self, ledger, rank: int, world_size: int, timeout_s: float, store, exit=os._exit):
        super().__init__(name="podscale-watchdog", daemon=True)
        self.ledger, self.rank, self.world = ledger, rank, world_size
        self.timeout_s, self.interval = float(timeout_s), interval_for(timeout_s)
        self.store, self._exit = store, exit
        self._stop_event = threading.Event()
        self.diagnosis: str | None = None

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                self.publish()
                if self.store.check([_ABORT]):
                    return self._give_up(self.store.get(_ABORT).decode())
                b = self.ledger.blocked
                if b is not None and time.monotonic() - b[4] > self.timeout_s:
                    diag = diagnose(self.read_records(), self.rank, self.timeout_s, 3 * self.interval + 1)
                    # the first rank to conclude decides what every rank prints
                    won = self.store.compare_set(_ABORT, "", diag)
                    return self._give_up(won.decode() if isinstance(won, bytes) else str(won))
            except Exception as err:  # (the store went away: the job is ending anyway)
                if self._stop_event.is_set():
                    return
                print(f"podscale: watchdog: rank {self.rank}: cannot reach the job's store ({err}); the "
                      "process-group timeout remains", file=sys.stderr, flush=True)
                return

    def publish(self) -> None:
        rec = self.ledger.snapshot()
        rec["t"] = time.time()
        self.store.set(str(self.rank), json.dumps(rec))

    def read_records(self) -> dict[int, dict | None]:
        out: dict[int, dict | None] = {}
        now = time.time()
        for r in range(self.world):
            if not self.store.check([str(r)]):
                out[r] = None
                continue
            rec = json.loads(self.store.get(str(r)))
            rec["age"] = max(0.0, now - rec.pop("t"))
            out[r] = rec
        return out

    def _give_up(self, diag: str) -> None:
        self.diagnosis = diag
        print(f"podscale: watchdog: rank {self.rank} exits: {diag}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Leave together: the elastic agent stops the group when the first process exits, and every rank
        # should have printed its line by then (a rank that is gone for good is not waited for long).
        try:
            deadline = time.monotonic() + 3 * self.interval + 1
            seen = self.store.add(_SEEN, 1)
            while seen < self.world and time.monotonic() < deadline:
                time.sleep(self.interval / 4)
                seen = self.store.add(_SEEN, 0)
        except Exception:  # (the store is gone: leave now)
            pass
        self._exit(EXIT_CODE)

    def stop(self) -> None:
        """End the thread (at the end of a run); idempotent."""
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5 * self.interval + 5)


def job_store(prefix: str, timeout_s: float = 30.0):
    """A client of the job's c10d store (``MASTER_ADDR:MASTER_PORT``, set by torchrun and podscale's
    launcher) under ``prefix`` and the elastic restart round, or None outside a launcher."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"podscale/watchdog/{restart}/{prefix}/", store)


def start(mesh, timeout_s: float, prefix: str = "train") -> Watchdog | None:
    """Start the watchdog of this rank over ``mesh``'s ledger (None for a one-rank job); stop it with
    :meth:`Watchdog.stop` (also done at interpreter exit)."""
    if mesh.world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return None
    store = job_store(prefix)
    if store is None:
        return None
    dog = Watchdog(mesh.ledger, mesh.rank, mesh.world_size, timeout_s, store)
    dog.publish()
    dog.start()
    atexit.register(dog.stop)
    return dog
