"""torch's powerSGD_hook / batched_powerSGD_hook registered with a PowerSGDState, and its
save/load, against torch DDP (powersgd_torch_state_scenarios.py): on 2 and 3 gloo ranks,
and on CUDA over NCCL (the first GPU machine crashed on exactly this registration)."""

import pytest

from tests.python.harness import World
from tests.python.hooks import powersgd_torch_state_scenarios as s


@pytest.fixture(scope="module")
def nccl_world1():
    world = World(1, backend="nccl")
    yield world
    world.close()


@pytest.mark.parametrize("batched", [False, True], ids=["powerSGD_hook", "batched"])
def test_torch_hook_with_state(world, batched):
    # Steps 2, 3 and 4 are compressed (start_powerSGD_iter=2).
    assert world.check(s.torch_hook_with_state, batched=batched) == [3] * world.size


# Batched PowerSGD's Q and error belong to the whole bucket's square matrix, and a fresh
# model's first step runs on its unrebuilt bucket layout (parameter order; the saved state
# was made on the rebuilt, gradient-ready order), so the first resumed step differs from
# the uninterrupted run (0.10 here). Strict: the day resuming adopts the saved layout, this
# passes and must be turned into a plain test.
RESUME_BATCHED = pytest.mark.xfail(strict=True, reason="batched PowerSGD resumes onto the "
                                   "unrebuilt bucket layout for one step")
RESUME_CASES = [pytest.param(False, id="powerSGD_hook"),
                pytest.param(True, id="batched", marks=RESUME_BATCHED)]


@pytest.mark.parametrize("batched", RESUME_CASES)
def test_saved_state_resumes_as_torch(world, batched):
    assert world.check(s.save_and_load_state, batched=batched) == [4] * world.size


@pytest.mark.gpu
@pytest.mark.parametrize("batched", [False, True], ids=["powerSGD_hook", "batched"])
def test_torch_hook_with_state_on_cuda(nccl_world1, batched):
    assert nccl_world1.check(s.torch_hook_with_state, device="cuda", batched=batched) == [3]


@pytest.mark.gpu
@pytest.mark.parametrize("batched", RESUME_CASES)
def test_saved_state_resumes_as_torch_on_cuda(nccl_world1, batched):
    assert nccl_world1.check(s.save_and_load_state, device="cuda", batched=batched) == [4]
