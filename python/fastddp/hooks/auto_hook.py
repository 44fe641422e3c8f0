"""What ``fastddp.hooks.auto()`` returns (``AutoHook``: the policy and the tuner's settings,
checked), and where the DDP core finds the tuner that runs it. The tuner and the
candidates it chooses among are fastddp.tuning's (auto.py, Note [auto tuning];
candidates.py)."""

from dataclasses import dataclass, field
from typing import Any, Callable

from fastddp.hooks import catalog, node_groups


@dataclass(frozen=True)
class AutoHook:
    """What ``fastddp.hooks.auto()`` returns: register it like any hook."""

    policy: str = "any"
    warmup: int = 2
    samples: int = 5
    trials: int = 3
    lossy_margin: float = 0.05
    verbose: bool = True
    local_size: int | None = None  # ranks per node (default: torchrun's LOCAL_WORLD_SIZE)
    groups: Any = field(default=None, compare=False, repr=False)  # (intra, inter) groups

    def __post_init__(self) -> None:
        if self.policy not in catalog.POLICIES:
            raise ValueError(f"fastddp.hooks.auto: policy {self.policy!r} is not one of "
                             f"{', '.join(catalog.POLICIES)}")
        for name in ("warmup", "samples", "trials"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name == "warmup" else 1):
                raise ValueError(f"fastddp.hooks.auto: {name} must be a positive int, got "
                                 f"{value!r}")
        if not 0 <= self.lossy_margin < 1:
            raise ValueError(f"fastddp.hooks.auto: lossy_margin must be in [0, 1), got "
                             f"{self.lossy_margin!r}")
        if self.local_size is not None and self.groups is not None:
            raise ValueError("fastddp.hooks.auto: give at most one of local_size= and groups=")
        if self.local_size is not None:
            node_groups.check_local_size(self.local_size, "fastddp.hooks.auto")
        if self.groups is not None and (not isinstance(self.groups, (tuple, list))
                                        or len(self.groups) != 2):
            raise TypeError("fastddp.hooks.auto: groups must be (intra_group, inter_group)")

    @property
    def __name__(self) -> str:  # torch's register_comm_hook and our logs read it
        return f"fastddp_auto_{self.policy}_hook"

    def __call__(self, state: object, bucket: Any) -> Any:
        raise NotImplementedError(
            "fastddp.hooks.auto() chooses among fastddp's native hooks while training and "
            "runs only on fastddp.DistributedDataParallel, not under stock torch DDP")


# What runs an AutoHook on a model: fastddp.tuning.auto.AutoTuner, handed over by the
# package's face (fastddp/__init__.py). The DDP core starts it through here, so that the core
# does not import the tuner, an extra built on it (issue 53).
_tuner: Callable[..., Any] | None = None


def set_tuner(tuner: Callable[..., Any]) -> None:
    """``tuner(handle, hook, install)`` becomes what runs an AutoHook: ``handle`` the model as
    a TunerHandle, ``install(native, cap_bytes)`` puts a candidate in place."""
    global _tuner
    _tuner = tuner


def start_tuner(handle: Any, hook: AutoHook, install: Callable[..., Any]) -> Any:
    """The tuner of ``hook`` on the model behind ``handle``."""
    if _tuner is None:
        raise RuntimeError("fastddp.hooks.auto(): no tuner was set; import fastddp, which "
                           "sets fastddp.tuning's")
    return _tuner(handle, hook, install)

