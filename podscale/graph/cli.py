"""``podscale graph partition``: partition a graph once, to disk, for ``[model] partitions``."""
from __future__ import annotations

import argparse
import json
import sys


def cmd_partition(args) -> int:
    from podscale.graph.core import GraphError
    from podscale.graph.partition import assign, write_partitions
    from podscale.graph.source import load_graph
    try:
        g = load_graph(args.graph, args.path, seed=args.graph_seed, nodes=args.nodes, scale=args.scale)
        part = assign(g, args.parts, args.method, args.imbalance, args.seed)
        meta = write_partitions(g, part, args.out, args.method)
    except GraphError as err:
        print(f"podscale: error: {err}", file=sys.stderr)
        return 2
    r = meta["report"]
    b = ", ".join(f"{k} {v:.3f}" for k, v in r["balance"].items())
    print(f"{meta['graph']}: {meta['num_nodes']} nodes, {meta['num_edges']} edges -> {meta['num_parts']} "
          f"{args.method} partitions in {args.out}: edge cut {r['edge_cut']:.1%}, halo {r['halo_nodes']} nodes "
          f"({r['halo_share']:.1%} of the nodes), balance (max/mean) {b}")
    if args.json:
        print(json.dumps(meta["report"]))
    return 0


def add_graph_parser(sub) -> None:
    """The ``graph`` command and its ``partition`` sub-command."""
    g = sub.add_parser("graph", help="graph tools for GNN training (partition)")
    gs = g.add_subparsers(dest="graph_command", required=True)
    p = gs.add_parser("partition", help="partition a graph with METIS (or randomly) into a folder, once")
    p.add_argument("graph", choices=("sbm", "rmat", "planetoid", "ogb"),
                   help="the generated SBM or R-MAT graph, a Planetoid .npz or an OGB-style folder (--path)")
    p.add_argument("out", help="the partition folder to write (must not exist)")
    p.add_argument("--parts", type=int, default=2, help="number of partitions (= ranks that train)")
    p.add_argument("--method", choices=("metis", "random"), default="metis")
    p.add_argument("--path", help="the .npz file (planetoid) or folder (ogb)")
    p.add_argument("--imbalance", type=float, default=0.05,
                   help="allowed load over the mean per constraint (nodes, training nodes, edges)")
    p.add_argument("--seed", type=int, default=0, help="seed of METIS or of the random partition")
    p.add_argument("--graph-seed", type=int, default=0, help="seed of a generated graph")
    p.add_argument("--nodes", type=int, default=2000, help="nodes of the generated SBM")
    p.add_argument("--scale", type=int, default=14, help="log2 of the nodes of the generated R-MAT graph")
    p.add_argument("--json", action="store_true", help="also print the report as JSON")
    p.set_defaults(func=cmd_partition)
