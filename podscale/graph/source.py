"""Which graph a run or a command uses: a generated one (``sbm``, ``rmat``) or a file a user has
(``planetoid``: a ``.npz``; ``ogb``: an OGB-style folder).  One place, so that ``podscale graph partition``
and the GNN task build the same graph from the same settings (the partitions are checked against it)."""
from __future__ import annotations

from podscale.graph.core import Graph, GraphError
from podscale.graph.generate import rmat, sbm
from podscale.graph.io import load_ogb_dir, load_planetoid

SOURCES = ("sbm", "rmat", "planetoid", "ogb")


def load_graph(kind: str, path: str | None = None, seed: int = 0, nodes: int = 2000, scale: int = 14,
               features: int = 32, classes: int = 8) -> Graph:
    """The graph ``kind`` names (GraphError, one line, when a file kind has no path)."""
    if kind in ("planetoid", "ogb") and not path:
        raise GraphError(f"graph '{kind}' is read from a file: give its path (a .npz for planetoid, a folder for ogb)")
    if kind == "sbm":
        return sbm(nodes, blocks=classes, features=features, seed=seed)
    if kind == "rmat":
        return rmat(scale, features=features, classes=classes, seed=seed)
    if kind == "planetoid":
        return load_planetoid(path)
    if kind == "ogb":
        return load_ogb_dir(path)
    raise GraphError(f"graph '{kind}' must be one of {', '.join(SOURCES)}")
