"""device_mesh=mesh["dp"] of a 2 x 2 mesh, with tensor parallel on mesh["tp"]: fastddp
trains to torch DDP's numbers (mesh_slice_scenarios.py, 4 gloo ranks)."""

import pytest

from tests.python.ddp import mesh_slice_scenarios


@pytest.mark.parametrize("ddp_kwargs", [{}, {"gradient_as_bucket_view": True,
                                              "bucket_cap_mb": 0.0005}],
                         ids=["default", "views_small_buckets"])
def test_dp_over_tp_mesh_trains_as_torch(world4, ddp_kwargs):
    world4.check(mesh_slice_scenarios.dp_over_tp_mesh, **ddp_kwargs)
