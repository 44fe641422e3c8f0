"""Cost is behaviour (issue 43 item 7): what one finite step moves outside the collectives,
counted by the code that launches each pass (Note [counted cost]), never timed, against a
budget written next to each figure with its reason. A change that adds a pass over the
gradients, a copy of the hooks' state or a check fails here. G is the gradients' bytes
(float32, every parameter used): 5904 for scenarios.mlp(). Budgets are exact where the
passes are: a figure that drops below its budget is a saving to write down here.

BUDGETS are for zero_grad(set_to_none=False): the gradients are kept from step to step, and
the result is written back into them, as torch does. ONE_PASS below is for torch's default,
set_to_none=True: the new gradient is copied in once and its slot becomes .grad (Note
[gradients handed out], csrc/reducer/bucket.h), nothing is copied back where the
reduction's result is the bucket."""

import math

import pytest

from tests.python.ddp import step_cost_scenarios as s

G = 5904
NONE = {"hook_bytes": 0, "check_bytes": 0, "state_copy_bytes": 0, "host_syncs": 0,
        "kept_grad_copy_bytes": 0}
BUDGETS = {
    # One pass in (read the grad, write the bucket: torch's copy-in too), one pass back.
    "none": {**NONE, "copy_in_bytes": 2 * G, "write_back_bytes": 2 * G},
    "allreduce": {**NONE, "copy_in_bytes": 2 * G, "write_back_bytes": 2 * G},
    # 16-bit wire: 4 B read and 2 B written per value, each way.
    "bf16": {**NONE, "copy_in_bytes": 3 * G // 2, "write_back_bytes": 3 * G // 2},
    "bf16_fp32": {**NONE, "copy_in_bytes": 3 * G // 2, "write_back_bytes": 3 * G // 2},
    # Error feedback in the same pass: the residual read and the new one written (8 B a
    # value); the averaged gradients checked once before the residuals are settled (Note [a
    # bad step leaves no trace]); no copy of the residuals (double-buffered).
    "bf16_ef": {**NONE, "copy_in_bytes": 7 * G // 2, "write_back_bytes": 3 * G // 2,
                "check_bytes": G},
    "fp16_ef": {**NONE, "copy_in_bytes": 7 * G // 2, "write_back_bytes": 3 * G // 2,
                "check_bytes": G},
    # 8-bit: the scaled copy into the staging (2G), the residual added in place (3G: a second
    # pass a fused copy-in would save); quantizing (hook_bytes, by world size: quant8_hook)
    # reads the padded staging, writes a byte a value and the error back; the new residual
    # copied out (2G); write-back: the codes read and the bucket written (G/4 + G), then the
    # bucket into the grads (2G).
    "int8": {**NONE, "copy_in_bytes": 5 * G, "write_back_bytes": 3 * G + G // 4,
             "check_bytes": G},
    "fp8_e4m3": {**NONE, "copy_in_bytes": 5 * G, "write_back_bytes": 3 * G + G // 4,
                 "check_bytes": G},
    # PowerSGD: the copy-in writes M = grad + error (3G: Note [error feedback in the
    # copy-in]; the bucket is not written); P = M Q and Q = M^T P read M (G each), P Q^T
    # written with the new error in place of M (3G), the uncompressed slots packed and
    # unpacked (read and written, 4 U, U their bytes below): the algorithm's own 8G + 4U.
    # No state copied: last step's Qs are read by the orthogonalization, which writes their
    # spares (Note [double-buffered step state]).
    "powersgd": {**NONE, "copy_in_bytes": 3 * G, "write_back_bytes": 2 * G, "check_bytes": G},
}
# The uncompressed slots of PowerSGD on mlp(): the 4x32 weight and the three biases.
POWERSGD_U = (4 * 32 + 32 + 32 + 4) * 4
BUDGETS["powersgd"]["hook_bytes"] = 5 * G + 4 * POWERSGD_U
BUDGETS["torch_powersgd"] = BUDGETS["powersgd"]  # torch's hook and state, run natively


def quant8_hook_bytes(bucket_numels: list[int], world: int) -> int:
    """The 8-bit hooks' staging holds each bucket padded to whole blocks of 256 values per
    rank's shard; quantizing reads it (4 B), writes a code (1 B) and the error (4 B) per
    value; then the new residuals are copied out of it (2G)."""
    block = 256 * world
    padded = sum(-(-n // block) * block for n in bucket_numels)
    return 9 * padded + 2 * G


@pytest.mark.parametrize("hook", list(BUDGETS))
def test_a_finite_step_costs_its_budget(world, hook):
    for out in world.check(s.step_cost, hook=hook):
        assert out["grad_bytes"] == G, out
        budget = dict(BUDGETS[hook])
        if hook in ("int8", "fp8_e4m3"):
            budget["hook_bytes"] = quant8_hook_bytes(out["bucket_numels"], world.size)
        assert out["cost"] == budget, (hook, out)


def test_gradient_as_bucket_view_writes_nothing_back(world):
    # The division in place is the copy-in's one pass (2G); the grads are the buckets.
    for out in world.check(s.step_cost, hook="none", gradient_as_bucket_view=True):
        assert out["cost"] == {**NONE, "copy_in_bytes": 2 * G, "write_back_bytes": 0}, out


def test_batched_powersgd_costs_its_budget(world):
    # Each bucket as one side x side square (side = ceil(sqrt(numel)), zero-padded), S its
    # bytes: pack 2S, M + error 3S and M's copy 2S, P = M Q and Q = M^T P read M (2S),
    # P Q^T with the new error in place of M's copy 3S, unpack 2S: 14S. No state copied:
    # last step's Q is read by the orthogonalization, which writes its spare.
    for out in world.check(s.step_cost, hook="batched_powersgd"):
        sides = [math.isqrt(n - 1) + 1 for n in out["bucket_numels"]]
        hook_bytes = 14 * 4 * sum(n * n for n in sides)
        assert out["cost"] == {**NONE, "copy_in_bytes": 2 * G, "write_back_bytes": 2 * G,
                               "check_bytes": G, "hook_bytes": hook_bytes}, out


def test_acpsgd_costs_its_budget(world):
    # M = grad + error (3G); this step's product reads M (G); P Q^T written with the new
    # error in place of M (3G); the uncompressed slots packed, and their part of M zeroed (3U).
    # No state copied: the turn's factor is read from the state by the orthogonalization,
    # which writes its spare, and the product writes the other spare.
    for out in world.check(s.step_cost, hook="acpsgd"):
        assert out["cost"] == {**NONE, "copy_in_bytes": 2 * G, "write_back_bytes": 2 * G,
                               "check_bytes": G, "hook_bytes": 7 * G + 3 * POWERSGD_U}, out


# zero_grad() as torch's default (set_to_none=True): .grad is None when backward reaches a
# parameter, and the new gradient is read once into its slot, which becomes .grad (Note
# [gradients handed out]). One pass over the gradient bytes: each read once and its result
# written once, the write-back empty where the reduction's result is the bucket.
ONE_PASS = {
    # No hook, and the allreduce hook: read and the slot written (2G); the result is the slot.
    "none": {**NONE, "copy_in_bytes": 2 * G, "write_back_bytes": 0},
    "allreduce": {**NONE, "copy_in_bytes": 2 * G, "write_back_bytes": 0},
    # Each float32 value read once into the 16-bit wire (4 + 2 B) and the wire read once
    # into the slot that is .grad (2 + 4 B).
    "bf16": {**NONE, "copy_in_bytes": 3 * G // 2, "write_back_bytes": 3 * G // 2},
    "fp16": {**NONE, "copy_in_bytes": 3 * G // 2, "write_back_bytes": 3 * G // 2},
    # As BUDGETS["int8"], less the copy of the bucket into the grads: the codes read and the
    # slot that is .grad written once (G/4 + G).
    "int8": {**NONE, "copy_in_bytes": 5 * G, "write_back_bytes": G + G // 4, "check_bytes": G},
    # As BUDGETS["powersgd"] (the algorithm's own 8G + 4U), less the copy of the bucket
    # into the grads: P Q^T is written into the slots that become .grad.
    "powersgd": {**NONE, "copy_in_bytes": 3 * G, "write_back_bytes": 0, "check_bytes": G,
                 "hook_bytes": 5 * G + 4 * POWERSGD_U},
}


@pytest.mark.parametrize("hook", list(ONE_PASS))
def test_the_default_step_is_one_pass(world, hook):
    for out in world.check(s.step_cost, hook=hook, set_to_none=True):
        budget = dict(ONE_PASS[hook])
        if hook == "int8":
            budget["hook_bytes"] = quant8_hook_bytes(out["bucket_numels"], world.size)
        assert out["cost"] == budget, (hook, out)


# The hierarchical hook over 2 nodes of 2 ranks, set_to_none=True: the reducer writes
# nothing back into .grad beyond the inner hook's own one pass.
HIERARCHICAL_ONE_PASS = {
    # The copy-in (2G) and the node's half of the bucket (G/2) reduced in place (read and
    # written, G); the all-gather lands in the slots that are .grad.
    "hier_allreduce": {**NONE, "copy_in_bytes": 3 * G, "write_back_bytes": 0},
    # The copy-in (2G) and the node's half read into the 16-bit wire (G/2 + G/4); the wire
    # read back into it (G/4 + G/2); the all-gather lands in the slots that are .grad.
    "hier_bf16": {**NONE, "copy_in_bytes": 11 * G // 4, "write_back_bytes": 3 * G // 4},
}


@pytest.mark.parametrize("hook", list(HIERARCHICAL_ONE_PASS))
def test_the_hierarchical_default_step_is_one_pass(world4, hook):
    for out in world4.check(s.step_cost, hook=hook, set_to_none=True):
        assert out["cost"] == HIERARCHICAL_ONE_PASS[hook], (hook, out)


def test_a_kept_gradient_gets_memory_of_its_own(world):
    # Last step's gradients kept in a list across zero_grad(): they must keep their values
    # (as under torch's reducer, which never lends its buckets), so before the copy-in each
    # gets memory of its own, a copy of its bytes (read and written: 2G); the buckets stay.
    for out in world.check(s.step_cost, hook="allreduce", set_to_none=True, keep_grads=True):
        assert out["cost"] == {**NONE, "copy_in_bytes": 2 * G, "write_back_bytes": 0,
                               "kept_grad_copy_bytes": 2 * G}, out
