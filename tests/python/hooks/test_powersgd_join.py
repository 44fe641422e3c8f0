"""PowerSGD with uneven inputs under join() against torch DDP with torch's own hook: the
joined rank's hook state moves on with its zero buckets, as torch's does (issue 43: the
double-buffered state is settled after the joined rank's shadow step too)."""

from tests.python.hooks import powersgd_join_scenarios as scen


def test_uneven_inputs_match_torch(world):
    out = world.check(scen.uneven_join)
    assert out[0]["steps"] == 4 and all(o["steps"] == 7 for o in out[1:]), out
    assert out[0]["hook"] == "powersgd", out
