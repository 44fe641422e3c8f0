"""What ``fastddp.hooks.auto()``'s tuner (fastddp/tuning/auto.py) and the launcher's
``--advise`` sampler (fastddp/tuning/advise.py) read and set of the model they observe, and
no more: its group, bucket cap, parameters and step figures, and the reducer's per-step
checks while they measure. They get this handle, not the DistributedDataParallel object
(issue 44 item 2); the reducer it reaches may be rebuilt
(a new bucket cap), so each call asks the model for the current one."""

from __future__ import annotations

from typing import Any

import torch


class TunerHandle:
    def __init__(self, ddp: Any):
        self._ddp = ddp

    @property
    def process_group(self) -> Any:
        return self._ddp.process_group

    @property
    def bucket_bytes_cap(self) -> int:
        return self._ddp.bucket_bytes_cap

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters the reducer averages, in its index order (bucket_plan's)."""
        return self._ddp._reducer_params

    def comm_stats(self) -> dict[str, Any]:
        return self._ddp.comm_stats()

    def reducer_id(self) -> int:
        """Changes when the reducer is rebuilt: the new one must be told to check too."""
        return id(self._ddp._reducer)

    def time_every_step(self, on: bool) -> None:
        """Every step timed on the device's clock (Note [device timeline]); off: the DDP
        logger's sampling again. A model with no reducer yet has nothing to time."""
        reducer = getattr(self._ddp, "_reducer", None)
        if reducer is not None:
            reducer.set_time_every_step(on)

    def check_each_step(self, on: bool) -> None:
        """While tuning, every step's averaged gradients checked for NaN/Inf (an
        overflowed step is not timed) and timed on the device's clock (Note [device
        timeline]); off: no check, and the DDP logger's sampling again."""
        reducer = self._ddp._reducer
        reducer.set_track_finite(on)
        reducer.set_time_every_step(on)

    def last_step_finite(self) -> bool | None:
        """The last step's check; None when off or no step finished since."""
        return self._ddp._reducer.last_step_finite()

    def bucket_plan(self) -> list[list[int]]:
        """Per bucket, the indices into ``params`` it holds."""
        return self._ddp._reducer.bucket_plan()
