"""Misuse: a clear error naming the culprit, then a next step that works or raises the same
error; never a hang, never a wrong number (issue 12, item 4). Each scenario does the misuse
and then the next step, against torch DDP on the same data (misuse_scenarios.py). What torch
DDP does on each is in docs/failures.md's table "Misuse: what each gets".
"""

import re

import pytest

from tests.python.ddp import misuse_scenarios as s



def _each_rank(results: list, check) -> None:
    for rank, value in enumerate(results):
        check(rank, value)


# --- a rank with a different model ---------------------------------------------------------

def test_different_model_on_a_rank(world):
    """Refused on every rank at construction (torch DDP raises on rank 1 only and leaves the
    others waiting in a collective); the next model, the same everywhere, trains."""
    for message in world.check(s.different_model):
        assert message.startswith("ValueError: fastddp: parameter 0 ('0.weight'"), message
        assert "on rank 0" in message and "on rank 1" in message, message


@pytest.fixture(scope="module")
def skipped_layer(world):
    """rank_skips_a_layer's outcomes, run once per world (each costs a 3 s timeout)."""
    return world.check(s.rank_skips_a_layer)


def test_rank_whose_forward_differs(skipped_layer):
    """Rank 1 leaves a layer out: the ranks waiting for its bucket fail at the group's
    timeout naming the bucket, the hook and the rank; rank 1's next forward names the
    parameters it did not reduce."""
    for rank, (first, second) in enumerate(skipped_layer):
        if rank == 1:
            assert first == "ok", first
            assert "did not receive grad for rank 1: first.weight, first.bias" in second, second
        else:
            assert (f"reduction of bucket 0 (comm hook 'allreduce') failed on rank {rank}"
                    in first), first


def test_rank_whose_forward_differs_next_step(skipped_layer):
    """The waiting ranks' next step fails at once (the timed-out group is closed): with the
    same clear error, not gloo's bare 'Application timeout caused pair closure'."""
    for rank, (_, second) in enumerate(skipped_layer):
        if rank != 1:
            # Its first collective: the one bucket rebuild's plan broadcast (or a bucket).
            assert second.startswith("RuntimeError: fastddp: the "), second
            assert f"(comm hook 'allreduce') failed on rank {rank}" in second, second


# --- bucket layouts that differ across ranks -----------------------------------------------

@pytest.mark.parametrize(("argument", "shown"), [
    ("bucket_cap_mb", "bucket_cap_mb=25 on rank 0 but 0.001 on rank 1"),
    ("bucket_cap_mb_list", "bucket_cap_mb_list=[25] on rank 0 but [0.001, 0.002] on rank 1"),
    ("find_unused_parameters", "find_unused_parameters=False on rank 0 but True on rank 1"),
])
def test_bucket_arguments_differ(world, argument, shown):
    """torch DDP and fastddp before this check: gloo aborts the process at the first
    backward ("Received data size doesn't match expected size"). Now a ValueError on every
    rank at construction; the next model, built alike everywhere, trains as torch DDP."""
    for message in world.check(s.bucket_arguments_differ, argument=argument):
        assert message.startswith("ValueError: fastddp: the gradient buckets differ"), message
        assert shown in message, message


def test_bucket_cap_only_for_the_rebuild_may_differ(world):
    """Without find_unused_parameters the first buckets are one per dtype on every rank and
    the rebuilt layout is rank 0's: it trains as torch DDP, with torch's rebuilt buckets."""
    assert world.check(s.bucket_arguments_differ, argument="bucket_cap_mb_rebuilt") == (
        ["ok"] * world.size)


# --- comm hooks that misbehave --------------------------------------------------------------

WRONG_SIZE = re.compile(r"RuntimeError: fastddp: comm hook '?misbehaving_hook'? returned a "
                        r"tensor of (\d+) elements for a bucket of (\d+);")


@pytest.mark.parametrize(("kind", "extra"), [("raise", None), ("short", -1), ("long", 1)])
def test_hook_misbehaves(world, kind, extra):
    """The step raises: the hook's own exception, or one naming the hook and the sizes
    (torch DDP reads a wrong-sized result through the bucket's offsets, past its end). The
    steps before and after match torch DDP bit for bit."""
    for outcomes in world.check(s.hook_misbehaves, kind=kind):
        assert outcomes[0] == outcomes[2] == "ok", outcomes
        if kind == "raise":
            assert outcomes[1] == "ValueError: misbehaving_hook fails on purpose at step 1"
            continue
        sizes = WRONG_SIZE.match(outcomes[1])
        assert sizes and int(sizes[1]) - int(sizes[2]) == extra, outcomes[1]


@pytest.mark.parametrize(("kind", "what"), [
    ("number", "float"), ("none", "None"), ("two_tensors", "list"),
    ("not_a_future", "Future"),
])
def test_hook_returns_the_wrong_type(world, kind, what):
    """torch DDP: "Unable to cast 3.0 to Tensor" (no hook named; None reads as "a tensor of
    0 elements"). fastddp names the hook and what it returned."""
    for outcomes in world.check(s.hook_misbehaves, kind=kind):
        assert outcomes[0] == outcomes[2] == "ok", outcomes
        assert outcomes[1].startswith("RuntimeError: fastddp: "), outcomes[1]
        assert "comm hook 'misbehaving_hook'" in outcomes[1], outcomes[1]
        assert what in outcomes[1], outcomes[1]


def test_hook_returns_integers(world):
    """An int32 result: torch DDP casts it into the gradients (truncated: wrong numbers, no
    error); fastddp raises, naming the hook and the dtype."""
    for outcomes in world.check(s.hook_misbehaves, kind="int_dtype"):
        assert outcomes[0] == outcomes[2] == "ok", outcomes
        assert "misbehaving_hook" in outcomes[1] and "Int" in outcomes[1], outcomes[1]


def test_hook_returns_a_2d_tensor(world):
    """A [1, N] result: torch DDP takes it, and so does fastddp."""
    assert world.check(s.hook_misbehaves, kind="two_d") == [["ok"] * 3] * world.size


# --- parameters converted after wrapping ----------------------------------------------------

@pytest.mark.parametrize(("how", "became"), [
    ("double", "torch.float64 on cpu"), ("half", "torch.float16 on cpu"),
    ("meta", "torch.float32 on meta"),
])
def test_wrapper_converted(world, how, became):
    """torch DDP converts, and then silently stops averaging (the parameters' new gradient
    accumulators lack its hooks). fastddp refuses before converting; the model trains on."""
    for message in world.check(s.convert_wrapper, how=how):
        assert message.startswith(f"RuntimeError: fastddp: this conversion would make "
                                  f"parameter '0.weight' {became}"), message


@pytest.mark.parametrize(("how", "became"), [
    ("module.double", "Double"), ("param.data", "Double"),
])
def test_module_converted_behind_the_wrapper(world, how, became):
    """ddp.module.double(), param.data = ...: torch DDP runs on
    without averaging (wrong numbers, no error); fastddp raises at every forward, naming
    the parameter and what it became."""
    for outcomes in world.check(s.convert_module, how=how):
        for outcome in outcomes:
            assert outcome.startswith("RuntimeError: fastddp: parameter '0.weight'"), outcomes
            assert became in outcome, outcomes
        assert outcomes[0] == outcomes[1], outcomes


# --- register_comm_hook after training started ----------------------------------------------

@pytest.mark.parametrize("when", ["between_steps", "before_backward"])
@pytest.mark.parametrize("spec", ["bf16_ef", "custom"])
def test_hook_registered_late(world, spec, when):
    """Accepted, as by torch DDP, and the steps after it match torch DDP bit for bit."""
    names = world.check(s.hook_registered_late, spec=spec, when=when)
    assert set(names) == {"bf16+error_feedback" if spec == "bf16_ef" else "custom_hook"}, names


def test_hook_registered_during_backward(world):
    """Refused with a clear error (torch DDP accepts it mid-backward); the step is dropped
    and the next step trains as torch DDP."""
    for outcomes in world.check(s.hook_registered_during_backward):
        assert outcomes[0] == "ok", outcomes
        assert "while a backward is reducing" in outcomes[1], outcomes
        assert outcomes[2] == "ok", outcomes


# --- gradients modified in place by user hooks ----------------------------------------------

@pytest.mark.parametrize("gradient_as_bucket_view", [False, True], ids=["copy", "view"])
@pytest.mark.parametrize("where", ["tensor_hook", "post_accumulate", "post_accumulate_replace"])
def test_grads_modified_by_user_hook(world, where, gradient_as_bucket_view):
    world.check(s.grads_modified_by_user_hook, where=where,
                gradient_as_bucket_view=gradient_as_bucket_view)


# --- PowerSGD state across a change of world size -------------------------------------------

@pytest.mark.parametrize("route", ["torch_state", "fastddp_state"])
@pytest.mark.parametrize("target", ["whole_world", "one"])
def test_powersgd_state_of_another_world_size(world, target, route):
    """Saved at world size 2, loaded at 3 (the 3-rank world) or 1: trains as torch DDP
    resumed by torch's recipe, within float rounding."""
    if target == "whole_world" and world.size == 2:
        pytest.skip("the 2-rank world has no other size than 1 to restart at")
    iters = world.check(s.powersgd_world_size_changed, route=route,
                        target=world.size if target == "whole_world" else 1)
    assert iters == [[7, 7]] * world.size, iters
