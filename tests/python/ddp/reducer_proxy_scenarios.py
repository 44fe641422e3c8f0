"""``ddp.reducer`` as Lightning and Accelerate call it, without the frameworks: each scenario
repeats a framework's calls (quoted from its source) on torch DDP and on fastddp side by
side, and compares grads, parameters and buffers (see scenarios.py for the helpers).
"""

import copy
import pickle
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fastddp
from tests.python.scenarios import (OutOfOrder, agree, assert_close_ulps, compare_grads,
                                    compare_state, rounding_ulps, side_by_side, torch_rebuilt_plan,
                                    train, vector_batch, with_batchnorm)

STEPS = 4


class StepInForward(nn.Module):
    """Lightning's manual optimization: ``training_step`` runs inside DDP's forward (Lightning
    redirects the wrapper's forward to it) and calls ``manual_backward`` and the optimizer
    there. BatchNorm shows when buffers are broadcast; ``unused`` gets no grad."""

    def __init__(self, unused_layer: bool):
        super().__init__()
        self.net = with_batchnorm()
        self.unused = nn.Linear(4, 4) if unused_layer else None

    def attach(self, wrapper: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # Plain attributes, not submodules: the wrapper owns this module.
        self.__dict__["wrapper"] = weakref.ref(wrapper)
        self.__dict__["optimizer"] = optimizer
        self.__dict__["grads"] = []

    def forward(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        ddp, optimizer = self.__dict__["wrapper"](), self.__dict__["optimizer"]
        loss = F.mse_loss(self.net(inputs), target)
        optimizer.zero_grad()
        # lightning/pytorch/overrides/distributed.py: prepare_for_backward(model, output)
        if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
            ddp.require_forward_param_sync = True
            args = [loss] if ddp.find_unused_parameters and not ddp.static_graph else []
            ddp.reducer._rebuild_buckets()
            ddp.reducer.prepare_for_backward(args)
        else:
            ddp.require_forward_param_sync = False
        loss.backward()
        # lightning/pytorch/strategies/ddp.py: DDPStrategy.post_backward, first static-graph
        # iteration of manual optimization only
        if ddp.static_graph and not self.__dict__.get("delay_done"):
            ddp.reducer._delay_all_reduce()
            self.__dict__["delay_done"] = True
        self.__dict__["grads"] = [None if p.grad is None else p.grad.clone()
                                  for p in self.parameters()]
        optimizer.step()
        # lightning/pytorch/strategies/ddp.py: _DDPForwardRedirection.on_after_inner_forward
        ddp.require_backward_grad_sync = False
        return loss.detach()


def manual_step_in_forward(find_unused_parameters: bool, static_graph: bool = False) -> None:
    """Lightning's manual optimization, with and without find_unused_parameters, and with
    static_graph (its first iteration reduces through reducer._delay_all_reduce())."""
    ref, fast = side_by_side(lambda: StepInForward(find_unused_parameters),
                             find_unused_parameters=find_unused_parameters,
                             static_graph=static_graph)
    for model in (ref, fast):
        model.module.attach(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for step in range(STEPS):
        for model in (ref, fast):
            model(*vector_batch(step))
            model.require_backward_grad_sync = True  # on_after_outer_forward
        agree(lambda: _compare_saved_grads(ref.module, fast.module, f"step {step}"))
        agree(lambda: compare_state(ref.module, fast.module, f"after step {step}"))
    if find_unused_parameters:
        assert fast.module.unused.weight.grad is None


def trigger_sync_in_backward(gradient_as_bucket_view: bool, static_graph: bool = False) -> None:
    """Accelerate's trigger_sync_in_backward: two forwards under no_sync, a local backward,
    then a backward that ``reducer.prepare_for_backward([])`` makes reduce the sum."""
    ref, fast = side_by_side(with_batchnorm, gradient_as_bucket_view=gradient_as_bucket_view,
                             static_graph=static_graph)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, fast)]
    for step in range(STEPS):
        for model, opt in zip((ref, fast), opts):
            opt.zero_grad()
            with model.no_sync():
                loss_a = F.mse_loss(*_forward(model, vector_batch(10 * step)))
                loss_b = F.mse_loss(*_forward(model, vector_batch(10 * step + 1)))
            loss_a.backward()
            # accelerate/accelerator.py: Accelerator.trigger_sync_in_backward
            old = model.require_backward_grad_sync, model.require_forward_param_sync
            model.require_backward_grad_sync = True
            model.require_forward_param_sync = True
            model.reducer.prepare_for_backward([])
            try:
                loss_b.backward()
            finally:
                model.require_backward_grad_sync, model.require_forward_param_sync = old
        agree(lambda: compare_grads(ref.module, fast.module, f"step {step}"))
        for opt in opts:
            opt.step()
        agree(lambda: compare_state(ref.module, fast.module, f"after step {step}"))


def rebuild_buckets_call() -> list[bool]:
    """``reducer._rebuild_buckets()`` returns what torch's returns: True once after the first
    synchronized backward when no forward ran since (it rebuilt then), False otherwise."""
    ref, fast = side_by_side(OutOfOrder, bucket_cap_mb=0.002)
    initial = fast.bucket_plan()
    returns = [[m.reducer._rebuild_buckets() for m in (ref, fast)]]  # before any backward
    for model in (ref, fast):
        F.mse_loss(*_forward(model, vector_batch(0))).backward()
    returns.append([m.reducer._rebuild_buckets() for m in (ref, fast)])
    returns.append([m.reducer._rebuild_buckets() for m in (ref, fast)])
    rebuilt = fast.bucket_plan()
    assert returns == [[False, False], [True, True], [False, False]], returns
    assert rebuilt != initial, "OutOfOrder should make the rebuild visible"
    train(ref, fast)  # the forwards find nothing left to rebuild
    assert [m.reducer._rebuild_buckets() for m in (ref, fast)] == [False, False]
    assert fast.bucket_plan() == rebuilt == torch_rebuilt_plan(ref)
    return [r for pair in returns for r in pair]


def unsupported_calls() -> None:
    """What the proxy cannot map raises NotImplementedError naming the method; names torch's
    Reducer lacks raise AttributeError; bad arguments TypeError."""
    torch.manual_seed(0)
    fast = fastddp.DistributedDataParallel(with_batchnorm())
    reducer = fast.reducer
    for call, name in ((reducer._get_local_used_map, "_get_local_used_map"),
                       (lambda: reducer._set_static_graph(), "_set_static_graph")):
        _expect_raises(call, NotImplementedError, f"reducer.{name}()")
    assert not hasattr(reducer, "no_such_method")
    _expect_raises(lambda: reducer.prepare_for_backward("loss"), TypeError, "outputs")
    _expect_raises(lambda: reducer.prepare_for_backward([torch.ones(1), 2]), TypeError, "list")
    _expect_raises(reducer._delay_all_reduce, RuntimeError, "first iteration of static_graph")


def copies_answer_for_themselves() -> None:
    """copy.deepcopy and pickle (torch.save) give the copy a reducer of its own: prepare_for_
    backward on the copy arms the copy's C++ reducer, as on a copy of torch's DDP."""
    ref, fast = side_by_side(with_batchnorm)
    for original in (ref, fast):
        F.mse_loss(*_forward(original, vector_batch(0))).backward()
    for ours in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert ours.reducer._ddp() is ours and fast.reducer._ddp() is fast
        theirs = copy.deepcopy(ref)
        for model in (theirs, ours):
            model.zero_grad()
            with model.no_sync():
                loss = F.mse_loss(*_forward(model, vector_batch(1)))
            model.reducer.prepare_for_backward([])
            loss.backward()
        agree(lambda: compare_grads(theirs.module, ours.module, f"copy {type(ours).__name__}"))


def world_size_one() -> None:
    """At world size 1 fastddp has no C++ reducer; the proxy's calls change nothing, which
    is what torch's reducer amounts to for one rank: both patterns train to torch's numbers."""
    assert dist.get_world_size() == 1
    ref, fast = side_by_side(lambda: StepInForward(False))
    assert fast._reducer is None
    for model in (ref, fast):
        model.module.attach(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    for step in range(STEPS):
        for model in (ref, fast):
            model(*vector_batch(step))
            model.require_backward_grad_sync = True
        _compare_saved_grads(ref.module, fast.module, f"step {step}")
        compare_state(ref.module, fast.module, f"after step {step}")
    assert fast.reducer._rebuild_buckets() is False
    fast.reducer._delay_all_reduce()  # nothing to reduce in a world of one
    trigger_sync_in_backward(gradient_as_bucket_view=False)


def _compare_saved_grads(ref: StepInForward, fast: StepInForward, where: str) -> None:
    names = [n for n, _ in ref.named_parameters()]
    for name, theirs, ours in zip(names, ref.__dict__["grads"], fast.__dict__["grads"],
                                  strict=True):
        if theirs is None or ours is None:
            assert theirs is None and ours is None, f"{where}: {name}.grad set on one side"
            continue
        assert_close_ulps(ours, theirs, rounding_ulps(),  # as scenarios.compare_grads
                          msg=lambda m: f"{where}: grad of {name}: {m}")


def _forward(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]):
    inputs, target = batch
    return model(inputs), target


def _expect_raises(call, error_type: type[BaseException], match: str) -> None:
    try:
        call()
    except error_type as e:
        assert match in str(e), f"{error_type.__name__} message lacks {match!r}: {e}"
        return
    raise AssertionError(f"expected {error_type.__name__} ({match})")
