"""_C.HookRunner: comm hooks on given gradients on real gloo ranks (2 and 3), no model.
The benchmark (benchmarks/powersgd.py) times hooks with it, so it must average as the
reducer does and run torch's Python hooks on a real GradBucket."""

import pytest

from tests.python.hooks import hook_runner_scenarios as scenarios


def test_allreduce_gives_the_mean_in_reverse_buckets(world):
    plan = world.check(scenarios.allreduce_is_mean)[0]
    assert len(plan) > 1, plan
    # Reverse parameter order, as backward makes gradients ready; every gradient once.
    flat = [i for bucket in plan for i in bucket]
    assert flat == sorted(flat, reverse=True) == list(range(len(scenarios.SHAPES)))[::-1]


@pytest.mark.parametrize("bucket_cap_bytes", [2048, 1 << 20], ids=["buckets", "one_bucket"])
def test_native_powersgd_matches_torch(world, bucket_cap_bytes):
    steps, start = 6, 2
    out = world.check(scenarios.powersgd_matches_torch, steps=steps,
                      bucket_cap_bytes=bucket_cap_bytes, start=start)[0]
    assert (out["buckets"] > 1) == (bucket_cap_bytes == 2048), out
    assert out["compressed_steps"] == steps - start, out
    assert out["torch_iter"] == steps, out  # torch's hook saw is_last() once per step


def test_bad_arguments(world1):
    messages = world1.check(scenarios.bad_arguments)[0]
    for expected, message in zip(["bucket_cap_bytes must be > 0", "has shape", "built over 2"],
                                 messages, strict=True):
        assert expected in message, (expected, message)
