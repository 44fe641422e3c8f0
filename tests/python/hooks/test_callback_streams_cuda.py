"""fastddp's work on fastddp's streams (issue 43 item 5): in a compressed step of each
PowerSGD-family hook, no device work other than NCCL's runs on a stream other than the
compute stream and fastddp's side stream; the decompression, launched from a future's
callback (where torch makes a pool stream current), is on the side stream
(callback_streams_cuda_scenarios.py). GPU-marked: run by `make gpu-check`."""

import pytest

from tests.python.harness import World
from tests.python.hooks import callback_streams_cuda_scenarios as s

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl1():
    world = World(1, backend="nccl")
    yield world
    world.close()


@pytest.mark.parametrize("hook", list(s.HOOKS))
def test_no_kernel_of_a_compressed_step_runs_on_a_pool_stream(nccl1, hook):
    (out,) = nccl1.check(s.step_streams, hook=hook)
    ids = out["ids"]
    # The three markers' streams differ: the ids tell streams apart.
    assert len({ids["compute"], ids["side"], ids["pool"]}) == 3, ids
    assert out["bytes_sent"] < out["bytes_reduced"], out  # the steps were compressed
    allowed = {ids["compute"], ids["side"]}
    # NCCL's own streams carry NCCL's kernels only; everything else is on one of ours.
    stray = {sid: names for sid, names in out["other"].items() if sid not in allowed}
    assert not stray, f"{hook}: device work on streams not fastddp's or compute's: {stray}; {out}"
    # The local work between and after the collectives (orthogonalization, products,
    # decompression) ran on the side stream.
    assert out["other"].get(ids["side"]), out
