"""The sharded optimizer on one GPU over NCCL (sharded_cuda_scenarios.py). GPU-marked: run by
`make gpu-check`; skipped where no GPU is visible."""

import pytest

from tests.python.harness import World
from tests.python.optim import main_weights_scenarios, wire8_scenarios
from tests.python.optim import sharded_cuda_scenarios as s

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl1():
    world = World(1, backend="nccl")
    yield world
    world.close()


# World size 1: the average is the rank's own gradient, and the shard the whole bucket; the
# update is torch's elementwise kernel on runs of a flat buffer. 1e-6: the fused CUDA kernels
# are elementwise, but their vectorized path depends on a tensor's alignment and length,
# which differ between a run and a parameter (the CPU's fused kernels differ by an ulp per
# step for that reason, Note [sharded optimizer]); ten steps at lr 0.01-0.05 move a weight
# by less than 1e-6 through such roundings.
@pytest.mark.parametrize("optimizer", ["adamw_fused", "adamw_foreach", "sgd_momentum"])
@pytest.mark.parametrize("overlap_all_gather", [False, True], ids=["gather_in_step", "overlap"])
def test_sharded_optimizer_on_cuda_equals_torch(nccl1, optimizer, overlap_all_gather):
    (r,) = nccl1.check(s.against_torch, optimizer=optimizer,
                       overlap_all_gather=overlap_all_gather)
    assert r["diff"] <= 1e-6 and r["on_gpu"] and r["grads_none"], r
    assert r["step_cost"]["host_syncs"] == 0 and r["step_cost"]["write_back_bytes"] == 0, r


# The bf16 wire on NCCL: cast on the compute stream, alltoall, the sum on the side stream
# (csrc/hooks/sharded/reduce_scatter.h); the same bound as above, for the same reason.
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_bf16_wire_on_cuda_equals_torchs_bf16_compress_hook(nccl1, zero_stage):
    (r,) = nccl1.check(s.against_torch, optimizer="adamw_fused", zero_stage=zero_stage,
                       wire="bf16")
    assert r["diff"] <= 1e-6 and r["grads_none"], r
    assert r["step_cost"]["host_syncs"] == 0, r


def test_zero_stage_2_on_cuda_holds_no_bucket_between_backwards(nccl1):
    (r,) = nccl1.check(s.against_torch, optimizer="adamw_fused", zero_stage=2)
    assert r["diff"] <= 1e-6 and r["held_bucket_bytes"] == 0, r


# The design rule on CUDA (tests/python/ddp/test_gpu_paths.py has it for the allreduce): the
# reduce-scatters, queued behind a 20 ms delayed collective on NCCL's stream, end after
# backward's last op; the compute stream never waited for one. 0 is the bound: any wait
# puts the mark after the delayed collective's end, a negative gap.
def test_backward_never_waits_for_a_reduce_scatter(nccl1):
    (gaps,) = nccl1.check(s.backward_does_not_wait_for_the_reduce_scatter)
    assert all(gap > 0 for gap in gaps), gaps


# main_weights="fp32" on NCCL: the widening reduce-scatter is an alltoall and a float32 sum
# on the side stream, as the CPU's. Against the computation written out with torch's ops on
# the GPU: a float32 main weight that a CUDA kernel rounds an ulp apart from the reference's
# may round to the neighbouring 16-bit weight, so up to 1 bf16 ulp (2^-7 relative).
def test_main_weights_on_cuda_are_the_written_out_mixed_precision(nccl1):
    (r,) = nccl1.check(main_weights_scenarios.train, optimizer="adamw_foreach", device="cuda")
    assert r["ulps"] <= 2 ** -7 and r["moved"] and r["grads_none"], r
    assert r["state_dtypes"] == ["torch.float32"], r


# The 8-bit wire on NCCL: the CUDA quantize / dequantize kernels, an alltoall, the float32
# sum on the side stream. Against the reference quantizer written with torch's ops on the
# GPU, bit for bit as on the CPU (the kernels quantize as the reference does).
@pytest.mark.parametrize("wire", sorted(wire8_scenarios.FORMATS))
def test_an_8_bit_reduce_scatter_on_cuda_is_the_written_out_sum(nccl1, wire):
    (r,) = nccl1.check(wire8_scenarios.shards_are_the_written_out_sum, wire=wire,
                       device="cuda")
    assert r["diff"] == 0.0, r
