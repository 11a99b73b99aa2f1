"""Graphs from files a user already has: the Planetoid ``.npz`` files and OGB-style directories.

Nothing downloads: each loader takes a path.  Nothing is unpickled (``numpy.load`` with
``allow_pickle=False``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from podscale.graph.core import Graph, GraphError, from_edges

PLANETOID_KEYS = ("feat_data", "feat_indices", "feat_indptr", "feat_shape", "labels", "edge_index", "train_idx",
                  "val_idx", "test_idx")


def load_planetoid(path: str | Path, normalize: bool = True) -> Graph:
    """A Planetoid citation graph (Cora, CiteSeer, PubMed; Yang, Cohen and Salakhutdinov, ICML 2016) with its
    standard split, from an ``.npz`` holding ``feat_data``/``feat_indices``/``feat_indptr``/``feat_shape``
    (CSR bag-of-words features), ``labels``, ``edge_index`` (2 x E, both directions) and
    ``train_idx``/``val_idx``/``test_idx``.  ``normalize`` divides each feature row by its sum, as Kipf and
    Welling (ICLR 2017) preprocess these data sets."""
    p = Path(path)
    if not p.is_file():
        raise GraphError(f"planetoid file '{path}' does not exist: point at a .npz such as tests/data/cora.npz")
    with np.load(p, allow_pickle=False) as z:
        missing = [k for k in PLANETOID_KEYS if k not in z.files]
        if missing:
            raise GraphError(f"'{path}' lacks the Planetoid keys {missing}: give a file with {', '.join(PLANETOID_KEYS)}")
        d = {k: z[k] for k in PLANETOID_KEYS}
    n, f = (int(x) for x in d["feat_shape"])
    rows = np.repeat(np.arange(n), np.diff(d["feat_indptr"]))
    x = np.zeros((n, f), dtype=np.float32)
    x[rows, d["feat_indices"]] = d["feat_data"]
    if normalize:
        s = x.sum(axis=1, keepdims=True)
        x = x / np.where(s > 0, s, 1.0)
    ei = d["edge_index"]
    splits = {"train": d["train_idx"], "val": d["val_idx"], "test": d["test_idx"]}
    return from_edges(ei[0], ei[1], n, features=x, labels=d["labels"], splits=splits, name=p.stem)


def _find(root: Path, stem: str, subdirs: tuple[str, ...]) -> Path | None:
    for sub in subdirs:
        for ext in (".npy", ".csv", ".csv.gz"):
            p = root / sub / f"{stem}{ext}"
            if p.is_file():
                return p
    return None


def _read(p: Path, dtype) -> np.ndarray:
    if p.suffix == ".npy":
        return np.load(p, allow_pickle=False).astype(dtype, copy=False)
    return np.loadtxt(p, delimiter=",", dtype=dtype, ndmin=2 if dtype == np.float32 else 1)


def load_ogb_dir(path: str | Path, symmetric: bool = False) -> Graph:
    """A graph from an OGB-style directory (the layout of the Open Graph Benchmark's raw node-property data,
    Hu et al., NeurIPS 2020)::

        DIR/raw/edge.{npy,csv,csv.gz}          E x 2 (or 2 x E .npy) source,destination node ids
        DIR/raw/node-feat.{npy,csv,csv.gz}     N x F float features            (optional)
        DIR/raw/node-label.{npy,csv,csv.gz}    N labels, one a line            (optional)
        DIR/raw/num-node-list.csv[.gz]         the node count N                (optional: max id + 1)
        DIR/split/<any>/{train,valid,test}.{npy,csv,csv.gz}   node ids of each split   (optional)

    The files may also sit directly in ``DIR`` (``DIR/edge.csv``, ``DIR/train.csv``, ...).  CSV files have no
    header and use commas.  ``symmetric`` adds the reverse of every edge (OGB lists undirected graphs such as
    ogbn-products once per edge)."""
    root = Path(path)
    if not root.is_dir():
        raise GraphError(f"OGB directory '{path}' does not exist: point at a folder holding raw/edge.csv(.gz)")
    edge = _find(root, "edge", ("raw", "."))
    if edge is None:
        raise GraphError(f"'{path}' holds no edge.npy, edge.csv or edge.csv.gz (in raw/ or the folder itself): "
                         "add the edge list, one 'src,dst' a line")
    e = _read(edge, np.int64)
    if e.ndim != 2 or 2 not in e.shape:
        raise GraphError(f"'{edge}' has shape {e.shape}: give E x 2 source,destination pairs")
    if e.shape[1] != 2:
        e = e.T
    feat_p, label_p, count_p = (_find(root, s, ("raw", ".")) for s in ("node-feat", "node-label", "num-node-list"))
    x = _read(feat_p, np.float32) if feat_p else None
    y = _read(label_p, np.float64).reshape(-1) if label_p else None
    if y is not None:
        y = np.where(np.isnan(y), -1, y).astype(np.int64)  # OGB marks unlabelled nodes with nan
    if count_p is not None:
        n = int(_read(count_p, np.int64).reshape(-1).sum())
    else:
        n = max(int(e.max()) + 1 if len(e) else 0, len(x) if x is not None else 0, len(y) if y is not None else 0)
    split_dirs = tuple(f"split/{d.name}" for d in sorted((root / "split").glob("*")) if d.is_dir()) \
        if (root / "split").is_dir() else ()
    splits = {}
    for name, stem in (("train", "train"), ("val", "valid"), ("test", "test")):
        p = _find(root, stem, split_dirs + (".",))
        if p is not None:
            splits[name] = _read(p, np.int64).reshape(-1)
    return from_edges(e[:, 0], e[:, 1], n, features=x, labels=y, splits=splits, name=root.name, symmetric=symmetric,
                      dedupe=symmetric)
