"""fastddp: torch DistributedDataParallel with a C++/CUDA reducer."""

from fastddp import _compat

_compat.load()  # before anything imports _C: a module built for another torch is refused

from fastddp._build import build_info  # noqa: E402
from fastddp import hooks  # noqa: E402
from fastddp.ddp import DistributedDataParallel  # noqa: E402
from fastddp.diloco import DiLoCo  # noqa: E402
from fastddp.launch.patch import patch  # noqa: E402
from fastddp.link import EmulatedLinkGroup, Link  # noqa: E402
from fastddp import optim  # noqa: E402
from fastddp.tuning.auto import AutoTuner  # noqa: E402

hooks.auto_hook.set_tuner(AutoTuner)  # the core starts the tuner it is given (auto_hook.py)

__all__ = ["DiLoCo", "DistributedDataParallel", "EmulatedLinkGroup", "Link", "build_info", "hooks",
           "optim", "patch"]
__version__ = "0.1.0"
