"""The aligned flat buffer per (device, dtype) (flat_buffer_scenarios.py), on gloo with
FASTDDP_BUCKET_ALIGN forcing CUDA's padded layout onto the CPU."""

import pytest

from tests.python.ddp import flat_buffer_scenarios as s
from tests.python.harness import World
from tests.python.hooks.world1_hooks_scenarios import CASES


@pytest.fixture(scope="module")
def world2():
    world = World(2)
    yield world
    world.close()


@pytest.mark.parametrize("align", [16, 64, 4096])
def test_grads_are_aligned_views_of_one_buffer_per_dtype(world, align):
    out = world.check(s.layout, align=align)
    for figures in out:
        # float32 and float64: one buffer each, although the plan has a bucket per parameter.
        assert figures["storages"] == {"torch.float32": 1, "torch.float64": 1}, figures
        assert figures["buckets"] > 2, figures
        assert figures["padded_bytes"] > 0, figures


@pytest.mark.parametrize("case", list(CASES))
def test_every_hook_over_padded_slots(world2, case):
    names = world2.check(s.hook_case, case=case)
    assert names[0] == names[1]


def test_bad_alignment_names_the_variable(world2):
    world2.expect_error(s.layout, ValueError, "FASTDDP_BUCKET_ALIGN", align=24)
