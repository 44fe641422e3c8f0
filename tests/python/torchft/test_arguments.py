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
