"""World size 1 with FASTDDP_WORLD1_REDUCER=1, every comm hook against torch DDP
(world1_hooks_scenarios.py): on a 1-rank gloo world here, over NCCL where there is a GPU
(`make gpu-check` also runs the scenarios as a script, and under compute-sanitizer)."""

import pytest

from tests.python.harness import World
from tests.python.hooks import world1_hooks_scenarios as s

# "plain" uses single-parameter buckets: a bucket holding only a bias has nothing for
# PowerSGD to compress, and torch's hook still draws a seed for it (a native hook that did
# not drew every later bucket's Q from the wrong seed).
def _cases() -> list:
    return [pytest.param(case, config, id=f"{case}-{config}")
            for case in s.CASES for config in s.CONFIGS]


@pytest.mark.parametrize(("case", "config"), _cases())
def test_world1_hooks(world1, case, config):
    out = world1.check(s.run_case, case=case, config=config, device="cpu", steps=4)[0]
    assert out["bytes_reduced"] > 0, out


@pytest.fixture(scope="module")
def nccl_world1():
    world = World(1, backend="nccl")
    yield world
    world.close()


@pytest.mark.gpu
@pytest.mark.parametrize(("case", "config"), _cases())
def test_world1_hooks_nccl(nccl_world1, case, config):
    out = nccl_world1.check(s.run_case, case=case, config=config, device="cuda")[0]
    assert out["bytes_reduced"] > 0, out


@pytest.mark.gpu
def test_comm_stats_on_the_device_clock(nccl_world1):
    from tests.python.ddp import dropin_scenarios

    (stats,) = nccl_world1.check(dropin_scenarios.device_clock_stats)
    assert len(stats["buckets"]) > 1, stats

