"""The link emulator (fastddp/link/emulator.py) and its link arithmetic (fastddp/link/model.py).

Expected times are computed here by hand from Note [collective cost] (L + f(n)·S/B with
f = 2(n-1)/n for allreduce, (n-1)/n for alltoall and allgather, 1 for broadcast, 0 for
barrier), never through fastddp.link. The emulator runs on a fake clock
(link_emulator_scenarios.FakeClock) that moves only when the test moves it: a collective
must not be complete just before its computed end and must complete just after, in one
process and on real gloo ranks; no wall time is measured, so a loaded machine cannot fail
these (the emulator's wall-time accuracy is benchmarks/link_emulator.py's). Training through
the wrapper is compared bit for bit with the plain group.
"""

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

from fastddp.link import EmulatedLinkGroup, Link, bus_factor, parse_link
from tests.python.harness import World
from tests.python.link import link_emulator_scenarios as scenarios
from tests.python.link.link_emulator_scenarios import FakeClock, launch_all, step_through

MB = 1_000_000


def expected_ms(kind: str, nbytes: int, n: int, bytes_per_s: float, latency_s: float) -> float:
    factor = {"allreduce": 2 * (n - 1) / n, "alltoall": (n - 1) / n, "allgather": (n - 1) / n,
              "broadcast": 1.0, "barrier": 0.0}[kind]
    return (latency_s + factor * nbytes / bytes_per_s) * 1e3


# --- link specs and arithmetic ----------------------------------------------------------

@pytest.mark.parametrize("text, bytes_per_s, latency_s", [
    ("3GB/s", 3e9, 0.0), ("100Gb/s", 12.5e9, 0.0), ("500MB/s", 5e8, 0.0),
    ("3GB/s,20us", 3e9, 20e-6), ("100 Gb/s, 5us", 12.5e9, 5e-6), ("1GiB/s,0.5ms", 2**30, 5e-4),
    ("25Gbps,2ms", 25e9 / 8, 2e-3), ("1e3MB/s,1s", 1e9, 1.0), ("10MB/s,0", None, None),
])
def test_parse_link(text: str, bytes_per_s: float | None, latency_s: float | None) -> None:
    if bytes_per_s is None:  # a latency without a unit
        with pytest.raises(ValueError, match="latency"):
            parse_link(text)
        return
    link = parse_link(text)
    assert link.bytes_per_s == pytest.approx(bytes_per_s)
    assert link.latency_us * 1e-6 == pytest.approx(latency_s)
    assert parse_link(str(link)).bytes_per_s == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text", ["", "3", "3GB", "fast", "3GB/s,20", "3GB/s,20us,1", "0GB/s",
                                  "-1GB/s", "3gb/s"])
def test_parse_link_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="link spec"):
        parse_link(text)


def test_link_seconds_follow_the_formula() -> None:
    link = Link(bus_gbs=3.0, latency_us=20.0)
    for kind in ("allreduce", "alltoall", "allgather", "broadcast", "barrier"):
        for n in (1, 2, 4, 8):
            assert link.ms(kind, 1.2e9, n) == pytest.approx(
                expected_ms(kind, 1.2e9, n, 3e9, 20e-6))
    # The article's PCIe box: 1.2 GB of fp32 grads at 8 GPUs and 3 GB/s busbw.
    assert link.ms("allreduce", 1.2e9, 8) == pytest.approx(700.02)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("allscatter", 2)
    with pytest.raises(ValueError, match="world size"):
        bus_factor("allreduce", 0)
    with pytest.raises(ValueError, match="bus_gbs"):
        Link(bus_gbs=0.0)


# --- one process: a wrapped group whose real collectives finish at once ----------------

class FailedWork(dist._Work):
    """A Work whose wait() raises, as a real group's does when the collective fails (a
    Python Future's set_exception would not: it fails only Python's view of the Future)."""

    def wait(self, timeout: object = None) -> bool:
        raise RuntimeError("peer went away")


class InstantGroup(dist.ProcessGroup):
    """A Python process group of `size` whose collectives are done when launched (or fail)."""

    def __init__(self, size: int, fail: bool = False):
        super().__init__(0, size)
        self.fail = fail

    def _work(self, result: list) -> object:
        if self.fail:
            return FailedWork()
        fut = torch.futures.Future()
        fut.set_result(result)
        return _create_work_from_future(fut)


    def allreduce(self, tensors, opts):
        return self._work(tensors)

    def alltoall_base(self, output, input, output_splits, input_splits, opts):
        return self._work([output])

    def _allgather_base(self, output, input, opts):
        return self._work([output])

    def barrier(self, opts):
        return self._work([])


def test_wrapper_arguments() -> None:
    with pytest.raises(TypeError, match="ProcessGroup"):
        EmulatedLinkGroup(object(), "1GB/s")
    with pytest.raises(ValueError, match="either link"):
        EmulatedLinkGroup(InstantGroup(2))
    with pytest.raises(ValueError, match="either link"):
        EmulatedLinkGroup(InstantGroup(2), "1GB/s", bus_gbs=1.0)
    with pytest.raises(ValueError, match="link spec"):
        EmulatedLinkGroup(InstantGroup(2), "1GB")
    group = EmulatedLinkGroup(InstantGroup(4), bus_gbs=2.0, latency_us=5.0)
    assert (group.size(), group.rank(), group.link) == (4, 0, Link(2.0, 5.0))
    with pytest.raises(NotImplementedError, match="any source"):
        group.recv_anysource([torch.ones(1)])


def test_collectives_queue_on_the_link_without_blocking() -> None:
    # 4 ranks, 10 MB/s, 2 ms: allreduce 1 MB = 2 + 150 ms, alltoall 2 MB = 2 + 150 ms,
    # allgather 2 MB = 2 + 150 ms, barrier 2 ms; launched together they end one after another.
    costs = [expected_ms("allreduce", MB, 4, 10e6, 2e-3),
             expected_ms("alltoall", 2 * MB, 4, 10e6, 2e-3),
             expected_ms("allgather", 2 * MB, 4, 10e6, 2e-3),
             expected_ms("barrier", 0, 4, 10e6, 2e-3)]
    with FakeClock() as clock:
        group = clock.group(InstantGroup(4), "10MB/s,2ms")
        a, b = torch.ones(MB // 4), torch.ones(2 * MB // 4)
        out = torch.empty_like(b)
        # The real collectives are done at once: only the link keeps them pending.
        works = launch_all([lambda: group.allreduce([a]),
                            lambda: group.alltoall_base(out, b, [], []),
                            lambda: group._allgather_base(out, b[: b.numel() // 4]),
                            group.barrier])
        ends = [sum(costs[: i + 1]) / 1e3 for i in range(4)]
        step_through(clock, works, ends, ["allreduce", "alltoall", "allgather", "barrier"])
        # The typed result (Note [typed futures]) is the output tensor, as the real group's.
        assert works[0].get_future().value()[0] is a
        stats = group.stats()
        assert stats["counts"] == {"allreduce": 1, "alltoall": 1, "allgather": 1, "barrier": 1}
        assert stats["bytes"] == {"allreduce": MB, "alltoall": 2 * MB, "allgather": 2 * MB,
                                  "barrier": 0}
        # The same costs summed through fastddp.link: rounding only (approx: 1e-6 relative).
        assert stats["emulated_s"] == pytest.approx(sum(costs) / 1e3)
        # An idle link starts the next collective at its launch, not at the old end.
        idle = ends[-1] + 0.02
        clock.advance_to(idle)
        step_through(clock, launch_all([group.barrier]), [idle + costs[3] / 1e3],
                     ["barrier on an idle link"])


def test_a_failed_collective_fails_the_work(capfd: pytest.CaptureFixture) -> None:
    group = EmulatedLinkGroup(InstantGroup(2, fail=True), "1GB/s")
    work = group.allreduce([torch.ones(4)])
    with pytest.raises(RuntimeError, match="EmulatedLinkGroup: the collective failed"):
        work.wait()
    assert "allreduce failed on the wrapped process group: RuntimeError: peer went away" in (
        capfd.readouterr().err)


# --- real ranks ----------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"world{n}")
def link_world(request: pytest.FixtureRequest):
    world = World(request.param)
    world.start()
    yield world
    world.close()


# (kind, S bytes, link): every kind of Note [collective cost], with and without latency.
# Time is the fake clock's, so the bytes can be few (the real collectives finish quickly).
SCHEDULE_CASES = [
    ("allreduce", 1 * MB, "5MB/s"), ("allreduce", 2 * MB, "50MB/s,2ms"),
    ("alltoall", 2 * MB, "25MB/s,2ms"), ("allgather", 2 * MB, "25MB/s,2ms"),
    ("broadcast", 2 * MB, "50MB/s"), ("barrier", 0, "1GB/s,100ms"),
]


def test_collectives_end_as_the_formula_says(link_world: World) -> None:
    n = link_world.size
    cases = []
    for kind, nbytes, spec in SCHEDULE_CASES:
        link = parse_link(spec)
        ms = expected_ms(kind, nbytes, n, link.bytes_per_s, link.latency_us * 1e-6)
        cases.append((kind, nbytes, spec, ms / 1e3))
    assert link_world.check(scenarios.collectives_end_on_schedule, cases=cases) == (
        [len(cases)] * n)


def test_queued_collectives_on_real_ranks(link_world: World) -> None:
    n = link_world.size
    seconds = [expected_ms(k, 4 * MB, n, 50e6, 1e-3) / 1e3
               for k in ("allreduce", "alltoall", "allgather")]
    # Ones summed over n ranks: n, exactly, in fp32.
    assert link_world.check(scenarios.queued_collectives, nbytes=4 * MB, spec="50MB/s,1ms",
                            seconds=seconds) == [[float(n)] * 2] * n


@pytest.mark.parametrize("hook", ["allreduce", "bf16", "bf16_fp32", "powersgd",
                                  "batched_powersgd"])
def test_training_through_the_wrapper_is_bitwise_identical(link_world: World, hook: str) -> None:
    steps = 5
    for rank, r in enumerate(link_world.check(scenarios.train_through_wrapper, hook_name=hook,
                                              steps=steps)):
        assert r["identical"], f"rank {rank}: parameters differ through the wrapper ({hook})"
        counts, nbytes, grads = r["counts"], r["bytes"], r["grad_bytes"]
        # Construction: the start values come from rank 0 through the wrapper too; after the
        # first step, the C++ reducer broadcasts the rebuilt bucket order through it.
        assert r["construction"].get("broadcast", 0) >= 1, r["construction"]
        assert counts.pop("broadcast") == 1, counts
        if hook == "allreduce":  # every fp32 gradient element once per step
            assert set(counts) == {"allreduce"}, counts
            assert nbytes["allreduce"] == steps * grads, (nbytes, grads)
        elif hook == "bf16":  # 16-bit gradients, one allreduce each
            assert set(counts) == {"allreduce"}, counts
            assert nbytes["allreduce"] == steps * grads // 2, (nbytes, grads)
        elif hook == "bf16_fp32":  # alltoall of 16-bit shards, allgather of the reduced shard
            assert set(counts) == {"alltoall", "allgather"}, counts
            assert counts["alltoall"] == counts["allgather"] >= steps, counts
            assert steps * grads // 2 <= nbytes["alltoall"] < steps * grads // 2 + 4096, nbytes
        else:  # PowerSGD: plain allreduces for 2 steps, then P and Q allreduces, compressed
            assert set(counts) == {"allreduce"}, counts
            assert counts["allreduce"] > 2 * steps, counts
            assert nbytes["allreduce"] < steps * grads, (nbytes, grads)


def test_torch_distributed_and_hook_states_use_the_wrapper(link_world: World) -> None:
    n = link_world.size
    for rank, r in enumerate(link_world.check(scenarios.dist_api_on_wrapper)):
        assert r["sum"] == n * (n + 1) / 2 and r["broadcast"] == 1.0
        assert r["gathered"] == [float(i) for i in range(n)]
        assert (r["rank"], r["backend"]) == (rank, "gloo")
        assert r["counts"] == {"allreduce": 1, "broadcast": 1, "allgather": 1, "barrier": 1}
    for r in link_world.check(scenarios.torch_hook_states):
        assert r == {"allreduce_hook": True, "explicit_group": True, "powersgd": True,
                     "fastddp_none": True, "groups": 1}
