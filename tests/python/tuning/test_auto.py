"""``--hook auto`` / ``fastddp.hooks.auto()`` (fastddp/tuning/auto.py).

Multi-rank: gloo worlds of 2 and 4 ranks over emulated links (EmulatedLinkGroup). The
decisions are taken on a model whose compute is a sleep in backward (sleep_model.py) over
emulated links, whose delays are sleeps too: CPU load changes neither, so it cannot change
the choice; the margins below are 2x and more. Training numbers against a hand replay of
auto's switches and, for the lossless policy, against stock torch DDP. How close auto comes
to the best fixed configuration is measured by benchmarks/auto.py, not asserted here.
Single-process: the policy's candidates, argument errors, the decision rules on synthetic
measurements.
"""

import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

import fastddp
from fastddp.launch.patch import HookSpec, HookUnavailableError, parse_hook_spec, patch, torch_hook
from fastddp.tuning import auto
from tests.python.harness import World

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_wide.py"
PACKAGE_DIR = Path(fastddp.__file__).resolve().parents[1]
# The ranks import the scenarios by this name (harness.World.run); this process does not.
SCENARIOS = "tests.python.tuning.auto_scenarios"


def _started(size: int):
    world = World(size, timeout_s=300)
    world.start()
    yield world
    world.close()


@pytest.fixture(scope="module", params=[2, 4])
def world(request):
    yield from _started(request.param)


@pytest.fixture(scope="module")
def world2():
    yield from _started(2)


@pytest.fixture(scope="module")
def world4():
    yield from _started(4)


# --- multi-rank ------------------------------------------------------------------------

def test_slow_link_gradient_bound_picks_compression(world) -> None:
    """2 MB of gradients at 20 MB/s: plain allreduce's two 1 MB buckets take 105 ms (2
    ranks) or 157 ms (4 ranks) on the link against a 20 ms backward; bf16 halves that,
    8-bit and PowerSGD cut it 4x and more, far past the 5% lossy margin. The run replays by
    hand bit for bit: no step lost or doubled, PowerSGD's state as auto's Note describes."""
    (result, *_) = world.check(f"{SCENARIOS}.auto_and_replay", kind="sleep", link="20MB/s",
                               policy="any", sleep_ms=20.0, steps=80, after_choice=3)
    summary = result["auto"]
    assert summary["choice"] is not None and auto.lossy(summary["choice"]), summary
    assert summary["chosen_at_step"] <= 60, summary
    assert summary["history"][-1][:2] == (summary["chosen_at_step"], summary["choice"])
    assert result["replay_identical"], summary


def test_fast_link_compute_bound_keeps_plain_allreduce(world) -> None:
    """The same 2 MB at 100 GB/s (the real loopback, a few ms even on a busy machine)
    behind a 200 ms backward: every collective ends inside the sleep, so no compression
    can shorten the step and none is predicted to."""
    (result, *_) = world.check(f"{SCENARIOS}.auto_and_replay", kind="sleep",
                               link="100GB/s", policy="any", sleep_ms=200.0, steps=80,
                               after_choice=0, replay=False)
    summary = result["auto"]
    assert summary["choice"] is not None and not auto.lossy(summary["choice"]), summary


def test_lossless_never_lossy_and_trains_as_torch_ddp(world2) -> None:
    (result, *_) = world2.check(f"{SCENARIOS}.auto_and_replay", kind="wide", link="1GB/s",
                                policy="lossless")
    summary = result["auto"]
    assert summary["choice"] is not None and not auto.lossy(summary["choice"]), summary
    assert not any(auto.lossy(name) for _, name, _ in summary["history"]), summary
    assert result["max_diff_vs_torch"] == 0.0
    assert result["replay_identical"]


def test_bucket_cap_switches_rebuild_the_reducer_cleanly(world2) -> None:
    """Three reducers replaced between steps: were an old one still hooked on the
    gradients, its collectives would hang or double the sums."""
    assert world2.check(f"{SCENARIOS}.bucket_switches_vs_torch", kind="wide") == [0.0, 0.0]


def test_launcher_hook_auto_logs_one_line(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    for key in ("FASTDDP_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "fastddp", "--emulate-link", "200MB/s", "--hook", "auto:bf16", str(SCRIPT),
           "--out", str(tmp_path / "out.json"), "--steps", "70"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240,
                          cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    lines = [ln for ln in output.splitlines() if ln.startswith("[fastddp] auto:bf16 chose ")]
    assert len(lines) == 1, output
    chosen = lines[0].split(" chose ")[1].split()[0]
    assert chosen in auto.candidates.for_auto(auto.AutoHook("bf16"), 1.0), lines[0]
    assert "ms measured" in lines[0]


def test_two_nodes_offer_and_try_hierarchical_reduction(world4) -> None:
    """2 nodes x 2 ranks, a slow link between the nodes and a fast one inside: the cost
    model gives each collective its link, so hierarchical bf16 is predicted faster than
    flat bf16 (a quarter of the inter-node bytes); its family is tried for real; the run
    replays by hand bit for bit."""
    (result, *_) = world4.check(f"{SCENARIOS}.auto_hierarchical", kind="sleep",
                                inter_link="10MB/s", sleep_ms=20.0, steps=100, after_choice=3)
    summary, names = result["auto"], result["names"]
    assert [n for n in names if n.startswith("hier_")] == [
        "hier_allreduce_fp32", "hier_bf16", "hier_int8"]
    predicted = summary["predicted_step_ms"]
    # Per 1 MB bucket, flat bf16 moves 0.79 MB at 10 MB/s (79 ms); hier_bf16 0.26 MB
    # between the nodes (26 ms) and 1 MB over the real loopback inside (probed at 0.77 GB/s
    # with both cores busy, 1.4 ms; 20 ms were it 50 MB/s): 0.37x bf16, 0.58x at worst.
    assert predicted["hier_bf16"] < predicted["bf16"], predicted
    assert "intra-node" in summary["link"] and "inter-node" in summary["link"], summary
    assert any(name.startswith("hier_") for _, name, _ in summary["history"]), summary
    assert summary["choice"] is not None, summary
    assert result["replay_identical"], summary


@pytest.mark.parametrize("local, policy, sizes", [
    ("2", "any", [2, 2]), ("2", "bf16", [2, 2]), ("2", "lossless", None),
    ("4", "any", None),  # one node: nothing hierarchical
])
def test_hierarchical_candidates_follow_torchrun_nodes(world4, local, policy, sizes) -> None:
    (names, got), *_ = world4.check(f"{SCENARIOS}.auto_candidates_from_env",
                                    local_world_size=local, policy=policy)
    assert got == sizes
    expected = {"any": ["hier_allreduce_fp32", "hier_bf16", "hier_int8"],
                "bf16": ["hier_allreduce_fp32", "hier_bf16"]}[policy] if sizes else []
    assert [n for n in names if n.startswith("hier_")] == expected


# --- single process --------------------------------------------------------------------

def test_policies_name_their_candidates() -> None:
    lossless = auto.candidates.for_auto(auto.AutoHook("lossless"), 4.0)
    assert lossless == ["allreduce_fp32", "allreduce_fp32@1MB", "allreduce_fp32@16MB"]
    assert auto.candidates.for_auto(auto.AutoHook("bf16"), 4.0) == lossless + [
        "bf16", "bf16_fp32_accumulate"]
    anything = auto.candidates.for_auto(auto.AutoHook("any"), 4.0)
    assert anything[:5] == auto.candidates.for_auto(auto.AutoHook("bf16"), 4.0)
    assert anything[5:7] == ["int8", "fp8"]
    assert anything[7:] == [f"{h}_r{r}" for h in ("powersgd", "acpsgd") for r in (1, 2, 4, 8)]
    assert not any(auto.lossy(n) for n in lossless)
    assert all(auto.lossy(n) for n in anything[3:])
    # Several nodes (Note [auto on several nodes]): hierarchical reduction, never lossless.
    assert auto.candidates.for_auto(auto.AutoHook("lossless"), 4.0, hierarchical=True) == lossless
    assert auto.candidates.for_auto(auto.AutoHook("bf16"), 4.0, hierarchical=True)[5:] == [
        "hier_allreduce_fp32", "hier_bf16"]
    multi = auto.candidates.for_auto(auto.AutoHook("any"), 4.0, hierarchical=True)
    assert multi[:15] == anything and multi[15:] == [
        "hier_allreduce_fp32", "hier_bf16", "hier_int8"]
    assert all(auto.lossy(n) for n in multi[15:])
    assert auto.hook_for("acpsgd_r2").name == "acpsgd"
    assert auto.hook_for("acpsgd_r2").options["matrix_approximation_rank"] == 2
    with pytest.raises(ValueError, match="groups"):
        auto.hook_for("hier_bf16")


@pytest.mark.parametrize("kwargs, culprit", [
    ({"policy": "fastest"}, "policy"), ({"samples": 0}, "samples"), ({"trials": 0}, "trials"),
    ({"warmup": -1}, "warmup"), ({"lossy_margin": 1.5}, "lossy_margin"),
    ({"local_size": 1}, "local_size"), ({"local_size": 2, "groups": (None, None)}, "groups="),
])
def test_bad_settings_name_the_culprit(kwargs: dict, culprit: str) -> None:
    with pytest.raises(ValueError, match=culprit):
        fastddp.hooks.auto(**kwargs)


def test_launcher_spelling() -> None:
    assert parse_hook_spec("auto") == HookSpec("auto", policy="any")
    assert parse_hook_spec("auto:lossless") == HookSpec("auto", policy="lossless")
    assert str(parse_hook_spec("auto:bf16")) == "auto:bf16"
    with pytest.raises(ValueError, match="auto's policy"):
        parse_hook_spec("auto:fast")


def test_auto_is_fastddp_only() -> None:
    with pytest.raises(HookUnavailableError, match="FASTDDP_DISABLE"):
        torch_hook(HookSpec("auto", policy="any"))
    with pytest.raises(NotImplementedError, match="stock torch DDP"):
        fastddp.hooks.auto()(None, None)
    with pytest.raises(ValueError, match="advise"):
        patch(hook="auto", advise=True)


def _tuner(policy: str, measured: dict, predicted: dict | None = None,
           times: dict | None = None) -> auto.AutoTuner:
    tuner = object.__new__(auto.AutoTuner)  # the decision rules only: no model, no group
    tuner.spec, tuner.measured, tuner.predicted = auto.AutoHook(policy), measured, predicted
    tuner.times = times or {}
    return tuner


@pytest.mark.parametrize("measured, expected", [
    ({"allreduce_fp32": 100.0, "bf16": 96.0}, "allreduce_fp32"),  # 4%: below the 5% margin
    ({"allreduce_fp32": 100.0, "bf16": 94.0}, "bf16"),
    ({"allreduce_fp32": 100.0, "allreduce_fp32@1MB": 99.0, "powersgd_r1": 95.0},
     "allreduce_fp32@1MB"),  # 95 > 0.95 * 99
    ({"allreduce_fp32": 100.0, "allreduce_fp32@16MB": 97.0}, "allreduce_fp32@16MB"),
])
def test_lossy_choice_must_win_by_the_margin(measured: dict, expected: str) -> None:
    assert _tuner("any", measured)._best_measured() == expected


@pytest.mark.parametrize("blocks, expected", [
    ([[90.0, 91.0, 89.0, 90.0], [92.0, 93.0, 92.0, 94.0]], "powersgd_r1"),  # median 91.5
    # A median as low (91), but the second block is within 5% of the baseline: load.
    ([[85.0, 86.0, 84.0, 85.0], [97.0, 96.0, 98.0, 97.0]], "allreduce_fp32"),
])
def test_lossy_choice_must_win_in_each_block(blocks: list, expected: str) -> None:
    times = {"powersgd_r1": [t for block in blocks for t in block]}
    # As _choose derives it: a candidate's measured step is the median of its trial steps.
    measured = {"allreduce_fp32": 100.0, "powersgd_r1": statistics.median(times["powersgd_r1"])}
    assert _tuner("any", measured, times=times)._best_measured() == expected


def test_8bit_candidates_are_the_8bit_hooks() -> None:
    assert repr(auto.hook_for("int8")) == "fastddp.hooks.int8(error_feedback=True)"
    assert auto.hook_for("fp8").options == {"format": "e4m3", "error_feedback": True}
    predicted = {"allreduce_fp32": 100.0, "bf16": 80.0, "int8": 60.0, "fp8": 62.0,
                 "powersgd_r1": 70.0}
    ranked = sorted(predicted, key=predicted.get)
    # int8 and fp8 are one family: the better predicted is tried, once.
    assert _tuner("any", {}, predicted)._worth_trying(ranked) == ["int8", "powersgd_r1", "bf16"]


def test_trials_take_the_best_predicted_of_each_family() -> None:
    predicted = {"allreduce_fp32": 100.0, "allreduce_fp32@1MB": 90.0,
                 "allreduce_fp32@16MB": 98.5, "bf16": 80.0, "bf16_fp32_accumulate": 85.0,
                 "powersgd_r1": 70.0, "powersgd_r2": 60.0, "powersgd_r4": 101.0}
    ranked = sorted(predicted, key=predicted.get)
    assert _tuner("any", {}, predicted)._worth_trying(ranked) == [
        "powersgd_r2", "bf16", "allreduce_fp32@1MB"]
    # Compute-bound: nothing predicted 2% better, nothing tried.
    flat = {n: 98.1 for n in predicted}
    flat["allreduce_fp32"] = 100.0
    assert _tuner("any", {}, flat)._worth_trying(sorted(flat, key=flat.get)) == []


def test_hierarchical_is_its_own_family() -> None:
    predicted = {"allreduce_fp32": 100.0, "bf16": 80.0, "int8": 70.0, "hier_int8": 50.0,
                 "hier_bf16": 55.0, "powersgd_r1": 75.0}
    ranked = sorted(predicted, key=predicted.get)
    assert _tuner("any", {}, predicted)._worth_trying(ranked) == [
        "hier_int8", "int8", "powersgd_r1", "bf16"]
