"""The DDP logger's sampled runtime statistics when the backward times trail the host, as
they do on a GPU (Note [device timeline]: comm_stats() reports the latest sampled step the
device has finished, never waiting): each sampled iteration is recorded once, with its own
forward times and bucket count, when its figures arrive; an overtaken one is left out; on the
host's clock (figures of the last step at once) the logger records as torch's does. No
process group: comm_stats is a stand-in dict per call."""

from fastddp.ddp._ddp_logger import DdpLogger


def _stats(timed: int, steps: int, origin_ns: int = 1_000) -> dict:
    # One bucket: ready at 2 ms, launched at 3 ms, done at 5 ms after the backward's start.
    return {"steps": steps, "timed_iteration": timed, "backward_start_ns": origin_ns,
            "buckets": [{"ready_ms": 2.0, "launched_ms": 3.0, "done_ms": 5.0}]}


class _Run:
    """Drives a logger as _forward.py does: before_forward(completed), then forward_done."""

    def __init__(self, rate: int = 100) -> None:
        self.logger = DdpLogger()
        self.logger.sample_rate = rate
        self.reads: list[int] = []  # the `completed` of each forward that read comm_stats
        self.reduced = 0

    def forward(self, completed: int, timed: int) -> None:
        def comm_stats() -> dict:
            self.reads.append(completed)
            return _stats(timed, completed)

        self.logger.before_forward(completed, comm_stats, lambda: self.reduced + completed)
        # Forward k+1 runs from 10k to 10k + 4 (fake ns): its times name the iteration.
        self.logger._forward = (10 * (completed + 1), 10 * (completed + 1) + 4)


def test_host_clock_records_each_sampled_iteration_at_the_next_forward():
    run = _Run()
    for completed in range(0, 13):
        run.forward(completed, timed=completed)
        if 1 <= completed <= 10:
            assert run.logger.sampled_iteration == completed
    # 11 and 12 are not sampled (rate 100): not read, iteration stays 10.
    assert run.logger.sampled_iteration == 10 and run.reads == list(range(1, 11))
    stats = run.logger.runtime_stats
    assert stats["forward_compute_time_start"] == 100  # iteration 10's forward
    assert stats["num_buckets_reduced"] == 10
    assert stats["backward_compute_time"] == 2_000_000  # 2 ms in ns
    assert stats["backward_comm_time"] == 2_000_000  # launched 3 ms -> done 5 ms


def test_device_figures_two_steps_behind_are_recorded_when_they_arrive():
    run = _Run()
    recorded = []
    for completed in range(0, 14):
        run.forward(completed, timed=max(completed - 2, 0))  # the device trails by 2 steps
        if run.logger.sampled_iteration and run.logger.sampled_iteration not in recorded:
            recorded.append(run.logger.sampled_iteration)
            # The iteration's own forward times, not the last forward's.
            it = run.logger.sampled_iteration
            assert run.logger.runtime_stats["forward_compute_time_start"] == 10 * it
            assert run.logger.runtime_stats["num_buckets_reduced"] == it
    assert recorded == list(range(1, 11))
    # Reads stop once nothing is pending: 12 (iteration 10 arrives) is the last.
    assert run.reads[-1] == 12 and 13 not in run.reads


def test_an_overtaken_iteration_is_left_out_and_no_figure_is_used_twice():
    run = _Run(rate=5)
    run.forward(0, timed=0)
    run.forward(1, timed=0)  # iteration 1 pending, no figures on the device yet
    assert run.logger.sampled_iteration == 0 and run.logger._samples == 0
    run.forward(2, timed=2)  # 1 was overtaken by 2 before it was read
    assert run.logger.sampled_iteration == 2 and run.logger._samples == 1
    run.forward(3, timed=2)  # 3 pending; 2's figures again: not recorded twice
    assert run.logger.sampled_iteration == 2 and run.logger._samples == 1
    run.forward(4, timed=3)
    assert run.logger.sampled_iteration == 3 and run.logger._samples == 2


def test_pending_iterations_are_bounded_when_figures_never_come():
    run = _Run()
    for completed in range(0, 11):
        run.forward(completed, timed=0)  # e.g. forwards without a backward
    assert len(run.logger._pending) <= 8 and run.logger.sampled_iteration == 0
