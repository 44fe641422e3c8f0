"""What the extras (fastddp.tuning, launch, diloco, integrations, selfcheck, link) use of the
DDP core beyond ``DistributedDataParallel`` itself. These names are public and kept for them;
every other module of fastddp.ddp is private to the core, and a test
(tests/python/test_import_graph.py) holds that no other package imports one.

- ``install_comm_hook(ddp, state, hook)``: makes ``hook`` the model's comm hook, as
  ``register_comm_hook`` does but without torch's register-once rule: torchft's integration
  installs the user's hook again on each new quorum's reducer.
- ``comm_hook_name(ddp)``, ``comm_hook_keeps_state(ddp)``: the registered hook's native name
  ("allreduce" without one) and whether it keeps state between steps (error feedback, or a
  Python hook's own object): what torchft's recovery sends a rejoining replica.
- ``TunerHandle``: the model as the tuner and ``--advise``'s sampler see it (its group,
  bucket cap, parameters, step figures), not the whole DistributedDataParallel.
- ``shard_gradients(ddp)``, ``BucketShard``, ``synchronized_backwards(ddp)``,
  ``averaged_parameters(ddp)``: the model's buckets cut into one shard per rank, reduce-scattered in backward, with the parameters in
  flat buffers of the buckets' layout, for fastddp.optim's sharded optimizer (_sharding.py).
- ``eager``, ``nonrecursive_disable``, ``skip_this_frame_from_now_on``: how the launcher's
  patched ``forward`` stays out of torch.compile's graphs as the core's own forward does
  (_compile.py).
"""

from fastddp.ddp._compile import eager, nonrecursive_disable, skip_this_frame_from_now_on
from fastddp.ddp._hook_install import install as install_comm_hook
from fastddp.ddp._hook_state import has_state as comm_hook_keeps_state
from fastddp.ddp._hook_state import hook_name as comm_hook_name
from fastddp.ddp._sharding import (BucketShard, averaged_parameters, shard_gradients,
                                   synchronized_backwards)
from fastddp.ddp._tuner_handle import TunerHandle

__all__ = ["BucketShard", "TunerHandle", "averaged_parameters", "comm_hook_keeps_state", "comm_hook_name", "eager",
           "install_comm_hook", "nonrecursive_disable", "shard_gradients",
           "skip_this_frame_from_now_on", "synchronized_backwards"]
