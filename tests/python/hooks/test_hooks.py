"""Comm hooks on real gloo ranks (2 and 3, and 4 for the accumulation test).

Native built-ins against torch DDP running torch's own hook where torch has one (bit for
bit: fastddp's bf16/fp16 round as torch's bf16/fp16_compress_hook, Note [torch's half
rounding]); the modes torch has no hook for against the same algorithm in torch ops run by
torch DDP (bit for bit) and against the exact mean of the ranks' gradients
(test_half_bound.py); torch's own hook functions, run natively by fastddp, against
torch DDP running them; Python hooks through the GradBucket path against torch DDP running
the same hook (bit for bit).
"""

import pytest

from tests.python.hooks import hooks_scenarios

# (fastddp hook, torch DDP reference hook): bit for bit. "none": torch DDP's own reduction.
EXACT_PAIRS = {
    "allreduce": ("fastddp.allreduce", "none"),
    "bf16": ("fastddp.bf16", "torch.bf16_compress_hook"),
    "fp16": ("fastddp.fp16", "torch.fp16_compress_hook"),
    "bf16_fp32": ("fastddp.bf16_fp32", "fastddp.bf16_fp32"),
    "bf16_ef": ("fastddp.bf16_ef", "fastddp.bf16_ef"),
    "bf16_fp32_ef": ("fastddp.bf16_fp32_ef", "fastddp.bf16_fp32_ef"),
    "fp16_fp32": ("fastddp.fp16_fp32", "fastddp.fp16_fp32"),
    "custom": ("custom", "custom"),
    "bf16_wrapper_custom": ("torch.bf16_wrapper_custom", "torch.bf16_wrapper_custom"),
    # No collective: each rank's gradients stay its own, on both sides.
    "noop": ("fastddp.noop", "torch.noop_hook"),
}


@pytest.mark.parametrize("pair", list(EXACT_PAIRS))
def test_hook_matches_reference(world, pair):
    fast, ref = EXACT_PAIRS[pair]
    world.check(hooks_scenarios.hooked_training, fast_hook=fast, ref_hook=ref, exact=True,
                bucket_cap_mb=0.001)


@pytest.mark.parametrize("pair", ["bf16", "fp16"])
def test_small_gradients_round_as_torch(world, pair):
    """Gradients scaled by 1e-4: many fall into float16's subnormal range, where rounding
    before or after the division differs even on 2 ranks."""
    fast, ref = EXACT_PAIRS[pair]
    world.check(hooks_scenarios.hooked_training, fast_hook=fast, ref_hook=ref, exact=True,
                bucket_cap_mb=0.001, loss_scale=1e-4)


@pytest.mark.parametrize("pair", ["bf16", "fp16"])
def test_float64_model_rounds_as_torch(world, pair):
    """A float64 model: the half hooks compress through ATen ops (not the float32 kernels),
    still as torch's hooks do."""
    fast, ref = EXACT_PAIRS[pair]
    world.check(hooks_scenarios.hooked_training, fast_hook=fast, ref_hook=ref, exact=True,
                bucket_cap_mb=0.001, dtype="float64")


@pytest.mark.parametrize("pair", list(EXACT_PAIRS))
def test_hook_at_world_size_one(world1, pair):
    """A registered hook runs at world size 1 (as in torch), bit for bit as its reference."""
    fast, ref = EXACT_PAIRS[pair]
    name = world1.check(hooks_scenarios.hooked_training, fast_hook=fast, ref_hook=ref, exact=True,
                        bucket_cap_mb=0.001)[0]
    assert name is not None, "no reducer ran the hook"


@pytest.mark.parametrize("spec", ["fastddp.bf16_fp32", "fastddp.bf16", "fastddp.allreduce"])
def test_failed_step_is_dropped(world, spec):
    world.check(hooks_scenarios.abandoned_step, spec=spec)


@pytest.mark.parametrize(("hook", "ref"), [("fastddp.bf16_fp32_ef", "fastddp.bf16_fp32_ef"),
                                         ("fastddp.bf16", "torch.bf16_compress_hook"),
                                         ("fastddp.fp16", "torch.fp16_compress_hook"),
                                         ("fastddp.noop", "torch.noop_hook")])
def test_hook_gradient_as_bucket_view(world, hook, ref):
    world.check(hooks_scenarios.hooked_training, fast_hook=hook, ref_hook=ref, exact=True,
                gradient_as_bucket_view=True)


# (torch hook, the built-in fastddp runs it as, torch DDP's reference, bit for bit?).
TORCH_HOOKS = [
    ("torch.allreduce_hook", "allreduce", "none", True),
    ("torch.allreduce_hook", "allreduce", "torch.allreduce_hook", None),
    ("torch.bf16_compress_hook", "bf16", "torch.bf16_compress_hook", True),
    ("torch.fp16_compress_hook", "fp16", "torch.fp16_compress_hook", True),
    ("torch.bf16_compress_wrapper", "bf16", "torch.bf16_compress_wrapper", True),
    ("torch.fp16_compress_wrapper", "fp16", "torch.fp16_compress_wrapper", True),
]


@pytest.mark.parametrize(("torch_hook", "native", "ref", "exact"), TORCH_HOOKS,
                         ids=[f"{h}-vs-{r}" for h, _, r, _ in TORCH_HOOKS])
def test_torch_hooks_run_natively(world, torch_hook, native, ref, exact):
    # fastddp runs allreduce_hook as torch DDP's own reduction (grad * (1/w)); torch's
    # hook divides (grad / w): the same on 2 ranks (a power of two), within a few float32
    # roundings of the terms on 3 (hooks_scenarios.division_bound).
    if exact is None:
        exact = world.size == 2
    names = world.check(hooks_scenarios.hooked_training, fast_hook=torch_hook, ref_hook=ref,
                        exact=exact)
    assert names[0] == native, names  # the C++ built-in ran, not the Python function


def test_registration_rules(world):
    messages = world.check(hooks_scenarios.registration_errors)[0]
    assert messages[0] == "Communication hook must be callable."
    assert messages[1] == "Communication hook: bucket annotation should be dist.GradBucket."
    assert messages[2] == ("Communication hook: return annotation should be "
                           "torch.futures.Future[torch.Tensor].")
    assert messages[3] == "register_comm_hook or register_builtin_comm_hook can only be called once."
    assert "accumulate must be 'bf16' or 'fp32'" in messages[4]
    assert "error_feedback must be a bool" in messages[5]


def test_fp32_accumulation_is_closer(world4):
    errors = world4.check(hooks_scenarios.accumulation_error)[0]
    assert errors["bf16_fp32"] < 0.8 * errors["bf16"], errors
