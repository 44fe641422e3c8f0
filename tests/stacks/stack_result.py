"""What each stack script writes: one JSON file per rank, read by
tests/python/launch/test_stacks.py.

Not part of the scripts' training logic: it only records which DDP class the framework
wrapped the model in, the losses, and the final state (parameters and buffers).
"""

import json
import os
from pathlib import Path

import torch
from torch import nn


def describe_wrapper(wrapper: object) -> dict:
    """``module.qualname`` of the wrapper's class and its bases (fastddp's subclass of torch's
    DDP lists fastddp.ddp.DistributedDataParallel; stock torch DDP does not), and the DDP
    arguments the framework chose."""
    return {"classes": [f"{c.__module__}.{c.__qualname__}" for c in type(wrapper).__mro__],
            "find_unused_parameters": getattr(wrapper, "find_unused_parameters", None),
            "static_graph": getattr(wrapper, "static_graph", None),
            "gradient_as_bucket_view": getattr(wrapper, "gradient_as_bucket_view", None)}


def write_result(out: str, wrapper: dict, losses: list[float], module: nn.Module,
                 rank: int | None = None) -> None:
    """Writes ``{out}.rank{rank}.json``; ``wrapper`` is describe_wrapper()'s. ``rank``
    defaults to torchrun's RANK (Lightning's own launcher sets no RANK: pass it)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    state = {name: t.detach().double().flatten().tolist()
             for name, t in module.state_dict().items() if torch.is_floating_point(t)}
    result = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
              "wrapper": wrapper, "losses": [float(x) for x in losses], "state": state}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))


def shutdown() -> None:
    """After main() returned: frees what its locals left in reference cycles (a DDP wrapper
    holds its process group), then tears gloo down on every rank together. A group left to
    the interpreter's exit can abort the process ("terminate called without an active
    exception"), as tests/python/scripts/train_tiny.py notes."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
