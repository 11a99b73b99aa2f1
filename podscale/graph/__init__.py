"""Graphs for GNN training: formats, loaders and generators, METIS partitions with halo nodes, a distributed
feature store and distributed neighbour sampling (DistDGL's design: Zheng et al., "DistDGL: Distributed Graph
Neural Network Training for Billion-Scale Graphs", IA3 2020)."""
from podscale.graph.core import Graph, GraphError, from_edges
from podscale.graph.generate import rmat, sbm
from podscale.graph.io import load_ogb_dir, load_planetoid

__all__ = ["Graph", "GraphError", "from_edges", "load_ogb_dir", "load_planetoid", "rmat", "sbm"]
