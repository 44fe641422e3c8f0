"""fastddp.hooks.hierarchical on 4 real gloo ranks as 2 nodes x 2 local ranks: against the
exact mean and against a plain-torch reference of the same algorithm (hierarchical_scenarios.py),
wrong meshes and local sizes, and the launcher's --hook hier:INNER."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import fastddp
from fastddp.launch.patch import HookSpec, parse_hook_spec
from tests.python.harness import _free_port
from tests.python.hooks import hierarchical_scenarios
from tests.python.hooks import hooks_scenarios
from tests.python.launch.test_elastic import _descendants
from tests.python.launch.test_launcher import PACKAGE_DIR, SCRIPT, TIMEOUT_S


@pytest.mark.parametrize(("inner", "source", "as_view"), [
    ("none", "local_size", False),
    ("none", "mesh", True),
    ("bf16", "local_size", False),
    ("bf16", "groups", True),
    ("bf16_fp32", "mesh", False),
])
def test_hierarchical_matches_reference(world4, inner, source, as_view):
    names = world4.check(hierarchical_scenarios.hier_training, inner=inner, source=source,
                         gradient_as_bucket_view=as_view)
    assert names[0].startswith("hierarchical("), names


def test_hierarchical_int8(world4):
    """Any registered hook works between nodes: int8 (issue 16 item 2) where it is built."""
    if "int8" not in fastddp._C.comm_hook_names():
        pytest.skip("no 'int8' comm hook is registered in this build")
    world4.check(hierarchical_scenarios.hier_training, inner="int8")


@pytest.mark.parametrize("spec", ["fastddp.hier_bf16_fp32", "fastddp.hier_allreduce"])
def test_failed_step_is_dropped(world4, spec):
    """A backward that fails half-way: the next steps are bit for bit those of a run without
    it (the half-done step's later collectives are never issued, on any rank)."""
    world4.check(hooks_scenarios.abandoned_step, spec=spec)


def test_an_inner_failure_on_one_rank_keeps_the_node_in_step(world4):
    errors = world4.check(hierarchical_scenarios.inner_fails_on_one_rank)
    assert "injected inter-node failure" in (errors[0][1] or ""), errors[0]
    assert errors[0][:1] + errors[0][2:] == [None, None, None], errors[0]
    for rank in (1, 2, 3):
        assert errors[rank] == [None] * 4, (rank, errors[rank])


def test_wrong_configurations_raise(world4):
    per_rank = world4.check(hierarchical_scenarios.bad_configurations)
    # The same error on every rank (the tiling message names each rank's own group).
    for case in per_rank[0]:
        kinds = {(r[case] or "").split(":")[0] for r in per_rank}
        assert len(kinds) == 1, (case, [r[case] for r in per_rank])
    errors = per_rank[0]
    expected = {
        "local_size=1": ("ValueError", "local_size=1"),
        "inter=auto": ("TypeError", "inter must be"),
        "inter=hier": ("TypeError", "inter must be"),
        "local_size=3": ("ValueError", "does not divide the world size 4"),
        "local_size=world": ("ValueError", "one node"),
        "mesh misnamed": ("ValueError", "dims must be named"),
        "mesh node dim 1": ("ValueError", "'node' dimension is 1"),
        "mesh local dim 1": ("ValueError", "'local' dimension is 1"),
        "mesh 1-D": ("ValueError", "2-D DeviceMesh"),
        "mesh does not tile": ("ValueError", "does not tile"),
    }
    for case, (kind, text) in expected.items():
        got = errors[case]
        assert got is not None and got.startswith(kind) and text in got, (case, got)


def test_parse_hier_spec():
    assert parse_hook_spec("hier:bf16") == HookSpec("hier", inner=HookSpec("bf16"))
    assert parse_hook_spec("hier") == HookSpec("hier", inner=HookSpec("bf16"))
    assert parse_hook_spec("hier:none") == HookSpec("hier", inner=HookSpec("allreduce"))
    assert str(parse_hook_spec("hier:powersgd:2")) == "hier:powersgd:2"
    assert parse_hook_spec("hier:int8") == HookSpec("hier", inner=HookSpec("int8"))
    assert parse_hook_spec("hier:fp8:e5m2") == HookSpec("hier", inner=HookSpec("fp8",
                                                                                format="e5m2"))
    for bad, text in (("hier:auto", "fixed hook"), ("hier:hier", "fixed hook"),
                      ("hier:nope", "not a hook")):
        with pytest.raises(ValueError, match=text):
            parse_hook_spec(bad)


def _outputs_or_stacks(agents: list[subprocess.Popen]) -> list[str]:
    """Both agents' outputs; past the no-hang deadline (TIMEOUT_S), fails with the Python
    stacks of every rank and both agents (SIGABRT under PYTHONFAULTHANDLER; the ranks write
    to their agent's stdout) and both agents' outputs (their INFO log: each phase with its
    time), every process of theirs killed. The deadline is 4x the 28-33 s the test takes
    beside two busy loops inside its file; it took 95-117 s there while the file's 4-rank
    world kept every scenario's gloo groups (results/suite.md)."""
    try:
        return [a.communicate(timeout=TIMEOUT_S)[0] for a in agents]
    except subprocess.TimeoutExpired:
        for agent in agents:
            for rank in _descendants(agent.pid):
                try:
                    os.kill(rank, signal.SIGABRT)
                except ProcessLookupError:
                    pass
        for agent in agents:
            try:
                os.kill(agent.pid, signal.SIGABRT)
            except ProcessLookupError:
                pass
        time.sleep(5)  # the stacks are written
        for agent in agents:
            try:
                os.killpg(agent.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        texts = [a.communicate()[0] for a in agents]
        pytest.fail(f"no result within {TIMEOUT_S} s:\n" + "\n".join(
            f"--- agent {i} ---\n{text}" for i, text in enumerate(texts)))


@pytest.mark.parametrize("hook", ["hier:bf16", "auto:bf16"])
def test_launcher_two_nodes(tmp_path, hook):
    """docs/multinode.md's command line, as two torchrun agents (2 "nodes" x 2 ranks) on
    this machine meeting at one rendezvous endpoint: --hook hier:bf16 trains the tiny script
    (the hook's numbers are hierarchical_scenarios' business; starting 6 processes costs ~20 s).
    auto:bf16 makes its hierarchical groups from torchrun's LOCAL_WORLD_SIZE, probes them
    after its 7 baseline steps, runs its trials and decides within 60 steps."""
    out = tmp_path / "hier.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(PACKAGE_DIR), os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    for key in ("FASTDDP_DISABLE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    endpoint = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=hier-test",
           "-m", "fastddp", "--hook", hook, str(SCRIPT), "--out", str(out), "--steps", "60"]
    env["PYTHONFAULTHANDLER"] = "1"  # a SIGABRT'd rank or agent prints its threads' stacks
    env["LOGLEVEL"] = "INFO"  # torchrun's agents log their phases
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True) for _ in range(2)]
    outputs = _outputs_or_stacks(agents)
    for agent, text in zip(agents, outputs):
        assert agent.returncode == 0, text
    fast = json.loads(out.read_text())
    assert fast["world"] == 4 and fast["losses"][-1] < fast["losses"][0], fast["losses"]
    assert f"hook={hook} (launcher" in "".join(outputs), outputs
    if hook.startswith("auto"):
        assert "[fastddp] auto:bf16 chose " in "".join(outputs), outputs
