"""The paths only a GPU takes (issue 32, items 5 and 6), against torch DDP on one GPU over
NCCL with fastddp's reducer forced (gpu_paths_scenarios.py), and the two-collective hooks
under torch's CUDA sanitizer. GPU-marked: run by `make gpu-check`."""

import os
import subprocess
import sys

import pytest

from tests.python.ddp import gpu_paths_scenarios as scenarios
from tests.python.harness import World

pytestmark = pytest.mark.gpu

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def nccl1():
    world = World(1, backend="nccl")
    yield world
    world.close()


def test_backward_never_waits_for_communication(nccl1):
    # The design rule: with every bucket's collective held back ~20 ms on its stream, the
    # last op of backward still ran before the first bucket's collective ended, in every
    # step, and the grads equal torch DDP's. CUDA events order GPU work, not wall time.
    (gaps,) = nccl1.check(scenarios.backward_does_not_wait_for_a_delayed_collective)
    assert len(gaps) == 3 and all(g > 0 for g in gaps), gaps


@pytest.mark.parametrize("hook", ["allreduce", "bf16", "python"])
def test_nan_check_on_cuda_names_the_parameter(nccl1, hook):
    (message,) = nccl1.check(scenarios.nan_check_on_cuda, hook=hook)
    assert "2.weight" in message and "on rank 0 at step 2" in message, message


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_fp16_bf16_fp64_parameter_buckets(nccl1, gradient_as_bucket_view):
    (dtypes,) = nccl1.check(scenarios.dtype_buckets,
                            gradient_as_bucket_view=gradient_as_bucket_view)
    assert dtypes == 4


@pytest.mark.parametrize("gradient_as_bucket_view", [False, True])
def test_channels_last_gradients(nccl1, gradient_as_bucket_view):
    nccl1.check(scenarios.channels_last_on_cuda, gradient_as_bucket_view=gradient_as_bucket_view)


def test_handed_out_gradients(nccl1):
    # Issue 55 on CUDA: one pass (nothing written back), torch's values, and last step's
    # gradients kept in a list copied out of the buckets before the next copy-in.
    (cost,) = nccl1.check(scenarios.handed_out_gradients_on_cuda)
    assert cost["one_pass"]["write_back_bytes"] == 0, cost
    assert cost["kept"]["kept_grad_copy_bytes"] > 0, cost


def test_a_bucket_over_2gib(nccl1):
    (size,) = nccl1.check(scenarios.bucket_over_2gib)
    assert size > 2 ** 31


def test_two_collective_hooks_under_the_cuda_sanitizer():
    # torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1, the caching allocator on) raises on
    # any unsynchronized access between streams it sees; each of these hooks issues two
    # collectives per bucket: PowerSGD's allreduces of P and Q; the shard-sum hooks'
    # (fp32-accumulating bf16, int8, fp8) alltoall and allgather, with the sum between
    # them on fastddp's side stream (Note [shard-sum hooks]).
    cases = "powersgd_r1,powersgd_r4,batched_powersgd,bf16_fp32acc,int8,fp8_e5m2"
    script = os.path.join(HERE, "..", "hooks", "world1_hooks_scenarios.py")
    done = subprocess.run([sys.executable, script, "--device", "cuda", "--backend", "nccl",
                           "--cases", cases, "--configs", "plain", "--steps", "4"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TORCH_CUDA_SANITIZER": "1"})
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "6 of 6 passed" in done.stdout, done.stdout[-2000:]
