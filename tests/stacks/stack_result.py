"""What each stack script writes: one JSON file per rank, read by tests/python/test_stacks.py.

Not part of the scripts' training logic: it only records which DDP class the framework
wrapped the model in, the losses, and the final state (parameters and buffers).
"""

import json
import os
from pathlib import Path

import torch
from torch import nn


def ddp_classes(wrapper: object) -> list[str]:
    """``module.qualname`` of the wrapper's class and its bases (fastddp's subclass of torch's
    DDP lists fastddp.ddp.DistributedDataParallel; stock torch DDP does not)."""
    return [f"{c.__module__}.{c.__qualname__}" for c in type(wrapper).__mro__]


def write_result(out: str, classes: list[str], losses: list[float], module: nn.Module) -> None:
    """Writes ``{out}.rank{RANK}.json``."""
    rank = int(os.environ.get("RANK", "0"))
    state = {name: t.detach().double().flatten().tolist()
             for name, t in module.state_dict().items() if torch.is_floating_point(t)}
    result = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
              "ddp_classes": classes, "losses": [float(x) for x in losses], "state": state}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
