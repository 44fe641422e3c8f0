"""``ParameterShardedOptimizer``: the optimizer's state sharded over the ranks by whole
parameters, for optimizers that need a whole tensor (Adagrad's and Adafactor's factored or
per-tensor state, LAMB's trust ratio, Shampoo-like preconditioners), as torch's
``ZeroRedundancyOptimizer`` shards.

Note [whole-parameter shards]
The model reduces as without it (an allreduce per bucket: every rank holds every averaged
gradient in ``.grad``). Each parameter belongs to one rank: in each param group, the
parameters sorted by size, largest first, go one by one to the rank that holds the fewest
elements so far (torch's ZeroRedundancyOptimizer's greedy rule, so the shares match its
own). Each rank runs torch's optimizer over its own parameters only, with their state:
about 1/world of it, as even as the parameters' sizes allow. Then every rank's updated
parameters are broadcast from it, coalesced into few collectives (c10d's
``_broadcast_coalesced``, whose flat buffers are made in C++: Note [no Python tensor in a
Work], csrc/hooks/common/collectives.h). The numbers are torch's optimizer's over the whole
model, bit for bit: each parameter is stepped by the same code from the same gradient.

Against ShardedOptimizer (bucket shards): no reduce-scatter, so the gradients stay whole on
every rank (DDP's memory for them), and the broadcasts move as much as ZeRO's; any torch
optimizer works, GradScaler and ``torch.nn.utils.clip_grad_norm_`` see the ordinary
``.grad``. ``state_dict()`` is torch's format, gathered onto one rank by
``consolidate_state_dict(to)``; ``load_state_dict`` takes a whole one on every rank.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from fastddp import _group_ops
from fastddp.optim import sharded_state
from fastddp.optim.sharded import _checked_groups

_WHO = "fastddp.optim.ParameterShardedOptimizer"


class ParameterShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` (any torch optimizer, whole-tensor ones included) over ``model``'s
    parameters, each parameter's state on one rank (Note [whole-parameter shards])::

        model = fastddp.DistributedDataParallel(module)
        optimizer = fastddp.optim.ParameterShardedOptimizer(model, torch.optim.Adafactor)

    ``params``: the parameters or param groups, as torch's optimizers take them (default:
    all of ``model``'s); exactly the parameters the model averages. The other keywords are
    ``optimizer_class``'s."""

    def __init__(self, model: Any, optimizer_class: type, params: Iterable | None = None,
                 **defaults: Any):
        if optimizer_class is torch.optim.LBFGS:
            raise NotImplementedError(f"{_WHO}: LBFGS re-evaluates the closure between its "
                                      "iterations, which a rank stepping part of the model "
                                      "cannot do alone")
        _, groups = _checked_groups(model, params, _WHO)
        self._group = model.process_group
        world, rank = self._group.size(), self._group.rank()
        # Greedy, as torch's ZeroRedundancyOptimizer: per group, largest first, to the rank
        # holding the fewest elements so far (ties: the lowest rank).
        sizes = [0] * world
        self._owned: list[list[torch.Tensor]] = [[] for _ in range(world)]
        mine: list[list[torch.Tensor]] = []
        for group in groups:
            own = []
            for p in sorted(group["params"], key=lambda t: t.numel(), reverse=True):
                owner = min(range(world), key=lambda r: sizes[r])
                sizes[owner] += p.numel()
                self._owned[owner].append(p)
                if owner == rank:
                    own.append(p)
            # this rank's parameters of the group, in the group's own order
            ids = {id(p) for p in own}
            mine.append([p for p in group["params"] if id(p) in ids])
        self._inner = optimizer_class(
            [{**{k: v for k, v in group.items() if k != "params"}, "params": own}
             for group, own in zip(groups, mine)], **defaults)
        super().__init__(groups, self._inner.defaults)
        # GradScaler unscales the ordinary .grad of param_groups itself (every rank holds
        # every averaged gradient), then calls step().
        self._step_supports_amp_scaling = False

    def _sync_groups(self) -> None:
        """The user's hyperparameters (what LR schedulers change) onto the inner groups."""
        for mine, theirs in zip(self.param_groups, self._inner.param_groups):
            for key, value in mine.items():
                if key != "params":
                    theirs[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Steps this rank's parameters, then broadcasts every rank's to the others."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._sync_groups()
        self._inner.step()
        for root, params in enumerate(self._owned):
            # Every rank knows every rank's list (the assignment is the same everywhere).
            # The parameters themselves, as torch DDP broadcasts them: no short-lived Python
            # tensor for a gloo worker to release (Note [no Python tensor in a Work]).
            _group_ops.broadcast_tensors(self._group, params, root)
        return loss

    def shard_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its own parameters' only)."""
        return sum(t.numel() * t.element_size() for state in self._inner.state.values()
                   for t in state.values() if torch.is_tensor(t) and t.dim() > 0)

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers every rank's state onto group rank ``to`` in torch's format; every rank
        calls it. Then ``state_dict()`` on that rank returns it."""
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups
                                                   for p in g["params"])}
        mine = {index[id(p)]: {k: v.cpu() if torch.is_tensor(v) else v
                               for k, v in self._inner.state[p].items()}
                for g in self._inner.param_groups for p in g["params"] if p in self._inner.state}
        everyone = [None] * self._group.size() if self._group.rank() == to else None
        dist.gather_object(mine, everyone, dst=dist.get_global_rank(self._group, to)
                           if _group_ops.registered(self._group) else to, group=self._group)
        if everyone is None:
            self._consolidated = None
            return
        state = {}
        for theirs in everyone:
            state.update(theirs)
        params = [p for g in self.param_groups for p in g["params"]]
        self._consolidated = {
            "state": {i: {k: v.to(params[i].device) if torch.is_tensor(v) and v.dim() else v
                          for k, v in state[i].items()} for i in sorted(state)},
            "param_groups": sharded_state.indexed_groups(self.param_groups)}

    def state_dict(self) -> dict:
        """The state ``consolidate_state_dict()`` gathered: what torch's optimizer over the
        same parameters and groups would return."""
        return sharded_state.take_consolidated(self, _WHO, "its own parameters' state")

    def load_state_dict(self, state_dict: dict) -> None:
        """A whole state dict in torch's format, on every rank: each keeps its parameters'."""
        saved = state_dict["param_groups"]
        if [len(g["params"]) for g in saved] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError(f"{_WHO}.load_state_dict: the saved param groups hold "
                             f"{[len(g['params']) for g in saved]} parameters, these "
                             f"{[len(g['params']) for g in self.param_groups]}")
        params = [p for g in self.param_groups for p in g["params"]]
        position = {id(p): i for i, p in enumerate(params)}
        inner_ids = [position[id(p)] for g in self._inner.param_groups for p in g["params"]]
        local = sharded_state.indexed_groups(self._inner.param_groups)
        for mine, theirs in zip(self.param_groups, saved):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        for mine, theirs in zip(local, saved):
            mine.update({k: v for k, v in theirs.items() if k != "params"})
        self._inner.load_state_dict({
            "state": {j: state_dict["state"][i] for j, i in enumerate(inner_ids)
                      if i in state_dict["state"]},
            "param_groups": local})
