"""Sharded key -> row tables over the mesh (the parameter server's embeddings, the GNN's feature store)."""
from podscale.table.base import ShardedTable
from podscale.table.embedding import SHARDINGS, ShardedEmbeddingBags, Shard, TableError, TableSpec, plan_shards
from podscale.table.optim import LazyAdam, RowWiseAdagrad, SparseOptimizer, SparseSGD

__all__ = ["ShardedTable", "SHARDINGS", "ShardedEmbeddingBags", "Shard", "TableError", "TableSpec", "plan_shards",
           "LazyAdam", "RowWiseAdagrad", "SparseOptimizer", "SparseSGD"]
