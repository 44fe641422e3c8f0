"""PowerSGD under find_unused_parameters against torch DDP running torch's own powerSGD_hook
(issue 43 item 1): heads used on alternate steps and one never, alone in a bucket or sharing
the trunk's, on 2 and 3 gloo ranks; grads within powersgd_scenarios.TOL every step."""

import pytest

from tests.python.hooks import powersgd_unused_scenarios as scen


@pytest.mark.parametrize("as_on_device", [False, True], ids=["cpu_settle", "device_settle"])
@pytest.mark.parametrize("cap", [scen.HEADS_ONLY_MB, scen.SHARED_MB], ids=["heads_alone", "shared"])
def test_matches_torch(world, cap, as_on_device):
    out = world.check(scen.unused_heads_training, bucket_cap_mb=cap, as_on_device=as_on_device)[0]
    assert out["hook"] == "powersgd", out  # torch's hook and state ran as the native hook
    if cap == scen.SHARED_MB:  # the unused heads share the one bucket with the trunk
        assert out["buckets"] == [["even", "never", "odd", "trunk"]], out
    else:  # the heads alone, reduced first; the trunk after them
        assert out["buckets"] == [["even", "never", "odd"], ["trunk"]], out
        assert out["torch_bucket_sizes"] == "1584, 2176", out  # torch's buckets are the same
