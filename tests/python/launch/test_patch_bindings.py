"""``fastddp.patch()`` after a framework was imported: the names modules bound to torch's
class at import (``from torch.nn.parallel import DistributedDataParallel``, as Lightning does)
are replaced too, listed, and restored by ``unpatch()``. In-process, with stand-in modules."""

import importlib
import sys
import types
from collections.abc import Iterator

import pytest
import torch

import fastddp
from fastddp.launch.patch import imported_bindings

# patch() rebinds every module global that is torch's class, this module's own included;
# held in a tuple, torch's class stays reachable while patched.
_TORCH = (torch.nn.parallel.distributed.DistributedDataParallel,)
TORCH_DDP = _TORCH[0]


@pytest.fixture
def stand_ins() -> Iterator[tuple[types.ModuleType, types.ModuleType]]:
    """Two already-imported modules: one binds torch's class under its own name and an
    alias, the other under its own name only; plus one that merely mentions torch."""
    first = types.ModuleType("stand_in_strategies")
    first.DistributedDataParallel = TORCH_DDP
    first.DDP = TORCH_DDP
    first.unrelated = torch.nn.Linear
    second = types.ModuleType("stand_in_overrides")
    second.DistributedDataParallel = TORCH_DDP
    bystander = types.ModuleType("stand_in_bystander")
    bystander.torch = torch
    modules = {m.__name__: m for m in (first, second, bystander)}
    sys.modules.update(modules)
    sys.modules["stand_in_alias"] = first  # one module under two keys: reported once
    try:
        yield first, second
    finally:
        for key in (*modules, "stand_in_alias"):
            sys.modules.pop(key, None)


def test_patch_replaces_names_bound_before_it(stand_ins) -> None:
    first, second = stand_ins
    with fastddp.patch(disable=False) as handle:
        assert TORCH_DDP is handle.cls  # this module's global too
        for module, attr in ((first, "DistributedDataParallel"), (first, "DDP"),
                             (second, "DistributedDataParallel")):
            assert getattr(module, attr) is handle.cls, f"{module.__name__}.{attr}"
        assert first.unrelated is torch.nn.Linear
        names = handle.rebound
        assert sorted(n for n in names if n.startswith("stand_in")) == [
            "stand_in_overrides.DistributedDataParallel", "stand_in_strategies.DDP",
            "stand_in_strategies.DistributedDataParallel"]
        assert all(not n.startswith("torch.") for n in names), names
        line = handle.describe()
        assert "stand_in_strategies.DDP" in line and "stand_in_overrides" in line, line
    for module, attr in ((first, "DistributedDataParallel"), (first, "DDP"),
                         (second, "DistributedDataParallel")):
        assert getattr(module, attr) is TORCH_DDP, f"{module.__name__}.{attr} not restored"
    assert torch.nn.parallel.DistributedDataParallel is TORCH_DDP


def test_torch_modules_keep_torch_class(stand_ins) -> None:
    # torch's own composable replicate() builds torch's DDP by the name it imported.
    replicate = importlib.import_module("torch.distributed._composable.replicate")
    assert replicate.DistributedDataParallel is _TORCH[0]
    with fastddp.patch(disable=False):
        assert replicate.DistributedDataParallel is _TORCH[0]
    assert all(module.__name__.split(".")[0] != "torch"
               for module, _ in imported_bindings(_TORCH[0]))


def test_unpatch_leaves_a_name_rebound_in_between(stand_ins) -> None:
    first, _ = stand_ins
    handle = fastddp.patch(disable=False)
    first.DDP = torch.nn.Linear  # the script rebinds it while patched
    handle.unpatch()
    assert first.DDP is torch.nn.Linear
    assert first.DistributedDataParallel is TORCH_DDP


def test_disabled_patch_touches_nothing_without_overrides(stand_ins) -> None:
    first, _ = stand_ins
    with fastddp.patch(disable=True) as handle:
        assert handle.cls is None and handle.rebound == []
        assert first.DistributedDataParallel is TORCH_DDP
        assert "nothing replaced" in handle.describe()


def test_disabled_patch_with_overrides_rebinds_torch_subclass(stand_ins) -> None:
    # FASTDDP_DISABLE=1 with launcher overrides: torch's class with the overrides applied,
    # under every name, so the comparison run differs from fastddp's only in the reducer.
    first, _ = stand_ins
    with fastddp.patch(bucket_cap_mb=2, disable=True) as handle:
        assert first.DistributedDataParallel is handle.cls
        assert issubclass(handle.cls, _TORCH[0])
        assert not issubclass(handle.cls, fastddp.DistributedDataParallel)
    assert first.DistributedDataParallel is TORCH_DDP
