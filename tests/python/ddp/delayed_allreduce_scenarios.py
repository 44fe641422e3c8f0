"""torch DDP's delay_all_reduce_named_params / param_to_hook_all_reduce, fastddp against
torch DDP on the same data. Run on every rank of a harness world (see harness.py)."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import fastddp
from tests.python.scenarios import agree, compare_grads, compare_state, mlp, unwrap, vector_batch

# mlp(): Linear 0, 2, 4. The middle layer is delayed; the hook sits on the first layer's
# weight, whose gradient backward computes last (after layer 2's have been accumulated).
DELAYED = ("2.weight", "2.bias")


def _delay_args(model) -> dict:
    named = dict(model.named_parameters())
    return {"delay_all_reduce_named_params": [(n, named[n]) for n in DELAYED],
            "param_to_hook_all_reduce": named["0.weight"]}


def delayed_training(steps: int = 5) -> None:
    """Both wrappers with the same delayed parameters: grads after every backward, the
    parameters after every step. torch never waits for its delayed allreduce, so a barrier
    (gloo runs it after every earlier collective of the group) lets its result land before
    the comparison; fastddp has waited already."""
    torch.manual_seed(0)
    base = mlp()
    ref_module, fast_module = copy.deepcopy(base), copy.deepcopy(base)
    ref = TorchDDP(ref_module, bucket_cap_mb=0.001, **_delay_args(ref_module))
    fast = fastddp.DistributedDataParallel(fast_module, bucket_cap_mb=0.001,
                                           **_delay_args(fast_module))
    assert fast.bucket_plan() and not any(n in DELAYED for b in fast.bucket_plan() for n in b)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(steps):
        inputs, target = vector_batch(step)
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad(set_to_none=step % 2 == 0)  # both paths of torch's grad buffer
            F.mse_loss(model(inputs), target).backward()
        dist.barrier()
        agree(lambda s=step: compare_grads(unwrap(ref), unwrap(fast), f"step {s}"))
        delayed = [p.grad for n, p in unwrap(fast).named_parameters() if n in DELAYED]
        agree(lambda: _same_storage(delayed, fast._delayed.buffer))
        for opt in opts:
            opt.step()
        agree(lambda s=step: compare_state(unwrap(ref), unwrap(fast), f"after step {s}"))


def _same_storage(grads: list, buffer: torch.Tensor) -> None:
    assert all(g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
               for g in grads), "a delayed gradient is not a view of the flat buffer"


def delayed_errors() -> dict:
    """One argument without the other (torch's ValueError); every parameter delayed and
    pickling, which fastddp refuses by name."""
    out = {}
    model = mlp()
    named = list(model.named_parameters())
    for name, wrap in (("torch", TorchDDP), ("fastddp", fastddp.DistributedDataParallel)):
        with pytest.raises(ValueError) as e:
            wrap(mlp(), delay_all_reduce_named_params=named[:1])
        out[name] = str(e.value)
    with pytest.raises(NotImplementedError, match="every parameter"):
        fastddp.DistributedDataParallel(model, delay_all_reduce_named_params=named,
                                        param_to_hook_all_reduce=named[0][1])
    model = mlp()
    fast = fastddp.DistributedDataParallel(model, **_delay_args(model))
    with pytest.raises(NotImplementedError, match="pickling"):
        pickle.dumps(fast)
    return out
