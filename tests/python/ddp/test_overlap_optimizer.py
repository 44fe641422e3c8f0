"""The optimizer overlapped with backward (overlap_optimizer_scenarios.py): bit for bit torch
DDP followed by the same optimizer's step(), on 2 and 3 gloo ranks and at world size 1, and
torch DDP's own _register_fused_optim."""

import pytest

from tests.python.ddp import overlap_optimizer_scenarios as s
from tests.python.harness import World


def _check(results, native=False):
    for r in results:
        assert r == {"equal": True, "grads_equal": True, "state_equal": True,
                     "replicas_agree": True, "moved": True, "native": native}, r


# The matrix: SGD, SGD with momentum and AdamW, both gradient layouts, with a hook
# and without. Bit for bit: the same averaged gradients (the same bucket layout, so the
# same sums), then the optimizer's own update, per parameter.
@pytest.mark.parametrize("optimizer", ["sgd", "sgd_momentum", "adamw"])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
@pytest.mark.parametrize("hook", [None, "bf16", "python"])
def test_equals_torch_ddp_then_step(world, optimizer, view, hook):
    _check(world.check(s.train, optimizer=optimizer, gradient_as_bucket_view=view, hook=hook))


# Any torch.optim optimizer and implementation, through its own step(): foreach AdamW,
# RMSprop; two param groups with their own learning rates.
@pytest.mark.parametrize("optimizer", ["adamw_foreach", "rmsprop"])
def test_other_optimizers_and_implementations(world, optimizer):
    _check(world.check(s.train, optimizer=optimizer, groups=True))


# SGD, Adam and AdamW with fused=True: torch's fused kernels called from C++, no Python per
# bucket; the numbers and state of the optimizer's own step(). Two param groups, a StepLR
# changing their learning rates every step, a reload of the optimizer's state (a resume),
# both gradient layouts.
@pytest.mark.parametrize("optimizer", ["adamw_fused", "adam_fused_amsgrad", "sgd_fused",
                                       "sgd_fused_plain"])
@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
def test_fused_optimizers_step_natively(world, optimizer, view):
    _check(world.check(s.train, optimizer=optimizer, gradient_as_bucket_view=view, groups=True,
                       schedule=True, steps=5, reload_at=2), native=True)


def test_no_sync_accumulates_and_steps_with_the_next_backward(world):
    _check(world.check(s.train, optimizer="adamw", steps=6, no_sync_every=2))


# Where the write-back waits for the end of backward: the steps come after it, same numbers.
@pytest.mark.parametrize("ddp_kwargs", [
    {"find_unused_parameters": True, "model": "unused"},
    {"static_graph": True},
    {"check_for_nan_in_grad": True},
], ids=lambda kw: next(iter(kw)))
def test_with_arguments_that_finish_at_the_end(world, ddp_kwargs):
    _check(world.check(s.train, optimizer="sgd_momentum", **ddp_kwargs))


# Buffers allocated at the first gradient: the steps during backward (CPU) and at its end
# read grads written from them, the buffers are released after the last step.
@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_fused"])
def test_lazy_bucket_allocation(world, view, optimizer):
    results = world.check(s.train, optimizer=optimizer, gradient_as_bucket_view=view,
                          lazy_bucket_allocation=True)
    assert [r.pop("held_bucket_bytes") for r in results] == [0] * len(results), results
    _check(results, native=optimizer == "adamw_fused")


def test_world_size_one(world1):
    _check(world1.check(s.train, optimizer="adamw"))


# torch's functional optimizers step per parameter after its allreduce_hook: the same
# update formulas on the same averaged gradients.
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
def test_register_fused_optim_equals_torch_ddp(world, optimizer):
    for r in world.check(s.registered_fused, optimizer=optimizer):
        assert r == {"equal": True, "moved": True}, r


def test_steps_run_during_backward(world):
    # Four buckets (body's two, mid, last): body's two step inside backward, before last's
    # gradient exists, in each of the two backward passes after the first. (mid's may too,
    # when its reduction is done by the time the loop reaches it: not counted.)
    for r in world.check(s.steps_during_backward):
        assert r == {"body_steps_inside_backward": 4, "body_steps": 4, "buckets": 4,
                     "equal": True}, r


def test_refusals(world):
    for r in world.check(s.refusals):
        assert r["user_step"].startswith("RuntimeError: SGD.step() was called"), r
        assert r["twice"].startswith("RuntimeError:") and "already" in r["twice"], r
        assert r["pickle"].startswith("NotImplementedError:"), r
        assert r["lbfgs"].startswith("NotImplementedError:") and "closure" in r["lbfgs"], r
        assert r["not_an_optimizer"].startswith("TypeError:"), r
        assert r["mixed_precision"].startswith("NotImplementedError:"), r
        assert r["delayed"].startswith("NotImplementedError:"), r


# On a GPU the steps are enqueued at the end of backward, each after its own bucket's
# reduction (Note [overlapped optimizer]): fused AdamW natively, SGD through its step().
@pytest.mark.gpu
@pytest.mark.parametrize(("optimizer", "native"), [("adamw_fused", True), ("sgd_momentum", False)])
def test_cuda_equals_torch_ddp_then_step(optimizer, native):
    # gloo reduces CUDA tensors through host memory: two ranks on one GPU.
    world = World(2, backend="gloo")
    try:
        _check(world.check(s.train, optimizer=optimizer, device="cuda", groups=True),
               native=native)
    finally:
        world.close()
