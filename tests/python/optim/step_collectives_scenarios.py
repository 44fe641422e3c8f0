"""What the sharded optimizer's step hands to its process group: aliases made in C++, never a
tensor Python holds (Note [no Python tensor in a Work], csrc/hooks/common/collectives.h).
Scenarios for a harness world (2 and 3 gloo ranks)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fastddp
from fastddp.optim import ShardedOptimizer
from tests.python.optim.sharded_scenarios import CAP_MB
from tests.python.scenarios import mlp, vector_batch


class _RecordingGroup(dist.ProcessGroup):
    """The world's gloo group behind a Python ProcessGroup that keeps every tensor handed to
    its collectives, as the Python object the call received."""

    def __init__(self) -> None:
        super().__init__(dist.get_rank(), dist.get_world_size())
        self.inner = dist.group.WORLD
        self.seen: list[tuple[str, torch.Tensor]] = []

    def allreduce(self, tensors, opts):
        self.seen += [("allreduce", t) for t in tensors]
        return self.inner.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        self.seen += [("broadcast", t) for t in tensors]
        return self.inner.broadcast(tensors, opts)

    def allgather(self, outputs, inputs, opts=None):
        return self.inner.allgather(outputs, inputs)

    def all_to_all_single(self, output, inputs, output_splits, input_splits, opts):
        self.seen += [("all_to_all_single", output), ("all_to_all_single", inputs)]
        return dist.group.WORLD.all_to_all_single(output, inputs, output_splits, input_splits,
                                                  opts)

    def getBackendName(self) -> str:
        return "python-recording"


def step_hands_no_python_tensor_to_the_group(steps: int = 2) -> dict:
    """Every tensor a sharded step (backward's reduce-scatter, clip_grad_norm_, GradScaler's
    inf check, the all-gather) hands to the group is an alias made in C++: neither a tensor
    Python holds (a flat buffer, a shard, a parameter) nor a view of one, whose base it would
    hold (Note [no Python tensor in a Work], csrc/hooks/common/collectives.h: a gloo worker
    releasing a Python tensor while the interpreter exits aborts the process). Checked
    through a Python group, which receives each tensor as the Python object of its
    TensorImpl: the very object Python holds, if it was handed one."""
    torch.manual_seed(0)
    group = _RecordingGroup()
    model = fastddp.DistributedDataParallel(mlp(), process_group=group, bucket_cap_mb=CAP_MB)
    opt = ShardedOptimizer(model, torch.optim.AdamW, lr=0.01)
    scaler = torch.amp.GradScaler("cpu")
    held = ([b.flat for b in model._sharded] + [b.grad for b in model._sharded]
            + list(model.parameters()) + [p.data for p in model.parameters()])
    group.seen.clear()
    for step in range(steps):
        inputs, target = vector_batch(step)
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(inputs), target)).backward()
        opt.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()
    python_held = sorted({what for what, t in group.seen
                          if any(t is h or t._base is h for h in held)})
    return {"collectives": sorted({what for what, _ in group.seen}),
            "python_held": python_held}
