"""No host sync on the CUDA step (issue 43 item 4): 50 steps of each hook, and of the
overlapped optimizer, under ``torch.cuda.set_sync_debug_mode("error")`` and torch's GPU trace
(no_host_sync_scenarios.py says why both); the options that must sync (docs/design.md, Host
synchronization) sync only when on; the device timing events are recorded only in the steps
the DDP logger samples, and read without a wait. One GPU, NCCL at world size 1 with fastddp's
reducer forced. GPU-marked: run by `make gpu-check`."""

import pytest

from tests.python.ddp import no_host_sync_scenarios as s
from tests.python.harness import World

pytestmark = pytest.mark.gpu

# ACP-SGD decides each step's turn (P or Q: collectives of different sizes) on the host, from
# whether the previous step's state was kept; it reads that flag after an event query and
# waits only when the device has not reached the end of the previous backward yet, which a
# host running ahead of a small model's GPU work can meet (Note [acpsgd] in acpsgd.h).
ACPSGD_SYNC = pytest.mark.xfail(
    strict=False, reason="ACP-SGD waits for the previous step's kept flag when the device "
    "lags a whole forward behind (Note [acpsgd]); the turn must be known on the host")
HOOK_CASES = [pytest.param(name, marks=ACPSGD_SYNC) if name == "acpsgd" else name
              for name in s.HOOKS]


@pytest.fixture(scope="module")
def nccl1():
    world = World(1, backend="nccl")
    yield world
    world.close()


def _synced(out: dict) -> bool:
    return out["raised"] is not None or bool(out["traced"])


@pytest.mark.parametrize("case", HOOK_CASES)
def test_fifty_steps_make_no_host_sync(nccl1, case):
    (out,) = nccl1.check(s.hook_steps, case=case)
    assert not _synced(out), f"{case}: a host sync at step {out['step']}: {out}"
    assert out["finite"] and out["stats"]["steps"] == s.WARMUP + s.STEPS, out


@pytest.mark.parametrize(("option", "syncs"), [
    ("nan_check", True),  # reads the allreduced flags to name the parameter
    ("find_unused_all_used", False),  # the used map is read only for an unused parameter
    ("find_unused_locally_unused", True),  # ... which this model has
    ("join_bufferless", False),  # join's per-step collectives are asynchronous
    ("buffers_without_join", False),  # buffers are broadcast from rank 0: no host read
    ("join_with_buffers", True),  # under join() the source rank is agreed on the host
])
def test_options_sync_only_when_on(nccl1, option, syncs):
    (out,) = nccl1.check(s.option_steps, option=option)
    assert _synced(out) == syncs, f"{option}: expected sync={syncs}, got {out}"


def test_timing_events_only_in_sampled_steps_and_read_without_a_wait(nccl1):
    rate, steps = 5, 24
    (out,) = nccl1.check(s.sampled_timing, steps=steps, rate=rate)
    # After step k (device synchronized by the scenario), the latest timed step: torch's
    # sampling, iterations 1-10 and every rate-th.
    sampled = [i for i in range(1, steps + 1) if i <= 10 or i % rate == 0]
    expected = [max(i for i in sampled if i <= k) for k in range(1, steps + 1)]
    assert out["timed"] == expected, out["timed"]
    watched = out["watched"]
    assert not _synced(watched), watched
    # The logger recorded a sampled iteration's figures, read as they completed.
    assert out["iteration"] % rate == 0 and out["iteration"] >= 20, out
    assert out["avg_backward_comm_time"] > 0, out
