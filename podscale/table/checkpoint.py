"""Checkpoints of sharded tables: full and incremental, atomic, loadable on any number of ranks and any
sharding, and exported for serving.  Nothing is pickled: rows are safetensors files, manifests JSON.

Layout under a checkpoint root (``runs/NAME/checkpoints``)::

    tables/seg_<step>_<token>/r<rank>-<chunk>.safetensors   rows of one save, per rank, in chunks
    tables/seg_<step>_<token>/r<rank>.json                  that rank's file list (written last)
    step_<N>/tables.json                                     the manifest: specs, clock, chain of segments

A *full* save writes every row of every local shard; an *incremental* save writes only the rows written
since the last save and the keys deleted since (TTL), and its manifest's ``chain`` lists the full save it
builds on and every incremental save since, oldest first.  Loading applies the chain in order.  This is
the delta checkpointing of recommender parameter servers (Monolith's and Persia's incremental dumps;
Check-N-Run, Eisenman et al., NSDI 2022, saves only modified embedding rows for the same reason: a step
touches a tiny share of a huge table).

Atomicity: a save writes into a segment folder of its own (a random token), each file to a temporary
name then renamed; the manifest is written into the trunk's unfinished checkpoint folder, which becomes
visible only by its final rename (:func:`podscale.train.checkpoint.save`).  A crash leaves an orphan
segment that no manifest names; the next save deletes segments no finished checkpoint names.

Resharding: every piece records its table and columns ``[c0, c1)``; on load each rank reads every file,
keeps the keys it owns (row-wise: by the table's
:meth:`~podscale.table.embedding.ShardedEmbeddingBags.key_owner`) and the columns of its shards, and converts the
optimizer state between column blocks with :meth:`~podscale.table.optim.SparseOptimizer.state_columns` /
:meth:`~podscale.table.optim.SparseOptimizer.join_state`.

Serving export (:func:`export_tables`): per table, files ``<name>-<chunk>.safetensors`` with tensors
``keys`` (int64 ``[n]``, sorted) and ``weights`` (float32 ``[n, dim]``), and a header with ``name``,
``dim``, ``pooling`` and ``step``; ``index.json`` lists the tables and their files.  A server maps an id
to its row by binary search of ``keys`` (an id absent from ``keys`` has no row: zeros, as in training).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import torch

from podscale.runtime import comm
from podscale.table.embedding import Shard, ShardedEmbeddingBags, TableError

FORMAT = "podscale-tables/1"
MANIFEST = "tables.json"
SEGMENTS = "tables"
CHUNK_ROWS = 65536


def _fsync_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    from safetensors.torch import save
    _fsync_write(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata={"podscale": json.dumps(meta)}))


def _load_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        meta = json.loads((f.metadata() or {}).get("podscale", "{}"))
        return {k: f.get_tensor(k) for k in f.keys()}, meta


def _barrier(table: ShardedEmbeddingBags) -> None:
    t = torch.zeros(1, device=table.mesh.device)
    comm.all_reduce(t, table.mesh, table.axes)


def _token(table: ShardedEmbeddingBags) -> str:
    """A random token, the same on every rank (rank 0's, broadcast)."""
    t = torch.tensor([secrets.randbits(62)], dtype=torch.int64, device=table.mesh.device)
    comm.broadcast(t, 0, table.mesh, table.axes)
    return f"{int(t.item()):016x}"


def _spec_record(table: ShardedEmbeddingBags) -> list[dict]:
    return [{"name": s.name, "dim": s.dim, "pooling": s.pooling, "sharding": s.sharding, "num_keys": s.num_keys,
             "trainable": s.trainable} for s in table.specs]


class TableCheckpointer:
    """Saves and loads one :class:`ShardedEmbeddingBags`; remembers the chain of its last save or load so
    that the next save can be incremental.  Every method is collective over the table's ranks."""

    def __init__(self, table: ShardedEmbeddingBags, full_every: int = 4, chunk_rows: int = CHUNK_ROWS):
        self.table, self.full_every, self.chunk_rows = table, int(full_every), int(chunk_rows)
        self.chain: list[dict] | None = None  # segments of the last save/load; None: the next save is full
        self.chain_root: Path | None = None    # the checkpoint root those segments are under

    # -- save -------------------------------------------------------------------------------------------
    def save(self, step_dir: Path, root: Path, step: int, full: bool | None = None) -> dict:
        """Write the tables' rows for checkpoint ``step``: segment files under ``root/tables``, the manifest
        into ``step_dir`` (rank 0).  ``full=None``: incremental unless there is no chain to build on or the
        chain already holds ``full_every`` saves.  Returns the manifest."""
        tb = self.table
        step_dir, root = Path(step_dir), Path(root)
        if full is None:  # a delta builds on a chain under the same root only
            full = self.chain is None or len(self.chain) >= self.full_every or \
                self.chain_root is None or self.chain_root.resolve() != root.resolve()
        seg_name = f"seg_{step:08d}_{_token(tb)}"
        seg = root / SEGMENTS / seg_name
        if tb.me == 0:
            self._collect_garbage(root, keep=seg_name)
        seg.mkdir(parents=True, exist_ok=True)
        files, chunk = [], 0
        try:
            for sh in tb.local_shards():
                for tensors, meta in self._pieces(sh, full):
                    name = f"r{tb.me:05d}-{chunk:05d}.safetensors"
                    _save_tensors(seg / name, tensors, meta)
                    files.append(name)
                    chunk += 1
            _fsync_write(seg / f"r{tb.me:05d}.json", json.dumps({"files": files}).encode())
            err = 0
        except OSError as e:
            err, text = 1, f"table checkpoint: cannot write {seg} ({e.strerror}): free space or fix permissions"
        flag = torch.tensor([err], dtype=torch.int64, device=tb.mesh.device)
        comm.all_reduce(flag, tb.mesh, tb.axes)
        if int(flag.item()):
            raise TableError(text if err else "table checkpoint: another rank could not write its rows: "
                             "free space or fix permissions")
        chain = ([] if full else list(self.chain)) + [{"segment": f"{SEGMENTS}/{seg_name}", "ranks": tb.n,
                                                       "full": bool(full), "step": step}]
        manifest = {"format": FORMAT, "step": step, "specs": _spec_record(tb), "clock": tb.clock(),
                    "optimizer": type(tb.optimizer).__name__ if tb.optimizer is not None else None,
                    "chain": chain}
        if tb.me == 0:
            _fsync_write(step_dir / MANIFEST, json.dumps(manifest, indent=1).encode())
        tb.mark_saved()
        self.chain, self.chain_root = chain, root
        _barrier(tb)
        return manifest

    def _pieces(self, sh: Shard, full: bool):
        """Safetensors dicts of one local shard: its rows (all, or those changed), deletions, admission
        counts; in chunks of ``chunk_rows`` rows."""
        tb = self.table
        spec = tb.specs[sh.table]
        meta = {"table": spec.name, "c0": sh.c0, "c1": sh.c1, "width": sh.width,
                "state": tb.row_floats(sh.table, sh) - sh.width - 1}
        first = True

        def extras() -> dict[str, torch.Tensor]:
            out = {}
            if not full:
                out["deleted"] = tb.changed_since_save(sh)[1]
            if sh.c0 == 0:  # one copy of the admission counts per key set
                out["count_keys"], out["counts"] = tb.admission_counts(sh)
            return out

        if full:
            for keys, rows in tb.stores[(sh.table, sh.index)].scan(self.chunk_rows):
                t = {"keys": keys, "rows": rows.cpu()}
                if first:
                    t.update(extras())
                    first = False
                yield t, meta
        else:
            changed, _ = tb.changed_since_save(sh)
            for a in range(0, max(1, len(changed)), self.chunk_rows):
                keys = changed[a: a + self.chunk_rows]
                rows, found = tb.get_rows(sh, keys)
                t = {"keys": keys[found], "rows": rows[found]}
                if first:
                    t.update(extras())
                    first = False
                yield t, meta
        if first:  # an empty shard still records its deletions and counts
            yield {"keys": torch.zeros(0, dtype=torch.int64),
                   "rows": torch.zeros(0, tb.row_floats(sh.table, sh)), **extras()}, meta

    def _collect_garbage(self, root: Path, keep: str) -> None:
        """Delete segment folders that no finished checkpoint's manifest names (orphans of crashed saves,
        and segments of pruned checkpoints)."""
        seg_root = root / SEGMENTS
        if not seg_root.is_dir():
            return
        named = {keep}
        for m in root.glob(f"step_*/{MANIFEST}"):
            try:
                named.update(Path(c["segment"]).name for c in json.loads(m.read_text())["chain"])
            except (OSError, ValueError, KeyError):
                continue
        if self.chain:
            named.update(Path(c["segment"]).name for c in self.chain)
        for d in seg_root.iterdir():
            if d.is_dir() and d.name not in named:
                shutil.rmtree(d, ignore_errors=True)

    # -- load -------------------------------------------------------------------------------------------
    def load(self, step_dir: Path) -> dict:
        """Replace every local row with checkpoint ``step_dir``'s (saved on any number of ranks, any
        sharding); returns the manifest."""
        tb = self.table
        step_dir = Path(step_dir)
        manifest = read_manifest(step_dir)
        saved = {s["name"]: s for s in manifest["specs"]}
        for s in tb.specs:
            if s.name not in saved or saved[s.name]["dim"] != s.dim:
                got = saved.get(s.name, {}).get("dim")
                raise TableError(f"checkpoint {step_dir} has no table '{s.name}' of dim {s.dim} (found "
                                 f"{'none' if got is None else f'dim {got}'}): load it into the tables it saved")
        tb.clear()
        root = step_dir.parent
        for entry in manifest["chain"]:
            self._apply(root / entry["segment"], entry["ranks"])
        tb.set_clock(manifest["clock"], [s["name"] for s in manifest["specs"]])
        tb.mark_saved()
        self.chain, self.chain_root = manifest["chain"], root
        _barrier(tb)
        return manifest

    def _apply(self, seg: Path, ranks: int) -> None:
        tb = self.table
        files = []
        for r in range(ranks):
            listing = seg / f"r{r:05d}.json"
            if not listing.is_file():
                raise TableError(f"table checkpoint segment {seg} lacks {listing.name}: the checkpoint is "
                                 "incomplete; load an earlier one")
            files += [seg / f for f in json.loads(listing.read_text())["files"]]
        # pieces whose columns differ from a local shard's are joined per key after the whole segment
        partial: dict[tuple[int, int], list[tuple[torch.Tensor, int, int, torch.Tensor, torch.Tensor,
                                                  torch.Tensor]]] = {}
        for path in files:
            tensors, meta = _load_tensors(path)
            t = tb.index.get(meta["table"])
            if t is None:
                continue
            keys, rows = tensors["keys"], tensors["rows"]
            c0, c1, w = meta["c0"], meta["c1"], meta["width"]
            for sh in tb.local_shards():
                if sh.table != t or c1 <= sh.c0 or c0 >= sh.c1:
                    continue
                key = (t, sh.index)
                mine = tb.key_owner(keys) == sh.rank if sh.hashed else torch.ones(len(keys), dtype=torch.bool)
                if "deleted" in tensors:
                    d = tensors["deleted"]
                    d = d[tb.key_owner(d) == sh.rank] if sh.hashed else d
                    tb.delete_rows(key, d)
                if "count_keys" in tensors:
                    ck, cn = tensors["count_keys"], tensors["counts"]
                    sel = tb.key_owner(ck) == sh.rank if sh.hashed else torch.ones(len(ck), dtype=torch.bool)
                    tb.add_admission_counts(sh, ck[sel], cn[sel])
                k, r = keys[mine], rows[mine]
                if not len(k):
                    continue
                if (c0, c1) == (sh.c0, sh.c1) and r.shape[1] == tb.row_floats(t, sh):
                    tb.put_rows(key, k, r)
                else:
                    partial.setdefault(key, []).append((k, c0, c1, r[:, :w], r[:, w:-1], r[:, -1]))
        for key, parts in partial.items():
            self._join(tb.shards[key[0]][key[1]], parts)

    def _join(self, sh: Shard, parts) -> None:
        """Rows of local shard ``sh`` assembled from pieces with other column ranges."""
        tb = self.table
        keys = torch.unique(torch.cat([p[0] for p in parts]))
        n = len(keys)
        weights = torch.zeros(n, sh.width)
        last = torch.zeros(n)
        opt, trainable = tb.optimizer, tb.specs[sh.table].trainable
        states = []  # (state of the overlap, overlap width, overlap start) per piece
        for k, c0, c1, w, st, lst in parts:
            pos = torch.searchsorted(keys, k)
            a, b = max(c0, sh.c0), min(c1, sh.c1)
            weights[pos, a - sh.c0: b - sh.c0] = w[:, a - c0: b - c0]
            last[pos] = torch.maximum(last[pos], lst)
            if trainable and opt is not None and st.shape[1]:
                full = torch.zeros(n, st.shape[1])
                full[pos] = st
                states.append((a, opt.state_columns(full, c1 - c0, a - c0, b - c0), b - a))
        rows = torch.zeros(n, tb.row_floats(sh.table, sh))
        rows[:, : sh.width] = weights
        rows[:, -1] = last
        if trainable and opt is not None and opt.state_width(sh.width):
            if states:
                states.sort(key=lambda x: x[0])
                rows[:, sh.width:-1] = opt.join_state([(s, w) for _, s, w in states])
            else:
                rows[:, sh.width:-1] = opt.init_state(n, sh.width)
        tb.put_rows((sh.table, sh.index), keys, rows)


def read_manifest(step_dir: Path) -> dict:
    path = Path(step_dir) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise TableError(f"checkpoint {step_dir} has no readable {MANIFEST} ({err}): point at a checkpoint "
                         "written with sharded tables") from None
    if manifest.get("format") != FORMAT:
        raise TableError(f"{path} has format {manifest.get('format')!r}, not {FORMAT!r}: write it with this "
                         "podscale version")
    return manifest


def export_tables(step_dir: Path, out: Path, chunk_rows: int = 1 << 20) -> Path:
    """Write the tables of checkpoint ``step_dir`` for serving into folder ``out`` (format in the module
    docstring); one process, no process group.  Memory: one table's rows at a time."""
    from podscale.runtime.mesh import Mesh
    from podscale.table.embedding import TableSpec

    step_dir, out = Path(step_dir), Path(out)
    manifest = read_manifest(step_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {"format": "podscale-serving/1", "step": manifest["step"], "tables": []}
    mesh = Mesh.build()
    for s in manifest["specs"]:
        spec = TableSpec(s["name"], s["dim"], s["pooling"], "table", trainable=False)
        tb = ShardedEmbeddingBags([spec], mesh)
        ck = TableCheckpointer(tb)
        for entry in manifest["chain"]:
            ck._apply(step_dir.parent / entry["segment"], entry["ranks"])
        keys, rows = [], []
        for k, _, _, w in tb.local_rows(s["name"]):
            keys.append(k)
            rows.append(w)
        tb.close()
        keys_t = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
        rows_t = torch.cat(rows) if rows else torch.zeros(0, s["dim"])
        order = torch.argsort(keys_t)
        keys_t, rows_t = keys_t[order], rows_t[order]
        files = []
        for j, a in enumerate(range(0, max(1, len(keys_t)), chunk_rows)):
            name = f"{s['name']}-{j:05d}.safetensors"
            from safetensors.torch import save
            meta = {"name": s["name"], "dim": str(s["dim"]), "pooling": s["pooling"], "step": str(manifest["step"])}
            _fsync_write(out / name, save({"keys": keys_t[a: a + chunk_rows].contiguous(),
                                           "weights": rows_t[a: a + chunk_rows].contiguous()}, metadata=meta))
            files.append(name)
        index["tables"].append({"name": s["name"], "dim": s["dim"], "pooling": s["pooling"], "files": files,
                                "rows": int(len(keys_t))})
    _fsync_write(out / "index.json", json.dumps(index, indent=1).encode())
    return out
