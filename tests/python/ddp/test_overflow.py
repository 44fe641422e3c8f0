"""One overflow step under GradScaler never poisons a run (overflow_scenarios.py): for every
stateful hook, the parameters equal, bit for bit, those of the same training without that
iteration, and every later step is taken."""

import pytest

from tests.python.ddp import overflow_scenarios as s
from tests.python.harness import World

STATEFUL = ["bf16_ef", "fp16_ef", "bf16_fp32_ef", "int8", "fp8_e4m3", "fp8_e5m2", "powersgd",
            "batched_powersgd", "torch_powersgd", "acpsgd"]
HIERARCHICAL = ["hier_int8", "hier_bf16_ef", "hier_powersgd"]
# No state to keep: the same must hold, with nothing to put back.
STATELESS = ["allreduce", "bf16", "fp16", "bf16_fp32"]
# Where the overflow is: every parameter on one rank, every parameter on every rank, one
# parameter of the bucket reduced first, one of the bucket reduced last (one rank).
PLACES = [("all", "one"), ("all", "all"), ("first", "one"), ("last", "one")]


@pytest.fixture(scope="module")
def nccl_world1():
    world = World(1, backend="nccl")
    yield world
    world.close()


def both(world, hook: str, scenario=s.scaler_run, **kwargs) -> None:
    for where, ranks in PLACES:
        for r in world.check(scenario, hook=hook, where=where, ranks=ranks, **kwargs):
            what = f"{hook}, overflow in {where} on {ranks} rank(s): {r}"
            # Every step after the bad one is taken (the scale is never halved again).
            assert r["taken_after"] == [True] * len(r["taken_after"]), what
            assert r["equal"] and r["finite"] and r["scales"][0] == r["scales"][1], what


@pytest.mark.parametrize("hook", STATEFUL + STATELESS)
def test_one_overflow_leaves_no_trace(world, hook):
    both(world, hook)


@pytest.mark.parametrize("hook", ["powersgd", "torch_powersgd", "batched_powersgd", "acpsgd",
                                  "bf16_ef", "int8"])
def test_device_settling_leaves_no_trace(world, hook):
    # The GPU's way of settling double-buffered state, run on CPU tensors.
    both(world, hook, scenario=s.scaler_run_settled_as_on_device)


@pytest.mark.parametrize("hook", HIERARCHICAL)
def test_one_overflow_leaves_no_trace_hierarchical(world4, hook):
    both(world4, hook)


@pytest.mark.parametrize("hook", STATEFUL)
def test_overflow_every_fifth_step_keeps_learning(world, hook):
    if world.size != 2:
        pytest.skip("one world size is enough for the long run")
    (r, *_) = world.check(s.long_run, hook=hook)
    # 40 of 200 steps skipped (and their scale halvings) must not stop the training, and are
    # lost progress, nothing more: the parameters equal, bit for bit, those of the same
    # training without those 40 iterations, and the loss falls. (The bound, a loss
    # within 10% of the 200-step run's, is a property of the 160 steps, not of the
    # overflows: with batched PowerSGD the 160-step run itself ended 10.4% above it on a
    # held-out batch on an Intel Xeon, where other machines' CPUs stayed within; so the
    # losses are reported and the exact statement is asserted.)
    assert r["equal"], r
    # The loss over the batches trained on falls (measured: to 0.73-0.76 of its start with
    # batched PowerSGD, ACP-SGD, int8 and bf16 with error feedback); a run stuck on a NaN
    # or no longer stepping stays at or above it.
    assert r["overflows"] < 0.9 * r["start"], r


@pytest.mark.gpu
@pytest.mark.parametrize("hook", STATEFUL)
def test_one_overflow_leaves_no_trace_on_cuda(nccl_world1, hook):
    # float16 autocast and GradScaler on CUDA, NCCL at world size 1 (a registered hook
    # builds the reducer there, as torch runs hooks at world size 1).
    both(nccl_world1, hook, device="cuda")


def test_auto_takes_no_figure_from_an_overflow_step(world):
    clean = world.check(s.auto_run, overflow_at=None)
    # Step 2 is one of the 3 sampled (after 1 warm-up step): it gives no figure, so the
    # sampling ends one step later, and every step after it is taken.
    bad = world.check(s.auto_run, overflow_at=2)
    for c, b in zip(clean, bad):
        assert c["first_switch"] is not None and b["first_switch"] == c["first_switch"] + 1, (c, b)
        assert b["taken"][:2] + b["taken"][3:] == [True] * 11 and not b["taken"][2], b
        assert c["finite"] and b["finite"]
