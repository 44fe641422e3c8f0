"""Optimizers built on fastddp's buckets.

- ``ShardedOptimizer(model, torch.optim.AdamW, lr=...)``: torch's SGD, Adam or AdamW with
  its state sharded over the ranks (ZeRO-1): each rank steps its shard of every bucket,
  whose averaged gradient a reduce-scatter delivered in backward, and the parameters are
  all-gathered after the step (Note [sharded optimizer] in sharded.py; docs/sharded.md).
- ``ParameterShardedOptimizer(model, torch.optim.Adafactor, ...)``: any torch optimizer, its
  state sharded by whole parameters (torch's ZeroRedundancyOptimizer's rule) over an
  ordinary allreduce (by_parameter.py).
- ``shard_torch_optimizer``, ``point_scheduler_at``: a framework's torch optimizer and its
  schedulers moved onto a ShardedOptimizer (from_torch.py), for the integrations.
"""

from fastddp.optim.by_parameter import ParameterShardedOptimizer
from fastddp.optim.from_torch import point_scheduler_at, shard_torch_optimizer
from fastddp.optim.sharded import ShardedOptimizer

__all__ = ["ParameterShardedOptimizer", "ShardedOptimizer", "point_scheduler_at",
           "shard_torch_optimizer"]
