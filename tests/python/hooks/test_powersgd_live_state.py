"""torch's PowerSGDState on fastddp kept live on the native hook (fastddp/hooks/powersgd_live.py):
against torch's own hook, torch's checkpoint recipe, and the state's lifetime."""

import pytest

from tests.python.hooks import powersgd_live_state_scenarios as scen
from tests.python.hooks.powersgd_state_scenarios import ROUNDING_ULPS


@pytest.mark.parametrize("batched", [False, True], ids=["powerSGD_hook", "batched"])
def test_fields_are_torchs(world, batched):
    out = world.check(scen.against_torch, batched=batched)[0]
    assert out["iter"] == 7, out
    assert [it for it, _ in out["per_step"]] == list(range(1, 8)), out
    assert out["stats"][1] > out["stats"][2] > 0, out  # compression ran
    assert out["keys"]["error_dict"] == [0] and out["keys"]["q_memory_dict"] == [0], out
    assert out["is_state"] and out["live_type"] == "LivePowerSGDState", out
    assert out["p_native"], "p_memory_dict must hold the hook's P, compared with torch's"
    names = [name for name, _ in out["error_layout"]["params"]]
    assert "b.weight" in names and "head.bias" in names, out


@pytest.mark.parametrize("via", ["torch.save", "pickle"])
@pytest.mark.parametrize("cap", [0.004, 25], ids=["buckets", "one_bucket"])
def test_resume_is_the_uninterrupted_run(world, via, cap):
    out = world.check(scen.resume, via=via, cap=cap)[0]
    assert out["loaded_plain"], out  # a checkpoint holds torch's class
    assert out["iter_at_resume"] == 4 and out["final_iter"] == 8, out
    if world.size == 2:
        assert out["equal"], out
        assert out["same_final_state"] is True, out
    else:
        # The resumed run's first step has the initial bucket layout, the uninterrupted
        # one the rebuilt layout; gloo's ring on 3 ranks then adds in another order.
        assert out["ulps"] <= ROUNDING_ULPS, out


def test_resume_batched(world):
    # Batched PowerSGD's numbers depend on the bucket layout (a bucket is one matrix), and a
    # new model's first step runs in the initial layout: find_unused_parameters=True keeps
    # that layout for good, in both runs, so the resumed run must be the uninterrupted one.
    out = world.check(scen.resume, batched=True, cap=25, find_unused_parameters=True)[0]
    assert out["plans"][0] == out["plans"][1], out
    assert out["iter_at_resume"] == 4 and out["final_iter"] == 8, out
    if world.size == 2:
        assert out["equal"] and out["same_final_state"] is True, out
    else:
        assert out["ulps"] <= ROUNDING_ULPS, out


@pytest.mark.parametrize("batched", [False, True], ids=["powerSGD_hook", "batched"])
def test_resume_without_the_state_differs(world, batched):
    # The control: the comparisons above can fail.
    args = {"cap": 25, "find_unused_parameters": True} if batched else {}
    out = world.check(scen.resume, via="fresh", batched=batched, **args)[0]
    # A fresh state moves the grads by ~1e-2 (measured), far beyond any rounding (~1e-7).
    assert not out["equal"] and out["max_diff"] > 1e-4, out
    assert out["iter_at_resume"] == 0 and out["same_final_state"] is not True, out


@pytest.mark.parametrize("batched", [False, True], ids=["powerSGD_hook", "batched"])
def test_pickle_roundtrip(world, batched):
    out = world.check(scen.pickle_roundtrip, batched=batched)[0]
    assert out["iter"] == 4, out
    assert not [m for m in out["modules"] if "fastddp" in m], out  # loads without fastddp
    assert "torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook" in out["modules"], out
    assert out["keys"]["error_dict"] and out["keys"]["q_memory_dict"], out


def test_model_deleted_keeps_final_values(world):
    out = world.check(scen.model_deleted)[0]
    assert out["live_type"] == "LivePowerSGDState" and out["plain"], out
    assert out["iter"] == 4 and out["errors"] > 0, out


def test_writes_are_refused(world):
    out = world.check(scen.writes_refused)[0]
    assert sorted(out) == ["error_item", "iter", "q_clear"], out
    assert "PowerSGDState.iter" in out["iter"], out
    assert "copy" in out["error_item"], out


def test_state_of_torchs_hook(world):
    out = world.check(scen.torch_state)[0]
    assert "error_dict[0]" in out["refused"] and "empty" in out["refused"], out
    assert out["kept"] and out["iter"] == 4 and out["errors"] == [0], out


def test_own_state_dict_still_works(world):
    out = world.check(scen.own_state_dict)[0]
    assert out["iter_before"] == 0 and out["iter"] == out["saved_iter"] == 4, out


def test_registered_again_follows_the_new_model(world):
    out = world.check(scen.reregistered)[0]
    assert out == {"iter_at_move": 3, "after_first": 3, "after_second": 4,
                   "still_live": True}, out


def test_world_size_one(world1):
    # Needs fastddp to run a registered hook at world size 1 (as torch does).
    out = world1.check(scen.world1)[0]
    assert out["iter"] == (5, 5) and out["stats"][0] == out["stats"][1], out
    assert out["errors"][0] == out["errors"][1] == [0], out
    assert out["rng"][0] == out["rng"][1] and out["same_rng_key"], out


def test_model_copy_carries_a_live_copy_of_the_state(world):
    out = world.check(scen.model_copied)[0]
    assert out["distinct"] and out["same_scalars"] and out["iters"] == (5, 5), out
    assert out["clone_live"] == "LivePowerSGDState", out
    if world.size == 2:
        assert out["equal"] and out["error_diff"] == 0, out
    else:
        # The copy's buckets differ from the original's: another sum order on 3 ranks.
        assert out["ulps"] <= ROUNDING_ULPS and out["error_ulps"] <= ROUNDING_ULPS, out
