"""Optimizers built on fastddp's buckets.

- ``ShardedOptimizer(model, torch.optim.AdamW, lr=...)``: torch's SGD, Adam or AdamW with
  its state sharded over the ranks (ZeRO-1): each rank steps its shard of every bucket,
  whose averaged gradient a reduce-scatter delivered in backward, and the parameters are
  all-gathered after the step (Note [sharded optimizer] in sharded.py; docs/sharded.md).
"""

from fastddp.optim.sharded import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
