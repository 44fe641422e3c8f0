"""fastddp.patch(shard_optimizer=True) in-process, on every rank of a harness world: which
optimizers it shards, which it leaves to torch and says so, and clip_grad_norm_ over a part
of a sharded model refused (Note [sharded optimizer under the launcher])."""

import torch
import torch.nn.functional as F

import fastddp
from tests.python.scenarios import mlp, vector_batch


def patched() -> dict:
    before = torch.optim.AdamW
    with fastddp.patch(shard_optimizer=True) as handle:
        torch.manual_seed(0)
        early = mlp()
        kept = torch.optim.Adam(early.parameters(), lr=0.01)  # before its model is wrapped
        model = torch.nn.parallel.DistributedDataParallel(mlp())
        part = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
        sharded = torch.optim.AdamW(model.parameters(), lr=0.01)
        inputs, target = vector_batch(0)
        F.mse_loss(model(inputs), target).backward()
        whole = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        try:
            torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)
            part_clip = None
        except NotImplementedError as e:
            part_clip = str(e)
        sharded.step()
        notes = sorted(handle._notes)
    return {"rank": torch.distributed.get_rank(), "kept": type(kept).__name__, "part": type(part).__name__,
            "sharded": type(sharded).__name__, "whole_norm": float(whole),
            "part_clip": part_clip, "notes": notes,
            "restored": torch.optim.AdamW is before}
