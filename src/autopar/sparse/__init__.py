"""Sparse-embedding communication (EmbRace): classify tables by measured row density, shard the
sparse ones over the data-parallel ranks with AlltoAll lookups, schedule row updates by priority.
"""

from .classify import TableInfo, classify_tables
from .engine import SparseEmbeddingEngine
from .exchange import CommLedger
from .schedule import RowVersions, StaleRowError
from .sharded_embedding import ShardedEmbedding, ShardLayout

__all__ = ["CommLedger", "RowVersions", "ShardLayout", "ShardedEmbedding", "SparseEmbeddingEngine",
           "StaleRowError", "TableInfo", "classify_tables"]
