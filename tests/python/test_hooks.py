"""Comm hooks on real gloo ranks (2 and 3, and 4 for the accumulation test).

Native built-ins against the same algorithm in torch ops run by torch DDP (bit for bit);
torch's own hook functions, run natively by fastddp, against torch DDP running them
(within bf16/fp16 tolerance: torch casts then divides, fastddp divides then casts); Python
hooks through the GradBucket path against torch DDP running the same hook (bit for bit).
"""

import pytest

import hook_scenarios

# (fastddp hook, torch DDP reference hook): the same algorithm, bit for bit.
EXACT_PAIRS = {
    "allreduce": ("fastddp.allreduce", "fastddp.allreduce"),
    "bf16": ("fastddp.bf16", "fastddp.bf16"),
    "fp16": ("fastddp.fp16", "fastddp.fp16"),
    "bf16_fp32": ("fastddp.bf16_fp32", "fastddp.bf16_fp32"),
    "bf16_ef": ("fastddp.bf16_ef", "fastddp.bf16_ef"),
    "bf16_fp32_ef": ("fastddp.bf16_fp32_ef", "fastddp.bf16_fp32_ef"),
    "fp16_fp32": ("fastddp.fp16_fp32", "fastddp.fp16_fp32"),
    "custom": ("custom", "custom"),
    "bf16_wrapper_custom": ("torch.bf16_wrapper_custom", "torch.bf16_wrapper_custom"),
}


@pytest.mark.parametrize("pair", list(EXACT_PAIRS))
def test_hook_matches_reference(world, pair):
    fast, ref = EXACT_PAIRS[pair]
    world.check(hook_scenarios.hooked_training, fast_hook=fast, ref_hook=ref, exact=True,
                bucket_cap_mb=0.001)


@pytest.mark.parametrize("pair", list(EXACT_PAIRS))
def test_hook_at_world_size_one(world1, pair):
    """A registered hook runs at world size 1 (as in torch), bit for bit as its reference."""
    fast, ref = EXACT_PAIRS[pair]
    name = world1.check(hook_scenarios.hooked_training, fast_hook=fast, ref_hook=ref, exact=True,
                        bucket_cap_mb=0.001)[0]
    assert name is not None, "no reducer ran the hook"


@pytest.mark.parametrize("spec", ["fastddp.bf16_fp32", "fastddp.bf16", "fastddp.allreduce"])
def test_failed_step_is_dropped(world, spec):
    world.check(hook_scenarios.abandoned_step, spec=spec)


@pytest.mark.parametrize("hook", ["fastddp.bf16_fp32_ef", "fastddp.bf16"])
def test_hook_gradient_as_bucket_view(world, hook):
    world.check(hook_scenarios.hooked_training, fast_hook=hook, ref_hook=hook, exact=True,
                gradient_as_bucket_view=True)


@pytest.mark.parametrize(("torch_hook", "native"), [
    ("torch.allreduce_hook", "allreduce"),
    ("torch.bf16_compress_hook", "bf16"),
    ("torch.fp16_compress_hook", "fp16"),
    ("torch.bf16_compress_wrapper", "bf16"),
    ("torch.fp16_compress_wrapper", "fp16"),
])
def test_torch_hooks_run_natively(world, torch_hook, native):
    # torch DDP refuses its bf16 hooks without NCCL; fastddp's reference is then
    # the same algorithm in torch ops (torch DDP running fastddp.hooks.bf16()).
    ref = {"torch.bf16_compress_hook": "fastddp.bf16",
           "torch.bf16_compress_wrapper": "fastddp.bf16"}.get(torch_hook, torch_hook)
    names = world.check(hook_scenarios.hooked_training, fast_hook=torch_hook, ref_hook=ref,
                        exact=False)
    assert names[0] == native, names  # the C++ built-in ran, not the Python function


def test_registration_rules(world):
    messages = world.check(hook_scenarios.registration_errors)[0]
    assert messages[0] == "Communication hook must be callable."
    assert messages[1] == "Communication hook: bucket annotation should be dist.GradBucket."
    assert messages[2] == ("Communication hook: return annotation should be "
                           "torch.futures.Future[torch.Tensor].")
    assert messages[3] == "register_comm_hook or register_builtin_comm_hook can only be called once."
    assert "accumulate must be 'bf16' or 'fp32'" in messages[4]
    assert "error_feedback must be a bool" in messages[5]


def test_fp32_accumulation_is_closer(world4):
    errors = world4.check(hook_scenarios.accumulation_error)[0]
    assert errors["bf16_fp32"] < 0.8 * errors["bf16"], errors
