"""TokenLake: a segment-level prefix-cache pool with distributed prefix attention.

The control plane (this package) decides where segments live and returns immutable plans;
the data plane (:mod:`tokenlake.engines`) executes them.
"""

from tokenlake.config import ModelShape, PoolConfig
from tokenlake.errors import (
    InvalidArgumentError,
    IterationStateError,
    PoolFullError,
    StalePlanError,
    TokenLakeError,
    UnknownRequestError,
)
from tokenlake.keys import SegmentHasher
from tokenlake.plans import Chunk, Plans, QueryPlan, TransferPlan
from tokenlake.pool import Pool, PrefixTreeView
from tokenlake.tree.policy import EvictionConfig

__all__ = [
    "Chunk",
    "EvictionConfig",
    "InvalidArgumentError",
    "IterationStateError",
    "ModelShape",
    "Plans",
    "Pool",
    "PoolConfig",
    "PoolFullError",
    "PrefixTreeView",
    "QueryPlan",
    "SegmentHasher",
    "StalePlanError",
    "TokenLakeError",
    "TransferPlan",
    "UnknownRequestError",
]
