"""fastddp.integrations.torchft's refusals: what it does not support raises, naming it, before
anything is built (a torchft Manager stand-in: these fail before any quorum is asked for)."""

from unittest import mock

import pytest

torchft = pytest.importorskip("torchft")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.process_group import ProcessGroupBabyGloo, ProcessGroupGloo  # noqa: E402

import fastddp  # noqa: E402
from fastddp.integrations.torchft import DistributedDataParallel  # noqa: E402


def _manager(pg=None):
    manager = mock.create_autospec(Manager, instance=True)
    manager._pg = pg if pg is not None else ProcessGroupGloo()
    manager._load_state_dict_fns = {}
    manager._healing = False
    manager._pending_state_dict = None
    manager._group_rank, manager._group_world_size = 0, 1
    manager.register_state_dict_fn.side_effect = (
        lambda key, load, save: manager._load_state_dict_fns.__setitem__(key, load))
    return manager


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


@pytest.mark.parametrize("argument", ["static_graph", "gradient_as_bucket_view"])
def test_unsupported_arguments_raise(argument):
    with pytest.raises(NotImplementedError, match=argument):
        DistributedDataParallel(_manager(), _model(), **{argument: True})


def test_a_process_group_is_the_managers():
    with pytest.raises(ValueError, match="process_group"):
        DistributedDataParallel(_manager(), _model(), process_group=object())


def test_broadcast_buffers_with_buffers_raises():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(NotImplementedError, match="broadcast_buffers"):
        DistributedDataParallel(_manager(), model, broadcast_buffers=True)


@pytest.mark.parametrize("hook", [fastddp.hooks.auto(), "auto"])
def test_the_auto_hook_raises(hook):
    with pytest.raises(NotImplementedError, match="auto"):
        DistributedDataParallel(_manager(), _model(), hook=hook)


def test_a_subprocess_group_raises():
    with pytest.raises(NotImplementedError, match="ProcessGroupBabyGloo"):
        DistributedDataParallel(_manager(ProcessGroupBabyGloo()), _model())


def test_not_a_manager():
    with pytest.raises(TypeError, match="torchft.Manager"):
        DistributedDataParallel(object(), _model())


def test_one_model_per_manager_and_join_raises():
    manager = _manager()
    ddp = DistributedDataParallel(manager, _model(), hook="powersgd")
    assert "fastddp_comm_hook" in manager._load_state_dict_fns  # registered for recovery
    with pytest.raises(ValueError, match="one manager per model"):
        DistributedDataParallel(manager, _model())
    with pytest.raises(NotImplementedError, match="join"):
        ddp.join()
    # Nothing reduced yet: its forward outside a synchronized step is the module's.
    with torch.no_grad():
        assert ddp(torch.ones(3, 4)).shape == (3, 2)


def _replica_manager(group_rank=0, group_world=2):
    manager = _manager()
    manager._group_rank, manager._group_world_size = group_rank, group_world
    return manager


@pytest.mark.parametrize(("hook", "error", "match"), [
    (lambda: fastddp.hooks.hierarchical(local_size=2), NotImplementedError, "replica group"),
    (lambda: fastddp.hooks.hierarchical(fastddp.hooks.powersgd(2)), NotImplementedError,
     "powersgd"),
    (lambda: fastddp.hooks.hierarchical(groups=(_one_rank_group(), _one_rank_group())),
     ValueError, "quorum group"),
    (lambda: fastddp.hooks.hierarchical(groups=(_one_rank_group(), None)), ValueError,
     "manager was made for rank 0 of 2"),
])
def test_the_hierarchical_hook_takes_the_replica_group(hook, error, match):
    # Under torchft the node is the replica group (its ranks' own group), inter the quorum's.
    with pytest.raises(error, match=match):
        DistributedDataParallel(_replica_manager(), _model(), hook=hook())


def test_the_hierarchical_hook_needs_a_replica_group_of_two():
    with pytest.raises(ValueError, match="one rank"):
        DistributedDataParallel(_replica_manager(0, 1), _model(),
                                hook=fastddp.hooks.hierarchical(groups=(_one_rank_group(), None)))


def _one_rank_group():
    from fastddp.integrations._torchft_group import placeholder_group
    return placeholder_group()


def test_torchs_default_hooks_run_over_the_quorum():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DistributedDataParallel(_manager(), _model())
    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    state, hook = ddp._hook_args  # made again for every quorum's group
    assert state is None and isinstance(hook, fastddp.hooks.CommHook) and hook.name == "bf16"


@pytest.mark.parametrize(("state", "hook", "error", "match"), [
    ("powersgd_state", "powersgd", NotImplementedError, "fastddp.hooks.powersgd"),
    (None, "python", NotImplementedError, "outside the quorum's group"),
    ("group", "allreduce", ValueError, "state must be None"),
])
def test_hooks_tied_to_another_group_raise(state, hook, error, match):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from fastddp.integrations._torchft_group import placeholder_group
    states = {"powersgd_state": lambda: psgd.PowerSGDState(process_group=None),
              "group": placeholder_group, None: lambda: None}
    hooks = {"powersgd": psgd.powerSGD_hook, "allreduce": default_hooks.allreduce_hook,
             "python": lambda state, bucket: None}
    ddp = DistributedDataParallel(_manager(), _model())
    with pytest.raises(error, match=match):
        ddp.register_comm_hook(states[state](), hooks[hook])


def test_init_sync_is_the_integrations():
    with pytest.raises(ValueError, match="init_sync"):
        DistributedDataParallel(_manager(), _model(), init_sync=True)


def test_optimizers_in_backward_raise():
    ddp = DistributedDataParallel(_manager(), _model())
    with pytest.raises(NotImplementedError, match="should_commit"):
        ddp.overlap_optimizer(torch.optim.SGD(ddp.parameters(), lr=0.1))
    model = _model()
    model[0].weight._in_backward_optimizers = [torch.optim.SGD([model[0].weight], lr=0.1)]
    ddp = DistributedDataParallel(_manager(), model)
    with pytest.raises(NotImplementedError, match="should_commit"):
        ddp(torch.ones(3, 4))
