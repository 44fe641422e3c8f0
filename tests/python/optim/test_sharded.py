"""The sharded optimizer (sharded_scenarios.py) on 2 and 3 gloo ranks and at world size 1:
the numbers of torch DDP + the unsharded optimizer and of torch's ZeroRedundancyOptimizer,
1/world of the state per rank, and its refusals."""

import pytest

from tests.python.optim import sharded_scenarios as s


def _check(results, world_size, clip=False):
    for r in results:
        assert r["within_bound_of_torch"], r
        # None: not compared (sharded_scenarios.train says why)
        assert r["diff_zero"] is None or r["within_bound_of_zero"], r
        assert r["replicas_agree"] and r["moved"] and r["grads_none"], r
        assert r["norms_agree"], r
        assert r["buckets"] > 1, r  # shard boundaries inside parameters, several buckets
        if r["exact"]:  # Note [sharded optimizer]: torch's, to the bit (2 ranks, no clip)
            assert r["diff_ref"] == 0.0 and r["diff_zero"] in (0.0, None), r


# SGD with momentum, Adam and AdamW in torch's for-loop, foreach and fused implementations.
@pytest.mark.parametrize("optimizer", sorted(s.OPTIMIZERS))
def test_equals_torch_ddp_and_zero_redundancy_optimizer(world, optimizer):
    results = world.check(s.train, optimizer=optimizer)
    _check(results, world.size)
    assert all(r["held_bucket_bytes"] > 0 for r in results), results  # ZeRO-1 keeps them


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw"])
def test_clip_grad_norm_over_the_shards_is_torchs(world, optimizer):
    _check(world.check(s.train, optimizer=optimizer, clip=True), world.size, clip=True)


def test_param_groups_and_a_learning_rate_schedule(world):
    _check(world.check(s.train, optimizer="adamw", groups=True, schedule=True), world.size)


@pytest.mark.parametrize("view", [False, True], ids=["copy", "bucket_view"])
def test_no_sync_accumulates_for_the_next_synchronized_backward(world, view):
    _check(world.check(s.train, optimizer="adamw", no_sync_every=3,
                       gradient_as_bucket_view=view), world.size)


# channels_last and non-dense parameters: the flat buffer takes the strides of the bucket's
# slot views (Reducer.bucket_layout), so element e of a shard is element e of its gradient.
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_parameters_with_strides_of_their_own(world, zero_stage):
    _check(world.check(s.train, optimizer="adamw", model="strided", zero_stage=zero_stage),
           world.size)


# The 16-bit wires: half the bytes, the same average as torch DDP with torch's
# bf16_compress_hook (2 ranks) or the wire's arithmetic written out in torch ops, bit for bit
# (_wire_hook says why). ZeRO-2 too: the CPU's receive buffers freed after each backward.
@pytest.mark.parametrize("wire", ["bf16", "fp16"])
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_a_16_bit_wire_averages_as_torchs_compress_hook(world, wire, zero_stage):
    results = world.check(s.train, optimizer="adamw", wire=wire, zero_stage=zero_stage)
    _check(results, world.size)
    assert all(r["exact"] for r in results), results


# The all-gather of each bucket overlapping the next forward: each module waits for its own.
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw_fused"])
def test_all_gather_overlapped_with_the_next_forward(world, optimizer):
    results = world.check(s.train, optimizer=optimizer, overlap_all_gather=True)
    _check(results, world.size)
    # Left pending by step(), waited for by the forward's module hooks, every step.
    assert all(r["gathers_overlap"] for r in results), results


# ZeRO-2: the same numbers, with no bucket buffer held once a backward has reduced (the
# shards hold the averaged gradients); no_sync() still accumulates in .grad.
@pytest.mark.parametrize("no_sync_every", [0, 3])
def test_zero_stage_2_frees_the_buckets_between_backwards(world, no_sync_every):
    results = world.check(s.train, optimizer="adamw", zero_stage=2, no_sync_every=no_sync_every)
    _check(results, world.size)
    assert all(r["held_bucket_bytes"] == 0 for r in results), results


def test_world_size_one(world1):
    r = world1.check(s.train, optimizer="adamw", steps=5)[0]
    assert r["diff_ref"] == 0.0 and r["moved"] and r["grads_none"], r


def test_each_rank_holds_its_share_of_the_state(world):
    for r in world.check(s.state_bytes, optimizer="adamw"):
        # The shards together are the whole state: no element twice, none missing.
        assert r["total"] == r["whole"], r
        # One shard per bucket: 1/world of it, give or take the padding of each bucket to
        # world equal shards (at most world - 1 elements of 8 bytes of Adam state each).
        share = r["whole"] / world.size
        assert abs(r["mine"] - share) <= 8 * (world.size - 1) * r["buckets"], r


def test_refusals_name_the_culprit(world):
    for r in world.check(s.refusals):
        expected = {
            "powersgd": ("NotImplementedError", "powerSGD_hook"),
            "acpsgd": ("NotImplementedError", "acpsgd"),
            "hook_after": ("NotImplementedError", "ShardedOptimizer"),
            "stranger": ("ValueError", "shape (3,)"),
            "missing": ("NotImplementedError", "0.weight"),
            "twice": ("ValueError", "'0.weight' is in more than one param group"),
            "whole_tensor": ("NotImplementedError", "Adagrad"),
            "lbfgs": ("NotImplementedError", "LBFGS"),
            "unused": ("NotImplementedError", "find_unused_parameters"),
            "two_optimizers": ("RuntimeError", "sharded already"),
            "overlap": ("NotImplementedError", "ShardedOptimizer"),
            "step_without_backward": ("RuntimeError", "without a synchronized backward"),
            "unscale_first": ("NotImplementedError", "unscale_"),
            "checkpoint": ("RuntimeError", "consolidate_state_dict"),
            "wrong_groups": ("ValueError", "do not match"),
            "join": ("NotImplementedError", "join()"),
            "pickled": ("NotImplementedError", "ShardedOptimizer"),
            "int4_wire": ("NotImplementedError", "gradient_wire='int4'"),
            "bf16_wire_of_float64": ("NotImplementedError", "torch.float64"),
        }
        assert set(r) == set(expected), r
        for name, (error, text) in expected.items():
            assert r[name] is not None and r[name][0] == error and text in r[name][1], \
                (name, r[name])


# The state dict in torch's format: consolidated on rank 0 equal to torch's optimizer's (bit
# for bit on 2 ranks, Note [sharded optimizer]), loadable into a plain torch optimizer; and
# a torch optimizer's state dict loaded into the shards resumes with torch's numbers.
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adamw", "adam_fused"])
def test_state_dict_round_trip_with_a_plain_torch_optimizer(world, optimizer):
    results = world.check(s.checkpoint, optimizer=optimizer)
    root = results[0]
    assert root["same_keys"] and root["groups_equal"] and root["plain_loads"], root
    assert root["state_within_bound"], {k: v for k, v in root["state_diff"].items() if v != 0.0 and (not isinstance(v, tuple) or v[0] != v[1])}
    for r in results:
        assert r["state_on_other_ranks_refused"] and r["resumed_within_bound"], r


# Cost is behaviour (tests/python/ddp/test_step_cost.py): the reduce-scatter's step moves the
# gradients once into the buckets (torch's copy-in, 2G: read the grad, write the bucket) and
# nothing back (.grad stays None; the optimizer reads the shards where the collective wrote
# them), checks nothing and never waits for the device. On the CPU the reduce-scatter is an
# alltoall and the hook's sum of the rows it received: one read of the buckets' bytes B
# (padding included) and one write of the shards' B / world.
@pytest.mark.parametrize("zero_stage", [1, 2])
def test_a_step_copies_the_gradients_in_once_and_nothing_back(world, zero_stage):
    for out in world.check(s.step_cost, zero_stage=zero_stage):
        g, b = out["grad_bytes"], out["bucket_bytes"]
        assert out["cost"] == {"copy_in_bytes": 2 * g, "write_back_bytes": 0,
                               "hook_bytes": b + b // world.size,
                               "check_bytes": 0, "state_copy_bytes": 0, "host_syncs": 0,
                               "kept_grad_copy_bytes": 0}, out


# A 16-bit wire of float32 buckets (B bytes): the cast to the wire (read B, write B/2), and
# after the alltoall the sum of the rows (read B/2, write the 16-bit shard B/2d), widened into
# the float32 shard (read B/2d, write B/d): 2B + 2B/d, nothing else.
def test_a_16_bit_wire_costs_one_cast_and_one_sum(world):
    for out in world.check(s.step_cost, wire="bf16"):
        g, b = out["grad_bytes"], out["bucket_bytes"]
        assert out["cost"] == {"copy_in_bytes": 2 * g, "write_back_bytes": 0,
                               "hook_bytes": 2 * b + 2 * b // world.size,
                               "check_bytes": 0, "state_copy_bytes": 0, "host_syncs": 0,
                               "kept_grad_copy_bytes": 0}, out


# GradScaler on bf16 autocast: the shards unscaled and checked, an inf on one rank skips the
# step on all (the scale halves alike), and the numbers stay torch DDP + the optimizer's.
@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_grad_scaler_skips_an_overflow_step_on_every_rank(world, optimizer):
    for r in world.check(s.grad_scaler, optimizer=optimizer):
        assert r["within_bound"] and r["scales_equal"] and r["skipped"] and r["finite"], r
        if r["exact"]:
            assert r["diff"] == 0.0, r


def test_a_bucket_is_waited_for_by_its_first_user_only(world):
    for r in world.check(s.first_user_waits):
        assert r["own_waited"] and r["others_pending"], r


# torch's own ZeroRedundancyOptimizer still works over a fastddp model (issue 56, item 6):
# the same weights and state as over torch DDP, bit for bit (the same averaged gradients).
def test_torch_zero_redundancy_optimizer_over_fastddp(world):
    for r in world.check(s.zero_redundancy_over_fastddp):
        assert r["diff"] == 0.0 and r["states_equal"], r


# torch.distributed.checkpoint, sharded (Note [sharded checkpoint]): each rank saves its own
# shards; a resume at the same world size continues bit for bit, another layout is refused.
def test_dcp_sharded_checkpoint_resumes_bit_for_bit(world, tmp_path):
    for r in world.check(s.dcp_resume, path=str(tmp_path / "ckpt")):
        assert r["diff"] == 0.0 and r["lr_restored"], r
        assert r["other_layout"] and "saved by" in r["other_layout"], r

