"""Issue 52: where the suite's CPU goes, test by test. A pytest plugin:

    python -m pytest tests/python -q -p no:cacheprovider -p benchmarks.ci.suite_cpu \
        --cpu-report build/suite_cpu.tsv

For each test (setup, call and teardown together) it writes the wall time and the CPU seconds
spent by the pytest process and every process below it: the ranks of persistent worlds, fork
servers, torchrun and its ranks, builds. Wall time alone misleads on 2 cores: a test that
waits on a timeout costs wall time and no CPU, and under a second test runner (pytest-xdist)
only the CPU is shared out. At the end it prints the files with the most CPU.

How the CPU is counted: this process's own rusage, its reaped children's rusage, and for every
live descendant (found through /proc) its utime + stime and the cutime + cstime of the
children it reaped. A process reaped during a test moves from the live sum to its parent's
reaped sum with its whole total, so the total only grows and each test's share is its
difference. A process that exits while no test runs is counted in the next test.
"""

import os
import resource
import time
from collections import defaultdict

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _live_descendants_cpu(root: int) -> float:
    children = defaultdict(list)
    stats = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:  # gone meanwhile
            continue
        # The command name is in parentheses and may hold spaces: split after its end.
        fields = text[text.rindex(")") + 2:].split()
        pid, ppid = int(entry), int(fields[1])
        children[ppid].append(pid)
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the name.
        stats[pid] = sum(int(x) for x in fields[11:15]) / _TICK
    total, todo = 0.0, list(children[root])
    while todo:
        pid = todo.pop()
        total += stats.get(pid, 0.0)
        todo += children[pid]
    return total


def _cpu_so_far() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime
            + _live_descendants_cpu(os.getpid()))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-report", default=None,
                     help="write each test's wall and CPU seconds (TSV) to this path")


class _Recorder:
    def __init__(self, path: str):
        self.path = path
        self.rows: list[tuple[str, float, float]] = []

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        wall, cpu = time.monotonic(), _cpu_so_far()
        yield
        self.rows.append((item.nodeid, time.monotonic() - wall, _cpu_so_far() - cpu))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        with open(self.path, "w") as f:
            f.write("test\twall_s\tcpu_s\n")
            for nodeid, wall, cpu in self.rows:
                f.write(f"{nodeid}\t{wall:.2f}\t{cpu:.2f}\n")
        files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
        for nodeid, wall, cpu in self.rows:
            row = files[nodeid.split("::")[0]]
            row[0] += wall
            row[1] += cpu
            row[2] += 1
        wall_sum = sum(r[0] for r in files.values())
        cpu_sum = sum(r[1] for r in files.values())
        write = terminalreporter.write_line
        write(f"[suite_cpu] {len(self.rows)} tests: wall {wall_sum:.0f} s, CPU {cpu_sum:.0f} s "
              f"({cpu_sum / max(wall_sum, 1e-9):.2f} cores on average); rows in {self.path}")
        for name, (wall, cpu, n) in sorted(files.items(), key=lambda kv: -kv[1][1])[:30]:
            write(f"[suite_cpu] {cpu:8.1f} CPU s {wall:8.1f} wall s {n:4d} tests  {name}")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--cpu-report")
    if path:
        config.pluginmanager.register(_Recorder(path), "suite_cpu_recorder")
